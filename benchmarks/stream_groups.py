"""Benchmark fragments (``dask_octopus.annotate``) on one worker against strong baselines.

Operations (each variant interleaved with the others, run after run; medians reported):

- ``chain-sum``: 1024 blocks (256x384 float32 on GPU, 64x96 on CPU), an 8-kernel elementwise chain,
  then a sum: Dask, the whole compute annotated (first run; repeated: replayed as a CUDA graph on
  GPU), the README pattern (``annotate`` around ``map_blocks`` only), the plain loop in this process
  and, on GPU, the floor: that loop captured as one CUDA graph over 8 streams.
- ``tiny``: ``blocks`` tiny blocks mapped (``2 b + 1``) and summed: unannotated vs ``annotate(group=G)``;
  on GPU also the peak device memory of each (capture off: CuPy's pool after the run, and the bytes
  in use at once, counted).
- ``dataframe``: the same on a dask-expr dataframe of ``blocks`` partitions (pandas), computed inside
  ``annotate``: grouped by the scheduler plugin, since dataframes ignore layer annotations.
- ``frames``: 216 frames (256x256 to 4K) through blur, Sobel, normalise and histogram, the whole set
  ``sets`` times per run (the same shapes arriving again, like video): one Dask task per frame,
  annotated groups with CUDA graph replay off (``grouped-eager``) and on (``grouped``), the frames
  through ``dask_octopus.map(..., group=G or all of them, gather=True, to_host=True)`` (``map``: one
  batch per worker thread over CUDA streams, replayed; no task graph to build), the plain loop
  a user would write in one process, and the floor: the whole set captured as one CUDA graph in
  one process and replayed (kernel time alone, GPU only); on GPU also the peak device memory of one
  task per frame and of the fragments (one eager run, capture off: CuPy's pool after it, and the
  bytes in use at once, counted).
- ``large``: 8192x8192 blocks (GPU; 1024 on CPU), GEMM and elementwise, annotated vs not.
- ``mixed`` (GPU, no Dask): one group of GEMMs (512-1024) and elementwise passes (1-16 M elements)
  on one stream, round-robin over streams in submission order, and class-interleaved; beside them
  the serial sum of the members' kernel times and the overlap bound max(sum compute, sum memory).

    python benchmarks/stream_groups.py --type cpu --operations tiny --out benchmarks/results/cpu
    python benchmarks/stream_groups.py --type gpu --devs 0 --out benchmarks/results/gpu

Asserts nothing about time; checks that every variant returns the same values as the reference.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import click
import dask
import numpy as np
from distributed import Client, wait

import dask_octopus
from dask_octopus.bench.experiment import local_cluster
from dask_octopus.bench.options import FiniteRange, Names, OutFolder
from dask_octopus.bench.protocol import check_cluster, protocol_of, protocol_option
from dask_octopus.bench.record import header, write_json
from dask_octopus.bench.runner import interleave, settle, timed
from dask_octopus.bench.small_tasks import run_small_tasks
from dask_octopus.bench.workloads import (
    array_module,
    frame_pipeline,
    frame_specs,
    make_frame,
    random_matrix,
    scale_shift,
    square,
    stack_to_host,
    to_host,
)
from dask_octopus.cli import console as make_console
from dask_octopus.groups.replay import CaptureRefused, capture
from dask_octopus.groups.streams import EXTENSION


def measure(client: Client, variants: dict[str, Callable[[int], Any]], runs: int, warmup: int,
            around: dict[str, Callable[[], AbstractContextManager]] | None = None) -> dict[str, dict[str, Any]]:
    """Time the variants interleaved (:func:`~dask_octopus.bench.runner.interleave`), each from a settled
    cluster (:func:`~dask_octopus.bench.runner.settle`), inside its context of ``around`` (set up and
    torn down outside the timed call); per variant the kept seconds and the value of its last run."""

    def run_one(name: str, fn: Callable[[int], Any], run: int) -> tuple[float, Any]:
        with (around or {}).get(name, contextlib.nullcontext)():
            return timed(lambda: fn(run))

    res = interleave({name: functools.partial(run_one, name, fn) for name, fn in variants.items()},
                     runs, warmup=warmup, between=lambda: settle(client))
    return {name: {"seconds": [s for s, _ in r], "value": r[-1][1]} for name, r in res.items()}


def same(a: Any, b: Any) -> bool:
    return bool(np.array_equal(to_host(a), to_host(b)))


def summarise(results: dict[str, dict[str, Any]], reference: str) -> dict[str, Any]:
    ref = results[reference]
    base = statistics.median(ref["seconds"]) if ref["seconds"] else None
    table = {}
    for name, r in results.items():
        med = statistics.median(r["seconds"]) if r["seconds"] else None
        table[name] = {"median_seconds": med, "seconds": r["seconds"],
                       "spread": (max(r["seconds"]) - min(r["seconds"])) / med if med else None,
                       f"speedup_vs_{reference}": base / med if base and med else None,
                       "same_values_as_reference": same(r["value"], ref["value"]) if "value" in r else None}
    return table


CHAIN_SUM_BLOCKS = 1024  # the shape of work


def op_chain_sum(client: Client, gpu: bool, runs: int) -> dict[str, Any]:
    """1024 blocks (256x384 float32 on GPU, 64x96 on CPU) through the 8-kernel chain, then a sum: Dask,
    the whole compute annotated (first run, then repeated), the README pattern, a plain loop in this
    process and, on GPU, that loop captured as one CUDA graph (:mod:`dask_octopus.bench.small_tasks`)."""
    shape = (256, 384) if gpu else (64, 96)
    timings = run_small_tasks(client, gpu=gpu, blocks=CHAIN_SUM_BLOCKS, shape=shape, runs=runs, group=None)
    return {"config": {"blocks": CHAIN_SUM_BLOCKS, "block": list(shape)},
            "variants": {t.label: {"how": t.how, "seconds": t.seconds, "median": t.median(), "value": t.value,
                                   "same_values_as_reference": t.same} for t in timings},
            "worker_capture": worker_capture(client)}


def op_tiny(client: Client, gpu: bool, blocks: int, group: int, runs: int, warmup: int) -> dict[str, Any]:
    x = client.persist(random_matrix(blocks * 64, 8, (64, 8), gpu))
    wait(x)

    def plain(run: int) -> Any:
        return client.compute(x.map_blocks(scale_shift, name=f"tiny-plain-{run}").sum(axis=0)).result()

    def grouped(run: int) -> Any:
        with dask_octopus.annotate(resource="memory", group=group):
            y = x.map_blocks(scale_shift, name=f"tiny-grouped-{run}")
        return client.compute(y.sum(axis=0)).result()

    res = measure(client, {"unannotated": plain, "grouped": grouped}, runs, warmup)
    out = {"config": {"blocks": blocks, "block": [64, 8], "group": group}, "variants": summarise(res, "unannotated")}
    if gpu:
        out["device_peak_bytes"] = device_peaks(client, {"unannotated": plain, "grouped": grouped})
        out["block_bytes"] = 64 * 8 * x.dtype.itemsize
    return out


def op_dataframe(client: Client, blocks: int, group: int, runs: int, warmup: int) -> dict[str, Any]:
    import dask.dataframe as dd
    import pandas as pd

    frame = pd.DataFrame({"a": np.arange(blocks * 64, dtype=np.float64), "b": np.arange(blocks * 64) % 7})
    df = client.persist(dd.from_pandas(frame, npartitions=blocks))
    wait(df)

    def plain(run: int) -> Any:
        return client.compute(df.map_partitions(scale_shift, token=f"df-plain-{run}").a.sum()).result()

    def grouped(run: int) -> Any:
        with dask_octopus.annotate(resource="memory", group=group):
            return client.compute(df.map_partitions(scale_shift, token=f"df-grouped-{run}").a.sum()).result()

    res = measure(client, {"unannotated": plain, "grouped": grouped}, runs, warmup)
    return {"config": {"partitions": blocks, "rows_per_partition": 64, "group": group},
            "variants": summarise(res, "unannotated")}


def _set_capture(on: bool) -> None:
    dask.config.set({"octopus.streams.capture": on})


@contextlib.contextmanager
def _capture_off(client: Client) -> Iterator[None]:
    """The workers' CUDA graph capture off inside the block."""
    client.run(_set_capture, False)
    try:
        yield
    finally:
        client.run(_set_capture, True)


