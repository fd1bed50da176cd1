"""Sampling on CUDA queues its work behind the forward pass without waiting for it: a chained
decode step's pick must not hold the host (engine/upload.py). torch's sync debug mode turns any
synchronizing call into an error."""
from __future__ import annotations

import torch

from spanserve.engine.params import SamplingParams
from spanserve.engine.sampling import Sampler, make_generator


def test_pick_and_logprobs_never_wait_for_the_device():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=40, logprobs=3),
              SamplingParams(temperature=1.2, min_p=0.05), SamplingParams(temperature=0),
              SamplingParams(temperature=0.9, seed=11)]
    gens = [make_generator(p.seed, dev) for p in params]
    logits = torch.randn(len(params), 128256, device=dev)
    sampler = Sampler()
    want = sampler.pick(logits, params, gens)  # first call: lazy CUDA state is set up outside the check
    torch.cuda.synchronize()
    gens = [make_generator(p.seed, dev) for p in params]
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sampler.pick(logits, params, gens)
        lt = sampler.logprob_tensors(logits, params, got)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert lt is not None and lt.rows == [1]
    assert got[[0, 3]].tolist() == logits[[0, 3]].argmax(dim=-1).tolist()
    assert got[4].item() == want[4].item()  # the seeded row repeats itself
