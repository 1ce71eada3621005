"""Calibration probes run on a worker: one compute-bound GEMM, one memory-bound streaming pass.

CuPy on a GPU worker (device 0 of the worker's ``CUDA_VISIBLE_DEVICES``, as dask-cuda sets it),
NumPy on a CPU worker. Each probe warms up, then repeats its operation for a time budget and
reports throughput (total work / elapsed time), synchronising the device before reading a clock
so a co-tenant that time-slices the device shows up as a lower figure. A probe told to stop (its
worker closes) stops before its next operation.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from dask_octopus._checks import check_finite


def gpu_count() -> int:
    """The CUDA devices CuPy sees (0 when CuPy is not installed or sees none)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return gpu_count() > 0


class ProbeStopped(RuntimeError):
    """The probes were told to stop before their time was up."""


def _check(stop: threading.Event, start: float, seconds: float) -> None:
    if stop.is_set():
        raise ProbeStopped(f"stopped after {time.perf_counter() - start:.3g} of {seconds:.3g} s")


def _throughput(step: Callable[[], None], sync: Callable[[], None], work: float, seconds: float,
                stop: threading.Event) -> float:
    """Work per second of ``step`` repeated for about ``seconds`` after two warm-up calls; raises
    :class:`ProbeStopped` once ``stop`` is set (looked at before each call: on a GPU, the calls queued
    then run on)."""
    start = time.perf_counter()
    for _ in range(2):
        _check(stop, start, seconds)
        step()
    sync()
    reps = 0
    start = time.perf_counter()
    while True:
        _check(stop, start, seconds)
        step()
        reps += 1
        if reps % 4 == 0 or reps < 4:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
    return check_finite(work * reps / elapsed, f"the probe's rate over {elapsed!r} s", error=RuntimeError)


def _gemm_rate(xp: Any, n: int, sync: Callable[[], None], seconds: float, stop: threading.Event) -> float:
    """FLOP/s of an ``n x n`` float32 matrix product with the array module ``xp``."""
    a = xp.random.default_rng(0).random((n, n), dtype=xp.float32)
    b = a.T.copy()
    out = xp.empty_like(a)
    return _throughput(lambda: xp.matmul(a, b, out=out), sync, 2.0 * n**3, seconds, stop)


def _stream_rate(xp: Any, elements: int, sync: Callable[[], None], seconds: float,
                 stop: threading.Event) -> float:
    """Bytes/s of an elementwise ``sqrt(x) * 2 + 1`` over ``elements`` float32 values (three passes,
    each reading and writing the array)."""
    x = xp.ones(elements, dtype=xp.float32)
    y = xp.empty_like(x)

    def stream() -> None:
        xp.sqrt(x, out=y)
        xp.multiply(y, 2, out=y)
        xp.add(y, 1, out=y)

    return _throughput(stream, sync, 6.0 * x.nbytes, seconds, stop)


def _probe_cpu(seconds: float, stop: threading.Event) -> dict[str, Any]:
    import numpy as np
    import psutil

    compute = _gemm_rate(np, 384, lambda: None, seconds / 2, stop)
    # two arrays of 64 MiB, each twice a large L3 (a 2-core machine's 32 MiB L3: arrays of 16 MiB streamed at
    # 40-48 GB/s, partly from the cache; 64 MiB 36-37; 256 MiB 32-35)
    memory = _stream_rate(np, 16 * 2**20, lambda: None, seconds / 2, stop)
    vm = psutil.virtual_memory()
    return {"device": "cpu", "name": "CPU", "compute": compute, "memory": memory,
            "memory_total": int(vm.total), "memory_free": int(vm.available)}


def _probe_gpu(seconds: float, stop: threading.Event) -> dict[str, Any]:
    import cupy

    sync = cupy.cuda.get_current_stream().synchronize
    try:
        compute = _gemm_rate(cupy, 4096, sync, seconds / 2, stop)
        memory = _stream_rate(cupy, 64 * 2**20, sync, seconds / 2, stop)  # 256 MiB
    finally:
        cupy.get_default_memory_pool().free_all_blocks()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    free, total = cupy.cuda.runtime.memGetInfo()
    name = props["name"]
    return {"device": "gpu", "name": name.decode() if isinstance(name, bytes) else str(name),
            "compute": compute, "memory": memory, "memory_total": int(total), "memory_free": int(free)}


def probed_device(device: str = "auto") -> str:
    """The device this process calibrates and computes on, ``"gpu"`` or ``"cpu"``, for the setting
    ``device``: ``"auto"`` (GPU when CuPy sees one), ``"gpu"`` or ``"cpu"``.

    Raises
    ------
    ValueError
        For any other ``device``.
    """
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"unknown calibration device {device!r}: expected auto, cpu or gpu")
    return "gpu" if device == "gpu" or (device == "auto" and gpu_available()) else "cpu"


def run_probes(seconds: float = 0.6, device: str = "auto", stop: threading.Event | None = None) -> dict[str, Any]:
    """Calibrate this process's device.

    Parameters
    ----------
    seconds
        The probes' time budget.
    device
        ``"auto"``, ``"cpu"`` or ``"gpu"``: the device is :func:`probed_device` of it.
    stop
        Once set, the probes stop before their next operation (a GEMM, a streaming pass) and raise
        :class:`ProbeStopped`.

    Returns
    -------
    dict
        The figures (FLOP/s, bytes/s, memory) and the probes' time.
    """
    use_gpu = probed_device(device) == "gpu"
    stop = stop if stop is not None else threading.Event()
    start = time.perf_counter()
    result = _probe_gpu(seconds, stop) if use_gpu else _probe_cpu(seconds, stop)
    result["probe_seconds"] = time.perf_counter() - start
    return result
