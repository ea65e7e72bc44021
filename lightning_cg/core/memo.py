"""StateMemo: remember a pure function's results while the state it reads stays the same.

Routing runs on every call and its answers repeat (a batch-first tower's
calls all have one shape), but they depend on state that changes now and
then: the plans' dispatchers, the item cap. A :class:`StateMemo` entry keeps
the state it was computed under and is recomputed under any other, so no
entry outlives the state it came from.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

Value = TypeVar("Value")

#: Entries a memo holds before it starts over (mixed-size sets have many shapes).
DEFAULT_SIZE = 4096


class StateMemo(Generic[Value]):
    """Results by lookup key, each valid under the state it was computed in.

    States are compared with ``==``: tuples of plain objects (which compare by
    identity) and numbers. Values are shared between callers, so they must not
    be changed.

    Args:
        size: entries held at most; a full memo is emptied before the next entry.

    Example:
        >>> memo = StateMemo()
        >>> memo.get("x", state=(1,), compute=lambda: 2 * 21)
        42
    """

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        self._size = size
        self._entries: dict[Hashable, tuple[Hashable, Value]] = {}

    def get(self, lookup: Hashable, state: Hashable, compute: Callable[[], Value]) -> Value:
        """The value remembered for ``lookup`` under ``state``, else ``compute()`` (remembered)."""
        entry = self._entries.get(lookup)
        if entry is not None and entry[0] == state:
            return entry[1]
        value = compute()
        if len(self._entries) >= self._size and lookup not in self._entries:
            self._entries.clear()
        self._entries[lookup] = (state, value)
        return value
