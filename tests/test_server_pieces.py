"""Chat text encoded piece by piece between special tokens, against the tokenizer's own
whole-text encoding: random conversations rendered by real templates (SmolLM2's tokenizer with
its ChatML template and spanserve's shipped ones), pieces kept per tenant, and tokenizers whose
added tokens do not split text as written fall back to encoding it whole."""
from __future__ import annotations

import random

import pytest

from spanserve.model.loader import load_tokenizer
from spanserve.server.pieces import MIN_PIECE_CHARS, PieceCache
from spanserve.toolcall.chat_setup import builtin_template
from tiny_models import make_tiny_tokenizer

WORDS = ["the", "cat", " sat", "\n", "  ", "<tool_call>", "{\"a\": 1}", "ünï", "<|im_start|>", "<|im_end|>",
         "<|endoftext|>", "assistant", "42", "\t", "x" * 70, "end."]


def _conversation(rng: random.Random) -> list[dict]:
    msgs = []
    for i in range(rng.randint(1, 8)):
        role = rng.choice(["user", "assistant", "tool"] if i else ["system", "user"])
        text = "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 60)))
        msg = {"role": role, "content": text}
        if role == "tool":
            msg["tool_call_id"] = f"c{i}"
        msgs.append(msg)
    return msgs


@pytest.mark.parametrize("template", [None, "hermes", "llama3_json", "mistral"])
def test_pieces_equal_whole_text_encoding(template: str | None) -> None:
    tok = load_tokenizer("smollm2")
    if template is not None:
        tok.chat_template = builtin_template(template)
    cache = PieceCache(tok)
    assert cache.enabled
    rng = random.Random(7)
    for _ in range(150):
        text = tok.apply_chat_template(_conversation(rng), tokenize=False, add_generation_prompt=True)
        whole = list(tok.encode(text, add_special_tokens=False))
        tenant = rng.choice(["", "a", "b"])
        assert cache.encode(tok, text, tenant) == whole
        assert cache.encode(tok, text, tenant) == whole  # from kept pieces this time


def test_pieces_are_kept_per_tenant_and_bounded() -> None:
    tok = load_tokenizer("smollm2")
    cache = PieceCache(tok, max_chars=4 * 1000)
    doc = "a long tool result " * 10
    text = f"<|im_start|>user\n{doc}<|im_end|>\n"
    cache.encode(tok, text, "a")
    assert ("a", f"user\n{doc}") in cache._kept and not any(t == "b" for t, _ in cache._kept)
    cache.encode(tok, text, "b")
    assert ("b", f"user\n{doc}") in cache._kept
    for i in range(100):
        cache.encode(tok, f"<|im_start|>{i} {doc}<|im_end|>", "a")
    assert cache._chars <= 4 * 1000 and all(len(p) >= MIN_PIECE_CHARS for _, p in cache._kept)


def test_tokenizers_that_split_otherwise_are_encoded_whole() -> None:
    tok = make_tiny_tokenizer()
    tok.add_tokens(["<pad_me>"])
    tok.add_special_tokens({"additional_special_tokens": ["<sp>"]})
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken("<strip>", lstrip=True, rstrip=True)])
    cache = PieceCache(tok)
    assert not cache.enabled
    text = "the cat <strip> sat <sp> the mat"
    assert cache.encode(tok, text, "a") == list(tok.encode(text, add_special_tokens=False))
