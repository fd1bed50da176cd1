"""Shutting an engine down frees what it held: the KV pool, the weights and (under tensor
parallelism) the workers, so that a second engine in the same process gets the memory back,
even while the first LLM object is still referenced."""
from __future__ import annotations

import gc
import weakref

import pytest

from spanserve import LLM, SamplingParams
from tiny_models import make_tiny_model


def _held(llm: LLM) -> list[weakref.ref]:
    eng = llm.engine
    return [weakref.ref(t) for t in (eng.storage.k[0], eng.storage.v[-1], eng.model.embed, eng.model.norm)]


@pytest.mark.parametrize("tp", [1, 2])
def test_shutdown_releases_the_pool_and_weights(tmp_path, tp: int) -> None:
    path, _ = make_tiny_model("llama", tmp_path)
    llm = LLM(str(path), num_blocks=64, block_size=8, tensor_parallel_size=tp)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = llm.generate([3, 4, 5, 6, 7], params)[0].token_ids
    refs = _held(llm)
    procs = list(llm.engine.tp.procs) if tp > 1 else []
    llm.shutdown()
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)  # nothing left holds them
    assert all(p.exitcode is not None for p in procs)
    llm.shutdown()  # again: nothing happens
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([3, 4, 5], params)
    with LLM(str(path), num_blocks=64, block_size=8, tensor_parallel_size=tp) as again:  # a second engine
        assert again.generate([3, 4, 5, 6, 7], params)[0].token_ids == first
