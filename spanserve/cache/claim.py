"""A request as the cache manager sees it, in plain data: what admission is asked for (`Admission`:
the layout's pieces, tokens, namespace, policy) and the work left on it (`Task`: positions to
compute over one key table). The engine converts its requests to an Admission and carries the
Holding (cache/units.py) it gets back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spanserve.cache.table import Entry, Table, delta_array, slot_array, tail_slots


@dataclass(frozen=True)
class Piece:
    """A resolved segment: its tokens sit at logical positions [start, start + len(tokens));
    a plus piece is encoded at local positions [anchor_len, anchor_len + len) after the first
    anchor_len tokens of the prompt."""

    kind: str
    tokens: tuple[int, ...]
    start: int
    anchor_len: int = 0
    key: str | None = None
    # the tokens as int32 little-endian bytes, when resolve had them (validation packs them
    # anyway): hashing and the pool's chain memo reuse them instead of converting again
    packed: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass
class Task:
    """Positions still to compute over one key table (one attention row).

    The main task is the request's own sequence in logical positions; a standalone segment being
    encoded is a task of its own in local positions. `todo` is sorted and consumed from the front,
    so everything before todo[0] already has KV: perforated holes are just gaps in `todo`."""

    tokens: list[int]
    entries: "list[Entry] | Table"  # the cache manager passes a Table (columns, built in bulk)
    todo: list[int]
    block_size: int
    sample: bool = False  # sample from the logits of the last position of `tokens`
    main: bool = False  # a task on the request's own (main) row
    recompute: Any = None  # reuse.recompute.RecomputeSpec: a policy recomputes reused tokens
    anchor_end: int | None = None  # plus-segment mask form; None = causal
    seg_start: int | None = None
    repair: Any = None  # attention.plan.Repair: how later tokens read the row's plus segments
    _slots: Any = field(default=None, repr=False)  # a buffer with room to grow; `slots` is its first _n
    _n: int = field(default=0, repr=False)
    _own_table: bool = field(default=False, repr=False)  # entries is this task's alone (others share admission's)
    _deltas: Any = field(default=False, repr=False)  # False: not computed yet (None is a value)

    @property
    def slots(self) -> Any:
        """numpy int64 array: the flat slot of every position of this task's row."""
        if self._slots is None:
            self._slots = slot_array(self.entries, self.block_size)
            self._n = len(self._slots)
        return self._slots[:self._n]

    @property
    def deltas(self) -> Any:
        """numpy int64 array: every key's delta, or None when all are zero."""
        if self._deltas is False:
            self._deltas = delta_array(self.entries)
        return self._deltas

    def append(self, tok: int) -> None:
        """A generated token: the row grows by one position still to compute."""
        self.tokens.append(tok)
        self.todo.append(len(self.tokens) - 1)

    def hold_place(self) -> None:
        """What appending a token still on the device does, without its value (`fill_place`)."""
        self.append(0)

    def fill_place(self, tok: int) -> None:
        """The token whose place was held arrives (its position may already be computed)."""
        self.tokens[-1] = tok

    def drop_place(self) -> None:
        """The held place will not be filled (its request is aborted): the row ends before it."""
        self.tokens.pop()
        if self.todo and self.todo[-1] == len(self.tokens):
            self.todo.pop()

    def take(self, n: int) -> tuple[list[int], Any]:
        """The next n positions to compute and the recompute spec of the forward that computes
        them; positions after it read the private KV as it is, so the spec is taken once."""
        positions = self.todo[:n]
        del self.todo[:n]
        spec, self.recompute = self.recompute, None
        return positions, spec

    def own_table(self) -> Table:
        """The key table, copied once if other tasks may hold it too (admission shares one table
        between a request's tasks and hands segment tasks views of it): then grown in place."""
        if not self._own_table:
            self.entries, self._own_table = np.array(self.entries, dtype=np.int64), True
        return self.entries

    def set_entries(self, entries: "list[Entry] | Table") -> None:
        self._own_table = False
        self.entries = entries
        self._slots = None
        self._deltas = False

    def extend_last(self, first_slot: int, n: int, delta: int) -> None:
        """The last entry's block takes n more keys, at slots first_slot..first_slot+n-1 read at
        `delta` (decode growth inside a block): the table, slots and deltas grown in place."""
        table = self.own_table()
        table[-1, 2] += n
        slots, have = self._slots, self._n
        if slots is not None:
            if have + n > len(slots):
                slots = self._slots = np.concatenate([slots[:have], np.empty(max(have + n, 2 * have), np.int64)])
            slots[have:have + n] = range(first_slot, first_slot + n)
            self._n = have + n
        if self._deltas is not None and self._deltas is not False:
            self._deltas = np.concatenate([self._deltas, np.full(n, delta, np.int64)])
        elif self._deltas is None and delta:
            self._deltas = False  # no longer all zero: built again when asked

    def extend_entries(self, table: Table, added: int, owned: bool = False) -> None:
        """`table` covers `added` more positions at its end, every earlier one as before (decode
        growth): the cached slots are extended, not rebuilt from every entry, which would cost
        O(context) per request per step; all-zero deltas stay None while the new keys are too."""
        slots, n, deltas = self._slots, self._n, self._deltas
        self.set_entries(table)
        self._own_table = owned  # `table` is new, or already this task's own
        if slots is not None:  # appended in place, the buffer doubled when full: O(added) a step
            if n + added > len(slots):
                slots = np.concatenate([slots[:n], np.empty(max(n + added, 2 * n), dtype=np.int64)])
            slots[n:n + added] = tail_slots(table, added, self.block_size)
            self._slots, self._n = slots, n + added
        if deltas is None and not table[-min(len(table), added):, 1].any():
            self._deltas = None


@dataclass
class Admission:
    """What admitting a request needs: its layout as it stands (generated tokens extend the final
    cross piece of a resumed request) and the tokens of all pieces in order."""

    pieces: list[Piece]
    tokens: list[int]  # taken by the main task, which grows it as tokens are generated
    namespace: str = ""
    policy: Any = None  # reuse.policies.Policy; None = pure span semantics
    encode_only: bool = False  # pin requests: encode the plus units, sample nothing
    compute_all: bool = False  # every prompt position computed, none served from cache (prompt logprobs)
