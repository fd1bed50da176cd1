"""The synchronous engine: requests in, one scheduled model step at a time, outputs out."""
from __future__ import annotations

import functools
import gc
import itertools
import time
from typing import Any, Iterable, Sequence

import torch

from spanserve.engine.batch import prepare
from spanserve.engine.builder import build
from spanserve.engine.config import EngineConfig
from spanserve.engine.detokenize import make_decoder
from spanserve.engine.layout import Segment
from spanserve.engine.outputs import RequestOutput, output_of
from spanserve.engine.overlap import Pending, chainable, continues, may_continue, next_is_chained
from spanserve.engine.params import SamplingParams
from spanserve.engine.pins import PinTable
from spanserve.engine.prepare import Limits, Prepared, check_ids, check_prompt
from spanserve.engine.prompt_logprobs import record_prompt_logprobs, wants_prompt_logprobs
from spanserve.engine.request import Request
from spanserve.engine.sampling import make_generator
from spanserve.engine.scheduler import Chunk, Schedule
from spanserve.engine.step_stats import DecodeStepStats
from spanserve.engine.stops import OutputText, token_stop
from spanserve.engine.structured import parse_response_format
from spanserve.reuse.policies import Policy, resolve_policy
from spanserve.worker.host_tokens import HostTokens
from spanserve.worker.step import StepOutput