def _free_pool() -> None:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()


def _pool_bytes() -> int:
    import cupy

    return int(cupy.get_default_memory_pool().total_bytes())


def _count_from_here() -> int:
    """Start counting the bytes allocated through CuPy (the worker's ``CupyPeak``); the bytes in use now."""
    import cupy

    from dask_octopus.profiling.working_set import CupyPeak

    CupyPeak.shared().start()
    return int(cupy.get_default_memory_pool().used_bytes())


def _counted_peak() -> int:
    """The most bytes held at once through CuPy since :func:`_count_from_here`, above what was held then."""
    from dask_octopus.profiling.working_set import CupyPeak

    counter = CupyPeak._process
    extra = counter.extra()
    counter.close()
    return extra


def device_peaks(client: Client, variants: dict[str, Callable[[int], Any]]) -> dict[str, dict[str, int]]:
    """Each variant's peak device memory on the worker, run once eagerly (capture off), two ways:
    ``pool``, the CuPy default pool's held bytes after the run, its cached blocks freed before (the
    pool reuses freed blocks, so what it holds after a run is at least the most it had in use at once,
    persisted inputs included, plus blocks it could not reuse for a larger request); ``in_use``, the
    bytes in use before the run (the persisted inputs) plus the most bytes allocated through CuPy and
    held at once during it (counted as the working-set meters count them)."""
    with _capture_off(client):
        peaks: dict[str, dict[str, int]] = {"pool": {}, "in_use": {}}
        for name, fn in variants.items():
            client.run(_free_pool)
            (before,) = client.run(_count_from_here).values()
            fn(-1)
            (extra,) = client.run(_counted_peak).values()
            peaks["in_use"][name] = before + extra
            (peaks["pool"][name],) = client.run(_pool_bytes).values()
        return peaks


