"""The dask_octopus benchmark suite, in the shape of dask-cuda's ``local_cupy.py``.

One invocation runs Dask's baselines and dask_octopus side by side in the same cluster, interleaved
in balanced orders (``bench.runner.run_orders``) so drift hits all alike: ``defaults`` (the user's
chunking, ``--chunk-size`` rows per block; one block per worker when not given), ``over-4`` /
``over-16`` (equal blocks, 4 or 16 per worker, work stealing and queuing on), and the octopus
variants chosen by ``--octopus``: ``balance`` (speed-weighted blocks, one and four per worker,
pinned), ``streams`` (the per-block work in stream groups), ``all`` (both, and both at once).
``images`` runs image pipelines of five size mixes: ``client.map`` one task each, equal batches, a
loop on one worker, ``dask_octopus.map``.

Prints a table per operation (median and spread of wall time, throughput, per-worker finish spread,
speedups, the ideal with its formula and the ratio to it), writes one JSON (config, hardware,
versions, every pass, each run's result checksum) and PNGs (per-worker timelines of each variant's
median pass, speedups). Every variant computes on the same input values (cut its own way): a
variant whose result differs from the first variant's (sum, sum of squares and a sum weighted by
position, relative 1e-4) fails the run after the JSON is written; the image mixes' histograms are
compared exactly.
``--compare OLD.json`` prints the change against an earlier result. Asserts nothing about time.

    python benchmarks/local_octopus.py --type cpu --operation dot,map_overlap --size 400000 --out DIR
    python benchmarks/local_octopus.py --type gpu --devs 0,1 --cotenant 0 --octopus all \\
        --operation matmul_iterate,dot,transpose_sum,map_overlap,images --out DIR
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from collections.abc import Iterator
from typing import Any

import click
from distributed import Client
from rich.progress import Progress
from rich.table import Table

import dask_octopus
from dask_octopus.bench.cotenant import CoTenant
from dask_octopus.bench.experiment import (
    Variant,
    ideal_reference,
    ideal_seconds,
    local_cluster,
    parse_variant,
    run_variants,
)
from dask_octopus.bench.images import measure_scenario
from dask_octopus.bench.operations import OPERATIONS, calibrated_ideal
from dask_octopus.bench.options import FiniteRange, Names, OutFolder
from dask_octopus.bench.protocol import check_cluster, protocol_of, protocol_option
from dask_octopus.bench.record import header, write_json
from dask_octopus.bench.timeline import bar_chart, plot_timelines
from dask_octopus.bench.workloads import SCENARIOS, specs
from dask_octopus.cli import console as make_console

BASELINES = ["defaults", "over-4", "over-16"]
OCTOPUS = {"off": [], "balance": ["balance", "balance-4"], "streams": ["streams"],
           "all": ["balance", "balance-4", "streams", "balance-4-streams"]}
UNITS = {"compute": ("GFLOP/s", 1e9), "memory": ("GB/s", 1e9)}


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def array_table(op: str, results: dict[str, Variant], ideal: float | None, measured: float | None,
                work: float) -> Table:
    unit, scale = UNITS[OPERATIONS[op].resource]
    table = Table(title=f"{op}: per pass (median); "
                        + (f"ideal {ideal:.4f} s ({OPERATIONS[op].formula} over the workers' calibrated speeds)"
                           if ideal else "no calibrated ideal (a worker has no calibration)")
                        + (f", measured ideal {measured:.4f} s (in {ideal_reference(results)})" if measured else ""))
    baselines = [b for b in BASELINES if b in results]
    for col in ["variant", "blocks", "s / pass", "spread", unit, "finish spread",
                *[f"vs {b}" for b in baselines], "x ideal", "x measured ideal"]:
        table.add_column(col, justify="right")
    for v in results.values():
        s = v.seconds()
        table.add_row(v.name, str(v.blocks), f"{s:.4f}", f"{spread([r.seconds for r in v.passes]):.0%}",
                      f"{work / s / scale:.1f}", f"{v.median().spread():.0%}",
                      *[f"{results[b].seconds() / s:.2f}x" for b in baselines], f"{s / ideal:.2f}" if ideal else "-",
                      f"{s / measured:.2f}" if measured else "-")
    return table


def run_array_op(client: Client, op: str, names: list[str], size: int, cols: int, width: int, chunk_size: int | None,
                 passes: int, runs: int, warmup: int, gpu: bool, stem: str, progress: Progress) -> dict[str, Any]:
    console = progress.console
    task = progress.add_task(op, total=runs * len(names))

    def tick(label: str) -> None:
        progress.update(task, advance=1, description=f"{op} {label}")

    results = run_variants(client, names, rows=size, cols=cols, width=width, passes=passes, runs=runs,
                           warmup=warmup, gpu=gpu, operation=op, chunk_rows=chunk_size, progress=tick)
    spec = OPERATIONS[op]
    ncols = size if spec.square else cols
    profiles = dask_octopus.profiles(client)
    ideal = calibrated_ideal(spec, size, cols, width, profiles)
    measured = ideal_seconds(results, size) if spec.per_block_tasks else None
    work = spec.work(size, ncols, width)
    console.print(array_table(op, results, ideal, measured, work))
    plot_timelines({v.name: v.median() for v in results.values()}, stem + "-timeline.png",
                   title=f"{op}, {size}x{ncols}" + (f", width {width}" if op == "matmul_iterate" else ""))
    bar_chart({n: v.seconds() for n, v in results.items()}, ideal, stem + "-speedup.png", "seconds per pass")
    return {
        "resource": spec.resource, "work_per_pass": work, "work_formula": spec.formula,
        "ideal_seconds": ideal, "ideal_formula": "work per pass / sum of the workers' calibrated speeds "
                                                 f"({spec.resource}: {UNITS[spec.resource][0]})",
        "measured_ideal_seconds": measured,
        "measured_ideal_variant": ideal_reference(results) if measured else None,
        "measured_ideal_formula": "rows / sum over workers of (rows / busy seconds of per-block tasks) in "
                                  "measured_ideal_variant: the first pinned variant, else the first variant (its "
                                  "stolen tasks blur the figure); operations that time their per-block tasks apart",
        "variants": {v.name: {"median_seconds": v.seconds(), "spread": spread([r.seconds for r in v.passes]),
                              "median_block_makespan": v.block_makespan(), "blocks": v.blocks,
                              "grouped": parse_variant(v.name)[2], "rows_per_worker": v.rows,
                              "persist_seconds": v.persist_seconds, "finish_spread_of_median_pass": v.median().spread(),
                              "weights_after_each_run": v.weights, "result_checksums": v.values,
                              "same_values_as_reference": v.same_values,
                              "passes": [{"seconds": r.seconds, "finish": r.finish()} for r in v.passes]}
                     for v in results.values()},
    }


def run_images(client: Client, names: list[str], scale: float, repeat: int, runs: int, warmup: int, stem: str,
               progress: Progress) -> dict[str, Any]:
    console = progress.console
    out: dict[str, Any] = {"scale": scale, "repeat": repeat, "scenarios": {}}
    task = progress.add_task("images", total=len(SCENARIOS))
    for scenario in SCENARIOS:
        progress.update(task, description=f"images {scenario}")
        record, last = measure_scenario(client, specs(scenario, scale, repeat), names, runs, warmup)
        out["scenarios"][scenario] = record
        plot_timelines(last, f"{stem}-{scenario}-timeline.png",
                       f"images, {scenario}: last run of each variant (ideal {record['ideal_seconds'] * 1e3:.1f} ms)")
        progress.advance(task)
    # the comparisons are made for map with its results gathered per batch when it ran, else for its futures
    lead = next((v for v in ("octopus-gather", "octopus") if v in names), None)
    others = [v for v in names if lead and not v.startswith("octopus")]
    table = Table(title="images: ms per mix (median), ideal = items' times alone shared by speed")
    for col in ["mix", "images", *names, "ideal", "largest item", "round trip", *[f"{lead} vs {v}" for v in others],
                *([f"{lead} / ideal"] if lead else [])]:
        table.add_column(col, justify="right")
    for scenario, r in out["scenarios"].items():
        med = r["median_seconds"]
        table.add_row(scenario, str(r["images"]), *[f"{med[v] * 1e3:.1f}" for v in names],
                      f"{r['ideal_seconds'] * 1e3:.1f}", f"{r['largest_item_seconds'] * 1e3:.1f}",
                      f"{r['round_trip_seconds'] * 1e3:.1f}",
                      *[f"{med[v] / med[lead]:.2f}x" for v in others],
                      *([f"{r['ratio_to_ideal'][lead]:.2f}"] if lead else []))
    console.print(table)
    ends = Table(title="images: ms until the last pipeline ended (median; before results are picked and gathered)")
    for col in ["mix", *names, "ideal"]:
        ends.add_column(col, justify="right")
    for scenario, r in out["scenarios"].items():
        ends.add_row(scenario, *[f"{r['work_end_seconds'][v] * 1e3:.1f}" for v in names],
                     f"{r['ideal_seconds'] * 1e3:.1f}")
    console.print(ends)
    totals = {v: sum(r["median_seconds"][v] for r in out["scenarios"].values()) for v in names}
    ideal_total = sum(r["ideal_seconds"] for r in out["scenarios"].values())
    bar_chart(totals, ideal_total, stem + "-speedup.png", "seconds, all five mixes (medians)")
    return out


def _earlier_record(path: str) -> dict[str, Any]:
    """The suite's record at ``path`` (``--compare``), read before the run: one that is not such a record is
    a usage error then, not a traceback after the run."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise click.BadParameter(f"cannot read {path!r} as JSON: {e}") from None
    if not isinstance(record, dict) or not isinstance(record.get("operations"), dict):
        raise click.BadParameter(f"{path!r} is not a record of this suite (no 'operations')")
    return record


