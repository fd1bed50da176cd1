"""Model runner: runs a step (`StepInput`, host data) on one device: the attention plan on the
device, the forward (eagerly or as a CUDA graph), the LM head over the sampled positions."""
from __future__ import annotations

import gc
from typing import Callable

import numpy as np
import torch

from spanserve.attention.backend import AttentionBackend
from spanserve.attention.host_plan import HostPlan
from spanserve.attention.paths import GraphLimits, StepPath
from spanserve.attention.plan import AttentionPlan, Row
from spanserve.model.llama import LlamaModel
from spanserve.reuse.recompute import Recompute, RecomputeRow
from spanserve.worker.cuda_graphs import DecodeGraphs, StepGraphs
from spanserve.worker.executor import Executor
from spanserve.worker.host_tokens import HostTokens
from spanserve.worker.step import StepInput, StepOutput
from spanserve.worker.storage import KVStorage


def device_plan(hp: HostPlan, device: torch.device) -> tuple[torch.Tensor, AttentionPlan]:
    """(input ids, plan) on the device: every array of the step in one host-to-device copy (a
    step of 256 rows has over a thousand of them), the rows' tensors views of it."""
    parts: list[np.ndarray] = [hp.ids, hp.positions, hp.write_slots]
    for h in hp.rows:
        parts += [a for a in (h.q_pos, h.key_slots, h.key_delta, h.anchor_end, h.seg_start) if a is not None]
    flat = torch.from_numpy(np.concatenate(parts).astype(np.int64, copy=False)).to(device)
    views = iter(flat.split([len(a) for a in parts]))
    ids, positions, write_slots = next(views), next(views), next(views)
    rows: list[Row] = []
    start = 0
    for h in hp.rows:
        nq = len(h.q_pos)
        q_pos, key_slots = next(views), next(views)
        rows.append(Row(q_start=start, q_end=start + nq, q_pos=q_pos, key_slots=key_slots,
                        key_delta=None if h.key_delta is None else next(views),
                        anchor_end=None if h.anchor_end is None else next(views),
                        seg_start=None if h.seg_start is None else next(views), host=h,
                        repair=h.repair))
        start += nq
    return ids, AttentionPlan(rows, positions, write_slots)


