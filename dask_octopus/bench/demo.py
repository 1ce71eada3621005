"""``dask-octopus demo``: one worker made slower by a co-tenant, Dask defaults against ``balance``."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from rich.console import Console
from rich.table import Table

import dask_octopus
from dask_octopus.bench.cotenant import CoTenant
from dask_octopus.bench.experiment import (
    Variant,
    ideal_seconds,
    local_cluster,
    run_variants,
    slowest_target,
)
from dask_octopus.bench.timeline import plot_timelines


def summary_table(results: dict[str, Variant], ideal: float, reference: str = "equal") -> Table:
    """Time per pass, each worker's finish time, spread, speedup over ``reference``, and the ratios to
    the ideal of the whole pass and of the per-block phase (latest worker's last block)."""
    table = Table(title=f"per pass (median); ideal = total rows / sum of worker speeds = {ideal:.3f} s")
    for col in ("variant", "blocks", "s / pass", "worker finish (s)", "spread", f"speedup vs {reference}",
                "pass x ideal", "blocks x ideal"):
        table.add_column(col, justify="right")
    base = results[reference].seconds()
    for v in results.values():
        rec = v.median()
        finish = ", ".join(f"{t:.3f}" for _, t in sorted(rec.finish().items()))
        table.add_row(v.name, str(v.blocks), f"{v.seconds():.3f}", finish, f"{rec.spread():.0%}",
                      f"{base / v.seconds():.2f}x", f"{v.seconds() / ideal:.2f}", f"{v.block_makespan() / ideal:.2f}")
    return table


def run_demo(*, gpu: bool, rows: int, cols: int, width: int, passes: int, out: str, console: Console,
             cotenant: bool = True) -> dict[str, Any]:
    """Run the demo, print its tables on ``console`` and write its timeline PNG under ``out``;
    returns the figures."""
    os.makedirs(out, exist_ok=True)
    with local_cluster(gpu) as client:
        slow, load = slowest_target(client, gpu)
        console.print(f"cluster: {len(client.scheduler_info(n_workers=-1)['workers'])} "
                      f"{'GPU' if gpu else 'CPU'} workers; co-tenant on {slow}: {load if cotenant else 'none'}")
        with CoTenant(**load) if cotenant else contextlib.nullcontext():
            dask_octopus.register(client)
            weights = dask_octopus.speeds(client)
            console.print("calibrated weights: " + ", ".join(f"{w}: {v:.2f}" for w, v in sorted(weights.items())))
            results = run_variants(client, ["equal", "balance"], rows=rows, cols=cols, width=width,
                                   passes=passes, gpu=gpu)
    ideal = ideal_seconds(results, rows)
    console.print(summary_table(results, ideal))
    png = plot_timelines({v.name: v.median() for v in results.values()}, os.path.join(out, "demo-timeline.png"),
                         title=f"subspace iteration, {rows}x{cols} rows, one worker with a co-tenant")
    console.print(f"timeline written to {png}")
    return {"weights": weights, "ideal": ideal, "png": png,
            "seconds": {v.name: v.seconds() for v in results.values()}}

