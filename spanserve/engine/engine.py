"""The synchronous engine: requests in, one scheduled model step at a time, outputs out."""
from __future__ import annotations

import functools
import itertools
import time
from typing import Any, Iterable, Sequence

from spanserve.engine.builder import build
from spanserve.engine.config import EngineConfig
from spanserve.engine.detokenize import IncrementalText, make_decoder
from spanserve.engine.layout import Segment, checked_many, checked_tokens, resolve
from spanserve.engine.outputs import RequestOutput, output_of, stop_check
from spanserve.engine.overlap import DecodeChain, drop_placeholder
from spanserve.engine.prompt_logprobs import record_prompt_logprobs, wants_prompt_logprobs
from spanserve.engine.request import Request
from spanserve.engine.sampling import SamplingParams, make_generator
from spanserve.engine.scheduler import Schedule
from spanserve.engine.step_stats import DecodeStepStats
from spanserve.engine.structured import parse_response_format
from spanserve.reuse.policies import Policy, resolve_policy


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
        self.pin_fraction = config.cache.pin_fraction
        self.pinned: dict[tuple[str, str], list] = {}  # (namespace, key) -> blocks held for the pin
        self.device, self.dtype, self.tp = parts.device, parts.dtype, parts.side.tp
        self.config, self.tokenizer, self.model = parts.side.config, parts.side.tokenizer, parts.side.model
        self.block_size, self.sink_prefix = config.cache.block_size, parts.sink_prefix
        self.max_model_len = parts.max_model_len
        self.storage, self.tiers, self.pool, self.manager = parts.storage, parts.tiers, parts.pool, parts.manager
        self.scheduler, self.runner, self.sampler = parts.scheduler, parts.runner, parts.sampler
        self.grammars = parts.grammars
        self._decode = make_decoder(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.decode_stats = DecodeStepStats()  # decode-only steps: wall time by batch size
        # overlap: decode steps chained on the device (engine/overlap.py); None = with CUDA graphs
        overlap, graphs = config.runtime.overlap, self.runner.graphs
        chain = graphs is not None and (graphs.capture if overlap is None else overlap)
        self.chain: DecodeChain | None = DecodeChain(self) if chain else None
        self.counters = {"prefix": 0, "perforated": 0, "segment": 0, "computed": 0, "preemptions": 0,
                         "prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0}

    def shutdown(self) -> None:
        """Stop tensor-parallel workers and finish the tiers' queued writes (a disk tier also keeps
        what the pool holds, for the next start). The engine is not used afterwards."""
        if self.tiers is not None:
            tiers, self.tiers = self.tiers, None
            tiers.close(self.pool if self.tp is None or self.tp.dead is None else None)  # dead: KV unreadable
        if self.tp is not None:
            if self.tp.dead is None:  # a dead peer's collective never finishes: no waiting on it
                self.runner.release_graphs()
            self.tp.close()

    def close(self) -> None:
        self.shutdown()

    @property
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
        return list(checked_tokens(ids, self.config.vocab_size, pack=False)[0])

    def add_request(self, prompt: "str | list[int] | list[Segment]", params: SamplingParams | None = None,
                    request_id: str | None = None, namespace: str = "", policy: "str | Policy | None" = None,
                    **extra: Any) -> Request:
        """prompt: text, token ids, or a span layout (a list of Segments)."""
        params = params or SamplingParams()
        self._check_params(params)
        pol = resolve_policy(policy, self.default_policy)
        pieces = []
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], Segment):
            pieces = resolve(prompt, self.encode, pol.name, require_tail=not extra.get("encode_only", False),
                             check=functools.partial(checked_tokens, vocab_size=self.config.vocab_size),
                             check_all=functools.partial(checked_many, vocab_size=self.config.vocab_size),
                             sink=self.sink_prefix)
            ids = list(itertools.chain.from_iterable(p.tokens for p in pieces))
        else:
            ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt is empty; send at least one token")
        if pieces and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs needs a plain prompt; a span layout's standalone segments are "
                             "encoded on their own, so its positions have no single causal reading to score")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the model's context here is {self.max_model_len}; "
                             "shorten the prompt (or raise kv_cache_memory / max_model_len)")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        fmt = parse_response_format(params.response_format)
        if fmt is not None:  # last check: a matcher exists only for a request that is queued
            self.grammars.open(rid, fmt)
        req = Request(rid, ids, params, namespace=namespace, generator=make_generator(params.seed, self.device),
                      pieces=pieces, policy=pol, **extra)
        self.requests[rid] = req
        self.scheduler.add(req)
        self.counters["prompt_tokens"] += len(ids)
        return req

    def _check_params(self, params: SamplingParams) -> None:
        vocab = self.config.vocab_size
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias names token id {bad[0]}, outside this model's vocabulary of {vocab}")

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.token_in_flight:  # its pick is dropped: the row ends at the last token it has
            drop_placeholder(req)
        req.finish_reason = "abort"
        self.scheduler.finish(req)
        self.grammars.close(request_id)
        return output_of(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (self.chain is not None and self.chain.pending is not None)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.chain is not None and self.chain.pending is not None:
            return self.chain.step()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.counters["preemptions"] += len(sched.preempted)
        if not sched.chunks:
            done_pins = [r for r in self.scheduler.running if r.encode_only and not any(t.todo for t in r.tasks)]
            if done_pins:  # every segment was already cached: nothing to compute
                for r in done_pins:
                    self._pin(r)
                return [self._finish_output(r) for r in done_pins]
            req = self.scheduler.stuck()
            if req is not None:  # nothing runs and it cannot be admitted: fail it rather than hang
                req.finish_reason = "length"
                self.scheduler.finish(req)
                return [self._finish_output(req)]
            self.scheduler.wait_for_loads()  # only requests waiting on tier loads: sleep, not spin
            return []
        return self.run_schedule(sched, t0)

    def run_schedule(self, sched: Schedule, t0: float) -> list[RequestOutput]:
        """Runs a scheduled step: forward, sampling (or, chained, picks left on the device), outputs."""
        if any(wants_prompt_logprobs(c) for c in sched.chunks):
            logits, rows, hidden = self.runner.run_keep_hidden(sched.chunks)
            record_prompt_logprobs(functools.partial(self.runner.logits_at, hidden), sched.chunks)
        else:
            prepared = self.runner.prepare(sched.chunks)
            logits, rows = self.runner.run(sched.chunks, prepared)
            if self.chain is not None and self.chain.chainable(sched.chunks, prepared):
                return self.chain.launch(sched.chunks, logits, rows, t0)
        sampled = [(c.request, r) for c, r in zip(sched.chunks, rows) if r >= 0]
        mask = self.grammars.mask([q.request_id for q, _ in sampled], logits.device)
        tokens, logprobs = self.sampler(logits, [q.params for q, _ in sampled], [q.generator for q, _ in sampled],
                                        mask=mask, histories=[(q.prompt_token_ids, q.output_token_ids) for q, _ in sampled])
        for (req, _), tok, lp in zip(sampled, tokens, logprobs):
            self._append(req, tok, lp)
        outputs = self._outputs({id(c.request): c.request for c in sched.chunks}.values())
        if all(len(c.positions) == 1 and c.recompute is None for c in sched.chunks):
            self.decode_stats.record(len(sched.chunks), sum(c.positions[0] + 1 for c in sched.chunks),
                                     time.perf_counter() - t0)
        return outputs

    def _outputs(self, touched: "Iterable[Request]") -> list[RequestOutput]:
        outputs = []
        for req in touched:
            if req.encode_only and not any(t.todo for t in req.tasks):
                self._pin(req)
            if req.finished:
                outputs.append(self._finish_output(req))
                continue
            self.manager.publish(req.kv)
            outputs.append(output_of(req))
        return outputs

    def take(self, picked: "list[tuple[Request, int, Any]]") -> list[RequestOutput]:
        """Tokens picked on the device (with their logprobs), now on the host (a chained step):
        appended, then output."""
        for req, tok, lp in picked:
            self._append(req, tok, lp)
        return self._outputs(req for req, _, _ in picked)

    def structured(self, req: Request) -> bool:
        return req.request_id in self.grammars

    @property
    def overlap(self) -> bool:
        return self.chain is not None

    @property
    def chained_steps(self) -> int:
        return 0 if self.chain is None else self.chain.steps

    def _append(self, req: Request, tok: int, lp: Any) -> None:
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if not req.output_token_ids:
            self.manager.snapshot_prompt_tail(req.kv)
        req.output_token_ids.append(tok)
        req.logprobs.append(lp)
        main = req.main
        if req.token_in_flight:  # the placeholder's place (and its todo entry, if not yet computed)
            main.tokens[-1] = tok
            req.token_in_flight = False
        else:
            main.tokens.append(tok)
            main.todo.append(len(main.tokens) - 1)
        self.counters["generation_tokens"] += 1
        p = req.params
        prev_len = len(req.text)
        if req.detok is None:
            req.detok = IncrementalText(self._decode)
        req.text = req.detok.update(req.output_token_ids)
        grammar_done = req.request_id in self.grammars and self.grammars.ends(req.request_id, tok)
        reason, stop, text = stop_check(req.text, prev_len, tok, p, self.eos_token_ids, grammar_done,
                                        len(req.output_token_ids), len(main.tokens) >= self.max_model_len)
        req.text = text
        if reason is not None:
            req.stop_reason = stop
            if not isinstance(req.stop_reason, str):  # not cut at a stop string: all of the text
                req.text = req.detok.update(req.output_token_ids, final=True)
            req.finish_reason = reason
            self.scheduler.finish(req)

    # ---- pinned segments -------------------------------------------------------------------
    def pin(self, segments: "list[Segment | str]", namespace: str = "") -> Request:
        """Queue the encoding of standalone segments that stay cached (never evicted) until
        unpinned. Each is pinned under its key (its text if no key is given)."""
        segs = [s if isinstance(s, Segment) else Segment(text=s, kind="plus") for s in segments]
        if any(s.kind != "plus" for s in segs):
            raise ValueError("only plus (standalone) segments can be pinned")
        need = sum(-(-len(self.encode(s.text) if s.text is not None else s.token_ids) // self.block_size) for s in segs)
        held = sum(len(b) for b in self.pinned.values())
        limit = int(self.pin_fraction * self.pool.num_blocks)
        if held + need > limit:
            raise ValueError(f"pinning needs {need} blocks but only {limit - held} of the pin budget "
                             f"({self.pin_fraction:.0%} of {self.pool.num_blocks}) are left; unpin something "
                             "or raise pin_fraction")
        return self.add_request(segs, SamplingParams(max_tokens=1), namespace=namespace, policy="none",
                                encode_only=True)

    def _pin(self, req: Request) -> None:
        self.manager.publish(req.kv, tail=True)
        for u, p in zip(req.units, req.pieces):
            name = p.key if p.key is not None else self._detok(list(p.tokens))
            for b in u.blocks:
                self.pool.acquire(b)
            old = self.pinned.pop((req.namespace, name), None)
            self.pinned[(req.namespace, name)] = list(u.blocks)
            for b in old or []:
                self.pool.release(b)
        req.finish_reason = "stop"
        self.scheduler.finish(req)

    def unpin(self, key: str, namespace: str = "") -> bool:
        blocks = self.pinned.pop((namespace, key), None)
        for b in blocks or []:
            self.pool.release(b)
        return blocks is not None

    def _detok(self, ids: list[int]) -> str:
        return self._decode(ids)

    def _finish_output(self, req: Request) -> RequestOutput:
        self.requests.pop(req.request_id, None)
        self.grammars.close(req.request_id)
        self.counters["requests_finished"] += 1
        for k, n in req.reuse.items():  # the reuse kinds, and tokens loaded per tier if any
            self.counters[k] = self.counters.get(k, 0) + n
        return output_of(req)
