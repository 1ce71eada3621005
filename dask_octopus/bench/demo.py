"""``dask-octopus demo``: both halves of the product on the machine at hand.

1. **Balance** (needs two workers): two workers, one slowed down by a real co-tenant; Dask's equal
   blocks against ``balance``, with the ideal beside them. On two GPUs or more a
   ``LocalCUDACluster``; otherwise a 2-worker CPU ``LocalCluster`` (the co-tenant on one core).
2. **Small tasks** (one worker): many small blocks through an elementwise chain and a sum, in Dask,
   in fragments (``annotate``: first run, then repeated, replayed as CUDA graphs on a GPU), and
   as a plain loop in this process, with the floor beside them on a GPU.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

from dask.utils import format_bytes
from rich.console import Console
from rich.table import Table

import dask_octopus
from dask_octopus.bench.cotenant import CoTenant
from dask_octopus.bench.experiment import Variant, ideal_seconds, local_cluster, run_variants, slowest_target
from dask_octopus.bench.protocol import resolve_protocol
from dask_octopus.bench.record import hardware
from dask_octopus.bench.small_tasks import Timing, differing, run_small_tasks
from dask_octopus.bench.timeline import bar_chart, plot_timelines
from dask_octopus.bench.workloads import workers_info

PARTS = ("all", "balance", "tasks")


@dataclass(frozen=True)
class Placement:
    """Where each part of the demo runs: ``"gpu"``, ``"cpu"`` or ``None`` (not run), why, and the
    protocol of its clusters."""

    balance: str | None
    tasks: str | None
    note: str = ""
    protocol: str = "tcp"


def place_parts(kind: str, gpus: int, part: str = "all", protocol: str = "auto") -> Placement:
    """Where the parts run for ``--type kind`` on a machine with ``gpus`` GPUs, and over which protocol
    (:func:`~dask_octopus.bench.protocol.resolve_protocol` for the balance part's cluster when it runs,
    else for the small tasks' one). Balance needs two workers: with one GPU it runs on CPU workers
    (``auto``) or not at all (``gpu``, which says why). Raises ``ValueError`` where the machine cannot
    run what was asked (``--protocol ucx`` is for GPU workers only; ``--type gpu --part balance`` needs
    two GPUs)."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r}: expected one of {', '.join(PARTS)}")
    if kind == "gpu" and gpus == 0:
        raise ValueError("--type gpu: CuPy sees no GPU on this machine")
    note = ""
    if kind == "cpu" or gpus == 0:
        balance, tasks = "cpu", "cpu"
    elif gpus >= 2:
        balance, tasks = "gpu", "gpu"
    elif kind == "gpu":
        balance, tasks = None, "gpu"
        note = ("balance needs two workers or more and this machine has one GPU (one dask-cuda worker), so it "
                "is not run; --type auto shows it on two CPU workers")
    else:
        balance, tasks = "cpu", "gpu"
        note = "one GPU: balance needs two workers, so it runs on a 2-worker CPU cluster here"
    balance, tasks = balance if part in ("all", "balance") else None, tasks if part in ("all", "tasks") else None
    if balance is None and tasks is None:  # --type gpu --part balance on one GPU: nothing to run
        raise ValueError(note)
    # the protocol of the balance part's cluster (all GPUs or CPU workers), else of the one-worker part's
    try:
        used = resolve_protocol(protocol, (gpus if balance == "gpu" else 0) if balance else int(tasks == "gpu"))
    except ValueError as e:
        if balance == "cpu" and tasks == "gpu":  # one GPU: the balance part runs on CPU workers
            raise ValueError(f"{e}; on this machine the balance part runs on CPU workers: "
                             "run --part tasks over ucx, or the demo over tcp") from e
        raise
    return Placement(balance, tasks, note if part in ("all", "balance") else "", used)