def op_frames(client: Client, gpu: bool, scale: float, group: int, sets: int, runs: int, warmup: int) -> dict[str, Any]:
    specs = frame_specs(scale)
    local = [make_frame(*spec, gpu=gpu) for spec in specs]
    shapes = [f.shape for f in local]
    frames = [client.submit(make_frame, *spec, gpu=gpu, pure=False) for spec in specs]
    wait(frames)
    xp = array_module(gpu)

    def through_dask(annotate: bool) -> Callable[[int], Any]:
        def run(run_no: int) -> Any:
            out = None
            for _ in range(sets):
                if annotate:
                    with dask_octopus.annotate(resource="memory", group=group):
                        hists = [dask.delayed(frame_pipeline, pure=False)(f) for f in frames]
                else:
                    hists = [dask.delayed(frame_pipeline, pure=False)(f) for f in frames]
                out = client.compute(dask.delayed(stack_to_host)(hists)).result()
            return out
        return run

    def loop(run_no: int) -> Any:
        out = None
        for _ in range(sets):
            hists = [frame_pipeline(f) for f in local]
            out = stack_to_host(hists)
        return out

    variants: dict[str, Callable[[int], Any]] = {"one-task-each": through_dask(False)}

    def mapped(run_no: int) -> Any:
        out = None
        for _ in range(sets):
            out = stack_to_host(dask_octopus.map(frame_pipeline, frames, client=client, group=group or len(frames),
                                                 resource="memory", gather=True, to_host=True))
        return out

    variants["grouped-eager"] = through_dask(True)  # capture off around it, outside its timing
    variants["grouped"] = through_dask(True)
    variants["map"] = mapped
    variants["loop"] = loop
    res = measure(client, variants, runs, warmup, around={"grouped-eager": lambda: _capture_off(client)})
    for r in res.values():  # per set
        r["seconds"] = [s / sets for s in r["seconds"]]
    out: dict[str, Any] = {"config": {"frames": len(local), "shapes": sorted(set(shapes)), "scale": scale,
                                      "group": group, "sets_per_run": sets},
                           "variants": summarise(res, "one-task-each")}
    out["worker_capture"] = worker_capture(client)
    if gpu:
        out["device_peak_bytes"] = device_peaks(client, {"one-task-each": through_dask(False),
                                                         "grouped": through_dask(True)})
        out["largest_frame_bytes"] = max(f.nbytes for f in local)
        out["floor"] = capture_floor(xp, local, runs)
        loop_s = out["variants"]["loop"]["median_seconds"]
        for v in out["variants"].values():
            v["speedup_vs_loop"] = loop_s / v["median_seconds"]
            if out["floor"].get("seconds"):
                v["ratio_to_floor"] = v["median_seconds"] / out["floor"]["seconds"]
    return out


def worker_capture(client: Client) -> dict[str, Any]:
    """Each worker's captured, refused and replayed groups, and why its latest capture was refused."""
    return client.run(lambda dask_worker: dask_worker.extensions[EXTENSION].stats())


