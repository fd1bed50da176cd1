"""How each unit of a layout gets its blocks from the pool: which cached blocks it shares (prefix,
perforated, partial-block and segment hits), which are fresh and what is copied into them."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from spanserve.cache import hashing
from spanserve.cache.block_pool import Block, BlockPool
from spanserve.cache.units import Unit


class Plan(NamedTuple):
    """How a unit gets its blocks: block i shares the cached block `shared[i]`, or (None) is a
    fresh one whose first `copy_n` slots are copied from `src`, `copies[i] = (src, copy_n)`
    (src: a cached block holding a prefix of its tokens, or None). Columns rather than one
    object per block: a warm layout is thousands of shared blocks and no copies."""

    shared: list[Block | None]
    copies: dict[int, tuple[Block | None, int]]


def fresh_plan(n_blocks: int) -> Plan:
    """Every block fresh and computed (nothing shared, nothing copied)."""
    return Plan([None] * n_blocks, dict.fromkeys(range(n_blocks), (None, 0)))


def plan_unit(pool: BlockPool, block_size: int, seed: int, tokens: Sequence[int], keys: list[int],
              extended: bool, packed: bytes | None = None, tail_key: int | None = None) -> Plan:
    """Never stops at the first miss: a chained key after a gap still hits (perforated).
    An `extended` unit (generation continues it; its final token's logits are needed) keeps
    its last block private: copied from a hit, never shared. `tail_key`: the partial last
    block's key if the caller has it. `copies` is filled in block order (admit relies on it)."""
    bs = block_size
    n_blocks = -(-len(tokens) // bs)
    hits = pool.lookup_chain(keys, tokens, bs, packed)  # the full blocks, in one pass
    shared: list[Block | None] = hits + [None] * (n_blocks - len(hits))
    if extended:
        shared[-1] = None
    copies: dict[int, tuple[Block | None, int]] = {}
    # every full block hit (blocks are truthy): only a partial tail can be left to look at
    first = len(hits) if all(hits) else 0
    if extended:
        first = min(first, n_blocks - 1)
    for i in range(first, n_blocks):
        if shared[i] is not None:
            continue
        toks = tokens[i * bs:(i + 1) * bs]
        parent = keys[i - 1] if i else seed
        last = i == n_blocks - 1
        if len(toks) == bs:
            key = keys[i]
        else:
            key = tail_key if tail_key is not None else hashing.block_key(parent, toks)
        hit = pool.lookup(key, toks)
        if hit is not None and not (extended and last):
            shared[i] = hit
            continue
        keep = len(toks) - 1 if (extended and last) else len(toks)
        if hit is not None:
            copies[i] = (hit, keep)
            continue
        # the cached block holding the longest prefix of toks: a unit that ended inside this
        # block (an earlier turn, a finished generation) left it behind
        copies[i] = pool.longest_partial(parent, toks, min(keep, len(toks) - 1))
    return Plan(shared, copies)


def touched(plans: list[Plan]) -> list[Block]:
    """The cached blocks a request reads: each shared block, or else its copy source, in order."""
    out: list[Block] = []
    for plan in plans:
        done = 0
        for i, (src, _) in plan.copies.items():  # block order; the hits between go in bulk
            out += plan.shared[done:i]  # type: ignore[arg-type]
            if src is not None:
                out.append(src)
            done = i + 1
        out += plan.shared[done:]  # type: ignore[arg-type]
    return out


def reuse_kind(u: Unit, contiguous: bool) -> str:
    return "segment" if u.plus else ("prefix" if contiguous else "perforated")


def place_hits(held: list[Block], u: Unit, shared: list, lo: int, hi: int, bs: int) -> int:
    """Give u its shared blocks lo..hi-1 (whole hits: every slot valid); returns their tokens."""
    if hi <= lo:
        return 0
    run = shared[lo:hi]
    held += run
    u.blocks += run
    n_tok = min(hi * bs, len(u.tokens)) - lo * bs
    u.n_valid += [bs] * (hi - lo - 1)
    u.n_valid.append(n_tok - (hi - lo - 1) * bs)
    return n_tok


def all_hit(units: list[Unit], plans: list[Plan], bs: int) -> bool:
    """The whole request chain is cached: only the final token is left to compute."""
    for u, plan in zip(units, plans):
        last = len(plan.shared) - 1
        for i, (_, copy_n) in plan.copies.items():
            if not (u.final and i == last and copy_n == min(bs, len(u.tokens) - i * bs) - 1):
                return False
    return True