def describe_machine(gpu: bool, protocol: str) -> str:
    """One line: CPU cores, GPUs with names and memory, protocol."""
    hw = hardware(gpu)
    gpus = hw.get("gpus", [])
    names = ", ".join(f"{g['name']} ({format_bytes(g['memory'])})" for g in gpus)
    listed = f"{len(gpus)}: {names}" if gpus else "none"
    return f"machine: {hw['cores']} CPU cores ({hw['cpu']}); GPUs: {listed}; protocol: {protocol}"


def balance_table(results: dict[str, Variant], ideal: float, runs: int = 1, reference: str = "equal") -> Table:
    """Time per pass, each worker's finish time and their spread in the median pass (with that pass's
    time), speedup over ``reference``, and the ratios to the ideal of the whole pass and of the
    per-block phase (latest worker's last block), over the passes of ``runs`` runs of each variant."""
    over = f"median of {runs} runs' passes" if runs > 1 else "median"
    table = Table(title=f"Balance: per pass ({over}); ideal = total rows / sum of worker speeds = {ideal:.3f} s")
    for col in ("variant", "blocks", "s / pass", "median pass: worker finish / pass (s)", "finish spread",
                f"speedup vs {reference}", "pass x ideal", "blocks x ideal"):
        table.add_column(col, justify="right")
    base = results[reference].seconds()
    for v in results.values():
        rec = v.median()
        # (the finishes of one pass, beside its own time: of an even number of passes, the median
        # "s / pass" is the mean of the middle two, and this pass the slower of them)
        finish = ", ".join(f"{t:.3f}" for _, t in sorted(rec.finish().items())) + f" / {rec.seconds:.3f}"
        table.add_row(v.name, str(v.blocks), f"{v.seconds():.3f}", finish, f"{rec.spread():.0%}",
                      f"{base / v.seconds():.2f}x", f"{v.seconds() / ideal:.2f}", f"{v.block_makespan() / ideal:.2f}")
    return table


def tasks_table(timings: list[Timing], title: str) -> Table:
    """Each way's median seconds, against Dask and against the plain loop."""
    table = Table(title=title)
    for col in ("variant", "what runs", "s (median)", "speedup vs Dask", "x loop"):
        table.add_column(col, justify="right")
    dask_s = timings[0].median()
    loop_s = next(t.median() for t in timings if t.label.startswith("plain loop"))
    for t in timings:
        table.add_row(t.label, t.how, f"{t.median():.4f}", f"{dask_s / t.median():.2f}x", f"{t.median() / loop_s:.2f}")
    return table


def run_balance(*, gpu: bool, rows: int, cols: int, width: int, passes: int, out: str, console: Console,
                cotenant: bool = True, protocol: str = "tcp", runs: int = 2) -> dict[str, Any]:
    """The balance part over ``protocol``, ``runs`` runs of each variant in alternating orders (equal
    blocks first, then ``balance`` first, ...: :func:`~dask_octopus.bench.runner.interleave`): print
    its table and write its timeline PNG under ``out``; returns the figures."""
    with local_cluster(gpu, protocol=protocol) as client:
        slow, load = slowest_target(client, gpu)
        where = f"co-tenant on {slow}: {load}" if cotenant else "no co-tenant"
        console.print(f"cluster: {len(workers_info(client))} {'GPU' if gpu else 'CPU'} workers; {where}")
        with CoTenant(**load) if cotenant else contextlib.nullcontext():
            dask_octopus.register(client)
            weights = dask_octopus.speeds(client)
            console.print("calibrated weights: " + ", ".join(f"{w}: {v:.2f}" for w, v in sorted(weights.items())))
            results = run_variants(client, ["equal", "balance"], rows=rows, cols=cols, width=width,
                                   passes=passes, runs=runs, gpu=gpu)
    if results["balance"].same_values is False:
        raise RuntimeError(f"balance's result differs from equal blocks': checksums {results['balance'].values} "
                           f"against {results['equal'].values}")
    ideal = ideal_seconds(results, rows)
    console.print(balance_table(results, ideal, runs))
    png = plot_timelines({v.name: v.median() for v in results.values()}, os.path.join(out, "demo-timeline.png"),
                         title=f"subspace iteration, {rows}x{cols} rows"
                               + (", one worker with a co-tenant" if cotenant else ", no co-tenant"))
    console.print(f"timeline written to {png}")
    return {"weights": weights, "ideal": ideal, "png": png,
            "seconds": {v.name: v.seconds() for v in results.values()}}


