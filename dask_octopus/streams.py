"""Worker side of stream groups: run a group's members in one Dask task.

On a GPU worker (CuPy imported, a device present) the members are launched from the task's thread
over a small pool of non-blocking CUDA streams, reused across groups, in the order of
:func:`~dask_octopus.grouping.launch_order`. The pool streams first wait on an event recorded on
the stream that produced the inputs, so no member reads a block before its producer's kernels
finished; the group ends with one synchronisation of the streams it used, so results leaving the
task are complete and memory freed later on another stream cannot be reused early. On a CPU worker
(NumPy blocks) the members simply run one after the other.

A member whose class is ``"auto"`` is classified from its first run (bytes moved per second
against the worker's streaming bandwidth) and remembered per function and input shapes.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import dask.config

from dask_octopus.grouping import launch_order

_local = threading.local()
_classes: dict[tuple, str] = {}  # (function, shapes, dtypes) -> "compute" | "memory"
_DEFAULT_BANDWIDTH = 100e9  # bytes/s assumed when the worker was not calibrated


def _cupy() -> Any | None:
    """CuPy if the worker already uses it and a device is visible (CPU workers never import it)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return None
    try:
        return cp if cp.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


def stream_pool(cp: Any, n: int) -> list[Any]:
    """This thread's non-blocking streams on the current device (created once, reused)."""
    pools = getattr(_local, "pools", None)
    if pools is None:
        pools = _local.pools = {}
    device = cp.cuda.runtime.getDevice()
    pool = pools.setdefault(device, [])
    while len(pool) < n:
        pool.append(cp.cuda.Stream(non_blocking=True))
    return pool[:n]


def _nbytes(obj: Any) -> int:
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return int(getattr(obj, "nbytes", 0) or 0)


def _signature(name: str, inputs: Sequence[Any]) -> tuple:
    return (name, tuple((getattr(a, "shape", None), str(getattr(a, "dtype", ""))) for a in inputs))


def resolve_class(declared: str, name: str, inputs: Sequence[Any]) -> str | None:
    """The member's class: declared, remembered for its signature, or ``None`` (not measured yet)."""
    if declared != "auto":
        return declared
    return _classes.get(_signature(name, inputs))


def classify(name: str, inputs: Sequence[Any], output: Any, seconds: float, bandwidth: float) -> str:
    """Remember the class of function ``name`` on inputs of these shapes from one run: memory-bound
    when it moved bytes at a quarter or more of the worker's streaming bandwidth, else compute-bound."""
    moved = _nbytes(list(inputs)) + _nbytes(output)
    cls = "memory" if seconds > 0 and moved / seconds >= 0.25 * bandwidth else "compute"
    _classes[_signature(name, inputs)] = cls
    return cls


def _worker_bandwidth() -> float:
    """The streaming bandwidth this worker measured at calibration, or a default."""
    try:
        from distributed import get_worker

        profile = get_worker().plugins["octopus-worker"].profile
        return float(profile.get("memory") or _DEFAULT_BANDWIDTH)
    except (ValueError, KeyError, AttributeError):
        return _DEFAULT_BANDWIDTH


def run_group(members: Sequence[Callable[[], Any]], names: Sequence[str], inputs: Sequence[Sequence[Any]],
              declared: Sequence[str]) -> list[Any]:
    """Run ``members[i]()`` (function ``names[i]`` on ``inputs[i]``, which give its size and class)
    and return their results in member order."""
    bandwidth = _worker_bandwidth()
    known = [resolve_class(d, n, x) for d, n, x in zip(declared, names, inputs, strict=True)]
    sizes = [float(_nbytes(list(x))) for x in inputs]
    order = launch_order([c or "memory" for c in known], sizes)
    cp = _cupy()
    results: list[Any] = [None] * len(members)
    if cp is None:
        for i in order:
            start = time.perf_counter()
            results[i] = members[i]()
            if known[i] is None:
                classify(names[i], inputs[i], results[i], time.perf_counter() - start, bandwidth)
        return results
    max_streams = dask.config.get("octopus.streams.max-streams")
    streams = stream_pool(cp, max(1, min(len(members), max_streams)))
    ready = cp.cuda.get_current_stream().record()
    for s in streams:
        s.wait_event(ready)
    timed: dict[int, tuple[Any, Any]] = {}
    for slot, i in enumerate(order):
        s = streams[slot % len(streams)]
        with s:
            start = s.record() if known[i] is None else None
            results[i] = members[i]()
            if start is not None:
                timed[i] = (start, s.record())
    for s in streams:
        s.synchronize()
    for i, (start, end) in timed.items():
        seconds = cp.cuda.get_elapsed_time(start, end) / 1e3
        classify(names[i], inputs[i], results[i], seconds, bandwidth)
    return results
