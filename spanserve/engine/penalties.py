"""Logit processing before sampling: logit_bias, then the repetition, frequency and presence
penalties, for a whole batch at once.

Order (the same as vLLM's): the bias is added to the model's logits first; the repetition
penalty (over prompt + generated tokens, transformers' rule: a positive logit is divided by it, a
negative one multiplied) comes next; the frequency and presence penalties (OpenAI's rule, over
generated tokens only) are subtracted last:

    logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)

Rows that ask for none of this cost nothing, and a batch in which no row asks for any is returned
untouched (the same tensor), so plain requests pay one Python scan of their parameters.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from spanserve.engine.upload import row_index, upload

if TYPE_CHECKING:
    from spanserve.engine.params import SamplingParams

# One (prompt token ids, generated token ids) pair per row of logits.
Histories = Sequence[tuple[Sequence[int], Sequence[int]]]

MAX_BIAS = 100.0
MAX_PENALTY = 2.0  # OpenAI's bound on presence and frequency penalties
# Beyond these a division or product can overflow float32 logits to inf.
REPETITION_RANGE = (0.01, 100.0)


def check_penalties(p: Any) -> None:
    """ValueError naming the field when a penalty or bias is out of range (NaN included)."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_PENALTY <= v <= MAX_PENALTY:
            raise ValueError(f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}; 0 turns it off")
    r = p.repetition_penalty
    lo, hi = REPETITION_RANGE
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not lo <= r <= hi:
        raise ValueError(f"repetition_penalty must be a number in [{lo:g}, {hi:g}], got {r!r}; 1 turns it off")
    if p.logit_bias is None:
        return
    if not isinstance(p.logit_bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(p.logit_bias).__name__}")
    for tok, v in p.logit_bias.items():
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {tok!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_BIAS <= v <= MAX_BIAS:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {tok}")


def wants_processing(p: SamplingParams) -> bool:
    return (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0
            or bool(p.logit_bias))


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    histories: Histories | None) -> torch.Tensor:
    """float32 logits [B, V] after bias and penalties; the input tensor itself when no row asks.
    histories None: no row has a history (the bias still applies)."""
    rows = [i for i, p in enumerate(params) if wants_processing(p)]
    if not rows:
        return logits
    if histories is None:
        histories = [((), ())] * len(params)
    idx = row_index(rows, logits.device) if len(rows) < len(params) else None
    sub = logits.index_select(0, idx) if idx is not None else logits.clone()
    chosen = [params[i] for i in rows]
    hist = [histories[i] for i in rows]
    _add_bias(sub, chosen)
    _repetition(sub, chosen, hist)
    _frequency_presence(sub, chosen, hist)
    if idx is None:
        return sub
    return logits.index_copy(0, idx, sub)


def _pairs(seqs: Sequence[Sequence[int]], rows: Sequence[int], vocab: int,
           unique: bool) -> tuple[np.ndarray, np.ndarray]:
    """(row, token id) of every token of seqs[k], placed in row rows[k]; each pair once if
    `unique`. int64 arrays, built on the host: a history is short next to a vocabulary."""
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    if not lens.sum():
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    ids = np.concatenate([np.asarray(s, dtype=np.int64) for s in seqs])
    r = np.repeat(np.asarray(rows, dtype=np.int64), lens)
    if unique:
        key = np.unique(r * vocab + ids)
        r, ids = key // vocab, key % vocab
    return r, ids


def _index(rows: np.ndarray, ids: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return upload(rows, torch.long, device), upload(ids, torch.long, device)


def _add_bias(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    biased = [(r, p.logit_bias) for r, p in enumerate(params) if p.logit_bias]
    if not biased:
        return
    rows = np.concatenate([np.full(len(b), r, dtype=np.int64) for r, b in biased])
    ids = np.concatenate([np.fromiter(b.keys(), dtype=np.int64, count=len(b)) for _, b in biased])
    vals = upload([v for _, b in biased for v in b.values()], x.dtype, x.device)
    r, t = _index(rows, ids, x.device)
    x.index_put_((r, t), vals, accumulate=True)


# Both penalties touch only the logits of tokens in a history: they gather and scatter those
# (O(history) work) instead of building [batch, vocab] masks or counts (O(vocab) per row).

def _repetition(x: torch.Tensor, params: Sequence[SamplingParams], hist: Histories) -> None:
    sel = [r for r, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not sel:
        return
    seqs = [list(hist[r][0]) + list(hist[r][1]) for r in sel]
    rows, ids = _pairs(seqs, sel, x.shape[1], unique=True)  # each logit scaled once
    if not len(ids):
        return
    pen = upload([p.repetition_penalty for p in params], x.dtype, x.device)
    r, t = _index(rows, ids, x.device)
    vals = x[r, t]
    per = pen[r]
    x[r, t] = torch.where(vals > 0, vals / per, vals * per)


def _frequency_presence(x: torch.Tensor, params: Sequence[SamplingParams], hist: Histories) -> None:
    sel = [r for r, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not sel:
        return
    seqs = [hist[r][1] for r in sel]
    dev = x.device
    freq = upload([p.frequency_penalty for p in params], x.dtype, dev)
    pres = upload([p.presence_penalty for p in params], x.dtype, dev)
    rows, ids = _pairs(seqs, sel, x.shape[1], unique=False)  # once per occurrence
    if len(ids):
        r, t = _index(rows, ids, dev)
        x.index_put_((r, t), -freq[r], accumulate=True)
    rows, ids = _pairs(seqs, sel, x.shape[1], unique=True)  # once per distinct token
    if len(ids):
        r, t = _index(rows, ids, dev)
        x.index_put_((r, t), -pres[r], accumulate=True)