def compare(console: Any, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Print the change of each median against an earlier record."""
    table = Table(title=f"change against {old.get('date', '?')} ({old.get('command', '')[:60]})")
    for col in ("operation", "variant", "old s", "new s", "change"):
        table.add_column(col, justify="right")
    for op, rec in new["operations"].items():
        before = old.get("operations", {}).get(op)
        if before is None:
            continue
        if op == "images":
            pairs = [(f"{s}/{v}", before["scenarios"][s]["median_seconds"].get(v), t)
                     for s, r in rec["scenarios"].items() if s in before["scenarios"]
                     for v, t in r["median_seconds"].items()]
        else:
            pairs = [(v, before["variants"].get(v, {}).get("median_seconds"), r["median_seconds"])
                     for v, r in rec["variants"].items()]
        for name, a, b in pairs:
            if a:
                table.add_row(op, name, f"{a:.4f}", f"{b:.4f}", f"{(b - a) / a:+.1%}")
    console.print(table)


def check_local_sizes(ops: list[str], names: list[str], gpu: bool, devs: str | None, n_workers: int, size: int,
                      square_size: int | None) -> None:
    """Before a local cluster starts: CPU workers are pinned one per core, and a variant that cuts the
    rows into K blocks per worker needs as many rows (raised late otherwise, after other variants ran)."""
    cores = len(os.sched_getaffinity(0))
    if not gpu and n_workers > cores:
        raise click.BadParameter(f"{n_workers} CPU workers are pinned one per core, and this process may use "
                                 f"{cores}", param_hint="--n-workers")
    workers = (len(devs.split(",")) if devs else None) if gpu else n_workers  # (all GPUs: counted at start)
    for op in (o for o in ops if o != "images" and workers):
        rows = (square_size or size) if OPERATIONS[op].square else size
        for name in names:
            kind, per_worker, _ = parse_variant(name)
            if kind != "defaults" and rows < workers * per_worker:
                option = "--square-size" if OPERATIONS[op].square and square_size else "--size"
                raise click.BadParameter(f"{op} has {rows} row{'s' * (rows != 1)}, fewer than the {workers} "
                                         f"workers x {per_worker} blocks of variant {name}", param_hint=option)


@contextlib.contextmanager
def connect(gpu: bool, devs: str | None, n_workers: int, protocol: str,
            scheduler_address: str | None) -> Iterator[Client]:
    if scheduler_address:
        try:
            client = Client(scheduler_address)
        except OSError as e:  # (distributed's timeout is an OSError)
            raise click.ClickException(f"no scheduler reachable at {scheduler_address}: {e}") from None
        with client:
            yield client
    else:
        with local_cluster(gpu, devs, n_workers, protocol) as client:
            yield client


@click.command()
@click.option("--operation", "ops", type=Names([*OPERATIONS, "images"]), default="matmul_iterate",
              show_default=True, help=f"comma-separated: {', '.join([*OPERATIONS, 'images'])}")
@click.option("--type", "kind", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True)
@click.option("--size", type=click.IntRange(min=1), default=400_000, show_default=True,
              help="rows of the array (square ones: side)")
@click.option("--cols", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--square-size", type=click.IntRange(min=1), default=None,
              help="side of the square operations' array (default: --size)")
@click.option("--width", type=click.IntRange(min=1), default=128, show_default=True,
              help="matmul_iterate: subspace width")
@click.option("--chunk-size", type=click.IntRange(min=1), default=None,
              help="rows per block of 'defaults' (default: one block per worker)")
@click.option("--passes", type=click.IntRange(min=1), default=3, show_default=True, help="timed passes per run")
@click.option("--runs", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--warmup-runs", type=click.IntRange(min=0), default=1, show_default=True,
              help="untimed passes per run (images: untimed rounds of every variant)")
@click.option("--devs", default=None, help="GPUs for LocalCUDACluster (CUDA_VISIBLE_DEVICES form)")
@click.option("--n-workers", type=click.IntRange(min=1), default=2, show_default=True, help="CPU workers")
@protocol_option
@click.option("--scheduler-address", default=None, help="run against an existing cluster instead")
@click.option("--octopus", "octopus", type=click.Choice(list(OCTOPUS)), default="balance", show_default=True)
@click.option("--variants", default=None, help="explicit variant list (overrides --octopus)")
@click.option("--cotenant", default="", help="GPUs (gpu) or CPU cores (cpu) that get a co-tenant, e.g. 0")
@click.option("--cotenant-procs", type=click.IntRange(min=1), default=1, show_default=True,
              help="co-tenant processes per target")
@click.option("--image-scale", type=FiniteRange(min=0, min_open=True), default=None,
              help="images: side scale (default 1 on GPU, 0.05 on CPU)")
@click.option("--image-repeat", type=click.IntRange(min=1), default=4, show_default=True,
              help="images: repeat each mix")
@click.option("--compare", "compare_to", default=None, type=click.Path(exists=True, dir_okay=False),
              callback=lambda ctx, param, value: value and _earlier_record(value),
              help="an earlier JSON of this suite: print the change")
@click.option("--out", type=OutFolder(), default="benchmark-results", show_default=True,
              help="folder for JSON and PNGs")
@click.option("--tag", default="suite", show_default=True, help="name prefix of the output files")
def main(ops: list[str], kind: str, size: int, cols: int, square_size: int | None, width: int,
         chunk_size: int | None, passes: int, runs: int, warmup_runs: int, devs: str | None, n_workers: int,
         protocol: str, scheduler_address: str | None, octopus: str, variants: str | None,
         cotenant: str, cotenant_procs: int, image_scale: float | None, image_repeat: int,
         compare_to: dict[str, Any] | None,
         out: str, tag: str) -> None:
    """Run the operations' variants and report."""
    check_cluster(kind, protocol)
    console = make_console()
    gpu = kind == "gpu"
    names = variants.split(",") if variants else BASELINES + OCTOPUS[octopus]
    for name in names:
        try:
            parse_variant(name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--variants") from None
    if not scheduler_address:
        check_local_sizes(ops, names, gpu, devs, n_workers, size, square_size)
    image_names = ["one-task-each", "equal-batches", "loop"] + (
        ["octopus", "octopus-gather", "octopus-gather-host"] if octopus != "off" else [])
    load = CoTenant.from_option(cotenant, gpu, cotenant_procs)
    targets = [target for _, target in load.targets]
    stem = os.path.join(out, f"{tag}-{kind}-{'cotenant' if targets else 'even'}")
    config = {"operations": ops, "type": kind, "size": size, "cols": cols, "square_size": square_size,
              "width": width, "chunk_size": chunk_size, "passes": passes, "runs": runs, "warmup_runs": warmup_runs,
              "devs": devs, "protocol": protocol, "scheduler_address": scheduler_address, "octopus": octopus,
              "variants": names, "cotenant": targets, "cotenant_procs": cotenant_procs}
    with connect(gpu, devs, n_workers, protocol, scheduler_address) as client, load, \
            Progress(console=console, transient=True) as progress:
        record = header(gpu, protocol_of(client), config=config, operations={})
        console.print(f"protocol: {record['protocol']}")
        dask_octopus.register(client)
        record["weights_calibrated"] = dask_octopus.speeds(client)
        record["profiles"] = dask_octopus.profiles(client)
        for op in ops:
            if op == "images":
                scale = image_scale or (1.0 if gpu else 0.05)
                record["operations"][op] = run_images(client, image_names, scale, image_repeat, runs,
                                                      warmup_runs, f"{stem}-{op}", progress)
            else:
                rows = (square_size or size) if OPERATIONS[op].square else size
                record["operations"][op] = run_array_op(client, op, names, rows, cols, width, chunk_size, passes,
                                                        runs, warmup_runs, gpu, f"{stem}-{op}", progress)
        record["weights_after"] = dask_octopus.speeds(client)
    console.print(f"wrote {write_json(stem + '.json', record)} and PNGs")
    if compare_to:
        compare(console, compare_to, record)
    differ = [f"{op}: {name}" for op, r in record["operations"].items()
              for name, v in (r.get("variants") or {}).items() if v.get("same_values_as_reference") is False]
    differ += [f"images {scenario}: {name}" for scenario, r in record["operations"].get("images", {}).get(
        "scenarios", {}).items() for name, same in r["same_values_as_reference"].items() if not same]
    if differ:  # (after the JSON: it holds each variant's checksums)
        raise click.ClickException(f"results differ from the first variant's: {', '.join(differ)}")


if __name__ == "__main__":
    main()
