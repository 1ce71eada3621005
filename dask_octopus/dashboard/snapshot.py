"""One read of the scheduler plugin's state, shared by the page and the metrics.

Runs on the scheduler's event loop (a request handler or a Prometheus scrape), so it reads the
plugin's live structures without locks; what it returns is plain data that no later change touches.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dask_octopus.dashboard.records import Weights, spread
from dask_octopus.groups.streams import HEARTBEAT_KEY

if TYPE_CHECKING:
    from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin

_IDLE = frozenset({"released", "forgotten", "erred"})  # pinned tasks in these states are not counted


@dataclass
class WorkerRow:
    """One worker as the page and the metrics show it."""

    address: str
    name: str  #: the worker's name on the scheduler
    device: str  #: ``"gpu"`` or ``"cpu"`` (``"?"`` before calibration)
    model: str  #: the GPU's name, ``"CPU"``, or ``""`` when unknown
    compute: float | None  #: calibrated GEMM FLOP/s
    memory: float | None  #: calibrated streaming bytes/s
    weight_compute: float  #: current compute weight (the weights of all workers sum to 1)
    weight_memory: float  #: current memory weight
    samples: int  #: task timings behind the weights
    pinned: int  #: tasks pinned to this worker that are waiting, running or in memory
    plans: int  #: plans with such tasks on this worker
    groups: int | None  #: stream groups run (``None`` until the worker reported them)
    members: int | None  #: tasks run inside those groups
    graphs: int | None  #: CUDA graphs captured and held
    replays: int | None  #: CUDA graph replays
    error: str | None  #: why the worker has no calibration, if it has none


@dataclass
class PlanRow:
    """One recent plan: as made, and how its latest run finished."""

    name: str  #: the collection's key name
    made: float  #: when the plan arrived (seconds since the epoch)
    blocks: dict[str, int]  #: blocks per worker
    shares: dict[str, float]  #: each worker's share of the plan's work
    weights: dict[str, float]  #: each worker's weight when the plan was made
    predicted: dict[str, float]  #: predicted finish per worker, relative to the mean (1: as planned)
    observed: dict[str, float]  #: seconds from the shown run's first start to each worker's last stop
    tasks: dict[str, int]  #: tasks of the shown run finished, per worker
    expected: int  #: tasks of the shown run (its pinned tasks)
    complete: bool  #: the shown run is the latest complete one (else: the one in progress, or none)
    lost: int = 0  #: tasks of the shown run that failed or were cancelled
    ended: bool = False  #: no task of the shown run is left to run (complete, or the rest lost)

    @property
    def predicted_spread(self) -> float | None:
        """``(max - min) / max`` of the predicted finishes."""
        return spread(list(self.predicted.values()))

    @property
    def observed_spread(self) -> float | None:
        """``(max - min) / max`` of the observed finishes."""
        return spread(list(self.observed.values()))


@dataclass
class Snapshot:
    """Everything the page and the metrics show, read at one moment."""

    time: float  #: when it was read (seconds since the epoch)
    scheduler: str  #: the scheduler's address
    workers: list[WorkerRow]  #: sorted by address
    history: list[tuple[float, dict[str, Weights]]]  #: weight points, oldest first
    plans: list[PlanRow]  #: the most recent plans, newest first (each with its latest complete run)
    plans_kept: int  #: plans the scheduler remembers (``octopus.max-plans`` at most)
    plans_active: int  #: plans with pinned tasks waiting, running or in memory


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def take(plugin: OctopusSchedulerPlugin, plans: int = 10) -> Snapshot:
    """Read the scheduler plugin's workers, weights, weight history and latest plans.

    Parameters
    ----------
    plugin
        A started :class:`~dask_octopus.plugins.scheduler.OctopusSchedulerPlugin`.
    plans
        How many of the most recent plans to include.

    Returns
    -------
    Snapshot
        Plain data: later changes of the plugin do not show in it.
    """
    scheduler = plugin.scheduler
    workers = scheduler.workers
    weights, samples = plugin.current_weights()
    placement = plugin.placement
    tasks = scheduler.tasks
    pinned: Counter[str] = Counter()
    active: dict[str, set[str]] = {}
    plan_names = set()
    for key, block in placement.pins.items():
        ts = tasks.get(key)
        if ts is None or ts.state in _IDLE:
            continue
        plan_names.add(block[0])
        w = placement.worker_of(block)
        if w is None and ts.worker_restrictions is not None and len(ts.worker_restrictions) == 1:
            (w,) = ts.worker_restrictions  # its plan dropped (octopus.max-plans): the task's pin stands
        if w is not None:
            pinned[w] += 1
            active.setdefault(w, set()).add(block[0])
    rows = []
    for addr in sorted(workers):
        ws = workers[addr]
        profile = plugin.profiles.get(addr, {})
        counters = ws.metrics.get(HEARTBEAT_KEY) or {}
        figures = {} if profile.get("error") else profile  # a refused calibration's figures are not shown
        rows.append(WorkerRow(
            address=addr, name=str(ws.name), device=profile.get("device") or "?", model=profile.get("name") or "",
            compute=figures.get("compute"), memory=figures.get("memory"),
            weight_compute=weights[addr][0], weight_memory=weights[addr][1],
            samples=samples.get(addr, 0), pinned=pinned[addr], plans=len(active.get(addr, ())),
            groups=_count(counters.get("groups")), members=_count(counters.get("members")),
            graphs=_count(counters.get("graphs")), replays=_count(counters.get("replays")),
            error=profile.get("error") or (None if profile else "not calibrated yet"),
        ))
    plan_rows = []
    for record in plugin.plan_records.latest(plans):
        run = record.shown()
        plan_rows.append(PlanRow(
            name=record.name, made=record.made, blocks=record.blocks(), shares=record.shares(),
            weights=dict(record.weights), predicted=record.predicted(),
            observed=run.finish() if run else {}, tasks=dict(run.tasks) if run else {},
            expected=run.expected if run else 0, complete=run is not None and run.complete,
            lost=run.lost if run else 0, ended=run is not None and run.ended))
    return Snapshot(time=time.time(), scheduler=scheduler.address, workers=rows,
                    history=list(plugin.history.points), plans=plan_rows,
                    plans_kept=len(placement.plans), plans_active=len(plan_names))
