"""Worker plugin: calibrate the worker when it starts, report to the scheduler, time GPU tasks, and
own the worker's stream-group state (:class:`~dask_octopus.groups.streams.StreamRuntime`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any

from distributed.core import Status
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import pickle

from dask_octopus import config
from dask_octopus.groups.streams import EXTENSION, HEARTBEAT_KEY, RAISED_BY, StreamRuntime
from dask_octopus.plugins.messages import Profile
from dask_octopus.profiling.gpu_timing import GpuTaskTimer
from dask_octopus.profiling.probes import ProbeStopped, gpu_available, probed_device, run_probes
from dask_octopus.profiling.working_set import CupyPeak, RssPeak, WorkingSetMeter

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)

_CLOSING = (Status.closing, Status.closing_gracefully, Status.closed, Status.failed)


class OctopusWorkerPlugin(WorkerPlugin):
    """Runs the calibration probes once per worker (also on workers that join later), unless
    ``calibrate=False``, when weights come from task timings alone.

    Figures, or the probe's error, go to the scheduler plugin through its ``octopus_report``
    handler before :meth:`setup` returns, so registration waits for the calibration. On a GPU
    worker with one thread it also times tasks with CUDA events (:mod:`dask_octopus.profiling.gpu_timing`).
    A task that runs out of memory gets a note naming the worker, the bytes of its block and what
    to change in the plan. It measures the working sets of the tasks pinned for ``balance`` plans
    (:mod:`dask_octopus.profiling.working_set`). It installs the worker's
    :class:`~dask_octopus.groups.streams.StreamRuntime` (stream pools, captured graphs) as the worker
    extension ``octopus-streams`` and drops it on teardown.

    Arguments left ``None`` come from ``dask.config`` (``octopus.calibration.*``), read once here, on
    the client or scheduler that makes the plugin. :meth:`setup` checks the worker's own ``octopus``
    settings first (its fragments and batches read them): a bad one fails the setup there, naming the key.
    """

    name = "octopus-worker"
    idempotent = True

    #: run the probes (else the weights come from task timings alone)
    calibrate: bool
    #: probe budget in seconds
    seconds: float
    #: ``"auto"``, ``"cpu"`` or ``"gpu"``
    device: str
    #: CUDA-event task timer (GPU workers with one thread)
    timer: GpuTaskTimer | None
    #: measures the working sets of the tasks of balanced blocks
    meter: WorkingSetMeter | None
    worker: Worker | None
    #: this worker's calibration, as sent to the scheduler
    profile: Profile

    def __init__(self, seconds: float | None = None, device: str | None = None, calibrate: bool = True):
        self.calibrate = calibrate
        self.seconds = config.get("calibration.seconds", seconds, "calibration_seconds")
        self.device = config.get("calibration.device", device, "device")
        self.timer = None
        self.meter = None
        self.worker = None
        self.profile = {}
        self._torn_down = False
        self._stop: threading.Event | None = None  # ends a calibration running at teardown (a close waited for it)

    async def setup(self, worker: Worker) -> None:
        try:
            config.check_all()  # this worker's own settings, which its fragments and batches read: a bad one fails
        except ValueError as e:  # here, told to the scheduler first: Dask logs a failed setup on the worker only
            with contextlib.suppress(Exception):  # (a worker that joins later: no register hears of it)
                await worker.scheduler.octopus_not_loaded(worker=worker.address, error=repr(e))
            raise
        self.worker = worker
        runtime = worker.extensions.setdefault(EXTENSION, StreamRuntime())
        # sent with each heartbeat, for the dashboard. A new dict, not an update in place: a heartbeat may be
        # iterating over the old one, suspended at an awaitable metric, and a changed dict would close the worker
        worker.metrics = {**worker.metrics, HEARTBEAT_KEY: lambda w: runtime.stats()}
        profile: Profile
        device = probed_device(self.device)  # a GPU worker whose probes fail stays one (its memory is the GPU's)
        if not self.calibrate:
            profile = {"calibrated": False, "device": device, "error": None}
        else:
            self._stop = threading.Event()  # (made here: the plugin travels pickled)
            try:
                profile = await asyncio.get_running_loop().run_in_executor(None, run_probes, self.seconds, device,
                                                                           self._stop)
                profile["error"] = None
            except asyncio.CancelledError:
                if worker.status in _CLOSING:  # closed while it calibrates (a Ctrl-C, a cluster closed): no
                    return  # report, and no traceback logged for a setup that had nothing left to do
                raise
            except ProbeStopped:  # torn down while it calibrates: the worker closes, or a new plugin reports
                return
            except Exception as e:  # reported to the scheduler; the worker keeps working
                logger.warning("dask_octopus calibration failed on %s: %r", worker.address, e)
                profile = {"device": device, "error": f"{type(e).__name__}: {e}"}
            if self._torn_down:  # replaced while calibrating (a new register): the new plugin reports
                return
        gpu = device == "gpu" and gpu_available()  # (device="gpu" forced where CuPy is missing: neither)
        if gpu and worker.state.nthreads == 1:
            self.timer = GpuTaskTimer(worker)
        profile["event_timing"] = self.timer is not None
        profile["ends_at_launch"] = gpu and self.timer is None
        if gpu:
            self.meter = WorkingSetMeter(worker, CupyPeak.shared())
        elif device == "cpu" and RssPeak.available():
            self.meter = WorkingSetMeter(worker, RssPeak())
        if profile.get("memory"):
            runtime.bandwidth = profile["memory"]
        self.profile = profile
        await worker.scheduler.octopus_report(worker=worker.address, profile=profile)

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        if self.timer is not None:
            self.timer.transition(key, start, finish)
        if self.meter is not None:
            self.meter.transition(key, start, finish)
        if finish == "error" and self.worker is not None:
            self._explain_out_of_memory(key)

    def _explain_out_of_memory(self, key: Any) -> None:
        """Add the note to an out-of-memory error; the worker holds it pickled inside a ``Serialize``
        that the task-erred message shares, so the note travels to the client with it."""
        ts = self.worker.state.tasks.get(key)
        wrapped = getattr(ts, "exception", None)
        try:
            exc = pickle.loads(wrapped.data)
        except Exception:
            return
        if not (isinstance(exc, MemoryError) or "OutOfMemory" in type(exc).__name__):
            return
        fraction = config.get("balance.memory-fraction")
        advice = (f"make blocks smaller with per_worker=2 or more, or lower octopus.balance.memory-fraction "
                  f"(now {fraction})")
        if any(note.startswith(RAISED_BY) for note in getattr(exc, "__notes__", ())):
            # a step of a fragment ran out, maybe on another worker: this task only read its error
            exc.add_note(f"dask_octopus: the task named above ran out of memory in a fragment. Lower "
                         f"octopus.fragments.max-bytes (now {config.get('fragments.max-bytes')}) for smaller "
                         f"fragments; if dask_octopus.balance planned its block, {advice}.")
        else:
            nbytes = sum(d.nbytes or 0 for d in ts.dependencies)
            exc.add_note(f"dask_octopus: worker {self.worker.address} ran out of memory on task {key!r}, whose "
                         f"inputs hold {nbytes / 2**20:.1f} MiB. If dask_octopus.balance planned this block, "
                         f"{advice}.")
        wrapped.data = pickle.dumps(exc)

    def teardown(self, worker: Worker) -> None:
        self._torn_down = True
        if self._stop is not None:
            self._stop.set()
        if self.timer is not None:
            self.timer.stop()
            self.timer = None
        if self.meter is not None:
            self.meter.close()
            self.meter = None
        worker.metrics = {k: v for k, v in worker.metrics.items() if k != HEARTBEAT_KEY}  # as in setup
        runtime = worker.extensions.pop(EXTENSION, None)
        if runtime is not None:
            runtime.close()
