"""Pure packing of indivisible items onto workers of different speeds (no Dask here).

The uniform-machines makespan problem: item ``i`` costs ``c_i`` units, worker ``j`` processes
``s_j`` units per second, and a worker finishes at ``sum(c_i on j) / s_j`` (plus, optionally, a
penalty per item and worker, such as moving the item's data there). :func:`pack` runs LPT (largest
item first, to the worker where it would finish earliest) and then improves the result locally by
moving or swapping items off the worker that finishes last, until no move or swap helps or the
packing is within :data:`CLOSE_ENOUGH` of the lower bound: with many items LPT ends there at once
(2,000 items of random costs on 4 workers: within 0.013%), where the swaps' search, quadratic in the
items, took seconds to gain the rest. Penalties can keep the best packing further from the bound
than that (a fixed time per item weighs more on a faster worker, which the bound cannot tell): a
search for a swap tries at most :data:`SWAP_PAIRS` pairs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real

from dask_octopus._checks import check_finite, is_finite

CLOSE_ENOUGH = 1e-3  # relative to the lower bound: no local improvement is sought within it (costs are estimates)
SWAP_PAIRS = 50_000  # pairs one search for a swap may try (~30 ms)


@dataclass(frozen=True)
class Packing:
    """Worker index of each item, each worker's finish time, and the lower bound of any packing."""

    assignment: list[int]
    finish: list[float]
    floor: float

    @property
    def makespan(self) -> float:
        return max(self.finish)


def check_costs(costs: Sequence[float]) -> None:
    """Raise ``TypeError`` naming the first item whose cost is not a real number (``bool``, ``Decimal``
    and strings are not), ``ValueError`` the first whose cost is not finite and >= 0."""
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, Real):
            raise TypeError(f"cost of item {i} must be a real number (int, float or a NumPy one), "
                            f"got {type(c).__name__} {c!r}")
        check_finite(c, f"cost of item {i}", positive=False)


def _check(costs: Sequence[float], speeds: Sequence[float], penalty: Sequence[Sequence[float]] | None) -> None:
    if not speeds:
        raise ValueError("no workers to pack onto")
    for j, s in enumerate(speeds):
        check_finite(s, f"speed of worker {j}")
    check_costs(costs)
    if penalty is None:
        return
    if len(penalty) != len(costs) or any(len(row) != len(speeds) for row in penalty):
        raise ValueError(f"penalty must be {len(costs)} rows (items) of {len(speeds)} numbers (workers)")
    for i, row in enumerate(penalty):
        if not all(is_finite(p) for p in row):
            raise ValueError(f"penalties of item {i} must be finite numbers >= 0, got {list(row)!r}")


def lower_bound(costs: Sequence[float], speeds: Sequence[float],
                penalty: Sequence[Sequence[float]] | None = None) -> float:
    """No packing finishes before all work on all speeds, nor before the largest item on the fastest;
    with ``penalty`` (as :func:`pack`), each item's work counts its least penalty (in work: seconds
    times the worker's speed), and no item ends before its own least time."""
    if penalty is None:
        return max(sum(costs) / sum(speeds), max(costs, default=0.0) / max(speeds))
    extra = sum(min(p * s for p, s in zip(row, speeds, strict=True)) for row in penalty)
    alone = max((min(c / s + p for p, s in zip(row, speeds, strict=True)) for c, row in zip(costs, penalty)),
                default=0.0)
    return max((sum(costs) + extra) / sum(speeds), alone)


def pack(costs: Sequence[float], speeds: Sequence[float], *, penalty: Sequence[Sequence[float]] | None = None,
         rounds: int = 200) -> Packing:
    """Assign every item to a worker, minimising the latest finish (LPT + local improvement, at most
    ``rounds`` moves or swaps, none once within :data:`CLOSE_ENOUGH` of the lower bound).

    ``penalty[i][j]`` (>= 0, optional) is time item ``i`` costs on worker ``j`` beyond its work, in the
    unit of ``cost / speed``: moving the item's data to a worker that does not hold it, for instance.
    """
    _check(costs, speeds, penalty)
    n = len(speeds)

    def time(i: int, j: int) -> float:
        return costs[i] / speeds[j] + (penalty[i][j] if penalty is not None else 0.0)

    finish = [0.0] * n
    count = [0] * n
    assignment = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        # ties (items of no cost) go where they make the fewest items per speed: spread, not piled on one
        j = min(range(n), key=lambda j: (finish[j] + time(i, j), (count[j] + 1) / speeds[j], -speeds[j], j))
        assignment[i] = j
        count[j] += 1
        finish[j] += time(i, j)
    floor = lower_bound(costs, speeds, penalty)
    for _ in range(rounds):
        if max(finish) <= floor * (1 + CLOSE_ENOUGH) or not _improve(time, assignment, finish):
            break
    return Packing(assignment, finish, floor)


