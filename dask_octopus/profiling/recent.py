"""A mapping that keeps its most recently used keys only (no Dask here)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class RecentlyUsed(OrderedDict, Generic[V]):
    """Values by key, at most ``maxsize`` of them: :meth:`use` makes a missing key's value with
    ``make()`` and drops the least recently used keys beyond ``maxsize`` (per task prefix figures in a
    scheduler that lives for months, each new function name a prefix)."""

    def __init__(self, maxsize: int, make: Callable[[], V]):
        super().__init__()
        self.maxsize = maxsize
        self.make = make

    def __reduce__(self) -> tuple:  # (a plugin registered from a client travels pickled)
        return type(self), (self.maxsize, self.make), None, None, iter(self.items())

    def use(self, key: Hashable) -> V:
        """The value of ``key`` (made if missing), now the most recently used."""
        if key in self:
            self.move_to_end(key)
            return self[key]
        value = self[key] = self.make()
        while len(self) > self.maxsize:
            self.popitem(last=False)
        return value
