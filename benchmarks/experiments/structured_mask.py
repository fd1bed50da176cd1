"""Per-token cost of JSON-schema constrained decoding with three grammar libraries (llguidance,
xgrammar, outlines-core) on SmolLM2's tokenizer (49152 tokens): grammar compile time, then for
every token of a valid instance of each schema the time to compute the allowed-token bitmask
and to advance the matcher by that token. With --device cuda each step also copies the bitmask
to the GPU and applies it to a logits row there as the engine does (TokenMask: xgrammar's
kernel on a copy of the logits), and the apply alone is timed for batches of rows, beside a
plain-torch apply. Every library sees the same whitespace rule
(compact: "," and ":" separators, no free whitespace), the one spanserve serves with.

    .venv/bin/python benchmarks/experiments/structured_mask.py                  # CPU, writes results/structured_mask.json
    .venv/bin/python benchmarks/experiments/structured_mask.py --smoke          # quick end-to-end check
    .venv/bin/python benchmarks/experiments/structured_mask.py --save-tokenizer DIR   # for machines without the GGUF
    python3 benchmarks/experiments/structured_mask.py --device cuda --tokenizer DIR --out structured_mask_gpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from common import format_table, write_json  # noqa: E402

from spanserve.engine.structured import TokenMask, apply_bitmask  # noqa: E402

ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string"}, "city": {"type": "string"},
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"],
    "additionalProperties": False}
SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "person (nested, pattern)": ({
        "type": "object", "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]+ [A-Z][a-z]+$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,3}$"},
            "address": ADDRESS, "verified": {"type": "boolean"}},
        "required": ["name", "age", "email", "address", "verified"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada.lovelace@example.org",
         "address": {"street": "12 St James's Square", "city": "London", "zip": "10115"}, "verified": True}),
    "order (array of objects, enum)": ({
        "type": "object", "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
            "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
            "items": {"type": "array", "minItems": 1, "items": {
                "type": "object", "properties": {
                    "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number"}},
                "required": ["sku", "quantity", "unit_price"], "additionalProperties": False}},
            "total": {"type": "number"}},
        "required": ["order_id", "status", "items", "total"], "additionalProperties": False},
        {"order_id": "ORD-004217", "status": "shipped",
         "items": [{"sku": "keyboard-mx", "quantity": 2, "unit_price": 49.5},
                   {"sku": "usb-c cable", "quantity": 3, "unit_price": 7.25}], "total": 120.75}),
    "event (nested arrays, date)": ({
        "type": "object", "properties": {
            "title": {"type": "string"},
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "attendees": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "role": {"enum": ["speaker", "organizer", "guest"]},
                "topics": {"type": "array", "items": {"type": "string"}}},
                "required": ["name", "role", "topics"], "additionalProperties": False}},
            "online": {"type": "boolean"}},
        "required": ["title", "date", "attendees", "online"], "additionalProperties": False},
        {"title": "Structured decoding in practice", "date": "2026-03-14",
         "attendees": [{"name": "Grace", "role": "speaker", "topics": ["grammars", "tokenizers"]},
                       {"name": "Alan", "role": "guest", "topics": []}], "online": False}),
    "tool call (enum, numbers, strings)": ({
        "type": "object", "properties": {
            "function": {"enum": ["get_weather", "search_flights", "book_hotel"]},
            "arguments": {"type": "object", "properties": {
                "location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"}, "lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["location", "unit", "days", "lat", "lon"], "additionalProperties": False}},
        "required": ["function", "arguments"], "additionalProperties": False},
        {"function": "get_weather", "arguments": {"location": "San Francisco, CA", "unit": "celsius",
                                                  "days": 5, "lat": 37.7749, "lon": -122.4194}}),
}
SEPARATORS = (",", ":")


@dataclass
class Library:
    """One grammar library behind the calls the benchmark times."""

    name: str
    setup: Callable[[Any, int, list[int]], Any]  # (hf tokenizer, vocab, eos ids) -> tokenizer state
    compile: Callable[[Any, dict[str, Any]], Any]  # (state, schema) -> compiled grammar
    matcher: Callable[[Any, Any], Any]  # (state, compiled) -> fresh matcher
    fill: Callable[[Any, torch.Tensor], None]  # write the allowed-token bitmask into row [W] int32
    advance: Callable[[Any, int], bool]


def _llguidance() -> Library:
    import llguidance
    import llguidance.hf

    options = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}

    def compile_(state: Any, schema: dict[str, Any]) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        m = llguidance.LLMatcher(state, grammar)  # the compile happens here
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    return Library(
        "llguidance",
        lambda tok, vocab, eos: llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos),
        compile_,
        lambda state, grammar: llguidance.LLMatcher(state, grammar),
        lambda m, row: m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4),
        lambda m, t: bool(m.consume_token(t)),
    )


def _xgrammar() -> Library:
    import xgrammar as xgr

    def setup(tok: Any, vocab: int, eos: list[int]) -> Any:
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def fill(m: Any, row: torch.Tensor) -> None:
        m.fill_next_token_bitmask(row.view(1, -1), 0)

    return Library(
        "xgrammar", setup,
        lambda comp, schema: comp.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                      separators=SEPARATORS),
        lambda comp, compiled: xgr.GrammarMatcher(compiled),
        fill, lambda m, t: bool(m.accept_token(t)),
    )


def _outlines_core() -> Library:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    stop: set[int] = set()

    def setup(tok: Any, vocab: int, eos: list[int]) -> Any:
        stop.update(eos)
        return outlines_core.Vocabulary(eos[0], byte_vocabulary(tok, set(eos)))

    def advance(g: Any, t: int) -> bool:
        if t in stop:  # a Guide has no state after the end: EOS is allowed once it is finished
            return bool(g.is_finished())
        g.advance(t)  # raises on a token the grammar refuses
        return True

    def compile_(vocabulary: Any, schema: dict[str, Any]) -> Any:
        return outlines_core.Index(build_regex_from_schema(json.dumps(schema), whitespace_pattern=""), vocabulary)

    return Library(
        "outlines-core", setup, compile_,
        lambda vocabulary, index: outlines_core.Guide(index),
        lambda g, row: g.write_mask_into(row.data_ptr(), row.numel(), 4), advance,
    )


def byte_vocabulary(tok: Any, skip: set[int]) -> dict[bytes, list[int]]:
    """Each regular token's bytes, for a byte-level BPE tokenizer (GPT-2's byte-to-char map)."""
    to_byte = {c: b for b, c in byte_level_chars().items()}
    special = set(tok.all_special_ids) | skip
    out: dict[bytes, list[int]] = {}
    for piece, i in tok.get_vocab().items():
        if i in special or any(c not in to_byte for c in piece):
            continue
        out.setdefault(bytes(to_byte[c] for c in piece), []).append(i)
    return out


def byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted
    past 255 so that every byte has a visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


LIBRARIES: dict[str, Callable[[], Library]] = {
    "llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines_core}


def load_tokenizer(path: str | None) -> Any:
    if path is not None:
        import transformers

        return transformers.AutoTokenizer.from_pretrained(path)
    from spanserve.model.loader import load_tokenizer

    return load_tokenizer("smollm2")


def allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_schema(lib: Library, state: Any, schema: dict[str, Any], ids: list[int], eos: int, vocab: int,
               repeats: int, device: torch.device) -> dict[str, Any]:
    t0 = time.perf_counter()
    compiled = lib.compile(state, schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    mask = torch.full((1, (vocab + 31) // 32), 0, dtype=torch.int32, pin_memory=device.type == "cuda")
    logits = torch.randn(1, vocab, device=device)
    fills: list[float] = []
    advances: list[float] = []
    applies: list[float] = []
    ok = True
    for _ in range(repeats):
        m = lib.matcher(state, compiled)
        for t in ids + [eos]:
            t0 = time.perf_counter()
            lib.fill(m, mask[0])
            t1 = time.perf_counter()
            if device.type == "cuda":
                TokenMask([0], mask.to(device, non_blocking=True)).applied(logits)  # the engine's path
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            ok = ok and allowed(mask[0], t)
            good = lib.advance(m, t)
            t3 = time.perf_counter()
            ok = ok and good
            fills.append((t1 - t0) * 1e6)
            applies.append((t2 - t1) * 1e6)
            advances.append((t3 - t2) * 1e6)
    per_token = [f + a for f, a in zip(fills, advances)]
    out = {"compile_ms": compile_ms, "tokens": len(ids) + 1, "valid_path_allowed": ok,
           "mask_us_mean": statistics.fmean(fills), "advance_us_mean": statistics.fmean(advances),
           "per_token_us_mean": statistics.fmean(per_token), "per_token_us_p50": percentile(per_token, 0.5),
           "per_token_us_p99": percentile(per_token, 0.99), "per_token_us_max": max(per_token)}
    if device.type == "cuda":
        out["copy_apply_us_mean"] = statistics.fmean(applies)
    out["per_token_samples_us"] = per_token
    return out


def time_apply(device: torch.device, vocab: int, batch: int, iters: int, fn: Callable[..., None]) -> float:
    """Microseconds to apply a [batch, vocab] bitmask (already on device) to logits there."""
    logits = torch.randn(batch, vocab, device=device)
    mask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32, device=device)
    for _ in range(3):
        fn(logits, mask)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(logits, mask)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def appliers() -> dict[str, Callable[..., None]]:
    """The engine's apply (xgrammar's kernel: C++ on CPU, Triton on CUDA) and plain torch."""
    import xgrammar

    return {"xgrammar kernel (engine)": xgrammar.apply_token_bitmask_inplace, "plain torch": apply_bitmask}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--libs", nargs="+", default=list(LIBRARIES), choices=list(LIBRARIES))
    ap.add_argument("--tokenizer", default=None, help="a saved tokenizer directory (default: SmolLM2's GGUF)")
    ap.add_argument("--save-tokenizer", default=None, help="save SmolLM2's tokenizer here and exit")
    ap.add_argument("--repeats", type=int, default=5, help="passes over each instance")
    ap.add_argument("--smoke", action="store_true", help="one schema, one pass")
    ap.add_argument("--out", default="structured_mask.json")
    return ap.parse_args()


def run_libraries(args: argparse.Namespace, tok: Any, device: torch.device) -> tuple[list[dict[str, Any]], dict]:
    """Per library and schema: compile, then mask + advance per token of a valid instance; prints
    the table. Returns the per-schema results and each library's tokenizer setup seconds."""
    vocab, eos = len(tok), int(tok.eos_token_id)
    schemas = dict(list(SCHEMAS.items())[:1]) if args.smoke else SCHEMAS
    repeats = 1 if args.smoke else args.repeats
    rows: list[tuple[Any, ...]] = []
    results: list[dict[str, Any]] = []
    setup_s: dict[str, float] = {}
    for name in args.libs:
        lib = LIBRARIES[name]()
        t0 = time.perf_counter()
        state = lib.setup(tok, vocab, [eos])
        setup_s[name] = time.perf_counter() - t0
        for label, (schema, instance) in schemas.items():
            ids = tok.encode(json.dumps(instance, separators=SEPARATORS), add_special_tokens=False)
            r = {"library": name, "schema": label,
                 **run_schema(lib, state, schema, ids, eos, vocab, repeats, device)}
            results.append(r)
            rows.append((name, label, r["compile_ms"], r["tokens"], r["mask_us_mean"], r["advance_us_mean"],
                         r["per_token_us_p50"], r["per_token_us_mean"], r["per_token_us_p99"],
                         r.get("copy_apply_us_mean", "-"),
                         "yes" if r["valid_path_allowed"] else "NO"))
    print(f"SmolLM2 tokenizer, vocab {vocab}; device {device}; {repeats} pass(es) per instance")
    print(format_table(["library", "schema", "compile ms", "tokens", "mask us", "advance us", "per-token p50 us",
                        "mean us", "p99 us", "copy+apply us", "valid ok"], rows))
    return results, setup_s


