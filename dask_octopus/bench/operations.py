"""The array operations of the benchmark suite, in the shape of dask-cuda's ``local_cupy.py``.

Each operation runs passes over a persisted array ``x`` (``rows x cols``; ``size x size`` for the
square ones) and says how much work a pass is, so that the ideal time is that work over the sum of
the workers' calibrated speeds: FLOP over FLOP/s for compute-bound operations, bytes over the
measured streaming bandwidth for memory-bound ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import dask.array as da
from distributed import Client, wait

from dask_octopus.bench.workloads import (
    PassRecord,
    checksum,
    stencil_mean,
    subspace_iteration,
    timed_pass,
    watching_clock_shifts,
)
from dask_octopus.groups.marks import annotate


def timed_passes(client: Client, build: Callable[[], da.Array], passes: int, grouped: bool,
                 resource: str) -> list[PassRecord]:
    """``passes`` times: build the result (in stream groups when ``grouped``), persist it, wait; the last
    pass's record holds the result's :func:`~dask_octopus.bench.workloads.checksum`."""
    records = []
    with watching_clock_shifts(client):
        for i in range(passes):
            with timed_pass(client) as timing:
                with annotate(resource=resource) if grouped else contextlib.nullcontext():
                    y = build()
                y = client.persist(y)
                wait(y)
            busy = timing.intervals()  # every task of the pass counts as per-block work here
            records.append(PassRecord(timing.seconds, busy, busy, checksum(client, y) if i == passes - 1 else None))
            del y
    return records


@dataclass(frozen=True)
class Operation:
    """One benchmark operation; ``work(rows, cols, width)`` is FLOP (compute) or bytes (memory) per pass."""

    name: str
    resource: str
    square: bool
    formula: str
    work: Callable[[int, int, int], float]
    passes: Callable[[Client, da.Array, int, int, bool, bool], list[PassRecord]]
    per_block_tasks: bool = False  # its passes time the per-block tasks apart (a measured ideal exists)


def _matmul_iterate(client: Client, x: da.Array, width: int, n: int, gpu: bool, grouped: bool) -> list[PassRecord]:
    return subspace_iteration(client, x, width, n, gpu, grouped)


def _transpose_sum(client: Client, x: da.Array, width: int, n: int, gpu: bool, grouped: bool) -> list[PassRecord]:
    return timed_passes(client, lambda: (x + x.T).sum(), n, grouped, "memory")


def _dot(client: Client, x: da.Array, width: int, n: int, gpu: bool, grouped: bool) -> list[PassRecord]:
    return timed_passes(client, lambda: x.T @ x, n, grouped, "compute")


def _map_overlap(client: Client, x: da.Array, width: int, n: int, gpu: bool, grouped: bool) -> list[PassRecord]:
    # (zeros beyond the array's edges: with boundary="none" the edge blocks' rows wrap to their own far
    # end, so the result would depend on the chunks)
    return timed_passes(client, lambda: x.map_overlap(stencil_mean, depth={0: 4, 1: 0}, boundary=0), n,
                        grouped, "memory")


OPERATIONS: dict[str, Operation] = {op.name: op for op in (
    Operation("matmul_iterate", "compute", False, "4 * rows * cols * width FLOP per pass (X^T (X W))",
              lambda r, c, w: 4.0 * r * c * w, _matmul_iterate, per_block_tasks=True),
    Operation("dot", "compute", False, "2 * rows * cols^2 FLOP per pass (X^T X)",
              lambda r, c, w: 2.0 * r * c * c, _dot),
    Operation("transpose_sum", "memory", True, "2 * size^2 * 4 bytes per pass ((X + X^T).sum(): X read twice)",
              lambda r, c, w: 2.0 * r * c * 4, _transpose_sum),
    Operation("map_overlap", "memory", False, "2 * rows * cols * 4 bytes per pass (9-row mean: read, write)",
              lambda r, c, w: 2.0 * r * c * 4, _map_overlap),
)}


def calibrated_ideal(op: Operation, rows: int, cols: int, width: int, profiles: dict[str, dict]) -> float | None:
    """Seconds per pass if every worker worked at its calibrated speed all the time: the pass's work
    over the sum of the workers' FLOP/s (compute) or streaming bytes/s (memory); None when a worker
    has no such figure (registered without calibration, or its probes failed)."""
    cols = rows if op.square else cols
    speeds = [p.get(op.resource) for p in profiles.values()]
    if not speeds or not all(speeds):
        return None
    return op.work(rows, cols, width) / sum(speeds)
