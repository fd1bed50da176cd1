"""Tokenizer copies for the API server's threads.

Prompts are tokenized on a pool of worker threads, each with a private copy of the tokenizer: a
Rust tokenizer shared between threads can fail with "Already borrowed", and one worker would
make every request wait behind the longest prompt in flight. A thread pool (not a process pool)
is enough because Hugging Face's `tokenizer.encode` runs in Rust without the GIL: measured on
SmolLM2's tokenizer with a 1 MB prompt, the event loop's thread went at most 30 ms without the
GIL during a 0.68 s encode, where the `tokenizers` object's own `encode` holds it throughout
(0.54 s). So workers call the Hugging Face method, and prompt sizes are bounded before they get
here (server/limits.py); chat templates render in Python, bounded by the same character limit.
"""
from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


def warmed_copy(tokenizer: Any) -> Any:
    tok = copy.deepcopy(tokenizer)
    # The first encode may reset truncation/padding state (a mutation); do it while no other
    # thread can be using this copy.
    tok.encode("warm up", add_special_tokens=False)
    return tok


class TokenizerPool:
    """`await pool.run(fn, *args)` calls fn(tokenizer, *args) on a worker thread with its own
    tokenizer copy; `borrow()` lends a copy to a thread of another pool (span queries)."""

    def __init__(self, tokenizer: Any, workers: int):
        # A template no thread ever encodes with: copies are taken from it under the lock.
        self._template = copy.deepcopy(tokenizer)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._spares: list[Any] = []
        self._threads = ThreadPoolExecutor(workers, thread_name_prefix="spanserve-tokenizer", initializer=self._init)

    def _init(self) -> None:
        with self._lock:
            self._local.tok = warmed_copy(self._template)

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        return fn(self._local.tok, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._call, fn, args)

    @contextmanager
    def borrow(self) -> Iterator[Any]:
        """A tokenizer copy for the calling thread alone (blocking: call off the event loop)."""
        with self._lock:
            tok = self._spares.pop() if self._spares else warmed_copy(self._template)
        try:
            yield tok
        finally:
            with self._lock:
                self._spares.append(tok)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


def encode(tok: Any, text: str, add_special_tokens: bool = False) -> list[int]:
    """Through the Hugging Face method, which releases the GIL (see the module's docstring)."""
    return list(tok.encode(text, add_special_tokens=add_special_tokens))
