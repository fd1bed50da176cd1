"""What admission asks of the tiers below the pool: every unit of a layout (and every shared
segment a policy recomputes from) at once, so prefix, perforated and segment lookups alike find
the blocks a tier holds. Loads happen either inside admission (synchronous) or on the tiers'
loader threads while the request waits and others run (asynchronous, the default); either way the
loaded blocks are ordinary pool hits by the time the request is planned."""
from __future__ import annotations

from collections import Counter

from spanserve.cache.block_pool import BlockPool
from spanserve.cache.tiers.loader import Chain, LoadJob
from spanserve.cache.tiers.stack import TierStack
from spanserve.cache.units import Unit

TIER_NAMES = ("host", "disk", "store")  # the tiers below the pool, as reuse counts name them


def chains(units: list[Unit]) -> list[Chain]:
    return [(u.seed, u.keys, u.tokens, u.tail_key, u.final) for v in units for u in (v, v.source) if u]


def load_missing(stack: TierStack, pool: BlockPool, units: list[Unit], job: LoadJob | None) -> Counter[str] | LoadJob:
    """The blocks of `units` the pool lacks, loaded from the tiers: the tokens each tier served
    once they are pool blocks; or, with asynchronous loads, the job now in flight (the request
    waits for it and comes back with it once it is done, `job`, to install what it found)."""
    if job is not None:
        return stack.install(pool, job)
    if not stack.asynchronous:
        return stack.fill(pool, chains(units))
    job = stack.start(pool, chains(units))
    return job if job is not None else Counter()


def tier_reuse(loaded: Counter[str]) -> dict[str, int]:
    """Tokens served from each tier, every tier named."""
    return {t: loaded.get(t, 0) for t in TIER_NAMES}
