"""Incremental detokenization against decoding the whole output, token by token, on random ids:
a byte-level BPE tokenizer (partial UTF-8 characters, invalid bytes) and a SentencePiece-style one
whose decoder drops the leading space of a sequence."""
from __future__ import annotations

import random

import pytest
import transformers
from tiny_models import make_tiny_tokenizer
from tokenizers import Tokenizer, decoders, models

from spanserve.engine.detokenize import IncrementalText, make_decoder


def _metaspace() -> transformers.PreTrainedTokenizerFast:
    pieces = ["<unk>", "</s>", "▁", "▁the", "▁cat", "s", "at", "é", "▁naï", "ve", "▁日本", "語", "!"]
    backend = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"byte-level": make_tiny_tokenizer, "metaspace": _metaspace}


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_incremental_text_equals_whole_decode(name: str) -> None:
    tok = TOKENIZERS[name]()
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    n_vocab = len(tok)
    rng = random.Random(0)
    ragged = 0
    for trial in range(300):
        ids: list[int] = []
        inc = IncrementalText(decode)
        for _ in range(rng.randint(1, 40)):
            ids.append(rng.randrange(n_vocab))
            text = inc.update(ids)
            whole = decode(ids)
            # Never ahead of the whole decode, and behind it only by an unfinished character.
            assert whole.startswith(text), (trial, ids)
            rest = whole[len(text):]
            assert rest == "" or rest.endswith("\ufffd") or not rest.strip("\ufffd"), (trial, ids, rest)
            ragged += rest != ""
        assert inc.update(ids, final=True) == decode(ids), (trial, ids)
    if name == "byte-level":
        assert ragged > 100  # random bytes often leave a character unfinished


def test_each_update_decodes_a_short_window() -> None:
    # The point of it: a long output decodes O(1) tokens per step, not all of them.
    tok = make_tiny_tokenizer()
    seen: list[int] = []

    def decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return tok.decode(ids, skip_special_tokens=True)

    inc = IncrementalText(decode)
    word = tok.encode(" hello", add_special_tokens=False)
    ids: list[int] = []
    for _ in range(300):
        ids += word
        inc.update(ids)
    assert inc.text == tok.decode(ids) and max(seen) <= 2 * len(word)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("clean_up", [False, True])
def test_make_decoder_equals_tokenizer_decode(name: str, clean_up: bool) -> None:
    """The direct backend call (no clean-up configured) and the wrapper route (clean-up on) both
    spell what tokenizer.decode(ids, skip_special_tokens=True) does, special tokens included."""
    tok = TOKENIZERS[name]()
    tok.clean_up_tokenization_spaces = clean_up
    decode = make_decoder(tok)
    assert (decode.func == tok._tokenizer.decode) == (not clean_up)  # which route was taken
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 30))]
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True)
    assert make_decoder(None)([1, 2]) == ""