# Attributes of an engine that hold device memory (weights, KV pool, graphs, masks): dropped at shutdown.
_DEVICE_PARTS = ("executor", "model", "storage", "manager", "scheduler", "sampler", "grammars", "tp")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        """An engine for `config`, resolved here if it is not yet (its `auto` choices made for this
        machine); its parts come from engine/builder.py."""
        if not isinstance(config, EngineConfig):
            raise TypeError("LLMEngine takes one EngineConfig, e.g. LLMEngine(EngineConfig.from_kwargs(model=..., "
                            f"num_blocks=...)), or use LLM(...); got {type(config).__name__}")
        self.engine_config = config = config.resolve()
        parts = build(config)
        self.default_policy = resolve_policy(config.scheduler.default_policy)
        self.device, self.dtype, self.tp = parts.device, parts.dtype, parts.side.tp
        self.config, self.tokenizer, self.model = parts.side.config, parts.side.tokenizer, parts.side.model
        self.block_size, self.sink_prefix = config.cache.block_size, parts.sink_prefix
        self.max_model_len = parts.max_model_len
        self.storage, self.tiers, self.pool, self.manager = parts.storage, parts.tiers, parts.pool, parts.manager
        self.scheduler, self.executor, self.sampler = parts.scheduler, parts.executor, parts.sampler
        self.grammars = parts.grammars
        self.pins = PinTable(self.pool.num_blocks, config.cache.pin_fraction, config.cache.pin_quota)
        self._decode = make_decoder(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.decode_stats = DecodeStepStats()  # decode-only steps: wall time by batch size
        # overlap: decode steps chained on the device (engine/overlap.py); None = with CUDA graphs
        graphs = self.executor.graph_limits is not None
        self.overlap = graphs and (self.device.type == "cuda" if config.runtime.overlap is None else config.runtime.overlap)
        self._pending: Pending | None = None  # a chained step whose picks the host has not seen
        self._settled_at = 0.0
        self.chained_steps = 0  # steps launched before the host saw the previous one's picks
        self.closed = False
        self.detokenize = True  # text and stop strings here (the Python API); an engine core leaves them to its client
        self.counters = {"prefix": 0, "perforated": 0, "segment": 0, "computed": 0, "preemptions": 0,
                         "prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0}

    def shutdown(self) -> None:
        """Stop tensor-parallel workers, finish the tiers' queued writes (a disk tier also keeps
        what the pool holds, for the next start) and free the device: the KV pool, CUDA graphs
        and weights are released, so another engine in this process gets their memory back.
        The engine is not used afterwards; calling this again does nothing."""
        if self.closed:
            return
        self.closed = True
        if self.tiers is not None:
            tiers, self.tiers = self.tiers, None
            tiers.close(self.pool if self.tp is None or self.tp.dead is None else None)  # dead: KV unreadable
        self.executor.shutdown()
        self.requests.clear()
        self._pending = None
        device = self.device
        for name in _DEVICE_PARTS:  # everything that holds device memory, directly or through a part
            self.__dict__.pop(name, None)
        gc.collect()  # the parts reference each other (runner -> graphs -> model)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # cached blocks back to the device, where mem_get_info sees them

    def close(self) -> None:
        self.shutdown()

    @functools.cached_property
    def eos_token_ids(self) -> set[int]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ---- requests -------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return self.check_ids(prompt)

    def check_ids(self, ids: "Sequence[int]") -> list[int]:
        """Token ids as a list of ints, each in the vocabulary (vectorized: layouts are long)."""
        return check_ids(ids, self.config.vocab_size)

    @property
    def limits(self) -> Limits:
        return Limits(self.config.vocab_size, self.max_model_len, self.sink_prefix)

    def add_request(self, prompt: "str | list[int] | list[Segment]", params: SamplingParams | None = None,
                    request_id: str | None = None, namespace: str = "", policy: "str | Policy | None" = None,
                    encode_only: bool = False, tenant: str = "") -> Request:
        """prompt: text, token ids, or a span layout (a list of Segments). `tenant`: whose request
        it is (admission is fair across tenants; pins count against their owner's quota)."""
        if self.closed:
            raise RuntimeError("this engine was shut down; build a new one")
        params = params or SamplingParams()
        pol = resolve_policy(policy, self.default_policy)
        ids, pieces = check_prompt(prompt, params, pol, self.limits, self.encode, encode_only)
        fmt = parse_response_format(params.response_format)
        grammar = self.grammars.compile(fmt) if fmt is not None else None
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return self.add_prepared(Prepared(rid, ids, pieces, params, namespace, pol, encode_only, grammar,
                                          tenant=tenant))

    def add_prepared(self, p: Prepared) -> Request:
        """Queues a checked request (engine/prepare.py)."""
        if p.request_id in self.requests:
            raise ValueError(f"request id {p.request_id!r} is already in use")
        if p.encode_only:  # its blocks are promised now: pins in flight together stay within the limits
            self.pins.reserve(p.request_id, p.tenant, sum(-(-len(q.tokens) // self.block_size) for q in p.pieces))
        if p.grammar is not None:  # last: a matcher exists only for a request that is queued
            self.grammars.open(p.request_id, p.grammar)
        req = Request(p.request_id, p.token_ids, p.params, namespace=p.namespace,
                      generator=make_generator(p.params.seed, self.device), pieces=p.pieces,
                      policy=resolve_policy(p.policy, self.default_policy), encode_only=p.encode_only,
                      tenant=p.tenant)
        if p.arrival_time is not None:
            req.arrival_time = p.arrival_time
        self.requests[p.request_id] = req
        self.scheduler.add(req)
        self.counters["prompt_tokens"] += len(p.token_ids)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.token_in_flight:  # its pick is dropped: the row ends at the last token it has
            req.main.drop_place()
            req.token_in_flight = False
        req.finish_reason = "abort"
        self.scheduler.finish(req)
        self.grammars.close(request_id)
        self.pins.release_reservation(request_id)
        return output_of(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._pending is not None

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One model step: the outputs of the requests it advanced (finished ones included)."""
        return [output_of(r) for r in self.advance()]

    def advance(self) -> list[Request]:
        """One model step: the requests it advanced, finished ones released. With overlap, a decode step whose picks stay on the device may be in
        flight when this returns: the next call launches the step after it, then takes its
        tokens in while that one runs (or, when the batch changes, takes them in first)."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        sched = self.scheduler
        admissible = bool(sched.waiting) and sched.admits_now()
        if pending is not None and not next_is_chained(sched.running, admissible, self.pool.num_free):
            return self._settle(pending)
        schedule = sched.schedule()
        self.counters["preemptions"] += len(schedule.preempted)
        if pending is None:
            return self._run(schedule, t0) if schedule.chunks else self._idle()
        chunks = schedule.chunks
        step = prepare(chunks, self.executor.graph_limits) if chunks else None
        if step is not None and continues(chunks, step, bool(schedule.preempted)):
            step.chained = True
            self.chained_steps += 1
            ids = pending.picks.rows(pending.index_of([c.request for c in chunks]))
            return self._launch(chunks, self.executor.run(step, ids, wait=False), t0, settle=pending)
        outputs = self._settle(pending)  # not one chained step after all: the host goes first
        schedule.chunks = [c for c in chunks if not c.request.finished]
        return outputs + (self._run(schedule, t0) if schedule.chunks else [])

    def _idle(self) -> list[Request]:
        """A step with nothing to compute: pins whose segments were all cached finish, a request
        that cannot be admitted with nothing running fails (rather than hang), or the loop
        sleeps on tier loads (rather than spin)."""
        done_pins = [r for r in self.scheduler.running if r.encode_only and r.computed]
        if done_pins:
            for r in done_pins:
                self._pin(r)
            return [self._retire(r) for r in done_pins]
        req = self.scheduler.stuck()
        if req is not None:
            req.finish_reason = "length"
            self.scheduler.finish(req)
            return [self._retire(req)]
        self.scheduler.wait_for_loads()
        return []

    def _run(self, schedule: Schedule, t0: float) -> list[Request]:
        """Runs a scheduled step: forward, sampling (or, chained, picks left on the device), outputs."""
        chunks = schedule.chunks
        scores = any(wants_prompt_logprobs(c) for c in chunks)  # needs every position's hidden state
        step = prepare(chunks, self.executor.graph_limits, eager=scores)
        if self.overlap and chainable(chunks, step, [self.structured(c.request) for c in chunks], self.max_model_len):
            return self._launch(chunks, self.executor.run(step, wait=False), t0)
        out = self.executor.run(step)
        for (i, _, _), stats in zip(step.recompute, out.recompute_stats):
            chunks[i].request.recompute_stats = stats
        if scores:
            record_prompt_logprobs(functools.partial(self.executor.logits_at, out.hidden), chunks)
        sampled = [(c.request, r) for c, r in zip(chunks, out.rows) if r >= 0]
        mask = self.grammars.mask([q.request_id for q, _ in sampled], out.logits.device)
        tokens, logprobs = self.sampler(out.logits, [q.params for q, _ in sampled], [q.generator for q, _ in sampled],
                                        mask=mask, histories=[(q.prompt_token_ids, q.output_token_ids) for q, _ in sampled])
        outputs = self._take([(req, tok, lp) for (req, _), tok, lp in zip(sampled, tokens, logprobs)],
                             {id(c.request): c.request for c in chunks}.values())
        if all(len(c.positions) == 1 and c.recompute is None for c in chunks):
            self.decode_stats.record(len(chunks), sum(c.positions[0] + 1 for c in chunks), time.perf_counter() - t0)
        return outputs

    def _launch(self, chunks: list[Chunk], out: StepOutput, t0: float,
                settle: Pending | None = None) -> list[Request]:
        """Picks a chained step's tokens on the device, takes in the step before it (if any)
        while this one runs, then gives every request that goes on a placeholder for its pick."""
        sampled = [(c.request, r) for c, r in zip(chunks, out.rows)]
        params = [q.params for q, _ in sampled]
        picks = self.sampler.pick(out.logits, params, [q.generator for q, _ in sampled])
        lt = self.sampler.logprob_tensors(out.logits, params, picks)
        pending = Pending(sampled, HostTokens(picks, *(lt.tensors() if lt is not None else ())), t0,
                          sum(c.positions[0] + 1 for c in chunks), lt)
        outputs = self._settle(settle) if settle is not None else []
        for req, _ in sampled:
            if not req.finished and may_continue(req, self.max_model_len):
                req.main.hold_place()
                req.token_in_flight = True
        self._pending = pending
        return outputs

    def _settle(self, pending: Pending) -> list[Request]:
        """The host takes in a chained step's picks: each becomes its request's token."""
        tokens, *extra = self.executor.fetch(pending.picks)
        now = time.perf_counter()
        self.decode_stats.record(len(pending.sampled), pending.keys, now - max(pending.started, self._settled_at))
        self._settled_at = now
        lps: list = [None] * len(tokens)
        if pending.logprobs is not None:
            lps = pending.logprobs.build([q.params for q, _ in pending.sampled], tokens, *extra)
        picked = [(req, tokens[i], lps[i]) for req, i in pending.sampled if not req.finished]  # not aborted
        return self._take(picked, [req for req, _, _ in picked])

    def _take(self, picked: "list[tuple[Request, int, Any]]", touched: "Iterable[Request]") -> list[Request]:
        """Appends each picked token (with its logprobs) to its request; every request the step
        touched publishes its computed blocks, or is retired if it finished."""
        for req, tok, lp in picked:
            self._append(req, tok, lp)
        out = list(touched)
        for req in out:
            if req.encode_only and req.computed:
                self._pin(req)
            if req.finished:
                self._retire(req)
            else:
                self.manager.publish(req.kv)
        return out

    def structured(self, req: Request) -> bool:
        return req.request_id in self.grammars

    def _append(self, req: Request, tok: int, lp: Any) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if not req.output_token_ids:
            self.manager.snapshot_prompt_tail(req.kv)
        req.output_token_ids.append(tok)
        req.logprobs.append(lp)
        main = req.main
        if req.token_in_flight:
            main.fill_place(tok)
            req.token_in_flight = False
        else:
            main.append(tok)
        self.counters["generation_tokens"] += 1
        grammar_done = req.request_id in self.grammars and self.grammars.ends(req.request_id, tok)
        stop = token_stop(tok, req.params, self.eos_token_ids, grammar_done, len(req.output_token_ids),
                          len(main.tokens) >= self.max_model_len)
        if self.detokenize:  # else the engine core's client detokenizes and checks stop strings
            if req.output is None:
                req.output = OutputText(self._decode, req.params)
            stop = req.output.add(req.output_token_ids, stop)
        if stop is not None:
            req.finish_reason, req.stop_reason, req.stopped_by = stop.reason, stop.stop_reason, stop.by
            self.scheduler.finish(req)

    # ---- pinned segments -------------------------------------------------------------------
    def pin(self, segments: "list[Segment | str]", namespace: str = "", tenant: str = "") -> Request:
        """Queue the encoding of standalone segments that stay cached (never evicted) until
        unpinned. Each is pinned under its key (its text if no key is given), owned by `tenant`."""
        segs = [s if isinstance(s, Segment) else Segment(text=s, kind="plus") for s in segments]
        if any(s.kind != "plus" for s in segs):
            raise ValueError("only plus (standalone) segments can be pinned")
        return self.add_request(segs, SamplingParams(max_tokens=1), namespace=namespace, policy="none",
                                encode_only=True, tenant=tenant)

    def _pin(self, req: Request) -> None:
        self.manager.publish(req.kv, tail=True)
        self.pins.release_reservation(req.request_id)
        for u, p in zip(req.units, req.pieces):
            name = p.key if p.key is not None else self._detok(list(p.tokens))
            for b in u.blocks:
                self.pool.acquire(b)
            for b in self.pins.put((req.namespace, name), req.tenant, u.blocks):
                self.pool.release(b)
        req.finish_reason = "stop"
        self.scheduler.finish(req)

    def unpin(self, key: str, namespace: str = "") -> bool:
        """False when nothing is pinned under `key` in `namespace` (a namespace is one tenant's:
        another tenant's pin is not there to find)."""
        blocks = self.pins.pop((namespace, key))
        for b in blocks or []:
            self.pool.release(b)
        return blocks is not None

    def _detok(self, ids: list[int]) -> str:
        return self._decode(ids)

    def _retire(self, req: Request) -> Request:
        """A finished request leaves the engine; its counts join the engine's."""
        self.requests.pop(req.request_id, None)
        self.grammars.close(req.request_id)
        self.pins.release_reservation(req.request_id)  # a pin request that failed (could not be admitted)
        self.counters["requests_finished"] += 1
        for k, n in req.reuse.items():  # the reuse kinds, and tokens loaded per tier if any
            self.counters[k] = self.counters.get(k, 0) + n
        return req