def capture_floor(cp: Any, frames: list[Any], runs: int) -> dict[str, Any]:
    """Kernel time of the whole set: captured as one CUDA graph in this process (the frames on one
    stream, and forked over 8 streams as a group runs them) and replayed; the floor is the faster."""
    for f in frames:  # warm the kernels up (compilation, filter weights on the device)
        frame_pipeline(f)
    cp.cuda.Device().synchronize()
    out: dict[str, Any] = {"formula": "one CUDA graph of the whole set, replayed in one process (no copies, "
                                      "no Python); the faster of 1 and 8 streams"}
    for n in (1, 8):
        streams = [cp.cuda.Stream(non_blocking=True) for _ in range(n)]
        try:
            graph = capture(cp, [frame_pipeline] * len(frames), [[f] for f in frames], list(range(len(frames))),
                            streams)
        except CaptureRefused as e:
            out[f"streams_{n}"] = {"seconds": None, "note": f"capture refused: {e}"}
            continue
        seconds = []
        for _ in range(runs + 1):
            start = time.perf_counter()
            graph.graph.launch(streams[0])
            streams[0].synchronize()
            seconds.append(time.perf_counter() - start)
        out[f"streams_{n}"] = {"seconds": statistics.median(seconds[1:]), "all": seconds[1:]}
    measured = [v["seconds"] for k, v in out.items() if k.startswith("streams_") and v["seconds"]]
    out["seconds"] = min(measured) if measured else None
    return out


def op_large(client: Client, gpu: bool, side: int, runs: int, warmup: int) -> dict[str, Any]:
    x = client.persist(random_matrix(4 * side, side, (side, side), gpu))
    wait(x)
    variants = {}
    for label, fn, resource in (("gemm", square, "compute"), ("elementwise", scale_shift, "memory")):
        def plain(run: int, fn=fn, label=label) -> Any:
            return client.compute(x.map_blocks(fn, name=f"large-{label}-plain-{run}").sum(axis=0)).result()

        def grouped(run: int, fn=fn, label=label, resource=resource) -> Any:
            with dask_octopus.annotate(resource=resource, group=4):
                y = x.map_blocks(fn, name=f"large-{label}-grouped-{run}")
            return client.compute(y.sum(axis=0)).result()

        variants[label] = summarise(measure(client, {"unannotated": plain, "grouped": grouped}, runs, warmup),
                                    "unannotated")
    return {"config": {"blocks": 4, "side": side}, "variants": variants, "worker_capture": worker_capture(client)}


def op_mixed(runs: int) -> dict[str, Any]:
    """One group of GEMMs and elementwise passes, launched three ways (no Dask)."""
    import cupy as cp

    from dask_octopus.groups.planning import launch_order
    from dask_octopus.groups.streams import StreamRuntime, run_on_streams

    mats = [cp.random.default_rng(i).random((n, n), dtype=np.float32) for i, n in enumerate((512, 768, 1024) * 2)]
    vecs = [cp.random.default_rng(9 + i).random(n, dtype=np.float32) for i, n in enumerate((2**20, 2**22, 2**24) * 2)]
    members = [square] * len(mats) + [scale_shift] * len(vecs)
    inputs = [[m] for m in mats] + [[v] for v in vecs]
    classes = ["compute"] * len(mats) + ["memory"] * len(vecs)
    n = len(members)
    alone = []
    for fn, xs in zip(members, inputs):
        fn(*xs)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(5):
            fn(*xs)
        end.record()
        end.synchronize()
        alone.append(cp.cuda.get_elapsed_time(start, end) / 5e3)
    sizes = [float(sum(x.nbytes for x in xs)) for xs in inputs]
    ways = {"one-stream": (list(range(n)), 1), "round-robin": (list(range(n)), 8),
            "interleaved": (launch_order(classes, sizes), 8)}
    reps = 20  # one group takes about a millisecond: time 20 in a row
    rt = StreamRuntime()

    def launch(order: list[int], k: int) -> float:
        streams = rt.streams(cp, k)
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            run_on_streams(cp, rt, members, [None] * n, inputs, list(classes), order, streams, sizes)
        return (time.perf_counter() - start) / reps

    seconds = interleave({w: (lambda run, way=way: launch(*way)) for w, way in ways.items()}, runs, warmup=1)
    compute = sum(t for t, c in zip(alone, classes) if c == "compute")
    memory = sum(t for t, c in zip(alone, classes) if c == "memory")
    table = {w: {"median_seconds": statistics.median(v), "seconds": v} for w, v in seconds.items()}
    for v in table.values():
        v["gain_of_interleaved"] = v["median_seconds"] / table["interleaved"]["median_seconds"]
    return {"members": {"gemm_sides": [m.shape[0] for m in mats], "elementwise_sizes": [v.size for v in vecs]},
            "variants": table, "kernel_seconds_serial": compute + memory,
            "overlap_bound_seconds": max(compute, memory),
            "formula": "each member timed alone with CUDA events (mean of 5); bound = max(sum compute, sum memory)"}


