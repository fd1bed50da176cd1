"""Structured output: OpenAI's `response_format` as a grammar every sampled token must follow.

`{"type": "json_object"}` constrains the output to one JSON object, `{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}` to a JSON value valid against `schema`, and
`{"type": "text"}` (or none) leaves it free. xgrammar (chosen by measurement, see
docs/structured-output.md) compiles a schema once per tokenizer into a grammar whose
per-token masks are mostly precomputed; each request then holds a matcher: the engine asks it
for a bitmask of allowed tokens before every sample, and feeds it each token sampled.

The JSON is compact: "," and ":" separators and no free whitespace. A grammar that allows
whitespace anywhere lets a weak model emit it forever; the compact form has one layout per
value, so output length is bounded by the content alone.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)
SEPARATORS = (",", ":")
OPENED_TEXTS = 8
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:line: "; the rest is the reason.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


TOO_COMPLEX = "response_format_too_complex"  # the error code of a format refused for its size or compile time


class ResponseFormatError(ValueError):
    """A response_format the server cannot honour; `param` names the request field at fault,
    `code` the kind of refusal (None: not a usable JSON Schema)."""

    param = "response_format"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class JsonFormat:
    """A validated JSON response_format: schema None means any JSON object (json_object)."""

    schema: str | None  # the schema as compact JSON text (property order kept: it is the output order)
    name: str | None = None


@dataclass(frozen=True)
class StructuralFormat:
    """An xgrammar structural tag (`{"type": "structural_tag", "format": {...}}`): free text and
    constrained regions, as tool calls need. With `json_separators` every JSON Schema region is
    written with exactly those separators and no other whitespace (one layout per value)."""

    format: str  # the structural tag as JSON text
    json_separators: tuple[str, str] | None = None


Format = JsonFormat | StructuralFormat


def parse_response_format(value: Any) -> Format | None:
    """The format a response_format asks for, None for plain text; raises ResponseFormatError
    for any other shape (checked before any grammar library runs)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ResponseFormatError(f"response_format must be an object with a 'type', got {value!r}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonFormat(None)
    if kind == "structural_tag":
        return _structural(value)
    if kind != "json_schema":
        raise ResponseFormatError(f"response_format.type must be 'text', 'json_object', 'json_schema' or "
                                  f"'structural_tag', got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise ResponseFormatError("response_format.json_schema must be an object with 'name' and 'schema' "
                                  f"when type is 'json_schema', got {spec!r}")
    name, schema, strict = spec.get("name"), spec.get("schema"), spec.get("strict")
    if name is not None and not isinstance(name, str):
        raise ResponseFormatError(f"response_format.json_schema.name must be a string, got {name!r}")
    if not isinstance(schema, dict):
        raise ResponseFormatError("response_format.json_schema.schema must be a JSON Schema object, "
                                  f"got {schema!r}")
    if strict is not None and not isinstance(strict, bool):
        raise ResponseFormatError(f"response_format.json_schema.strict must be a boolean, got {strict!r}")
    try:
        text = json.dumps(schema, separators=SEPARATORS, allow_nan=False)
    except (TypeError, ValueError) as e:  # only reachable from Python: JSON bodies always serialize
        raise ResponseFormatError(f"response_format.json_schema.schema is not JSON: {e}") from e
    return JsonFormat(text, name)


def _structural(value: dict[str, Any]) -> StructuralFormat:
    fmt, seps = value.get("format"), value.get("json_separators")
    if not isinstance(fmt, dict):
        raise ResponseFormatError("response_format.format must be an xgrammar structural tag format object "
                                  f"when type is 'structural_tag', got {fmt!r}")
    if seps is not None and not (isinstance(seps, list) and len(seps) == 2 and all(isinstance(x, str) for x in seps)):
        raise ResponseFormatError(f"response_format.json_separators must be two strings (item, key), got {seps!r}")
    try:
        text = json.dumps({"type": "structural_tag", "format": fmt}, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ResponseFormatError(f"response_format.format is not JSON: {e}") from e
    return StructuralFormat(text, (seps[0], seps[1]) if seps is not None else None)


def _fixed_layout(node: Any, separators: tuple[str, str]) -> Any:
    """The structural tag with each JSON Schema region replaced by its grammar in one layout."""
    import xgrammar

    if isinstance(node, list):
        return [_fixed_layout(x, separators) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        schema = json.dumps(node["json_schema"])
        grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, separators=separators)
        return {"type": "grammar", "grammar": str(grammar)}
    return {k: _fixed_layout(v, separators) for k, v in node.items()}


@dataclass
class TokenMask:
    """Allowed tokens of some rows of a batch of logits: bitmask [batch, ceil(V/32)] int32 on
    the logits' device (bit v of row b set = token v allowed); only `rows` are constrained."""

    rows: list[int]
    bitmask: torch.Tensor

    def applied(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of logits [batch, V] with every disallowed token of a constrained row at -inf."""
        import xgrammar

        out = logits.clone()
        xgrammar.apply_token_bitmask_inplace(out, self.bitmask, indices=self.rows)
        return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain-torch form of the same masking, on any device: logits [B, V] go to -inf wherever
    bit v of bitmask row b [B, ceil(V/32)] is 0 (the tests' reference, and a fallback)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    keep = bits.view(bitmask.shape[0], -1)[:, : logits.shape[-1]].bool()
    logits.masked_fill_(~keep, float("-inf"))


class Grammars:
    """The engine's grammar state: one compiler for its tokenizer (built on first use: ~1 s
    for a 49k vocabulary), compiled grammars cached by schema, one matcher per live request."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler: Any = None
        self._info: Any = None  # xgrammar's TokenizerInfo, with the compiler
        self._matchers: dict[str, Any] = {}
        self._texts: dict[str, Any] = {}  # serialized grammar -> compiled, least recently used first
        self._bitmask: torch.Tensor | None = None  # host buffer, grown to the largest batch seen
        self._eos_only = _row_allowing(self.eos_token_ids, vocab_size)

    @property
    def live(self) -> int:
        return len(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def compile(self, fmt: Format) -> Any:
        """The compiled grammar of fmt; ResponseFormatError if the schema cannot be compiled."""
        compiler = self._get_compiler()
        try:
            if isinstance(fmt, StructuralFormat):
                tag = json.loads(fmt.format)
                if fmt.json_separators is not None:
                    tag = _fixed_layout(tag, fmt.json_separators)
                return compiler.compile_structural_tag(json.dumps(tag))
            if fmt.schema is None:
                # strict_mode off: an object may carry any properties
                return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False,
                                                    separators=SEPARATORS, strict_mode=False)
            return compiler.compile_json_schema(fmt.schema, any_whitespace=False, separators=SEPARATORS)
        except Exception as e:  # whatever the compiler raises on a user's schema is the schema's refusal
            reason = _CPP_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else "")
            what = "format is not a usable structural tag" if isinstance(fmt, StructuralFormat) else \
                "json_schema.schema is not a usable JSON Schema"
            raise ResponseFormatError(f"response_format.{what}: {reason or type(e).__name__}") from e

    def open(self, request_id: str, compiled: Any) -> None:
        """A matcher for the request: `compiled` is what `compile` gave, here or (as its
        serialize_json text) in another process with the same tokenizer."""
        import xgrammar

        if isinstance(compiled, str):
            compiled = self._opened(compiled)
        self._matchers[request_id] = xgrammar.GrammarMatcher(compiled)

    def _opened(self, text: str) -> Any:
        """The grammar of its serialized text; the n choices of a request send one text n times,
        and a large one takes a tenth of a second to read, so the last few are kept."""
        import xgrammar

        hit = self._texts.pop(text, None)
        if hit is None:
            self._get_compiler()  # the tokenizer info the text refers to
            hit = xgrammar.CompiledGrammar.deserialize_json(text, self._info)
        self._texts[text] = hit
        while len(self._texts) > OPENED_TEXTS:
            del self._texts[next(iter(self._texts))]
        return hit

    def close(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def mask(self, request_ids: list[str], device: torch.device) -> TokenMask | None:
        """The mask for a batch whose row i samples for request_ids[i]; None if no row is constrained."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return None
        words = (self.vocab_size + 31) // 32
        buf = self._bitmask
        if buf is None or buf.shape[0] < len(request_ids):
            buf = torch.full((len(request_ids), words), -1, dtype=torch.int32,
                             pin_memory=device.type == "cuda")
            self._bitmask = buf
        for i in rows:
            self._matchers[request_ids[i]].fill_next_token_bitmask(buf, i)
            if not bool(buf[i].any()):
                # A dead end: the schema has no value that continues this output (e.g. an
                # empty anyOf). Allow only EOS, which ends the request, rather than sample from
                # a row of -inf.
                buf[i] = self._eos_only
        # The copy is awaited by the sampler's own reads before this buffer is refilled.
        return TokenMask(rows, buf[: len(request_ids)].to(device, non_blocking=True))

    def advance(self, request_id: str, token: int) -> bool:
        """Feed a sampled token; False if the grammar refuses it (a bug: the mask allowed it)."""
        return bool(self._matchers[request_id].accept_token(token))

    def ends(self, request_id: str, token: int) -> bool:
        """Feed the request's sampled token; True once its grammar has ended (its stop token was
        accepted: with ignore_eos the request must still stop there)."""
        if not self.advance(request_id, token):
            # Masks allow only tokens the grammar accepts, except EOS at a dead end of an
            # unsatisfiable schema; either way nothing valid can follow: end the request.
            log.warning("request %s: its grammar refused token %d; ending it", request_id, token)
            return True
        return self.finished(request_id)

    def finished(self, request_id: str) -> bool:
        """The grammar has ended: the matcher accepted one of its stop tokens."""
        return bool(self._matchers[request_id].is_terminated())

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            if self.tokenizer is None:
                raise ResponseFormatError("response_format needs the model's tokenizer, and this model has none")
            import xgrammar

            self._info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                 stop_token_ids=self.eos_token_ids)
            self._compiler = xgrammar.GrammarCompiler(self._info, max_threads=1)
        return self._compiler


def _row_allowing(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """One bitmask row [ceil(V/32)] int32 with exactly `tokens` allowed."""
    words = [0] * ((vocab_size + 31) // 32)
    for t in tokens:
        if 0 <= t < vocab_size:
            words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)
