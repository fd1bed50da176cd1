"""Response formats compiled in worker processes, with a timeout.

A JSON Schema can take a grammar compiler minutes (counted regex repetitions grow with the
square of the count, nested ones multiply) and the compile cannot be interrupted from Python.
So each compile runs in a worker process that holds its own copy of the tokenizer and of
xgrammar's tokenizer info; one that overruns `grammar_timeout_s` is killed (the next compile
starts a fresh worker) and its request gets a 400 saying the format is too complex. Nothing of
it shares the API server's GIL, and the engine core only ever opens the finished grammar from
its serialized JSON (`Grammars.open`), whether it runs in its own process or on a thread.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import pickle
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spanserve.engine.structured import (TOO_COMPLEX, Format, Grammars, JsonFormat, ResponseFormatError,
                                         parse_response_format)
from spanserve.server.errors import APIError
from spanserve.server.limits import RequestLimits, check_schema

log = logging.getLogger("spanserve.grammars")
START_TIMEOUT_S = 300.0  # importing xgrammar and building the tokenizer info on a loaded machine
# An agent sends the same tools every turn: their grammar (megabytes of JSON, tens of ms to
# serialize) is kept, and so is a refusal, so that a format that timed out costs its 5 s once.
KEPT_FORMATS = 32
KEPT_BYTES = 128 << 20
WATCH_S = 1.0


def _worker_main(conn: Any, payload: bytes) -> None:
    """A compile worker: build the compiler once, then compile formats until the pipe closes."""
    parent = os.getppid()

    def watch() -> None:  # compiles release the GIL, so this runs even during a long one
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    tokenizer, vocab_size, eos = pickle.loads(payload)
    grammars = Grammars(tokenizer, vocab_size, set(eos))
    grammars.compile(JsonFormat(None))  # builds the tokenizer info and compiler now, not in a timed compile
    conn.send(("ready", None))
    while True:
        try:
            fmt = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", grammars.compile(fmt).serialize_json()))
        except ResponseFormatError as e:
            conn.send(("refused", str(e)))


class _Worker:
    def __init__(self, payload: bytes):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, payload), name="spanserve-grammar", daemon=True)
        self.proc.start()
        child.close()
        self.ready = False

    def wait_ready(self) -> None:
        try:
            ok = self.conn.poll(START_TIMEOUT_S) and self.conn.recv()[0] == "ready"
        except (EOFError, OSError):
            ok = False
        if not ok:
            self.kill()
            raise RuntimeError(f"a grammar compile worker did not start (exit code {self.proc.exitcode})")
        self.ready = True

    def compile(self, fmt: Format, timeout_s: float) -> str:
        """The serialized grammar; ResponseFormatError if refused, TimeoutError if it overran
        (the worker is then dead), EOFError if the worker died on it."""
        self.conn.send(fmt)
        if not self.conn.poll(timeout_s):
            self.kill()
            raise TimeoutError
        kind, value = self.conn.recv()
        if kind == "refused":
            raise ResponseFormatError(value)
        return str(value)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class GrammarPool:
    """`await pool(response_format)`: the format's compiled grammar as JSON text, or None for
    plain text; ResponseFormatError (a ValueError naming response_format) if it is refused."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], limits: RequestLimits):
        self.limits = limits
        self._payload = pickle.dumps((tokenizer, vocab_size, sorted(eos_token_ids)))
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(limits.grammar_workers)
        # one thread per worker waits on it; compiles beyond the workers queue here
        self._threads = ThreadPoolExecutor(limits.grammar_workers, thread_name_prefix="spanserve-grammar")
        self.killed = 0  # workers killed for overrunning the timeout
        self._kept: OrderedDict[Format, tuple[str, str | None]] = OrderedDict()  # fmt -> (text, code) or error
        self._kept_bytes = 0

    async def __call__(self, response_format: Any) -> str | None:
        check_schema(response_format, self.limits)
        fmt = parse_response_format(response_format)
        if fmt is None:
            return None
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.compile, fmt)

    def compile(self, fmt: Format) -> str:
        """Blocking: the grammar of a format compiled before, else compiled on a free worker."""
        with self._lock:
            kept = self._kept.get(fmt)
            if kept is not None:
                self._kept.move_to_end(fmt)
        if kept is None:
            try:
                kept = (self._compile(fmt), None)
            except ResponseFormatError as e:
                kept = (str(e), e.code or "")
            self._keep(fmt, kept)
        text, code = kept
        if code is not None:
            raise ResponseFormatError(text, code or None)
        return text

    def _keep(self, fmt: Format, kept: tuple[str, str | None]) -> None:
        with self._lock:
            if fmt in self._kept:
                return
            self._kept[fmt] = kept
            self._kept_bytes += len(kept[0])
            while len(self._kept) > KEPT_FORMATS or self._kept_bytes > KEPT_BYTES:
                _, (old, _) = self._kept.popitem(last=False)
                self._kept_bytes -= len(old)

    def _compile(self, fmt: Format) -> str:
        with self._slots:
            worker = self._take()
            try:
                text = worker.compile(fmt, self.limits.grammar_timeout_s)
            except TimeoutError:
                self._drop(worker, killed=True)
                raise ResponseFormatError(
                    f"response_format is too complex: its grammar did not compile within "
                    f"{self.limits.grammar_timeout_s:g} s; simplify the schema", code=TOO_COMPLEX) from None
            except (EOFError, OSError):
                self._drop(worker)
                raise ResponseFormatError("response_format could not be compiled: the grammar compiler failed "
                                          "on it; simplify the schema", code=TOO_COMPLEX) from None
            except ResponseFormatError:
                self._give_back(worker)
                raise
            self._give_back(worker)
            return text

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.proc.is_alive():
                    return worker
                self._all.discard(worker)
        worker = _Worker(self._payload)
        with self._lock:
            self._all.add(worker)
        try:
            worker.wait_ready()
        except RuntimeError as e:
            self._drop(worker)
            log.error("%s; its output above says why", e)
            raise APIError(503, f"response_format: the server cannot compile grammars now ({e}); its log says why. "
                                "Retry later, or send no response_format", code="grammar_compiler_unavailable") from None
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    def _drop(self, worker: _Worker, killed: bool = False) -> None:
        worker.kill()
        with self._lock:
            self._all.discard(worker)
            self.killed += killed
        if killed:
            log.warning("a response_format compile overran %.1f s; its worker was killed", self.limits.grammar_timeout_s)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            workers, self._all, self._idle = list(self._all), set(), []
        for w in workers:
            w.kill()
