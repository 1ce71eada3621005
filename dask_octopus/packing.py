"""Pure packing of indivisible items onto workers of different speeds (no Dask here).

The uniform-machines makespan problem: item ``i`` costs ``c_i`` units, worker ``j`` processes
``s_j`` units per second, and a worker finishes at ``sum(c_i on j) / s_j``. :func:`pack` runs LPT
(largest item first, to the worker where it would finish earliest) and then improves the result
locally by moving or swapping items off the worker that finishes last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Packing:
    """Worker index of each item, each worker's finish time, and the lower bound of any packing."""

    assignment: list[int]
    finish: list[float]
    floor: float

    @property
    def makespan(self) -> float:
        return max(self.finish)


def _check(costs: Sequence[float], speeds: Sequence[float]) -> None:
    if not speeds:
        raise ValueError("no workers to pack onto")
    for j, s in enumerate(speeds):
        if not (math.isfinite(s) and s > 0):
            raise ValueError(f"speed of worker {j} must be finite and > 0, got {s!r}")
    for i, c in enumerate(costs):
        if not (isinstance(c, (int, float)) and math.isfinite(c) and c >= 0):
            raise ValueError(f"cost of item {i} must be a finite number >= 0, got {c!r}")


def lower_bound(costs: Sequence[float], speeds: Sequence[float]) -> float:
    """No packing finishes before all work on all speeds, nor before the largest item on the fastest."""
    return max(sum(costs) / sum(speeds), max(costs, default=0.0) / max(speeds))


def pack(costs: Sequence[float], speeds: Sequence[float], *, rounds: int = 200) -> Packing:
    """Assign every item to a worker, minimising the latest finish (LPT + local improvement)."""
    _check(costs, speeds)
    n = len(speeds)
    load = [0.0] * n
    assignment = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        j = min(range(n), key=lambda j: ((load[j] + costs[i]) / speeds[j], -speeds[j], j))
        assignment[i] = j
        load[j] += costs[i]
    for _ in range(rounds):
        if not _improve(costs, speeds, assignment, load):
            break
    return Packing(assignment, [load[j] / speeds[j] for j in range(n)], lower_bound(costs, speeds))


def _improve(costs: Sequence[float], speeds: Sequence[float], assignment: list[int], load: list[float]) -> bool:
    """One move or swap that lowers the later finish of the last worker and a partner; False if none."""
    n = len(speeds)
    last = max(range(n), key=lambda j: load[j] / speeds[j])
    worst = load[last] / speeds[last]
    mine = [i for i, j in enumerate(assignment) if j == last]
    for i in sorted(mine, key=lambda i: -costs[i]):
        for j in range(n):
            if j != last and max((load[last] - costs[i]) / speeds[last], (load[j] + costs[i]) / speeds[j]) < worst - 1e-12:
                assignment[i] = j
                load[last] -= costs[i]
                load[j] += costs[i]
                return True
    for i in mine:
        for k, j in enumerate(assignment):
            if j == last or costs[k] >= costs[i]:
                continue
            delta = costs[i] - costs[k]
            if max((load[last] - delta) / speeds[last], (load[j] + delta) / speeds[j]) < worst - 1e-12:
                assignment[i], assignment[k] = j, last
                load[last] -= delta
                load[j] += delta
                return True
    return False