class ModelRunner(Executor):
    """One device's executor, and what each tensor-parallel rank runs on its shard."""

    def __init__(self, model: LlamaModel, storage: KVStorage, backend: AttentionBackend,
                 graphs: "bool | str" = "auto", max_batch: int = 256):
        """graphs: decode steps as CUDA graphs; "auto" = on a CUDA device with a backend that has
        fixed-address layouts; "eager" = the fixed-address path without capture (tests).
        max_batch: the largest decode step a graph replays (the scheduler's max_num_seqs)."""
        self.model = model
        self.storage = storage
        self.backend = backend
        n = model.config.num_layers
        layers = [storage.layer(i) for i in range(n)]
        self.k_caches = [k for k, _ in layers]
        self.v_caches = [v for _, v in layers]
        self.graphs: DecodeGraphs | None = None
        self.step_graphs: StepGraphs | None = None
        capable = hasattr(backend, "static_decode")
        if capable and (graphs == "eager" or (graphs in ("auto", True) and model.device.type == "cuda")):
            self.graphs = DecodeGraphs(model, backend, self.k_caches, self.v_caches, max_batch,
                                       capture=graphs != "eager", scratch_slot=storage.scratch_slot)
            self.step_graphs = StepGraphs(model, backend, self.k_caches, self.v_caches, self.graphs.pool,
                                          capture=graphs != "eager")

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs. Under tensor parallelism they hold NCCL collectives, and
        NCCL does not destroy a communicator while a graph holding its work is alive: the process
        group's teardown would wait for ever."""
        self.graphs = self.step_graphs = None
        gc.collect()
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)

    def _feeder(self, ids: torch.Tensor | None) -> Callable[[torch.Tensor], None]:
        """Fills a chained step's input ids into the decode buffer, after the host arrays' copy."""
        group = self.model.group

        def feed(buffer: torch.Tensor) -> None:
            if ids is not None:
                buffer.copy_(ids)
            if group is not None:
                group.broadcast_ids(buffer)
        return feed

    def _recompute_rows(self, step: StepInput, plan: AttentionPlan) -> list[RecomputeRow]:
        out = []
        for r, spec, reused in step.recompute:
            row = plan.rows[r]
            dev = row.q_pos.device
            place = dict(zip(spec.reused, spec.offsets)) if spec.offsets else None
            offsets = None if place is None else torch.tensor(
                [place[p] for p in step.host.rows[r].q_pos.tolist() if p in place], dtype=torch.long, device=dev)
            out.append(RecomputeRow(
                spec=spec,
                flat=torch.arange(row.q_start, row.q_end, device=dev),
                is_reused=torch.tensor(reused, dtype=torch.bool, device=dev),
                key_slots=row.key_slots, key_delta=row.key_delta, q_pos=row.q_pos,
                decision_layer=spec.policy.decision_layer(self.model.config.num_layers), offsets=offsets,
                repair=row.repair,
            ))
        return out

    @property
    def graph_limits(self) -> GraphLimits | None:
        if self.graphs is None or self.step_graphs is None:
            return None
        return GraphLimits(self.graphs.max_batch, self.step_graphs.max_tokens)

    @torch.inference_mode()
    def execute(self, step: StepInput, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, list[RecomputeRow]]:
        """Hidden states of the step's tokens, and its selective rows (with their stats). `ids`:
        a chained step's input ids on the device (the driver's; workers get them broadcast)."""
        if step.path is StepPath.DECODE_GRAPH:
            assert self.graphs is not None and step.decode is not None
            return self.graphs.run(step.decode, self._feeder(ids) if step.chained else None), []
        hp = step.host
        assert hp is not None
        if step.path is StepPath.STEP_GRAPH:
            assert self.step_graphs is not None
            return self.step_graphs.run(hp), []
        tokens, plan = device_plan(hp, self.model.device)
        rows = self._recompute_rows(step, plan)
        hooks = Recompute(rows, tokens.numel(), self.model.rotary, self.storage.block_size,
                          reduce=self.model.all_reduce) if rows else None
        return self.model.forward(tokens, plan, self.backend, self.k_caches, self.v_caches, hooks), rows

    @torch.inference_mode()
    def run(self, step: StepInput, ids: torch.Tensor | None = None, wait: bool = True) -> StepOutput:
        """Executes a prepared step; one device waits for nothing (`fetch` waits on picks)."""
        hidden, rows = self.execute(step, ids)
        logits, picks = self.logits(hidden, step.sample_at)
        return StepOutput(logits, picks, hidden, [r.stats for r in rows])

    def fetch(self, tokens: HostTokens) -> list[list]:
        return tokens.lists()

    def shutdown(self) -> None:
        self.release_graphs()

    def logits_at(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Float32 logits of the given rows of a step's hidden states (prompt logprobs)."""
        return self.model.logits(hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)])

    def logits(self, hidden: torch.Tensor, sample_at: list[int]) -> tuple[torch.Tensor, list[int]]:
        picks = [i for i in sample_at if i >= 0]
        if not picks or picks[-1] - picks[0] == len(picks) - 1:  # consecutive (every decode row): a view
            hidden = hidden[picks[0]:picks[-1] + 1] if picks else hidden[:0]
        else:  # an index tensor: one more host-to-device copy
            hidden = hidden[torch.tensor(picks, dtype=torch.long, device=hidden.device)]
        logits = self.model.logits(hidden)
        rows, k = [], 0
        for i in sample_at:
            rows.append(k if i >= 0 else -1)
            k += i >= 0
        return logits, rows
