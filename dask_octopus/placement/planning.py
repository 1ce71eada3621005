"""Pure planning math: split a total into integer shares proportional to weights.

No Dask here. Sizes are planned in units of ``align`` with bounds per part (a minimum of one
unit per block and an optional cap from the worker's memory), fractional quotas are found by
water-filling between the bounds and rounded with the largest-remainder method.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from itertools import pairwise

from dask_octopus._checks import check_finite, is_count, is_finite


class PlanningError(ValueError):
    """The requested plan cannot be made (bad weights, too little data or memory)."""


def _check_weights(weights: Sequence[float]) -> list[float]:
    if not weights:
        raise PlanningError("no weights: there is no worker to plan for")
    bad = [w for w in weights if not is_finite(w, positive=True)]
    if bad:
        raise PlanningError(f"weights must be finite and > 0, got {bad}")
    return [float(w) for w in weights]


def _quotas(total: int, weights: list[float], lo: list[int], hi: list[float]) -> list[float]:
    """Fractional shares ``clamp(t * w_i, lo_i, hi_i)`` summing to ``total``: the scale ``t`` found by
    bisection (the sum grows with ``t``; the callers checked that ``sum(lo) <= total <= sum(hi)``).
    (Clamping the parts below their minimum and those above their cap in the same round of a
    water-filling lost rows when both bounds were in play.)"""

    def filled(scale: float) -> float:
        return sum(min(max(w * scale, low), high) for w, low, high in zip(weights, lo, hi))

    scale = total / sum(weights)
    if all(low <= w * scale <= high for w, low, high in zip(weights, lo, hi)):
        return [w * scale for w in weights]  # no bound in play: the plain proportional shares
    below, above = 0.0, 1.0
    while filled(above) < total:
        above *= 2
    for _ in range(200):
        middle = (below + above) / 2
        if middle in (below, above):
            break
        below, above = (middle, above) if filled(middle) < total else (below, middle)
    return [min(max(w * above, low), high) for w, low, high in zip(weights, lo, hi)]


def proportional_split(
    total: int,
    weights: Sequence[float],
    *,
    minimum: Sequence[int] | int = 0,
    caps: Sequence[int | None] | None = None,
) -> list[int]:
    """Integers summing to ``total``, proportional to ``weights`` within ``[minimum, caps]``.

    Largest-remainder rounding of the water-filled quotas. Raises :class:`PlanningError` when
    the bounds make it impossible (total below the minimums, or above the sum of the caps).
    """
    w = _check_weights(weights)
    if total < 0 or int(total) != total:
        raise PlanningError(f"total must be a non-negative integer, got {total!r}")
    total = int(total)
    n = len(w)
    lo = [int(minimum)] * n if isinstance(minimum, int) else [int(m) for m in minimum]
    hi: list[float] = [math.inf if c is None else float(c) for c in (caps or [None] * n)]
    if len(lo) != n or len(hi) != n:
        raise PlanningError("minimum and caps must have one entry per weight")
    if any(h < m for h, m in zip(hi, lo)):
        raise PlanningError(f"a cap is below its minimum: caps={list(hi)}, minimum={lo}")
    if total < sum(lo):
        raise PlanningError(f"cannot split {total} into {n} parts of at least {lo}")
    if total > sum(hi):
        raise PlanningError(f"{total} does not fit: the caps hold only {int(sum(hi))}")
    quota = _quotas(total, w, lo, hi)
    sizes = [max(lo[i], min(math.floor(quota[i] + 1e-9), int(min(hi[i], total)))) for i in range(n)]
    left = total - sum(sizes)  # < n, and only parts with a fractional quota (hence room) get one
    order = sorted(range(n), key=lambda i: (-(quota[i] - sizes[i]), -w[i], i))
    for i in order[:left]:
        sizes[i] += 1
    return sizes


def block_sizes(
    total: int,
    weights: Sequence[float],
    *,
    per_worker: int | Sequence[int] = 1,
    align: int = 1,
    caps: Sequence[int | None] | None = None,
    fair: bool = True,
) -> list[list[int]]:
    """Sizes of ``per_worker`` blocks for each worker (one count for all, or one per worker),
    proportional to ``weights``.

    Every size is a multiple of ``align`` except the last block, which also takes
    ``total % align``. ``caps`` bound each worker's whole share (e.g. from its memory).
    Returns one list of block sizes per worker, in the order of ``weights``. ``fair``: refuse counts
    that give some block a share of the rows under ``align`` (it would take a whole ``align`` unit,
    more than its share); the counts of :func:`block_sizes_within`, made from whole units, may.
    """
    w = _check_weights(weights)
    counts = [per_worker] * len(w) if isinstance(per_worker, int) else list(per_worker)
    if len(counts) != len(w) or any(isinstance(k, bool) or int(k) != k or k < 1 for k in counts):
        raise PlanningError(f"per_worker must be an integer >= 1 (or one per worker), got {per_worker!r}")
    check_align(align)
    nblocks = sum(counts)
    if total < nblocks:
        raise PlanningError(
            f"{total} rows cannot make {nblocks} blocks ({len(w)} workers x per_worker={per_worker})"
        )
    units, rest = divmod(total, align)
    share = min(total * wi / sum(w) / k for wi, k in zip(w, counts))
    if units < nblocks or (fair and align > 1 and align > share):  # (at align 1 a share under a row: one row)
        raise PlanningError(
            f"align={align} is larger than the smallest block's share ({share:.1f} of {total}); "
            "use a smaller align or per_worker"
        )
    unit_caps = _unit_caps(caps, align, rest)
    if rest and unit_caps is not None and unit_caps[-1] is not None and unit_caps[-1] < counts[-1] <= caps[-1] // align:
        raise PlanningError(f"the last {rest} rows do not fit under the memory cap of the last worker")
    shares = proportional_split(units, w, minimum=counts, caps=unit_caps)
    plan = [[s * align for s in proportional_split(u, [1.0] * k, minimum=1)] for u, k in zip(shares, counts)]
    plan[-1][-1] += rest
    return plan


def _unit_caps(caps: Sequence[int | None] | None, align: int, rest: int) -> list[int | None] | None:
    """``caps`` in whole ``align`` units, the last worker's leaving room for the ``rest`` rows its last
    block takes."""
    if caps is None:
        return None
    out = [None if c is None else c // align for c in caps]
    if caps[-1] is not None:
        out[-1] = max(0, caps[-1] - rest) // align
    return out


def check_align(align: int) -> None:
    """Raise :class:`PlanningError` where ``align`` is not an integer >= 1."""
    if not is_finite(align) or align < 1 or int(align) != align:
        raise PlanningError(f"align must be an integer >= 1, got {align!r}")


def at_once(weights: Sequence[float], threads: Sequence[int], blocks: Sequence[int]) -> list[float]:
    """Each worker's weight (the speed of one of its threads) times the blocks it runs at once: its
    ``threads``, or its ``blocks`` where it has fewer."""
    if not len(weights) == len(threads) == len(blocks):
        raise PlanningError(f"{len(weights)} weights, {len(threads)} thread counts and {len(blocks)} block counts")
    if any(not is_count(t) for t in threads) or any(not is_count(n) for n in blocks):
        raise PlanningError(f"threads and blocks must be integers >= 1, got {list(threads)} and {list(blocks)}")
    return [w * min(t, n) for w, t, n in zip(weights, threads, blocks)]


def block_sizes_within(total: int, weights: Sequence[float], largest: int | Sequence[int], *, align: int = 1,
                       caps: Sequence[int | None] | None = None, threads: Sequence[int] | None = None,
                       ) -> list[list[int]]:
    """:func:`block_sizes` with, for each worker, the fewest blocks that keep each of its blocks within
    ``largest`` units (one bound for all, or one per worker), e.g. the largest block of the collection
    as its user chunked it: a plan never asks a worker to hold a block larger than the user's own (the
    last block may also hold the ``total % align`` remainder). With ``threads`` (per worker), ``weights``
    are one thread's speeds, and each worker's share counts the blocks it runs at once (:func:`at_once`:
    a worker of two threads gets twice the rows of one as fast with one thread where both of its threads
    get a block), found again from the blocks it is given until they agree (a few rounds; a round that
    cannot be planned keeps the last plan made). Of the plans so reached from one thread each and from
    all threads busy, the one of the shorter makespan (both agree with their own block counts)."""
    if threads is not None:
        def settled(plan: list[list[int]]) -> list[list[int]]:
            for _ in range(8):
                scaled = at_once(weights, threads, [len(blocks) for blocks in plan])
                try:
                    again = block_sizes_within(total, scaled, largest, align=align, caps=caps)
                except PlanningError:  # (align over the share that a slow worker's scaling left)
                    break
                if again == plan:
                    break
                plan = again
            return plan

        plans = [settled(block_sizes_within(total, weights, largest, align=align, caps=caps))]
        with contextlib.suppress(PlanningError):  # (the plan of one thread each is the one that must exist)
            plans.append(settled(block_sizes_within(total, at_once(weights, threads, threads), largest,
                                                    align=align, caps=caps)))
        return min(plans, key=lambda p: makespan(p, at_once(weights, threads, [len(b) for b in p])))
    w = _check_weights(weights)
    check_align(align)
    bounds = list(largest) if isinstance(largest, Sequence) else [largest] * len(w)
    if len(bounds) != len(w) or any(b < 1 for b in bounds):
        raise PlanningError(f"largest must be >= 1, for all or for each of the {len(w)} workers, got {largest!r}")
    bounds = [max(b, align) for b in bounds]
    smallest = min(total * wi / sum(w) for wi in w)
    if align > 1 and align > smallest:  # (its one block would be a whole align unit, more than its share)
        raise PlanningError(f"align={align} is larger than the smallest worker's share ({smallest:.1f} of {total}); "
                            "use a smaller align")
    units, rest = divmod(total, align)
    # from below (the rounded shares can undercut the real-valued ones), one block more where one is over;
    # the shares as block_sizes makes them, within the caps and one unit each at least (a slow worker's
    # one block is not taken from the rows the fast ones would need for theirs)
    shares = ([1] * len(w) if units < len(w)  # (too few rows: block_sizes says so)
              else proportional_split(units, w, minimum=1, caps=_unit_caps(caps, align, rest)))
    counts = [max(1, math.floor(s * align / b)) for s, b in zip(shares, bounds)]
    while True:
        plan = block_sizes(total, w, per_worker=counts, align=align, caps=caps, fair=False)
        over = [i for i, blocks in enumerate(plan)
                if max([*blocks[:-1], blocks[-1] - (total % align if i == len(plan) - 1 else 0)]) > bounds[i]]
        if not over:
            return plan
        for i in over:  # rounding put a row or an align unit over: one block more there
            counts[i] += 1


def reassign(owners: Sequence[str | None], weights: dict[str, float]) -> list[str]:
    """Move the blocks of ``owners`` whose worker is not in ``weights`` (or is ``None``) to workers that are.

    Blocks on surviving workers stay; the orphaned ones go to the survivors holding fewer blocks than
    their share of all of them (in proportion to their weights), as far as that share, in proportion
    to their weights (largest remainder), in block order. Returns the new owners.
    """
    alive = sorted(weights)
    if not alive:
        raise PlanningError("no surviving worker to take the blocks")
    orphans = [i for i, w in enumerate(owners) if w not in weights]
    shares = proportional_split(len(owners), [weights[w] for w in alive])
    kept = Counter(w for w in owners if w in weights)
    counts = proportional_split(len(orphans), [weights[w] for w in alive],
                                caps=[max(0, s - kept[w]) for w, s in zip(alive, shares)])
    targets = [w for w, c in zip(alive, counts) for _ in range(c)]
    new = list(owners)
    for i, w in zip(orphans, targets, strict=True):
        new[i] = w
    return new


def row_segments(old: Sequence[int], new: Sequence[int]) -> list[list[tuple[int, int, int]]]:
    """For each new partition, the ``(old_partition, start, stop)`` row ranges it is made of.

    ``old`` and ``new`` are partition lengths with the same sum; empty ranges are left out.
    """
    if sum(old) != sum(new):
        raise PlanningError(f"old and new partitions hold different row counts ({sum(old)} != {sum(new)})")
    out: list[list[tuple[int, int, int]]] = []
    i, offset = 0, 0  # current old partition and the first row of it not yet used
    for size in new:
        parts = []
        while size > 0:
            while old[i] == offset:
                i, offset = i + 1, 0
            take = min(size, old[i] - offset)
            parts.append((i, offset, offset + take))
            offset += take
            size -= take
        out.append(parts)
    return out


def snap_cuts(sizes: Sequence[int], runs: Sequence[tuple[int, int]], owners: Sequence[Hashable] | None = None,
              caps: Mapping[Hashable, int | None] | None = None) -> list[int] | None:
    """``sizes`` with every cut moved to the nearer end of the run of equal values around it.

    Cut ``j`` is the row position after block ``j`` (``sum(sizes[:j + 1])``); ``runs[j]`` are the
    global positions ``(left, right)`` where the run of equal values around it starts and ends
    (``left == right``, the cut itself, when it already sits on a value boundary). Ties go to the
    end that keeps the block before the cut (whose start is settled) closer to its planned size,
    then to the left end. Each cut moves by at most half its run, unless ``caps`` say otherwise:
    with ``owners[j]``, the worker of block ``j``, and ``caps[w]``, the most rows worker ``w`` may
    hold (``None`` or missing: no cap), a cut moves to the farther end where the nearer one would
    give the worker before it more rows than its cap (or than its planned rows, if more).
    Returns the new sizes, or None when a moved cut would empty a planned block or pass another
    cut, or leave a worker over its cap.
    """
    if len(runs) != max(len(sizes) - 1, 0):
        raise PlanningError(f"{len(sizes)} blocks have {len(sizes) - 1} cuts, got {len(runs)} runs")
    if (owners is None) != (caps is None) or (owners is not None and len(owners) != len(sizes)):
        raise PlanningError(f"owners and caps go together, one owner per block ({len(sizes)} blocks), got "
                            f"{None if owners is None else len(owners)} owners and caps {caps!r}")
    limit: dict[Hashable, float] = {}
    for w, size in zip(owners or (), sizes):
        limit[w] = limit.get(w, 0) + size
    for w in limit:  # (a plan over a cap, if one were made, is not made worse)
        cap = caps.get(w) if caps is not None else None
        limit[w] = math.inf if cap is None else max(cap, limit[w])
    held: dict[Hashable, int] = {}  # rows of each worker's blocks before the cut
    cuts, position, shift = [], 0, 0  # shift: how far the previous cut moved
    for j, (size, (left, right)) in enumerate(zip(sizes, runs)):
        position += size
        if not left <= position <= right:
            raise PlanningError(f"the run {(left, right)} does not hold the cut at row {position}")
        # the block before the cut deviates from its planned size by (end - position) - shift
        ends = sorted((left, right), key=lambda end: (abs(end - position), abs(end - position - shift), end))
        start = position - size + shift
        if owners is not None:
            before = held.get(owners[j], 0)
            ends = [e for e in ends if before + e - start <= limit[owners[j]]] or ends[:1]
            held[owners[j]] = before + ends[0] - start
        shift = ends[0] - position
        cuts.append(ends[0])
    edges = [0, *cuts, sum(sizes)]
    new = [b - a for a, b in pairwise(edges)]
    if any(n < 0 or n == 0 < s for n, s in zip(new, sizes)):
        return None
    if owners is not None:
        rows: Counter = Counter()
        for w, n in zip(owners, new):
            rows[w] += n
        if any(n > limit[w] for w, n in rows.items()):
            return None
    return new


def makespan(blocks: Sequence[Sequence[int]], weights: Sequence[float]) -> float:
    """Predicted finish time of the slowest worker: its rows over its weight."""
    return max(sum(b) / w for b, w in zip(blocks, _check_weights(weights), strict=True))


def worth_moving(kept: Sequence[Sequence[int]], planned: Sequence[Sequence[int]], weights: Sequence[float],
                 min_gain: float, *, speed: float | None = None, move_seconds: float = 0.0) -> bool:
    """Whether re-chunking the current blocks, ``kept[i]`` being the sizes of those worker ``i`` would
    keep, into ``planned`` shortens the predicted makespan by more than ``min_gain`` (a fraction)
    and, when the workers' total ``speed`` (rows per second; each worker's share of it is its share
    of the weights) is known, by more seconds than the rows that change owner take to move
    (``move_seconds``)."""
    before, after = makespan(kept, weights), makespan(planned, weights)
    if speed is not None and (before - after) * sum(weights) / check_finite(speed, "speed") <= move_seconds:
        return False
    return before > (1 + min_gain) * after


def axis_order(holders: Sequence[int | None], sizes: Sequence[int], workers: int) -> list[int]:
    """The ``workers`` (indices) in the order the rows they hold lie along the axis: by the mean row
    position of the blocks each holds (block ``b`` has ``sizes[b]`` rows and sits on worker
    ``holders[b]``, None where not known); those holding nothing follow, by index. Consecutive
    ranges planned in this order keep a contiguous layout's rows where they are."""
    if len(holders) != len(sizes):
        raise PlanningError(f"{len(holders)} holders for {len(sizes)} blocks")
    mass = [0.0] * workers
    rows = [0] * workers
    start = 0
    for h, n in zip(holders, sizes):
        if h is not None:
            mass[h] += (start + n / 2) * n
            rows[h] += n
        start += n
    return sorted(range(workers), key=lambda w: (rows[w] == 0, mass[w] / rows[w] if rows[w] else 0.0, w))


def kept_groups(holders: Sequence[int | None], workers: int, per_worker: int) -> list[list[int]] | None:
    """The current blocks (indices) each worker keeps if they stay as they are: those it holds when
    every block's holder is known, else ``per_worker`` consecutive blocks each; None when neither
    applies (holders unknown and not ``per_worker`` blocks per worker)."""
    if holders and all(h is not None for h in holders):
        return [[b for b, h in enumerate(holders) if h == w] for w in range(workers)]
    if len(holders) != workers * per_worker:
        return None
    return [list(range(w * per_worker, (w + 1) * per_worker)) for w in range(workers)]
