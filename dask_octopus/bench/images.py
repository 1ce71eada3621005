"""Ways to run image pipelines over a list of image specs on a cluster, timed side by side, and the
ideal time they are measured against.

``octopus`` (``dask_octopus.map`` by cost and speed, groups of 8, a future per image),
``octopus-gather`` (the same, results gathered per batch: ``gather=True``), ``octopus-gather-host`` (and
copied to host memory per batch: ``to_host=True``), ``one-task-each`` (``client.map``:
Dask defaults), ``equal-batches`` (equal item counts per worker, one task each) and ``loop`` (a
plain loop in one task on the worker fastest on the items). A run ends when every result is on the client, and every
variant must return the same histograms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from dask.utils import key_split
from distributed import Client, Future

import dask_octopus
from dask_octopus.bench.runner import interleave
from dask_octopus.bench.workloads import (
    PassRecord,
    image_pipeline,
    intervals,
    synchronize,
    timed_pass,
    to_host,
    watching_clock_shifts,
    workers_info,
)
from dask_octopus.placement.items import ITEM_PREFIX, run_batch

VARIANTS = ("octopus", "octopus-gather", "octopus-gather-host", "one-task-each", "equal-batches", "loop")


def run_variant(client: Client, variant: str, items: list, workers: list[str]) -> list[Future] | list:
    """Submit ``items`` the ``variant`` way; returns its futures (the gathering variants: the results).
    ``workers`` are sorted fastest last (the loop runs there: the strongest one-worker baseline)."""
    if variant.startswith("octopus"):
        return dask_octopus.map(image_pipeline, items, cost=[h * w for h, w, _ in items], group=8, client=client,
                                gather=variant != "octopus", to_host=variant == "octopus-gather-host")
    if variant == "one-task-each":
        return client.map(image_pipeline, items, pure=False)
    if variant == "equal-batches":
        n = len(workers)
        return [client.submit(_one_group, items[k::n], workers=[w], pure=False) for k, w in enumerate(workers)]
    if variant == "loop":
        return [client.submit(_one_group, items, workers=[workers[-1]], pure=False)]
    raise ValueError(f"unknown image variant {variant!r}: expected one of {', '.join(VARIANTS)}")


def _one_group(items: list) -> list:
    """The image pipelines of ``items`` in one task, as one stream group (``map``'s own executor: the
    equal batches and the loop baselines get its CUDA streams too)."""
    return run_batch(image_pipeline, items, {}, "auto", max(1, len(items)))


def in_input_order(results: list, variant: str, n_items: int, n_workers: int) -> list:
    """Per-image results in input order, whatever batching the variant used."""
    if variant == "loop":
        return results[0]
    if variant == "equal-batches":
        flat: list = [None] * n_items
        for k, batch in enumerate(results):
            flat[k::n_workers] = batch
        return flat
    return results


@dataclass
class VariantTimes:
    """Seconds of each run of one variant, when its last pipeline ended in each run (before its results
    were picked and sent to the client), and the per-worker busy intervals of its last run."""

    seconds: list[float] = field(default_factory=list)
    work_end: list[float] = field(default_factory=list)
    work_span: list[float] = field(default_factory=list)  # the longest first-start-to-last-end of one worker
    last: PassRecord | None = None
    same: bool = True  # every run gave the first variant's first histograms


def time_variants(client: Client, items: list, variants: list[str], runs: int, workers: list[str],
                  warmup: int = 1) -> dict[str, VariantTimes]:
    """Each variant's runs, interleaved (:func:`~dask_octopus.bench.runner.interleave`), from submission
    until every result is on the client, after ``warmup`` untimed rounds (kernel compilation); a variant
    whose histograms differ from the first run's is marked (``same``: the callers write what was measured,
    then fail). ``workers``: the cluster's workers, fastest last."""
    reference: list = []
    times = {v: VariantTimes() for v in variants}

    def one_run(v: str, run: int) -> None:
        with timed_pass(client) as timing:
            results = client.gather(run_variant(client, v, items, workers))
        if run >= warmup:
            seconds, shifts = timing.seconds, timing.shifts
            pipelines = [r for r in timing.stream if key_split(r["key"]) != ITEM_PREFIX]
            busy = timing.intervals()
            work = intervals(pipelines, timing.t0, shifts=shifts)
            times[v].seconds.append(seconds)
            times[v].work_end.append(max(b for iv in work.values() for _, b in iv))
            # a span is a difference of one worker's times, each with its own shift taken off, from the
            # clock's origin (from t0, a shift's error can put a short pass's tasks before it, where
            # intervals() clamps them to 0: a span of 0.0 under load)
            own = intervals(pipelines, 0.0, shifts=shifts)
            times[v].work_span.append(max(max(b for _, b in iv) - min(a for a, _ in iv) for iv in own.values()))
            times[v].last = PassRecord(seconds, busy, work)
        flat = [to_host(r) for r in in_input_order(results, v, len(items), len(workers))]
        if not reference:
            reference.extend(flat)
        elif not all(np.array_equal(a, b) for a, b in zip(reference, flat, strict=True)):
            times[v].same = False

    with watching_clock_shifts(client):
        interleave({v: partial(one_run, v) for v in variants}, runs, warmup=warmup)
    return times


