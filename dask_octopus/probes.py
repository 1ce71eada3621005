"""Calibration probes run on a worker: one compute-bound GEMM, one memory-bound streaming pass.

CuPy on a GPU worker (device 0 of the worker's ``CUDA_VISIBLE_DEVICES``, as dask-cuda sets it),
NumPy on a CPU worker. Each probe warms up, then repeats its operation for a time budget and
reports throughput (total work / elapsed time), synchronising the device before reading a clock
so a co-tenant that time-slices the device shows up as a lower figure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _throughput(step: Callable[[], None], sync: Callable[[], None], work: float, seconds: float) -> float:
    """Work per second of ``step`` repeated for about ``seconds`` after two warm-up calls."""
    step()
    step()
    sync()
    reps = 0
    start = time.perf_counter()
    while True:
        step()
        reps += 1
        if reps % 4 == 0 or reps < 4:
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
    rate = work * reps / elapsed
    if not (math.isfinite(rate) and rate > 0):
        raise RuntimeError(f"probe measured a non-positive rate ({rate!r}) over {elapsed!r} s")
    return rate


def _probe_cpu(seconds: float) -> dict[str, Any]:
    import numpy as np
    import psutil

    n = 384
    a = np.random.default_rng(0).random((n, n), dtype=np.float32)
    b = a.T.copy()
    out = np.empty_like(a)
    compute = _throughput(lambda: np.matmul(a, b, out=out), lambda: None, 2.0 * n**3, seconds / 2)
    x = np.ones(4 * 2**20, dtype=np.float32)  # 16 MiB: larger than caches
    y = np.empty_like(x)

    def stream() -> None:
        np.sqrt(x, out=y)
        np.multiply(y, 2, out=y)
        np.add(y, 1, out=y)

    memory = _throughput(stream, lambda: None, 6.0 * x.nbytes, seconds / 2)
    vm = psutil.virtual_memory()
    return {"device": "cpu", "name": "CPU", "compute": compute, "memory": memory,
            "memory_total": int(vm.total), "memory_free": int(vm.available)}


def _probe_gpu(seconds: float) -> dict[str, Any]:
    import cupy

    pool = cupy.get_default_memory_pool()
    n = 4096
    try:
        a = cupy.random.default_rng(0).random((n, n), dtype=cupy.float32)
        b = a.T.copy()
        out = cupy.empty_like(a)
        sync = cupy.cuda.get_current_stream().synchronize
        compute = _throughput(lambda: cupy.matmul(a, b, out=out), sync, 2.0 * n**3, seconds / 2)
        del a, b, out
        x = cupy.ones(64 * 2**20, dtype=cupy.float32)  # 256 MiB
        y = cupy.empty_like(x)

        def stream() -> None:
            cupy.sqrt(x, out=y)
            cupy.multiply(y, 2, out=y)
            cupy.add(y, 1, out=y)

        memory = _throughput(stream, sync, 6.0 * x.nbytes, seconds / 2)
        del x, y
    finally:
        pool.free_all_blocks()
    props = cupy.cuda.runtime.getDeviceProperties(0)
    free, total = cupy.cuda.runtime.memGetInfo()
    name = props["name"]
    return {"device": "gpu", "name": name.decode() if isinstance(name, bytes) else str(name),
            "compute": compute, "memory": memory, "memory_total": int(total), "memory_free": int(free)}


def run_probes(seconds: float = 0.6, device: str = "auto") -> dict[str, Any]:
    """Calibrate this process's device; returns figures (FLOP/s, bytes/s, memory) and timing.

    ``device`` is ``"auto"`` (GPU when CuPy sees one), ``"gpu"`` or ``"cpu"``.
    """
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"unknown calibration device {device!r}: expected auto, cpu or gpu")
    use_gpu = device == "gpu" or (device == "auto" and gpu_available())
    start = time.perf_counter()
    result = _probe_gpu(seconds) if use_gpu else _probe_cpu(seconds)
    result["probe_seconds"] = time.perf_counter() - start
    return result
