"""Ways to run image pipelines over a list of image specs on a cluster, timed side by side.

``octopus`` (``dask_octopus.map`` by cost and speed, groups of 8), ``one-task-each`` (``client.map``:
Dask defaults), ``equal-batches`` (equal item counts per worker, one task each) and ``loop`` (a
plain loop in one task on one worker). Every variant must return the same histograms.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from distributed import Client, Future, wait

import dask_octopus
from dask_octopus.mapping import run_group
from dask_octopus.workloads import image_pipeline

VARIANTS = ("octopus", "one-task-each", "equal-batches", "loop")


def run_variant(client: Client, variant: str, items: list, workers: list[str]) -> list[Future]:
    """Submit ``items`` the ``variant`` way and wait for the results."""
    if variant == "octopus":
        futs = dask_octopus.map(image_pipeline, items, cost=[h * w for h, w, _ in items], group=8, client=client)
    elif variant == "one-task-each":
        futs = client.map(image_pipeline, items, pure=False)
    elif variant == "equal-batches":
        n = len(workers)
        futs = [client.submit(run_group, image_pipeline, items[k::n], {}, workers=[w], pure=False)
                for k, w in enumerate(workers)]
    elif variant == "loop":
        futs = [client.submit(run_group, image_pipeline, items, {}, workers=[workers[-1]], pure=False)]
    else:
        raise ValueError(f"unknown image variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    wait(futs)
    return futs


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


def time_variants(client: Client, items: list, variants: list[str], runs: int) -> dict[str, list[float]]:
    """Seconds of each variant per run, interleaved (A B A B); raises if two variants disagree."""
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    reference: Any = None
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(runs):
        for v in variants:
            t0 = time.perf_counter()
            futs = run_variant(client, v, items, workers)
            times[v].append(time.perf_counter() - t0)
            flat = in_input_order(client.gather(futs), v, len(items), len(workers))
            if reference is None:
                reference = flat
            elif not all(np.array_equal(a, b) for a, b in zip(reference, flat, strict=True)):
                raise AssertionError(f"{v} gave different histograms")
    return times
