"""The iterative experiment behind the demo and the matmul benchmark.

Variants of the same persisted-array workload (:func:`~dask_octopus.bench.workloads.subspace_iteration`):
``equal`` (Dask's default: one equal row block per worker), ``over-K`` (K equal blocks per worker,
work stealing on, generated with Dask's root-task queuing), and ``balance`` (speed-weighted blocks
pinned by dask_octopus). The ideal is the total rows over the sum of the workers' speeds, each
measured as rows per second of per-block work in a variant where no task moves (``balance``: every block and its
consumers are pinned, so a worker's busy time is spent on its own rows, with the others running).
"""

from __future__ import annotations

import contextlib
import copy
import signal
import statistics
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import dask.array as da
from distributed import Client, LocalCluster

import dask_octopus
from dask_octopus.bench.cotenant import pin_workers
from dask_octopus.bench.protocol import resolve_protocol
from dask_octopus.bench.runner import interleave, timed
from dask_octopus.bench.workloads import (
    PassRecord,
    persist_on_workers,
    random_matrix,
    same_checksums,
    workers_info,
)
from dask_octopus.profiling.probes import gpu_count


@dataclass
class Variant:
    """Results of one variant: timed passes, persist time and rows held by each worker."""

    name: str
    passes: list[PassRecord] = field(default_factory=list)
    persist_seconds: list[float] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)  # of the last run
    row_passes: dict[str, int] = field(default_factory=dict)  # rows times timed passes, over all runs
    blocks: int = 0
    weights: list[dict[str, float]] = field(default_factory=list)  # dask_octopus weights after each run
    values: list[tuple[float, float, float]] = field(default_factory=list)  # each run's result checksum
    same_values: bool | None = None  # every run's result as the first variant's (None: not compared)

    def median(self) -> PassRecord:
        """The pass of median duration (of an even number of passes, the slower of the middle two;
        :meth:`seconds` is their mean)."""
        ordered = sorted(self.passes, key=lambda r: r.seconds)
        return ordered[len(ordered) // 2]

    def seconds(self) -> float:
        return statistics.median(r.seconds for r in self.passes)

    def block_makespan(self) -> float:
        """Median over passes of the latest worker's end of per-block work (from the pass start)."""
        return statistics.median(max(r.finish().values()) for r in self.passes)

    def speeds(self) -> dict[str, float]:
        """Rows per second of per-block work of each worker (over all passes)."""
        busy: dict[str, float] = {}
        for rec in self.passes:
            for w, iv in rec.blocks.items():
                busy[w] = busy.get(w, 0.0) + sum(b - a for a, b in iv)
        return {w: n / busy[w] for w, n in self.row_passes.items() if busy.get(w)}


class _CtrlCHeld:
    """Within ``with``, SIGINT is ignored here (in the main thread) while worker processes start, which
    inherit that and keep ignoring it (a Ctrl-C, which a terminal sends to every process of its group,
    made each print a KeyboardInterrupt traceback on its way down). One that comes meanwhile is held,
    not lost: a sentinel process started before (``sleep``, in the same group, SIGINT's default kept)
    dies of it, and :meth:`check` raises it once the cluster is there to stop. Elsewhere than in the
    main thread it does nothing."""

    def __init__(self) -> None:
        self.pressed = False
        self._previous: Any = None
        self._sentinel: subprocess.Popen | None = None

    def __enter__(self) -> _CtrlCHeld:
        if threading.current_thread() is threading.main_thread():
            # (before SIG_IGN, which it would inherit; 300 s: longer than workers take to start, and not left
            # behind for long where this process is killed meanwhile)
            self._sentinel = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL)
            self._previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        return self

    def __exit__(self, *exc: object) -> None:
        sentinel, self._sentinel = self._sentinel, None
        if sentinel is None:
            return
        # (a handler that Python did not set reads as None: SIG_DFL is what a Ctrl-C then does, as before)
        signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)
        self._previous = None
        if sentinel.poll() is None:
            sentinel.kill()
        self.pressed = self.pressed or sentinel.wait() == -signal.SIGINT

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` for a Ctrl-C held meanwhile."""
        if self.pressed:
            self.pressed = False
            raise KeyboardInterrupt


@contextlib.contextmanager
def local_cluster(gpu: bool, devs: str | None = None, n_workers: int = 2, protocol: str = "tcp") -> Iterator[Client]:
    """A client of a ``LocalCUDACluster`` on ``devs`` (all GPUs when None; a GPU named twice, as in
    ``"0,0"``, gets two workers that share it, each with the spec of that GPU's worker: the same device
    memory limit and CPU affinity) or of a ``LocalCluster`` of ``n_workers`` one-thread worker
    processes pinned to cores, over ``protocol`` (:func:`resolve_protocol`)."""
    gpus = (len(devs.split(",")) if devs else gpu_count()) if gpu else 0
    protocol = resolve_protocol(protocol, gpus)
    names = [d.strip() for d in devs.split(",")] if gpu and devs else []
    distinct = list(dict.fromkeys(names))
    held = _CtrlCHeld()
    with held:
        if gpu:
            try:
                from dask_cuda import LocalCUDACluster
            except ImportError as e:
                raise ImportError(f"GPU workers run in a dask-cuda LocalCUDACluster: pip install dask-cuda "
                                  f"({e})") from e

            cluster = LocalCUDACluster(CUDA_VISIBLE_DEVICES=",".join(distinct) or None, dashboard_address=":0",
                                       protocol=protocol)
        else:
            cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                                   dashboard_address=":0", protocol=protocol)
    with cluster, Client(cluster) as client:
        held.check()
        # LocalCUDACluster starts one worker per distinct device: a GPU named again gets a copy of its spec
        specs = {str(name): spec for name, spec in cluster.worker_spec.items()}
        for k, d in enumerate(d for i, d in enumerate(names) if d in names[:i]):
            cluster.worker_spec[f"{d}-shared-{k}"] = copy.deepcopy(specs[d])
        with held:
            cluster.scale(len(cluster.worker_spec))  # starts the added workers (a no-op otherwise)
            client.wait_for_workers(len(cluster.worker_spec), timeout=120)  # (a Ctrl-C is held meanwhile)
        held.check()
        if not gpu:
            pin_workers(client)
        yield client


def slowest_target(client: Client, gpu: bool) -> tuple[str, dict]:
    """The worker to slow down (first by name) and the ``CoTenant`` arguments that do it."""
    info = workers_info(client)
    worker = min(info, key=lambda w: str(info[w]["name"]))
    if gpu:
        return worker, {"gpus": [info[worker]["name"]]}
    core = client.run(lambda: min(__import__("os").sched_getaffinity(0)), workers=[worker])[worker]
    return worker, {"cores": [core]}


def _rows_per_worker(client: Client, x: da.Array) -> dict[str, int]:
    who = client.who_has(x)
    rows: dict[str, int] = {}
    for i, size in enumerate(x.chunks[0]):
        key = (x.name, i) + (0,) * (x.ndim - 1)
        for w in who[key][:1]:
            rows[w] = rows.get(w, 0) + size
    return rows


def parse_variant(variant: str) -> tuple[str, int, bool]:
    """``(kind, blocks per worker, grouped)`` of a variant name: ``defaults`` (the user's chunking),
    ``equal``, ``over-K``, ``balance``, ``balance-K``, and any of them with ``-streams`` (its blocks'
    work in stream groups; ``streams`` alone is ``defaults-streams``). A suffix ``@N`` names a replica
    of the same variant, run and reported apart: ``defaults`` against ``defaults@2`` is an A/A
    comparison, the noise floor of the others."""
    name, at, replica = variant.partition("@")
    if at and not replica.isdigit():
        raise ValueError(f"unknown variant {variant!r}: a replica is named variant@N, N a number")
    base, grouped = (name[: -len("-streams")], True) if name.endswith("-streams") else (name, False)
    if base == "streams":
        base, grouped = "defaults", True
    kind, _, k = base.partition("-")
    counted = k.isdigit() and int(k) >= 1  # (blocks per worker: over-0 divided by zero)
    valid = {"defaults": not k, "equal": not k, "over": counted, "balance": not k or counted}
    if not valid.get(kind, False):
        raise ValueError(f"unknown variant {variant!r}: expected defaults, equal, over-K, balance or balance-K "
                         f"(K >= 1), optionally with -streams")
    return kind, int(k or 1), grouped


def make_input(client: Client, variant: str, rows: int, cols: int, gpu: bool,
               chunk_rows: int | None = None) -> da.Array:
    """The persisted input of ``variant`` (see :func:`parse_variant`); ``defaults`` uses
    ``chunk_rows`` rows per block (one block per worker when None)."""
    n = len(workers_info(client))
    kind, per_worker, _ = parse_variant(variant)
    if kind == "balance":
        x = random_matrix(rows, cols, chunks=(-(-rows // n), cols), gpu=gpu)
        x = dask_octopus.balance(x, client=client, per_worker=per_worker)
    elif kind == "defaults" and chunk_rows:
        x = random_matrix(rows, cols, chunks=(chunk_rows, cols), gpu=gpu)
    else:
        x = random_matrix(rows, cols, chunks=(-(-rows // (n * per_worker)), cols), gpu=gpu)
    return persist_on_workers(client, x)


def run_variants(client: Client, variants: list[str], *, rows: int, cols: int, width: int, passes: int,
                 runs: int = 1, warmup: int = 1, gpu: bool = False, operation: str = "matmul_iterate",
                 chunk_rows: int | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Variant]:
    """Run each variant ``runs`` times, interleaved (:func:`~dask_octopus.bench.runner.interleave`),
    each run ``warmup`` untimed passes then ``passes`` timed ones; ``progress`` is told each variant
    run as it starts. Each run's last result is checked against the first variant's first
    (:attr:`Variant.same_values`): every variant computes on the same input values, cut its own way."""
    from dask_octopus.bench.operations import OPERATIONS

    op = OPERATIONS[operation]
    cols = rows if op.square else cols
    out = {v: Variant(v) for v in variants}

    def one_run(v: str, run: int) -> None:
        persist_seconds, x = timed(lambda: make_input(client, v, rows, cols, gpu, chunk_rows))
        out[v].persist_seconds.append(persist_seconds)
        out[v].rows, out[v].blocks = _rows_per_worker(client, x), len(x.chunks[0])
        records = op.passes(client, x, width, warmup + passes, gpu, parse_variant(v)[2])
        out[v].passes.extend(records[warmup:])
        for w, n in out[v].rows.items():  # each run plans anew: its rows count for its own passes
            out[v].row_passes[w] = out[v].row_passes.get(w, 0) + n * len(records[warmup:])
        out[v].weights.append(dask_octopus.speeds(client))
        if records and records[-1].value is not None:
            out[v].values.append(records[-1].value)

    interleave({v: partial(one_run, v) for v in variants}, runs, progress=progress)
    reference = out[variants[0]].values[:1]
    for v in out.values():
        if reference and v.values:
            v.same_values = all(same_checksums(value, reference[0]) for value in v.values)
    return out


def ideal_reference(results: dict[str, Variant]) -> str:
    """The variant whose measured speeds make the ideal (:func:`ideal_seconds`): the first pinned
    (``balance``) one, else the first variant (a task stolen from the worker holding its block then
    counts that block's rows to one worker and its time to another: the figure is blurred)."""
    return next((name for name in results if name.startswith("balance")), next(iter(results)))


def ideal_seconds(results: dict[str, Variant], rows: int) -> float:
    """Total rows over the sum of the workers' speeds measured in :func:`ideal_reference`'s variant."""
    return rows / sum(results[ideal_reference(results)].speeds().values())
