"""Pure per-item cost model of ``map`` batches (no Dask here).

A batch of ``n`` items of total cost ``c`` (the user's cost units, e.g. pixels) takes
``seconds = n * fixed + c * per_unit`` on a worker: a fixed time per item (Python, kernel launches,
a host copy) plus a time proportional to its cost (the GPU or CPU work). The two parts slow down
differently: a co-tenant on a GPU slows the proportional part, not the launches, so a worker's
speed relative to another depends on the items' sizes, and one rate per worker misplans mixes of
tiny and huge items. Fitted per worker from its recent batches as a line through the points
``(c / n, seconds / n)`` (mean cost and mean time per item), both terms >= 0. The fit is used only
when the batches differ enough in mean cost per item to tell the two terms apart.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ItemCost:
    """Seconds per item: ``fixed + per_unit * cost``."""

    fixed: float
    per_unit: float

    def seconds(self, cost: float) -> float:
        return self.fixed + self.per_unit * cost


@dataclass
class ItemCostFit:
    """Recent batches of one worker and one function, and the line through them.

    ``window``: batches kept; ``spread``: the largest mean cost per item must be at least this
    many times the smallest for the fit to separate the fixed and proportional parts.
    """

    window: int = 8
    spread: float = 1.5
    points: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, items: int, cost: float, seconds: float) -> None:
        """Add one batch of ``items`` items of total ``cost`` that took ``seconds``."""
        if not (isinstance(items, int) and items >= 1):
            raise ValueError(f"a batch has at least one item, got {items!r}")
        for name, value in (("cost", cost), ("seconds", seconds)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"batch {name} must be finite and >= 0, got {value!r}")
        self.points.append((cost / items, seconds / items))
        while len(self.points) > self.window:
            self.points.popleft()

    def fit(self) -> ItemCost | None:
        """The least-squares line with both terms >= 0, or ``None`` while the batches cannot tell
        the terms apart (fewer than three, or too alike in mean cost per item) or the
        proportional term comes out zero (then costs would not matter)."""
        if len(self.points) < 3:
            return None
        xs = [x for x, _ in self.points]
        ys = [y for _, y in self.points]
        if min(xs) <= 0 or max(xs) < self.spread * min(xs):
            return None
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        fixed = my - slope * mx
        if fixed < 0:  # no fixed part: the line through the origin
            fixed, slope = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        if slope <= 0:
            return None
        return ItemCost(fixed, slope)
