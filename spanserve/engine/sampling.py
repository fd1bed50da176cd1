"""The batched sampler (the parameters it reads are engine/params.py's SamplingParams).

Logit bias and penalties come first (engine/penalties.py); filtering order then matches
vLLM: temperature, top-k, top-p, min-p, renormalize.
Every filter is defined by a value threshold rather than by a position in a sorted
list, so tied tokens at a cut-off are kept or dropped together and the support
never depends on how a sort happened to order equal values.

Each seeded row draws its randomness from its own generator (exponential race:
argmax(p / q), q ~ Exp(1)), consuming exactly V uniforms per step; unseeded rows
share one draw from the global RNG; greedy rows draw nothing. A seeded request
therefore yields the same tokens whatever else shares its batch.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spanserve.engine.params import SamplingParams
from spanserve.engine.penalties import Histories, apply_penalties
from spanserve.engine.structured import TokenMask
from spanserve.engine.upload import row_index, upload


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    # Top-n alternatives (token id -> logprob), highest first, n = params.logprobs;
    # includes the chosen token if it is in the top n.
    top: dict[int, float]
    rank: int | None = None  # 1 = the most likely token; set for prompt tokens


def make_generator(
    seed: int | None, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """Generator for a request's seed; None means "use the global RNG"."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


# Top-p looks for its cut-off among this many of the most likely tokens first,
# then among more, and sorts the whole row only when even those fall short of
# top_p. A full sort of a large vocabulary costs many times a top-k, and real
# next-token distributions put almost all their mass in far fewer tokens.
_TOP_P_CANDIDATES: tuple[int, ...] = (1024, 8192)


def _filter_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Filtered, renormalized probabilities for float32 logits [B, V] of sampled rows."""
    vocab = logits.shape[-1]
    dev = logits.device
    temperature = upload([p.temperature for p in params], torch.float32, dev)
    # Shift by the row max before scaling: huge logits over a small temperature
    # would otherwise overflow to inf, and softmax would turn inf - inf into NaN.
    x = (logits - logits.amax(dim=-1, keepdim=True)) / temperature[:, None]

    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        # Thresholding the raw logits rather than x: same order (temperature > 0),
        # but no rounding from the division can merge or split ties.
        k = upload(ks, torch.long, dev)
        topv = torch.topk(logits, max(ks), dim=-1).values
        kth = topv.gather(1, (k.clamp_min(1) - 1)[:, None])
        kth = torch.where(k[:, None] > 0, kth, float("-inf"))
        x = x.masked_fill(logits < kth, float("-inf"))

    probs = torch.softmax(x, dim=-1)

    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        top_p = upload([params[i].top_p for i in p_rows], torch.float32, dev)
        if len(p_rows) == len(params):
            probs = probs.masked_fill(probs < _top_p_threshold(probs, top_p), 0.0)
        else:
            idx = row_index(p_rows, dev)
            sub = probs.index_select(0, idx)
            probs.index_copy_(0, idx, sub.masked_fill(sub < _top_p_threshold(sub, top_p), 0.0))

    if any(p.min_p > 0.0 for p in params):
        # Renormalizing does not change ratios to the max, so no need to do it first.
        min_p = upload([p.min_p for p in params], torch.float32, dev)
        pmax = probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < min_p[:, None] * pmax, 0.0)

    return probs / probs.sum(dim=-1, keepdim=True)


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Smallest probability top-p keeps, per row: [B, 1]."""
    vocab = probs.shape[-1]
    thresh = torch.empty((probs.shape[0], 1), dtype=probs.dtype, device=probs.device)
    rows = torch.arange(probs.shape[0], device=probs.device)
    sizes = [m for m in _TOP_P_CANDIDATES if m < vocab] + [vocab]
    for m in sizes:
        sub = probs if len(rows) == probs.shape[0] else probs[rows]
        if m < vocab:
            prefix = torch.topk(sub, m, dim=-1).values
        else:
            prefix = sub.sort(dim=-1, descending=True).values
        t, decided = _prefix_cut(prefix, top_p[rows])
        thresh[rows] = t
        if m == vocab or bool(decided.all()):
            break
        rows = rows[~decided]
    return thresh


