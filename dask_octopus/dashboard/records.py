"""Bounded records that the scheduler plugin keeps for the dashboard. No Dask here.

- :class:`WeightHistory`: each worker's compute and memory weights over time, one point each time
  they changed (sampled periodically by the plugin), at most ``maxlen`` points.
- :class:`PlanRecord`: what a plan predicted (each worker's share of the work over its weight when
  the plan was made) and how its runs finished on each worker (:class:`Run`: the tasks pinned to it
  by one graph); :class:`PlanRecords` keeps the most recent plans.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

#: a worker's (compute, memory) weights
Weights = tuple[float, float]


def spread(values: list[float]) -> float | None:
    """``(max - min) / max`` of ``values``: 0 when all finish together; ``None`` for fewer than two
    values or a maximum that is not > 0."""
    if len(values) < 2 or max(values) <= 0:
        return None
    return (max(values) - min(values)) / max(values)


class WeightHistory:
    """Points ``(time, {worker: (compute, memory)})``, the oldest dropped beyond ``maxlen`` points or
    ``max_weights`` workers' weights in all (each page poll sends them all: 3600 points of 64 workers
    took 0.8 s of the scheduler's event loop per poll).

    Parameters
    ----------
    maxlen
        Points kept.
    tolerance
        A point is added only when a weight moved by more than this, or the workers changed.
    max_weights
        Workers' weights kept in all, over the points (the newest point is kept whatever its size).
    """

    def __init__(self, maxlen: int = 3600, tolerance: float = 1e-4, max_weights: int = 20_000):
        self.points: deque[tuple[float, dict[str, Weights]]] = deque(maxlen=maxlen)
        self.tolerance = tolerance
        self.max_weights = max_weights

    def add(self, when: float, weights: dict[str, Weights]) -> bool:
        """Add the weights seen at ``when`` (seconds since the epoch) if they differ from the last point.

        Returns
        -------
        bool
            Whether a point was added.
        """
        if self.points:
            last = self.points[-1][1]
            if last.keys() == weights.keys() and all(
                    math.isclose(a, b, rel_tol=0, abs_tol=self.tolerance)
                    for w in weights for a, b in zip(last[w], weights[w])):
                return False
        self.points.append((when, dict(weights)))
        held = sum(len(ws) for _, ws in self.points)
        while len(self.points) > 1 and held > self.max_weights:
            held -= len(self.points.popleft()[1])
        return True


@dataclass(eq=False)
class Run:
    """One run of a plan's pinned tasks: those of one graph, from its first start to each worker's last stop.
    Only its own tasks count, each once: a task of an earlier graph still running, or one of its tasks
    computed again (its worker left), is not counted."""

    expected: int  #: its tasks: those pinned in the graph that started the run, with the parts of those split
    pending: set = field(default_factory=set)  #: the keys of those that have neither finished nor been lost
    number: int = 0  #: its place among its plan's runs (0 for the first)
    first_start: float | None = None  #: earliest start of its tasks seen (seconds since the epoch)
    stops: dict[str, float] = field(default_factory=dict)  #: latest stop of its tasks, per worker
    tasks: dict[str, int] = field(default_factory=dict)  #: its tasks finished, per worker
    lost: int = 0  #: its tasks that failed or were forgotten unfinished

    @property
    def complete(self) -> bool:
        """Whether every task of the run finished."""
        return not self.pending and self.lost == 0

    @property
    def ended(self) -> bool:
        """Whether no task of the run is left to run: each finished, failed or was cancelled."""
        return not self.pending

    def finish(self) -> dict[str, float]:
        """Seconds from the run's first start to each worker's last stop."""
        if self.first_start is None:
            return {}
        return {w: stop - self.first_start for w, stop in self.stops.items()}

    def observe(self, worker: str, start: float, stop: float, key: Any) -> bool:
        """Add task ``key``, which ran from ``start`` to ``stop`` on ``worker``, if it is one of the run's
        that had not finished. Returns whether it was."""
        if key not in self.pending:
            return False
        self.pending.remove(key)
        self.first_start = start if self.first_start is None else min(self.first_start, start)
        self.stops[worker] = max(self.stops.get(worker, stop), stop)
        self.tasks[worker] = self.tasks.get(worker, 0) + 1
        return True

    def lose(self, key: Any) -> bool:
        """Count task ``key`` of the run, unless it finished, as failed or cancelled: it will not finish.
        Returns whether it was one of the run's that had not finished."""
        if key not in self.pending:
            return False
        self.pending.remove(key)
        self.lost += 1
        return True

    def split(self, key: Any, parts: Collection[Any]) -> bool:
        """Task ``key`` of the run does its work as the tasks ``parts`` from now on (a fragment split into
        its members): they count in its place. Returns whether ``key`` was one of the run's that had
        not finished."""
        if key not in self.pending:
            return False
        self.pending.remove(key)
        self.pending.update(parts)
        self.expected += len(parts) - 1
        return True


