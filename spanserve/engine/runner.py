"""Model runner: turns a step's chunks into one flat batch and one attention plan."""
from __future__ import annotations

import gc
from dataclasses import dataclass, field

import numpy as np
import torch

from spanserve.attention.backend import AttentionBackend
from spanserve.attention.decode import DecodeRows
from spanserve.attention.host_plan import HostPlan
from spanserve.attention.paths import GraphLimits, StepPath, StepShape, step_path
from spanserve.attention.plan import AttentionPlan, HostRow, Row
from spanserve.cache.storage import KVStorage
from spanserve.engine.cuda_graphs import DecodeGraphs, StepGraphs
from spanserve.engine.overlap import HostTokens
from spanserve.engine.scheduler import Chunk
from spanserve.model.llama import LlamaModel
from spanserve.reuse.recompute import Recompute, RecomputeRow, RecomputeSpec


def host_plan(chunks: list[Chunk]) -> tuple[HostPlan, list[int]]:
    """The step as host arrays, and the index into the flat batch of each chunk's sampled position
    (-1: none)."""
    ids, positions, writes = [], [], []
    rows: list[HostRow] = []
    sample_at: list[int] = []
    start = 0
    for c in chunks:
        t = c.task
        pos = np.asarray(c.positions, dtype=np.int64)
        slots = t.slots
        n_keys = int(pos[-1]) + 1
        deltas = t.deltas
        nq = len(pos)
        ids.append(np.asarray(t.tokens, dtype=np.int64)[pos] if nq > 64 else [t.tokens[p] for p in c.positions])
        positions.append(pos)
        writes.append(slots[pos])
        rows.append(HostRow(pos, slots[:n_keys], None if deltas is None else deltas[:n_keys],
                            None if t.anchor_end is None else np.full(nq, t.anchor_end, dtype=np.int64),
                            None if t.seg_start is None else np.full(nq, t.seg_start, dtype=np.int64)))
        sample_at.append(start + nq - 1 if t.sample and c.positions[-1] == len(t.tokens) - 1 else -1)
        start += nq
    flat_ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in ids])
    return HostPlan(flat_ids, np.concatenate(positions), np.concatenate(writes), rows), sample_at


def device_plan(hp: HostPlan, device: torch.device) -> tuple[torch.Tensor, AttentionPlan]:
    """(input ids, plan) on the device."""
    rows: list[Row] = []
    start = 0
    for h in hp.rows:
        nq = len(h.q_pos)
        rows.append(Row(
            q_start=start, q_end=start + nq, q_pos=torch.from_numpy(h.q_pos).to(device),
            key_slots=torch.from_numpy(h.key_slots).to(device),
            key_delta=None if h.key_delta is None else torch.from_numpy(h.key_delta).to(device),
            anchor_end=None if h.anchor_end is None else torch.from_numpy(h.anchor_end).to(device),
            seg_start=None if h.seg_start is None else torch.from_numpy(h.seg_start).to(device),
            host=h,
        ))
        start += nq
    plan = AttentionPlan(rows, torch.from_numpy(hp.positions).to(device), torch.from_numpy(hp.write_slots).to(device))
    return torch.from_numpy(hp.ids).to(device), plan


def build_plan(chunks: list[Chunk], block_size: int, device: torch.device) -> tuple[torch.Tensor, AttentionPlan, list[int]]:
    """Returns (input ids, plan, index into the flat batch of each chunk's sampled position or -1)."""
    hp, sample_at = host_plan(chunks)
    ids, plan = device_plan(hp, device)
    return ids, plan, sample_at


def decode_rows(chunks: list[Chunk]) -> tuple[DecodeRows, list[int]] | None:
    """The step as host arrays when every chunk is one causal query with nothing to recompute
    (what a decode graph replays), with build_plan's sample_at; None for any other step."""
    ids, pos, slots, deltas, sample_at = [], [], [], [], []
    for b, c in enumerate(chunks):
        t = c.task
        if len(c.positions) != 1 or c.recompute is not None or t.anchor_end is not None or t.seg_start is not None:
            return None
        p = c.positions[0]
        ids.append(t.tokens[p])
        pos.append(p)
        slots.append(t.slots)
        deltas.append(t.deltas)
        sample_at.append(b if t.sample and p == len(t.tokens) - 1 else -1)
    return DecodeRows(ids, pos, slots, deltas), sample_at


@dataclass
class StepInput:
    """One step as host data: its path, a decode-only step's rows (for the decode graphs) or the
    general plan, the selective rows (chunk index, spec, per-token reused flags), and sample_at."""

    sample_at: list[int]
    path: StepPath
    decode: DecodeRows | None = None
    host: HostPlan | None = None
    recompute: list[tuple[int, RecomputeSpec, list[bool]]] = field(default_factory=list)
    # A decode step chained on the device: its input ids are the tokens the driver picked last
    # step, still on the device (the host has not seen them), broadcast to every rank under TP.
    chained: bool = False