def run_tasks(*, gpu: bool, blocks: int | None, runs: int, group: int | None, out: str, console: Console,
              protocol: str = "tcp") -> dict[str, Any]:
    """The small-tasks part on a one-worker cluster over ``protocol``: print its table and write its bar
    chart PNG. ``blocks`` defaults to 1024 on a GPU, 512 on CPU (Dask's cost per task is the same; the
    demo stays short)."""
    shape = (256, 384) if gpu else (64, 96)
    blocks = blocks or (1024 if gpu else 512)
    device = "GPU" if gpu else "CPU"
    with local_cluster(gpu, "0" if gpu else None, n_workers=1, protocol=protocol) as client:
        dask_octopus.register(client)
        console.print(f"cluster: one {device} worker; {blocks} blocks of {shape[0]}x{shape[1]} "
                      f"float32 ({'CuPy' if gpu else 'NumPy'}), an 8-kernel elementwise chain, then a sum")
        timings = run_small_tasks(client, gpu=gpu, blocks=blocks, shape=shape, runs=runs, group=group)
    console.print(tasks_table(timings, f"Small tasks: {blocks} blocks, one worker (median of {runs} runs; "
                                       "each first run on a cluster that forgot its plans and fragments)"))
    png = bar_chart({t.label: t.median() for t in timings}, None, os.path.join(out, "demo-tasks.png"),
                    "seconds (log scale)", log=True,
                    title=f"{blocks} blocks of {shape[0]}x{shape[1]}, chain and sum, one {device} worker")
    console.print(f"chart written to {png}")
    wrong = differing(timings)
    if wrong:  # (after the table and the chart, which show what each way took)
        raise RuntimeError(f"the small tasks' results differ: {wrong}")
    return {"seconds": {t.label: t.seconds for t in timings}, "png": png}


def balance_worker_count(where: Placement, gpus: int) -> int:
    """The workers of the balance part: one per GPU (``LocalCUDACluster``), else two CPU workers."""
    return gpus if where.balance == "gpu" else 2


def run_demo(where: Placement, *, gpus: int, rows: int | None, cols: int | None, width: int | None,
             passes: int, blocks: int | None, runs: int, group: int | None, out: str, console: Console,
             cotenant: bool = True, balance_runs: int = 2) -> dict[str, Any]:
    """Run the parts of the demo placed by :func:`place_parts` on a machine with ``gpus`` GPUs, each
    with its table and PNG under ``out``; returns their figures."""
    os.makedirs(out, exist_ok=True)
    console.print(describe_machine(gpus > 0, where.protocol))
    balance_workers = balance_worker_count(where, gpus)
    console.print("parts: balance " + (f"on {balance_workers} {where.balance.upper()} workers" if where.balance
                                       else "not run")
                  + "; small tasks " + (f"on 1 {where.tasks.upper()} worker" if where.tasks else "not run"))
    if where.note:
        console.print(where.note)
    figures: dict[str, Any] = {"placement": where}
    if where.balance:
        gpu = where.balance == "gpu"
        console.rule(f"Balance: {balance_workers} workers" + (", one slowed by a co-tenant" if cotenant else ""))
        figures["balance"] = run_balance(gpu=gpu, rows=rows or (1_000_000 if gpu else 400_000),
                                         cols=cols or (2048 if gpu else 256), width=width or (2048 if gpu else 128),
                                         passes=passes, out=out, console=console, cotenant=cotenant,
                                         protocol=where.protocol, runs=balance_runs)
    if where.tasks:
        console.rule("Small tasks: Dask's per-task cost against fragments")
        figures["tasks"] = run_tasks(gpu=where.tasks == "gpu", blocks=blocks, runs=runs, group=group, out=out,
                                     console=console, protocol=where.protocol)
    return figures
