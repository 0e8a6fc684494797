"""One explicit state table per worker: each request's entry has a state, and every move of
it goes through `move`, which asserts that the move is allowed and keeps it in a trace.

Only the worker's engine-loop thread touches its tables.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Mapping
from typing import Any, Generic, Protocol, TypeVar

E = TypeVar("E", bound=enum.Enum)


class HasState(Protocol):
    state: Any


T = TypeVar("T", bound=HasState)


class StateTable(Generic[E, T]):
    """Entries of type T by request id; an entry leaves the table when it reaches a state
    with no move out of it."""

    def __init__(self, initial: E, transitions: Mapping[E, frozenset[E]], trace_length: int = 10_000) -> None:
        """transitions: every state -> the states it may move to (none: it ends there)."""
        if set(transitions) != set(type(initial)):
            raise ValueError("transitions must name every state")
        self.initial = initial
        self.transitions = transitions
        self.terminal = frozenset(s for s, nexts in transitions.items() if not nexts)
        self._entries: dict[str, T] = {}
        self.trace: collections.deque[tuple[str, E, E]] = collections.deque(maxlen=trace_length)
        """(request id, from, to) of the latest moves, oldest first (entering: from == to == initial)."""

    def begin(self, request_id: str, entry: T) -> None:
        if request_id in self._entries:
            raise ValueError(f"{request_id} is in the table already")
        assert entry.state is self.initial, f"{request_id} enters as {entry.state.name}"
        self._entries[request_id] = entry
        self.trace.append((request_id, self.initial, self.initial))

    def get(self, request_id: str) -> T | None:
        return self._entries.get(request_id)

    def move(self, request_id: str, to: E, **changes: Any) -> T:
        """The one place an entry's state moves on (with the entry's other fields in
        `changes`). NOTE: a move the transitions do not allow is a bug: it asserts."""
        entry = self._entries[request_id]
        assert to in self.transitions[entry.state], \
            f"{request_id}: {entry.state.name} -> {to.name} is not an allowed move"
        self.trace.append((request_id, entry.state, to))
        entry.state = to
        for name, value in changes.items():
            setattr(entry, name, value)
        if to in self.terminal:
            del self._entries[request_id]
        return entry

    def count(self, *states: E) -> int:
        return sum(e.state in states for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[str, T]]:
        return list(self._entries.items())