class ModelRunner:
    def __init__(self, model: LlamaModel, storage: KVStorage, backend: AttentionBackend,
                 graphs: "bool | str" = "auto"):
        """graphs: decode steps as CUDA graphs; "auto" = on a CUDA device with a backend that has
        fixed-address layouts; "eager" = the fixed-address path without capture (tests)."""
        self.model = model
        self.storage = storage
        self.backend = backend
        self._chain_ids: torch.Tensor | None = None  # a chained step's input ids while it runs (the driver's)
        n = model.config.num_layers
        self.k_caches = [storage.k[i] for i in range(n)]
        self.v_caches = [storage.v[i] for i in range(n)]
        self.graphs: DecodeGraphs | None = None
        self.step_graphs: StepGraphs | None = None
        capable = hasattr(backend, "static_decode")
        if capable and (graphs == "eager" or (graphs in ("auto", True) and model.device.type == "cuda")):
            self.graphs = DecodeGraphs(model, backend, self.k_caches, self.v_caches, capture=graphs != "eager")
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

    def _recompute_rows(self, step: "StepInput", plan: AttentionPlan) -> list[RecomputeRow]:
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
            ))
        return out

    def _path(self, chunks: list[Chunk], decode_only: bool) -> StepPath:
        limits = None
        if self.graphs is not None and self.step_graphs is not None:
            limits = GraphLimits(self.graphs.max_batch, self.step_graphs.max_tokens)
        shape = StepShape(len(chunks), sum(len(c.positions) for c in chunks), decode_only,
                          any(c.recompute is not None for c in chunks))
        return step_path(shape, limits)

    def prepare(self, chunks: list[Chunk], eager: bool = False) -> "StepInput":
        """The step as host data only: what `execute` runs (on this process or, under tensor
        parallelism, on every rank). eager: the general plan, launched from Python."""
        # Decode-only steps skip the general plan: their fixed buffers are filled from host
        # arrays in one copy (on a GPU the host work is what the step waits for).
        dec = decode_rows(chunks) if self.graphs is not None and not eager else None
        path = StepPath.EAGER if eager else self._path(chunks, dec is not None)
        if path is StepPath.DECODE_GRAPH:
            assert dec is not None
            return StepInput(dec[1], path, decode=dec[0])
        hp, sample_at = host_plan(chunks)
        recompute = []
        for r, c in enumerate(chunks):
            if c.recompute is not None:
                reused = set(c.recompute.reused)
                recompute.append((r, c.recompute, [p in reused for p in c.positions]))
        return StepInput(sample_at, path, host=hp, recompute=recompute)

    @torch.inference_mode()
    def execute(self, step: "StepInput") -> tuple[torch.Tensor, list[RecomputeRow]]:
        """Hidden states of the step's tokens, and its selective rows (with their stats)."""
        if step.path is StepPath.DECODE_GRAPH:
            assert self.graphs is not None and step.decode is not None
            return self.graphs.run(step.decode, self._feed_ids if step.chained else None), []
        hp = step.host
        assert hp is not None
        if step.path is StepPath.STEP_GRAPH:
            assert self.step_graphs is not None
            return self.step_graphs.run(hp), []
        ids, plan = device_plan(hp, self.model.device)
        rows = self._recompute_rows(step, plan)
        hooks = Recompute(rows, ids.numel(), self.model.rotary, self.storage.block_size,
                          reduce=self.model.all_reduce) if rows else None
        return self.model.forward(ids, plan, self.backend, self.k_caches, self.v_caches, hooks), rows

    @torch.inference_mode()
    def run(self, chunks: list[Chunk], step: "StepInput | None" = None) -> tuple[torch.Tensor, list[int]]:
        """Logits [n_sampled, vocab] (float32) and, per chunk, its row in them or -1. `step`: the
        chunks already prepared."""
        logits, picks, _ = self._run(chunks, step if step is not None else self.prepare(chunks))
        return logits, picks

    @torch.inference_mode()
    def run_keep_hidden(self, chunks: list[Chunk]) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """run's result plus the hidden states of every position [T, H], in batch order (for
        prompt logprobs: always the eager path, whose hidden states cover every position)."""
        return self._run(chunks, self.prepare(chunks, eager=True))

    def run_chained(self, chunks: list[Chunk], step: "StepInput", ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Runs a prepared decode step (`step.chained`) whose input ids are `ids` on the device, one
        per chunk in order, and returns its logits without waiting for the device."""
        assert step.chained and step.path is StepPath.DECODE_GRAPH
        self._chain_ids = ids
        try:
            logits, picks, _ = self._run(chunks, step, wait=False)
        finally:
            self._chain_ids = None
        return logits, picks

    def _feed_ids(self, buffer: torch.Tensor) -> None:
        """A chained step's input ids into the decode buffer, after the host arrays' copy."""
        if self._chain_ids is not None:  # the driver (workers have none: the broadcast brings them)
            buffer.copy_(self._chain_ids)
        if self.model.group is not None:
            self.model.group.broadcast_ids(buffer)

    def fetch(self, tokens: HostTokens) -> list[list]:
        """The host's copies of tokens picked on the device and what came with them (waits)."""
        return tokens.lists()

    def _run(self, chunks: list[Chunk], step: "StepInput", wait: bool = True) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """Executes a prepared step (tensor parallelism overrides this to run it on every rank).
        wait=False: the caller waits on the device later, through `fetch`."""
        hidden, rows = self.execute(step)
        for (i, _, _), r in zip(step.recompute, rows):
            chunks[i].request.recompute_stats = r.stats
        logits, picks = self.logits(hidden, step.sample_at)
        return logits, picks, hidden

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
