"""Pure per-item cost model of ``map`` batches (no Dask here).

A batch of ``n`` items of total cost ``c`` (the user's cost units, e.g. pixels) takes
``seconds = n * fixed + c * per_unit`` on a worker: a fixed time per item (Python, kernel launches,
a host copy) plus a time proportional to its cost (the GPU or CPU work). The two parts slow down
differently: a co-tenant on a GPU slows the proportional part, not the launches, so a worker's
speed relative to another depends on the items' sizes, and one rate per worker misplans mixes of
tiny and huge items. Fitted per worker from its recent batches as a line through the points
``(c / n, seconds / n)`` (mean cost and mean time per item), both terms >= 0, each batch weighing
``1 - alpha`` times the next one: the line follows the latest batches (a worker that slows down
gets less within a few batches), while older batches of other sizes still set its slope. The fit is
used only when the batches differ enough in mean cost per item to tell the two terms apart. A
worker's first batch of a function also imports, compiles or plans what the function needs (``map``
runs one item alone first: its warm-up would count as that item's fixed time): it is left out once
three later batches can make the fit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dask_octopus._checks import check_finite

SPREAD = 1.5  # mean costs per item of a worker's batches must differ this much to tell the parts apart


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

    ``window``: batches kept; ``alpha``: the weight of the newest batch against the older ones
    (each older batch weighs ``1 - alpha`` times the next); ``spread``: the largest mean cost per
    item must be at least this many times the smallest for the fit to separate the two parts.
    """

    window: int = 8
    alpha: float = 0.5
    spread: float = SPREAD
    points: deque[tuple[float, float]] = field(default_factory=deque)
    first: tuple[float, float] | None = None  # the first batch, while it is one of ``points``

    def add(self, items: int, cost: float, seconds: float) -> None:
        """Add one batch of ``items`` items of total ``cost`` that took ``seconds``."""
        if not (isinstance(items, int) and items >= 1):
            raise ValueError(f"a batch has at least one item, got {items!r}")
        check_finite(cost, "batch cost", positive=False)
        check_finite(seconds, "batch seconds", positive=False)
        point = (cost / items, seconds / items)
        if self.first is None and not self.points:
            self.first = point
        self.points.append(point)
        while len(self.points) > self.window:
            self.points.popleft()
            self.first = None

    def fit(self) -> ItemCost | None:
        """The weighted least-squares line with both terms >= 0, or ``None`` while the batches cannot tell
        the terms apart (fewer than three, or too alike in mean cost per item; a batch of cost 0 is
        as unlike any other as can be) or the
        proportional term comes out zero (then costs would not matter)."""
        points = list(self.points)
        if self.first is not None and len(points) > 3:  # the first batch, with its warm-up, left out
            points = points[1:]
        if len(points) < 3:
            return None
        xs = [x for x, _ in points]
        ys = [y for _, y in points]
        if max(xs) <= 0 or max(xs) < self.spread * min(xs):  # (a batch of cost 0 measures the fixed part)
            return None
        ws = [(1 - self.alpha) ** age for age in range(len(xs) - 1, -1, -1)]  # newest last, weight 1
        total = sum(ws)
        mx = sum(w * x for w, x in zip(ws, xs)) / total
        my = sum(w * y for w, y in zip(ws, ys)) / total
        sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
        if sxx <= 0:  # all weight on batches of one mean cost (alpha near 1)
            return None
        slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx
        fixed = my - slope * mx
        if fixed < 0:  # no fixed part: the line through the origin
            fixed = 0.0
            slope = sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sum(w * x * x for w, x in zip(ws, xs))
        if slope <= 0:
            return None
        return ItemCost(fixed, slope)
