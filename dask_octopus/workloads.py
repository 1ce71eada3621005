"""Workloads shared by the demo, the benchmarks and the tests (NumPy or CuPy blocks)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import dask.array as da
import numpy as np
from dask.utils import key_split
from distributed import Client, get_task_stream, wait


def array_module(gpu: bool) -> Any:
    """CuPy when ``gpu`` else NumPy."""
    if gpu:
        import cupy

        return cupy
    return np


def random_matrix(rows: int, cols: int, chunks: Any, gpu: bool = False, seed: int = 0) -> da.Array:
    """A float32 dask array of uniform random numbers, generated on the workers."""
    rng = da.random.default_rng(array_module(gpu).random.default_rng(seed))
    return rng.random((rows, cols), chunks=chunks, dtype=np.float32)


def gemm_repeat(a: Any, reps: int) -> Any:
    """``reps`` products ``a.T @ a`` (compute-bound; synchronises the GPU before returning)."""
    xp = np if isinstance(a, np.ndarray) else __import__("cupy")
    out = None
    for _ in range(reps):
        out = a.T @ a
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
    return out


@dataclass
class PassRecord:
    """One pass: wall time, and each worker's busy intervals (seconds from the pass start)."""

    seconds: float
    intervals: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def finish(self) -> dict[str, float]:
        """Each worker's last task end, from the pass start."""
        return {w: max(stop for _, stop in iv) for w, iv in self.intervals.items() if iv}

    def spread(self) -> float:
        """(latest - earliest worker finish) / pass time."""
        f = list(self.finish().values())
        return (max(f) - min(f)) / self.seconds if len(f) > 1 else 0.0


def _intervals(stream: list[dict], t0: float, prefixes: set[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for rec in stream:
        if prefixes and key_split(rec["key"]) not in prefixes:
            continue
        for ss in rec["startstops"]:
            if ss["action"] == "compute":
                out.setdefault(rec["worker"], []).append((ss["start"] - t0, ss["stop"] - t0))
    return out


def subspace_iteration(client: Client, x: da.Array, width: int, passes: int, gpu: bool = False) -> list[PassRecord]:
    """Passes of ``W <- normalise(X^T (X W))`` over a persisted ``x``; one record per pass.

    The per-block work (two GEMMs on each row block, ``4 * rows * cols * width`` FLOP) dominates;
    the cross-block sum of the ``cols x width`` partial products is small.
    """
    xp = array_module(gpu)
    w = xp.ones((x.shape[1], width), dtype=np.float32) / np.sqrt(x.shape[1])
    records = []
    for _ in range(passes):
        wd = da.from_array(w, chunks=w.shape, asarray=False)
        g = x.T @ (x @ wd)
        with get_task_stream(client) as ts:
            t0 = time.time()
            start = time.perf_counter()
            g = client.compute(g).result()
            seconds = time.perf_counter() - start
        w = g / xp.linalg.norm(g)
        records.append(PassRecord(seconds, _intervals(ts.data, t0)))
    return records


def persist_on_workers(client: Client, x: da.Array) -> da.Array:
    """Persist ``x`` and wait until every block is in memory."""
    x = client.persist(x)
    wait(x)
    return x