def summarize(libs: list[str], results: list[dict[str, Any]], setup_s: dict[str, float]) -> list[dict[str, Any]]:
    summary = []
    for name in libs:
        mine = [r for r in results if r["library"] == name]
        samples = [x for r in mine for x in r.pop("per_token_samples_us")]
        summary.append({"library": name, "tokenizer_setup_s": setup_s[name],
                        "compile_ms_mean": statistics.fmean(r["compile_ms"] for r in mine),
                        "per_token_us_p50": percentile(samples, 0.5),
                        "per_token_us_mean": statistics.fmean(r["per_token_us_mean"] for r in mine),
                        "per_token_us_p99_max": max(r["per_token_us_p99"] for r in mine)})
    print(format_table(["library", "tokenizer setup s", "compile ms (mean)", "per-token us (p50)",
                        "per-token us (mean)", "per-token p99 us (worst)"],
                       [(s["library"], s["tokenizer_setup_s"], s["compile_ms_mean"], s["per_token_us_p50"],
                         s["per_token_us_mean"], s["per_token_us_p99_max"]) for s in summary]))
    return summary


def apply_table(device: torch.device, vocab: int, smoke: bool) -> list[dict[str, Any]]:
    """Applying a bitmask to a batch of logits rows, each way, at SmolLM2's and Llama 3's vocabularies."""
    apply_rows = []
    for v in (vocab, 128256):
        for b in (1, 8, 64):
            row: dict[str, Any] = {"vocab": v, "batch": b}
            for label, fn in appliers().items():
                row[label] = time_apply(device, v, b, 20 if smoke else 200, fn)
            apply_rows.append(row)
    labels = list(appliers())
    print(format_table(["vocab", "batch"] + [f"{x} on {device} us" for x in labels],
                       [(r["vocab"], r["batch"], *(r[x] for x in labels)) for r in apply_rows]))
    return apply_rows


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the mask work is single-threaded per request; keep torch's apply alike
    tok = load_tokenizer(args.tokenizer)
    if args.save_tokenizer:
        tok.save_pretrained(args.save_tokenizer)
        print(f"saved the tokenizer to {args.save_tokenizer}")
        return
    device = torch.device(args.device)
    results, setup_s = run_libraries(args, tok, device)
    summary = summarize(args.libs, results, setup_s)
    payload = {"benchmark": "structured_mask", "args": vars(args), "vocab": len(tok), "summary": summary,
               "results": results, "apply": apply_table(device, len(tok), args.smoke)}
    print(f"wrote {write_json(args.out, payload)}")


if __name__ == "__main__":
    main()
