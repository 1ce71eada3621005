"""Worker plugin: calibrate the worker when it starts, report to the scheduler, time GPU tasks."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import dask.config
from distributed.diagnostics.plugin import WorkerPlugin

from dask_octopus.gpu_timing import GpuTaskTimer
from dask_octopus.probes import run_probes

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)


class OctopusWorkerPlugin(WorkerPlugin):
    """Runs the calibration probes once per worker (also on workers that join later).

    Figures, or the probe's error, go to the scheduler plugin through its ``octopus_report``
    handler before :meth:`setup` returns, so registration waits for the calibration. On a GPU
    worker with one thread it also times tasks with CUDA events (:mod:`dask_octopus.gpu_timing`).
    """

    name = "octopus-worker"
    idempotent = True

    def __init__(self, seconds: float | None = None, device: str | None = None):
        self.seconds = seconds if seconds is not None else dask.config.get("octopus.calibration.seconds")
        self.device = device or dask.config.get("octopus.calibration.device")
        self.timer: GpuTaskTimer | None = None

    async def setup(self, worker: Worker) -> None:
        profile: dict[str, Any]
        try:
            profile = await asyncio.get_running_loop().run_in_executor(None, run_probes, self.seconds, self.device)
            profile["error"] = None
            if profile["device"] == "gpu" and worker.state.nthreads == 1:
                self.timer = GpuTaskTimer(worker)
            profile["event_timing"] = self.timer is not None
        except Exception as e:  # reported to the scheduler; the worker keeps working
            logger.warning("dask_octopus calibration failed on %s: %r", worker.address, e)
            profile = {"error": f"{type(e).__name__}: {e}"}
        await worker.scheduler.octopus_report(worker=worker.address, profile=profile)

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        if self.timer is not None:
            self.timer.transition(key, start, finish)

    def teardown(self, worker: Worker) -> None:
        if self.timer is not None:
            self.timer.stop()
            self.timer = None
