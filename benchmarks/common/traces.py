"""Request traces shared by the cache simulations (zipf_hits.py, routing_sim.py): seeded, no model."""
from __future__ import annotations

import numpy as np


def zipf_trace(n_requests: int, n_docs: int, k: int, n_slots: int, alpha: float,
               rng: np.random.Generator) -> list[list[tuple[int, int]]]:
    """Per request, k (document, slot) pairs: distinct documents by Zipf popularity (rank r has
    weight r^-alpha), distinct slots uniformly at random."""
    weights = np.arange(1, n_docs + 1, dtype=np.float64) ** -alpha
    p = weights / weights.sum()
    trace = []
    for _ in range(n_requests):
        docs = rng.choice(n_docs, size=k, replace=False, p=p)
        slots = rng.choice(n_slots, size=k, replace=False)
        trace.append([(int(d), int(s)) for d, s in zip(docs, slots)])
    return trace