def _prefix_cut(sorted_desc: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p cut over a descending prefix of each row's probabilities.

    Returns the smallest kept value [B, 1] and whether the cut fell inside the
    prefix [B] (if every value in it is kept, the cut may lie further down).
    """
    # Exclusive prefix sum = mass strictly above each position. Built by shifting
    # the inclusive cumsum rather than subtracting from it, to avoid cancellation.
    above = torch.nn.functional.pad(sorted_desc.cumsum(dim=-1)[:, :-1], (1, 0))
    # A prefix, never empty: position 0 has no mass above and top_p > 0.
    n_keep = (above < top_p[:, None]).sum(dim=-1, keepdim=True)
    # Keeping every value >= the last kept one also keeps its ties further down.
    return sorted_desc.gather(1, n_keep - 1), n_keep[:, 0] < sorted_desc.shape[-1]


@functools.lru_cache(maxsize=8)
def _chunks(V: int) -> int:
    """The largest divisor of V from 32 to sqrt(V); 0 when there is none (searched once per V)."""
    return next((d for d in range(math.isqrt(V), 31, -1) if V % d == 0), 0)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of [B, V] (the first index of the maximum), in two passes over about
    sqrt(V) chunks: on a GPU one row's single reduction over 128k logits took ~30 us."""
    B, V = x.shape
    c = _chunks(V)
    if B > 8 or not c:  # many rows fill the GPU already; or no even cut
        return x.argmax(dim=-1)
    best, at = x.view(B, c, V // c).max(dim=-1)  # the first maximum of each chunk
    chunk = best.argmax(dim=-1, keepdim=True)  # the first chunk holding the row's maximum
    return (chunk * (V // c) + at.gather(1, chunk))[:, 0]


def filtered_probs(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The float32 distribution [V] the sampler draws from for one row of logits [V].

    Greedy params give a one-hot at the argmax. Ties at a top-k / top-p / min-p
    cut-off are all kept, so top-p keeps the smallest set of the form
    {p >= t} whose mass reaches top_p.
    """
    row = logits_row.to(torch.float32).reshape(1, -1)
    if params.greedy:
        out = torch.zeros_like(row[0])
        out[int(row[0].argmax())] = 1.0
        return out
    return _filter_probs(row, [params])[0]


def _uniforms(shape: torch.Size, device: torch.device,
              generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """float64 uniforms [B, V]: each seeded row filled from its own generator, which makes it
    independent of its neighbours and its position in the batch; the unseeded rows (chat traffic:
    all of them) share the global RNG, so they take one fill together rather than a launch each."""
    u = torch.empty(shape, dtype=torch.float64, device=device)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        return u.uniform_()
    for i in seeded:
        u[i].uniform_(generator=generators[i])
    if len(seeded) < len(generators):
        free = [i for i, g in enumerate(generators) if g is None]
        u.index_copy_(0, row_index(free, device),
                      torch.empty((len(free), shape[-1]), dtype=torch.float64, device=device).uniform_())
    return u


class Sampler:
    """Picks one token per row of logits [B, V]; see the module docstring."""

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 **hooks: Any) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The picked tokens on the host, and each row's logprobs if it asked for them. `hooks`:
        `pick`'s mask and histories."""
        picked = self.pick(logits, params, generators, **hooks)
        tokens = picked.tolist()
        return tokens, self.logprobs(logits.to(torch.float32), params, picked, tokens)

    def logprobs(self, logits: torch.Tensor, params: Sequence[SamplingParams], picked: torch.Tensor,
                 tokens: list[int]) -> list[TokenLogprobs | None]:
        """Per row, the logprobs it asked for (None where it did not), waiting for them."""
        lt = self.logprob_tensors(logits, params, picked)
        if lt is None:
            return [None] * len(params)
        return lt.build(params, tokens, *(t.tolist() for t in lt.tensors()))

    def pick(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        *,
        mask: TokenMask | None = None,
        histories: Histories | None = None,
    ) -> torch.Tensor:
        """The picked token ids [B] (int64) on the logits' device, without waiting for them: a
        decode step chained on the device feeds them to the next step's input. mask: tokens a
        structured-output row may pick, applied before every filter and the argmax; histories:
        each row's (prompt, generated) token ids, for penalties; None = all empty."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"got {batch} logits rows, {len(params)} params and "
                f"{len(generators)} generators; pass one of each per row"
            )
        logits = apply_penalties(logits.to(torch.float32), params, histories)
        if mask is not None:
            logits = mask.applied(logits)
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        if len(greedy_rows) == batch:
            # the whole batch: indexing by a list of rows would copy that list to the device
            return argmax_rows(logits)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled_rows) == batch:
            return self._sample(logits, params, generators)
        tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
        greedy, sampled = row_index(greedy_rows, logits.device), row_index(sampled_rows, logits.device)
        tokens.index_copy_(0, greedy, logits.index_select(0, greedy).argmax(dim=-1))
        tokens.index_copy_(0, sampled, self._sample(logits.index_select(0, sampled), [params[i] for i in sampled_rows],
                                                    [generators[i] for i in sampled_rows]))
        return tokens

    @staticmethod
    def _sample(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        probs = _filter_probs(logits, params)
        # Exponential race: argmax(p / q) with q ~ Exp(1) picks token i with
        # probability p_i. Uniforms are drawn in float64 because torch's float32
        # uniforms are multiples of 2**-24, too coarse near 0 where the small,
        # race-winning q come from; the log can then run in float32, which keeps
        # full relative precision for small values.
        u = _uniforms(probs.shape, probs.device, generators)
        q = torch.log1p(-u.to(torch.float32)).neg_()
        scores = probs / q
        # q can be 0 (score inf) or inf (score 0, like a filtered-out token);
        # pushing filtered tokens below 0 guarantees a kept one always wins.
        scores.masked_fill_(probs == 0.0, -1.0)
        return scores.argmax(dim=-1)

    @staticmethod
    def logprob_tensors(logits: torch.Tensor, params: Sequence[SamplingParams],
                        picked: torch.Tensor) -> "LogprobTensors | None":
        """The logprobs the rows that asked for them report, still on the device (None: no row
        asked). Raw logits, before bias, penalties, temperature and filtering: they report what
        the model thought, not what the sampler was allowed to pick."""
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not rows:
            return None
        if len(rows) < len(params):
            idx = row_index(rows, logits.device)
            logits, picked = logits.index_select(0, idx), picked.index_select(0, idx)
        lp = torch.log_softmax(logits, dim=-1)
        chosen = lp.gather(1, picked[:, None])[:, 0]
        n_max = min(max(params[i].logprobs or 0 for i in rows), lp.shape[-1])
        top = torch.topk(lp, n_max, dim=-1)  # sorted, highest first
        return LogprobTensors(rows, n_max, chosen, top.values, top.indices)


@dataclass
class LogprobTensors:
    rows: list[int]  # the batch rows that asked for logprobs
    n_max: int
    chosen: torch.Tensor  # [R] the picked tokens' logprobs
    top_vals: torch.Tensor  # [R, n_max], highest first
    top_ids: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.chosen, self.top_vals, self.top_ids

    def build(self, params: Sequence[SamplingParams], tokens: list[int], chosen: list[float],
              top_vals: list[list[float]], top_ids: list[list[int]]) -> list[TokenLogprobs | None]:
        """Per batch row, from the host's copies of `tensors()`."""
        out: list[TokenLogprobs | None] = [None] * len(params)
        for j, i in enumerate(self.rows):
            n = min(params[i].logprobs or 0, self.n_max)
            alts = dict(zip(top_ids[j][:n], top_vals[j][:n])) if n > 0 else {}
            out[i] = TokenLogprobs(token_id=tokens[i], logprob=chosen[j], top=alts)
        return out
