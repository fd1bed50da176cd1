"""Offline Python API, shaped like vLLM's: LLM(...).generate(prompts, params)."""
from __future__ import annotations

import logging
from typing import Any, Sequence

from spanserve.attention.backend import AttentionBackend
from spanserve.engine.config import EngineConfig
from spanserve.engine.engine import LLMEngine
from spanserve.engine.layout import Segment
from spanserve.engine.outputs import RequestOutput
from spanserve.engine.params import SamplingParams
from spanserve.engine.runtime import Runtime
from spanserve.reuse.policies import Policy

Prompt = str | list[int] | list[Segment]
log = logging.getLogger("spanserve")


class LLM:
    def __init__(self, model: Any = "smollm2", device: str = "auto", dtype: str = "auto", block_size: int = 16,
                 backend: "str | AttentionBackend | None" = "auto", enforce_eager: bool = False,
                 fused_ops: str = "auto", **engine_args: Any):
        """device, dtype, backend ("auto", "triton", "reference" or a backend object) and
        fused_ops ("auto", "on", "off") default to the fastest choice for the machine: on a GPU
        CUDA, bfloat16, Triton attention, CUDA graphs (enforce_eager=True turns them off) and
        fused elementwise kernels; on a CPU float32 and the reference backend. Every other
        EngineConfig option (num_blocks, kv_cache_memory, max_num_seqs, tensor_parallel_size, ...)
        is a keyword argument too."""
        config = EngineConfig.from_kwargs(model=model, device=device, dtype=dtype, block_size=block_size,
                                          backend=backend, enforce_eager=enforce_eager, fused_ops=fused_ops,
                                          **engine_args).resolve()
        log.info("runtime: %s", config.summary())
        self.engine = LLMEngine(config)

    @property
    def runtime(self) -> Runtime:
        """The device, dtype, backend, CUDA graphs and fused ops in use, and why each was chosen."""
        return self.engine.engine_config.choices()

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes (also done at interpreter exit) and finish writes
        to the KV tiers below the pool (kv_offload), if any."""
        self.engine.shutdown()

    close = shutdown

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 namespace: str = "", policy: str | Policy | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion in one continuous batch; outputs in prompt order.
        A prompt is text, token ids, or a span layout (a list of Segments)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, Segment))):
            prompts = [prompts]  # a single prompt
        prompts = list(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} sampling params; pass one or one per prompt")
        ids = []
        try:  # a bad prompt aborts the ones queued before it: nothing is left half-submitted
            for p, sp in zip(prompts, plist):
                ids.append(self.engine.add_request(p, sp, namespace=namespace, policy=policy).request_id)
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._drain(ids)

    def _drain(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        want = set(ids)
        while want - done.keys():
            for out in self.engine.step():
                if out.finished and out.request_id in want:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def pin(self, segments: "Sequence[Segment | str]", namespace: str = "") -> None:
        """Encode documents now and keep them cached until unpinned (never evicted meanwhile)."""
        self._drain([self.engine.pin(list(segments), namespace=namespace).request_id])

    def unpin(self, keys: "Sequence[str] | str", namespace: str = "") -> None:
        for k in [keys] if isinstance(keys, str) else keys:
            if not self.engine.unpin(k, namespace=namespace):
                raise ValueError(f"nothing is pinned under {k!r} in namespace {namespace!r}")

    def chat(self, messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
             params: SamplingParams | None = None, namespace: str = "") -> list[RequestOutput]:
        """Applies the model's chat template (with the generation prompt) to each conversation."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        # Render to text and tokenize ourselves: the template already holds the special tokens, and
        # tokenizer versions disagree on what tokenize=True returns.
        texts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in convs]
        return self.generate([self.engine.encode(t) for t in texts], params, namespace=namespace)

