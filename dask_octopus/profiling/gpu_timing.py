"""Real GPU time of each task on a CuPy worker, from CUDA events.

A CuPy task returns as soon as its kernels are launched, so the ``startstops`` the scheduler sees
measure launches, not work. On a GPU worker with one thread (dask-cuda's default) the worker plugin
records an event on the default stream when a task starts executing and another when it finishes;
the elapsed time between them is the GPU time of that task's kernels. Finished pairs are polled
without blocking and sent to the scheduler plugin as ``octopus-gpu-timings`` events of
``(key, prefix, bytes, seconds)`` (a fragment task's prefix names its members' work:
:func:`~dask_octopus.groups.rewrite.timing_prefix`; a task some of whose work failed counts the seconds
the share of its work done would take, :data:`~dask_octopus.plugins.messages.DONE_SHARE`, none for 0).
Assumes the legacy default stream (no per-thread default stream), as dask-cuda sets it up.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from dask.utils import key_split
from tornado.ioloop import PeriodicCallback

from dask_octopus.groups.rewrite import timing_prefix
from dask_octopus.plugins.messages import DONE_SHARE

if TYPE_CHECKING:
    from distributed import Worker

TOPIC = "octopus-gpu-timings"


class GpuTaskTimer:
    """Brackets each executing task with CUDA events and reports ``(key, prefix, bytes, seconds)``."""

    def __init__(self, worker: Worker, interval_ms: float = 200):
        import cupy

        self.cupy = cupy
        self.worker = worker
        self.started: dict[Any, Any] = {}
        self.finished: deque[tuple[Any, str, int, float, Any, Any]] = deque()
        # the worker stops its periodic callbacks when it closes
        self.callback = worker.periodic_callbacks[TOPIC] = PeriodicCallback(self.flush, interval_ms)
        self.callback.start()

    def _event(self) -> Any:
        ev = self.cupy.cuda.Event(block=False, disable_timing=False)
        ev.record()
        return ev

    def transition(self, key: Any, start: str, finish: str) -> None:
        if finish == "executing":
            self.started[key] = self._event()
        elif start == "executing":
            begin = self.started.pop(key, None)
            ts = self.worker.state.tasks.get(key)
            share = ts.metadata.get(DONE_SHARE, 1.0) if ts is not None else 0.0
            if begin is not None and finish == "memory" and share > 0:
                units = (ts.nbytes or 0) + sum(d.nbytes or 0 for d in ts.dependencies)
                prefix = timing_prefix(key_split(key), ts.run_spec)
                self.finished.append((key, prefix, max(units, 1), share, begin, self._event()))

    def flush(self) -> None:
        """Send the timings whose end event has completed."""
        out = []
        while self.finished and self.finished[0][5].done:
            key, prefix, units, share, begin, end = self.finished.popleft()
            seconds = self.cupy.cuda.get_elapsed_time(begin, end) / 1000 / share
            if seconds != 0:  # (0: it launched no kernel, its work was on the host; not a bad timing)
                out.append((key, prefix, units, seconds))
        if out:
            self.worker.log_event(TOPIC, {"worker": self.worker.address, "timings": out})

    def stop(self) -> None:
        self.callback.stop()
        self.worker.periodic_callbacks.pop(TOPIC, None)
        self.started.clear()
        self.finished.clear()