def _alone(items: list) -> list[float]:
    """Seconds of each item's pipeline run alone on this worker (the device synchronised around it),
    after one warm-up run of each distinct size (kernel compilation, first allocations)."""
    for spec in {(h, w): (h, w, s) for h, w, s in items}.values():
        synchronize(image_pipeline(spec))
    out = []
    for spec in items:
        start = time.perf_counter()
        synchronize(image_pipeline(spec))
        out.append(time.perf_counter() - start)
    return out


def item_seconds(client: Client, items: list) -> dict[str, list[float]]:
    """Each worker's seconds for each item run alone there, measured on all workers at once."""
    workers = sorted(workers_info(client))
    futs = [client.submit(_alone, items, workers=[w], pure=False) for w in workers]
    return dict(zip(workers, client.gather(futs), strict=True))


def ideal(alone: dict[str, list[float]]) -> dict[str, Any]:
    """The ideal makespan: the items' total time alone, shared by the workers in proportion to their
    speed (1 / sum over workers of 1 / their total), and the floor an indivisible item sets (the
    largest item on the worker where it is fastest)."""
    totals = {w: sum(t) for w, t in alone.items()}
    shared = 1 / sum(1 / t for t in totals.values())
    largest = max(min(col) for col in zip(*alone.values(), strict=True))
    return {"ideal_seconds": shared, "largest_item_seconds": largest, "total_alone_seconds": totals,
            "formula": "1 / sum over workers of (1 / sum of the items' seconds alone on that worker)"}


def _nothing() -> None:
    return None


def round_trip(client: Client, workers: list[str], runs: int = 5) -> float:
    """Median seconds from submitting one empty task to each of ``workers`` until their results are on
    the client: what any variant run through Dask pays beyond its work."""
    seconds = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        client.gather([client.submit(_nothing, workers=[w], pure=False) for w in workers])
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds[1:]))


def measure_scenario(client: Client, items: list, variants: list[str], runs: int,
                     warmup: int = 1) -> tuple[dict[str, Any], dict[str, PassRecord]]:
    """Measure the ideal, then time ``variants`` on ``items`` (:func:`time_variants`; the loop runs on
    the worker fastest on these items alone) and Dask's :func:`round_trip`; returns the record
    (JSON-ready) and each variant's last run as busy intervals per worker (for a timeline)."""
    alone = item_seconds(client, items)
    workers = sorted(alone, key=lambda w: (-sum(alone[w]), w))
    times = time_variants(client, items, variants, runs, workers, warmup)
    record: dict[str, Any] = {
        "images": len(items), "seconds": {v: t.seconds for v, t in times.items()},
        "median_seconds": {v: float(np.median(t.seconds)) for v, t in times.items()},
        "work_end_seconds": {v: float(np.median(t.work_end)) for v, t in times.items()},
        "work_span_seconds": {v: float(np.median(t.work_span)) for v, t in times.items()},
        "loop_worker": workers[-1], "round_trip_seconds": round_trip(client, workers), **ideal(alone),
        "same_values_as_reference": {v: t.same for v, t in times.items()}}
    record["ratio_to_ideal"] = {v: m / record["ideal_seconds"] for v, m in record["median_seconds"].items()}
    return record, {v: t.last for v, t in times.items() if t.last is not None}
