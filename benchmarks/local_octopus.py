"""Benchmark dask_octopus on a local cluster, in the shape of dask-cuda's ``local_cupy.py``.

Every variant runs in the same cluster, interleaved (A B A B) so drift hits all alike:
``equal`` (Dask defaults: one equal block per worker), ``over-4`` / ``over-16`` (equal blocks,
4 or 16 per worker, work stealing and queuing on), ``balance`` (dask_octopus). Prints a table,
writes JSON (config, hardware, versions, every pass) and PNGs (timelines of the median pass of each
variant, speedups). Asserts nothing about time.

    python benchmarks/local_octopus.py --type cpu --cotenant 0 --out benchmarks/results/cpu
    python benchmarks/local_octopus.py --type gpu --devs 0,1 --cotenant 0 --out benchmarks/results/gpu
"""

from __future__ import annotations

import json
import os
import sys

import click

import dask_octopus
from dask_octopus.cli import console as make_console
from dask_octopus.cotenant import CoTenant
from dask_octopus.demo import summary_table
from dask_octopus.environment import hardware, now, versions
from dask_octopus.experiment import Variant, ideal_seconds, local_cluster, run_variants
from dask_octopus.timeline import plot_timelines


def speedup_chart(results: dict[str, Variant], ideal: float, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    secs = [results[n].seconds() for n in names]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(names, secs, color=[f"C{i}" for i in range(len(names))])
    ax.axhline(ideal, color="k", ls="--", label=f"ideal {ideal:.3f} s")
    ax.set_ylabel("seconds per pass (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


@click.command()
@click.option("--operation", type=click.Choice(["matmul_iterate"]), default="matmul_iterate", show_default=True)
@click.option("--type", "kind", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True)
@click.option("--size", type=int, default=400_000, show_default=True, help="rows of the persisted array")
@click.option("--cols", type=int, default=256, show_default=True)
@click.option("--width", type=int, default=128, show_default=True, help="subspace width (work per row)")
@click.option("--passes", type=int, default=3, show_default=True, help="timed passes per run")
@click.option("--runs", type=int, default=2, show_default=True)
@click.option("--warmup-runs", type=int, default=1, show_default=True, help="untimed passes per run")
@click.option("--devs", default=None, help="GPUs for LocalCUDACluster (CUDA_VISIBLE_DEVICES form)")
@click.option("--n-workers", type=int, default=2, show_default=True, help="CPU workers")
@click.option("--cotenant", default="", help="GPUs (gpu) or CPU cores (cpu) that get a co-tenant, e.g. 0")
@click.option("--cotenant-procs", type=int, default=1, show_default=True, help="co-tenant processes per target")
@click.option("--variants", default="equal,over-4,over-16,balance,balance-4", show_default=True,
              help="equal, over-K (K equal blocks per worker), balance, balance-K (K pinned blocks per worker)")
@click.option("--out", default="benchmark-results", show_default=True, help="folder for JSON and PNGs")
@click.option("--tag", default="", help="name prefix of the output files")
def main(operation: str, kind: str, size: int, cols: int, width: int, passes: int, runs: int, warmup_runs: int,
         devs: str | None, n_workers: int, cotenant: str, cotenant_procs: int, variants: str, out: str,
         tag: str) -> None:
    """Run the variants and report."""
    console = make_console()
    gpu = kind == "gpu"
    os.makedirs(out, exist_ok=True)
    targets = [t for t in cotenant.split(",") if t]
    load = CoTenant(gpus=targets, procs=cotenant_procs) if gpu else CoTenant(cores=[int(t) for t in targets],
                                                                             procs=cotenant_procs)
    names = variants.split(",")
    with local_cluster(gpu, devs, n_workers) as client, load:
        dask_octopus.register(client)
        weights = dask_octopus.speeds(client)
        results = run_variants(client, names, rows=size, cols=cols, width=width, passes=passes, runs=runs,
                               warmup=warmup_runs, gpu=gpu)
        refined = dask_octopus.speeds(client)
        rates = client.sync(client.scheduler.octopus_rates)
    ideal = ideal_seconds(results, size)
    console.print(summary_table(results, ideal))
    stem = os.path.join(out, f"{tag or operation}-{kind}-{'cotenant' if targets else 'even'}")
    plot_timelines({v.name: v.median() for v in results.values()}, stem + "-timeline.png",
                   title=f"{operation}, {size}x{cols}, width {width}, co-tenant on {targets or 'none'}")
    speedup_chart(results, ideal, stem + "-speedup.png")
    record = {
        "date": now(),
        "command": " ".join(sys.argv),
        "config": dict(operation=operation, type=kind, size=size, cols=cols, width=width, passes=passes, runs=runs,
                       warmup_runs=warmup_runs, devs=devs, cotenant=targets, cotenant_procs=cotenant_procs),
        "hardware": hardware(gpu), "versions": versions(),
        "weights_calibrated": weights, "weights_after": refined, "observed_rates": rates,
        "ideal_seconds": ideal, "ideal_formula": "rows / sum over workers of (rows / seconds of per-block tasks) in the first pinned variant; excludes transfers and the cross-block reduction",
        "variants": {v.name: {"median_seconds": v.seconds(), "median_block_makespan": v.block_makespan(),
                              "blocks": v.blocks, "rows_per_worker": v.rows,
                              "persist_seconds": v.persist_seconds, "spread_of_median_pass": v.median().spread(),
                              "weights_after_each_run": v.weights,
                              "passes": [{"seconds": r.seconds, "finish": r.finish()} for r in v.passes]}
                     for v in results.values()},
    }
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1, default=str)
    console.print(f"wrote {stem}.json and PNGs")


if __name__ == "__main__":
    main()