def _improve(time: Callable[[int, int], float], assignment: list[int], finish: list[float]) -> bool:
    """One move or swap that lowers the later finish of the last worker and a partner; False if none
    (a swap sought among the first :data:`SWAP_PAIRS` pairs)."""
    n = len(finish)
    last = max(range(n), key=lambda j: finish[j])
    worst = finish[last] - 1e-12 * max(1.0, finish[last])
    mine = [i for i, j in enumerate(assignment) if j == last]
    for i in sorted(mine, key=lambda i: -time(i, last)):
        for j in range(n):
            if j != last and max(finish[last] - time(i, last), finish[j] + time(i, j)) < worst:
                assignment[i] = j
                finish[last] -= time(i, last)
                finish[j] += time(i, j)
                return True
    tried = 0
    for i in mine:
        for k, j in enumerate(assignment):
            if j == last:
                continue
            tried += 1
            if tried > SWAP_PAIRS:
                return False
            new_last = finish[last] - time(i, last) + time(k, last)
            new_j = finish[j] - time(k, j) + time(i, j)
            if max(new_last, new_j) < worst:
                assignment[i], assignment[k] = j, last
                finish[last], finish[j] = new_last, new_j
                return True
    return False


def split_tail(costs: Sequence[float], fraction: float, pieces: int) -> list[tuple[int, int, bool]]:
    """Cut one worker's list of items, in run order (largest first), into a head and up to ``pieces``
    stealable parts of its tail, which holds the last items making up at most ``fraction`` of the
    list's cost (the head keeps at least one item).

    Returns ``(start, stop, stealable)`` slices of the list, head first; the parts of the tail cost
    about the same. ``fraction`` 0 (or a list of one item) gives the head alone.
    """
    check_costs(costs)
    if not 0 <= fraction <= 1 or pieces < 1:
        raise ValueError(f"fraction must be in [0, 1] and pieces >= 1, got {fraction!r} and {pieces!r}")
    n = len(costs)
    budget = fraction * sum(costs)
    if budget <= 0:  # nothing to steal (also when the last items cost nothing)
        return [(0, n, False)] if n else []
    start, tail = n, 0.0
    while start > 1 and tail + costs[start - 1] <= budget:
        start -= 1
        tail += costs[start]
    out = [(0, start, False)]  # the head keeps at least one item
    if start == n:
        return out
    k = min(pieces, n - start)
    done, cut = 0.0, start
    for p in range(1, k):  # the p-th cut lies where the tail's cumulated cost reaches p / k of it
        stop = cut
        while stop < n - (k - p) and (stop == cut or done + costs[stop] <= tail * p / k):
            done += costs[stop]
            stop += 1
        out.append((cut, stop, True))
        cut = stop
    out.append((cut, n, True))
    return out


def split_by_bytes(nbytes: Sequence[float], budget: float | None) -> list[tuple[int, int]]:
    """Cut a list of items, in order, into consecutive parts holding at most ``budget`` bytes each
    (``nbytes`` per item); an item over the budget is a part alone (budget 0: every item of any bytes).

    Returns ``(start, stop)`` slices of the list, first to last; ``budget`` ``None``: the list whole.
    """
    for i, b in enumerate(nbytes):
        check_finite(b, f"bytes of item {i}", positive=False)
    if budget is None or not nbytes:
        return [(0, len(nbytes))] if nbytes else []
    check_finite(budget, "budget", positive=False)
    out, start, held = [], 0, 0.0
    for i, b in enumerate(nbytes):
        if i > start and held + b > budget:
            out.append((start, i))
            start, held = i, 0.0
        held += b
    return [*out, (start, len(nbytes))]