@dataclass
class PlanRecord:
    """A plan as made, and its runs: each graph with tasks pinned to the plan starts one (:meth:`restart`);
    each pinned task that finishes is added to its run (:meth:`observe`). The runs of earlier graphs
    whose tasks are still running are followed too (at most ``open_runs``)."""

    name: str  #: the collection's key name
    made: float  #: when the plan arrived (seconds since the epoch)
    workers: list[str]  #: the worker of each block
    loads: list[float]  #: the work of each block (rows, or ``map``'s item costs)
    weights: dict[str, float]  #: each worker's weight when the plan was made, times the blocks it runs at once
    current: Run | None = None  #: the latest run
    done: Run | None = None  #: the latest complete run
    open_runs: int = 8  #: the runs not ended followed at most, the latest included
    _open: deque[Run] = field(default_factory=deque, init=False, repr=False)  #: those runs, oldest first

    def blocks(self) -> dict[str, int]:
        """Blocks per worker."""
        out: dict[str, int] = {}
        for w in self.workers:
            out[w] = out.get(w, 0) + 1
        return out

    def shares(self) -> dict[str, float]:
        """Each worker's share of the plan's work (summing to 1)."""
        load: dict[str, float] = {}
        for w, x in zip(self.workers, self.loads):
            load[w] = load.get(w, 0.0) + x
        total = sum(load.values())
        return {w: x / total for w, x in load.items()} if total > 0 else {}

    def predicted(self) -> dict[str, float]:
        """Each worker's predicted finish relative to the mean over the plan's workers: its share of the
        work divided by its weight (1 everywhere for a plan that makes all finish together)."""
        raw = {w: x / self.weights[w] for w, x in self.shares().items() if self.weights.get(w, 0) > 0}
        mean = sum(raw.values()) / len(raw) if raw else 0.0
        return {w: v / mean for w, v in raw.items()} if mean > 0 else {}

    def shown(self) -> Run | None:
        """The run to show: the latest complete one, else the one in progress (``None`` before any)."""
        return self.done or self.current

    def restart(self, keys: Collection[Any]) -> None:
        """A graph with the tasks ``keys`` pinned to the plan, to run, arrived: a new run begins (none
        where ``keys`` is empty)."""
        if not keys:
            return
        number = self.current.number + 1 if self.current is not None else 0
        self.current = Run(len(keys), set(keys), number)
        self._open.append(self.current)
        while len(self._open) > self.open_runs:
            self._open.popleft()

    def _settle(self, run: Run) -> None:
        """``run`` changed: it is the latest complete run unless a later one is; one that ended is no
        longer followed."""
        if run.complete and (self.done is None or run.number > self.done.number):
            self.done = run
        if run.ended:
            self._open.remove(run)

    def _apply(self, change: Callable[[Run], bool]) -> None:
        """Apply ``change`` to each followed run (it returns whether the run changed): a task that two
        graphs both run (the same collection computed again while the first compute runs) counts in
        both."""
        for run in list(self._open):
            if change(run):
                self._settle(run)

    def observe(self, worker: str, start: float, stop: float, key: Any) -> None:
        """Add the pinned task ``key``, which ran from ``start`` to ``stop`` on ``worker``, to its runs."""
        self._apply(lambda run: run.observe(worker, start, stop, key))

    def lose(self, key: Any) -> None:
        """Task ``key``, pinned to the plan, failed or was forgotten: :meth:`Run.lose` of its runs."""
        self._apply(lambda run: run.lose(key))

    def split(self, key: Any, parts: Collection[Any]) -> None:
        """:meth:`Run.split` of the runs of ``key``."""
        self._apply(lambda run: run.split(key, parts))


class PlanRecords:
    """The ``maxlen`` most recent :class:`PlanRecord`, by collection name."""

    def __init__(self, maxlen: int = 50):
        self.maxlen = maxlen
        self.records: OrderedDict[str, PlanRecord] = OrderedDict()

    def add(self, record: PlanRecord) -> None:
        """Add (or replace) the record of ``record.name``, dropping the oldest beyond ``maxlen``."""
        self.records[record.name] = record
        self.records.move_to_end(record.name)
        while len(self.records) > self.maxlen:
            self.records.popitem(last=False)

    def get(self, name: str) -> PlanRecord | None:
        """The record of collection ``name``, if kept."""
        return self.records.get(name)

    def restart(self, runs: Mapping[str, Collection[Any]]) -> None:
        """Start a new run of each kept plan in ``runs`` (plan name: the keys of its pinned tasks in the new
        graph)."""
        for name, keys in runs.items():
            record = self.records.get(name)
            if record is not None:
                record.restart(keys)

    def latest(self, n: int) -> list[PlanRecord]:
        """The ``n`` most recent records, newest first."""
        return list(reversed(self.records.values()))[:n]
