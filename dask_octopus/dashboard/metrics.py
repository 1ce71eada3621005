"""The ``dask_octopus_*`` Prometheus series, on distributed's ``/metrics``.

A collector in ``prometheus_client``'s default registry, as distributed registers its own
(``distributed/http/scheduler/prometheus/core.py``): each scrape reads a
:func:`~dask_octopus.dashboard.snapshot.take` of every running scheduler plugin of this process whose
scheduler runs on the scrape's event loop and
yields one sample per worker (label ``worker``, its address). Names start with distributed's
namespace (``distributed.dashboard.prometheus.namespace``, ``dask``) and ``octopus``. Needs
``prometheus_client``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import dask.config
import prometheus_client
from distributed.core import Status
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dask_octopus.dashboard import snapshot
from dask_octopus.dashboard.snapshot import WorkerRow

if TYPE_CHECKING:
    from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin

Family = GaugeMetricFamily | CounterMetricFamily

#: name (after ``<namespace>_octopus_``): (kind, help, the value of a worker's row or None, extra labels)
SERIES: dict[str, tuple[type[Family], str, list[tuple[tuple[str, ...], Callable[[WorkerRow], float | None]]]]] = {
    "weight": (GaugeMetricFamily, "Share of the work the worker is planned; the weights of a resource sum to 1",
               [(("compute",), lambda r: r.weight_compute), (("memory",), lambda r: r.weight_memory)]),
    "calibrated_flops": (GaugeMetricFamily, "GEMM FLOP/s measured by the calibration probe",
                         [((), lambda r: r.compute)]),
    "calibrated_bytes_per_second": (GaugeMetricFamily, "Streaming bytes/s measured by the calibration probe",
                                    [((), lambda r: r.memory)]),
    "task_timings": (GaugeMetricFamily, "Task timings behind the worker's weights", [((), lambda r: r.samples)]),
    "pinned_tasks": (GaugeMetricFamily, "Tasks pinned to the worker by a plan", [((), lambda r: r.pinned)]),
    "plans_active": (GaugeMetricFamily, "Plans with tasks pinned to the worker", [((), lambda r: r.plans)]),
    "groups_run": (CounterMetricFamily, "Stream groups run on the worker", [((), lambda r: r.groups)]),
    "group_tasks_run": (CounterMetricFamily, "Tasks run inside stream groups on the worker",
                        [((), lambda r: r.members)]),
    "graphs_captured": (GaugeMetricFamily, "Stream groups captured as CUDA graphs and held by the worker",
                        [((), lambda r: r.graphs)]),
    "graphs_replayed": (CounterMetricFamily, "CUDA graph replays of stream groups on the worker",
                        [((), lambda r: r.replays)]),
}
LABELS = {"weight": ["worker", "resource"]}  #: labels of each series (default: ``worker``)


def name(series: str) -> str:
    """The full name of one of :data:`SERIES` (``dask_octopus_weight``)."""
    namespace = dask.config.get("distributed.dashboard.prometheus.namespace")
    return "_".join(part for part in (namespace, "octopus", series) if part)


class OctopusCollector:
    """Yields :data:`SERIES` for the plugins in ``plugins`` whose scheduler runs on this event loop.

    Parameters
    ----------
    plugins
        The scheduler plugins to export, a list that their start and close update.
    """

    def __init__(self, plugins: list[OctopusSchedulerPlugin]):
        self.plugins = plugins

    def _families(self) -> dict[str, Family]:
        return {s: kind(name(s), text, labels=LABELS.get(s, ["worker"])) for s, (kind, text, _) in SERIES.items()}

    def describe(self) -> Iterator[Family]:
        """The series, without samples (what the registry checks for duplicate names)."""
        yield from self._families().values()

    def collect(self) -> Iterator[Family]:
        """The series with one sample per worker (and resource) where the value is known; a series
        without samples (no running plugin, or no worker knows its value) is left out."""
        families = self._families()
        for plugin in list(self.plugins):
            if not _on_its_loop(plugin):  # (another scheduler's state, read on its own loop only)
                continue
            if not plugin.registered():  # unregistered (which does not close a plugin), or never started
                with contextlib.suppress(ValueError):  # (gone already: a scrape on another loop removed it)
                    self.plugins.remove(plugin)  # for good: its scheduler is not kept alive by this list
                continue
            if plugin.scheduler.status != Status.running:
                continue
            for row in snapshot.take(plugin, plans=0).workers:
                for series, (_, _, values) in SERIES.items():
                    for extra, value in values:
                        v = value(row)
                        if v is not None:
                            families[series].add_metric([row.address, *extra], v)
        yield from (f for f in families.values() if f.samples)  # no worker, no series


def _on_its_loop(plugin: OctopusSchedulerPlugin) -> bool:
    """Whether this runs on the event loop of ``plugin``'s scheduler, the one thread that may read its
    state (a scrape of another scheduler of the process, on its own thread's loop, would read it while
    it changes: "dictionary changed size during iteration" failed the whole scrape)."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:  # (not on an event loop: no scheduler's thread)
        return False
    scheduler = plugin.scheduler
    return scheduler is not None and scheduler.loop.asyncio_loop is running


_collector: OctopusCollector | None = None


def register(plugins: list[OctopusSchedulerPlugin]) -> OctopusCollector:
    """Register, once per process, a collector of ``plugins`` in ``prometheus_client``'s default registry.

    Parameters
    ----------
    plugins
        The list of plugins to export (kept by reference: later changes show in the next scrape).

    Returns
    -------
    OctopusCollector
        The collector registered.
    """
    global _collector
    if _collector is None:
        _collector = OctopusCollector(plugins)
        prometheus_client.REGISTRY.register(_collector)
    return _collector