@click.command()
@click.option("--type", "kind", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True)
@click.option("--operations", type=Names(["chain-sum", "tiny", "dataframe", "frames", "large", "mixed"]), default=None,
              help="comma-separated [default: chain-sum,tiny,dataframe,frames,large, and mixed with --type gpu]")
@click.option("--devs", default="0", show_default=True, help="the GPU of the one worker (CUDA_VISIBLE_DEVICES)")
@click.option("--group", type=click.IntRange(min=1), default=None,
              help="tiny, dataframe, frames: most blocks per fragment [default: one fragment per worker thread; "
                   "chain-sum always so, large 4]")
@click.option("--blocks", type=click.IntRange(min=1), default=512, show_default=True,
              help="tiny, dataframe: number of blocks")
@click.option("--scale", type=FiniteRange(min=0, min_open=True), default=None,
              help="frames: side scale [default: 1 with --type gpu, 0.1 with --type cpu]")
@click.option("--sets", type=click.IntRange(min=1), default=10, show_default=True, help="frames: sets per run")
@click.option("--side", type=click.IntRange(min=1), default=None,
              help="large: block side [default: 8192 with --type gpu, 1024 with --type cpu]")
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--warmup-runs", type=click.IntRange(min=0), default=1, show_default=True,
              help="untimed runs of each variant first (chain-sum: its own warm-ups, always)")
@click.option("--out", type=OutFolder(), default="benchmark-results", show_default=True)
@click.option("--tag", default="stream-groups", show_default=True)
@protocol_option
def main(kind: str, operations: list[str] | None, devs: str, group: int, blocks: int, scale: float | None, sets: int,
         side: int | None, runs: int, warmup_runs: int, out: str, tag: str, protocol: str) -> None:
    """Run the operations and write one JSON file."""
    check_cluster(kind, protocol)
    console = make_console()
    gpu = kind == "gpu"
    scale = scale if scale is not None else 1.0 if gpu else 0.1
    side = side if side is not None else 8192 if gpu else 1024
    ops = operations or ["chain-sum", "tiny", "dataframe", "frames", "large"] + (["mixed"] if gpu else [])
    if "mixed" in ops and not gpu:
        raise click.BadParameter("mixed needs --type gpu (it measures CUDA streams)", param_hint="--operations")
    with local_cluster(gpu, devs if gpu else None, n_workers=1, protocol=protocol) as client:
        record = header(gpu, protocol_of(client), operations={})
        dask_octopus.register(client)
        for op in ops:
            console.print(f"[bold]{op}[/bold]")
            if op == "chain-sum":
                r = op_chain_sum(client, gpu, runs)
            elif op == "tiny":
                r = op_tiny(client, gpu, blocks, group, runs, warmup_runs)
            elif op == "dataframe":
                r = op_dataframe(client, blocks, group, runs, warmup_runs)
            elif op == "frames":
                r = op_frames(client, gpu, scale, group, sets, runs, warmup_runs)
            elif op == "large":
                r = op_large(client, gpu, side, runs, warmup_runs)
            else:
                r = op_mixed(runs)
            record["operations"][op] = r
            console.print_json(json.dumps(r.get("variants"), default=str))
    console.print(f"wrote {write_json(os.path.join(out, f'{tag}-{kind}.json'), record)}")
    differ = [f"{op}: {name}" for op, r in record["operations"].items() for variants in _tables(r)
              for name, v in variants.items() if v.get("same_values_as_reference") is False]
    if differ:  # (written first: the JSON shows what each returned)
        raise click.ClickException(f"results differ from the reference: {', '.join(differ)}")


def _tables(result: dict[str, Any]) -> list[dict[str, dict[str, Any]]]:
    """The variant tables of one operation's result (``large`` has one per kind of kernel)."""
    variants = result.get("variants") or {}
    nested = all(isinstance(v, dict) and "median_seconds" not in v and "median" not in v for v in variants.values())
    return list(variants.values()) if variants and nested else [variants]


if __name__ == "__main__":
    main()
