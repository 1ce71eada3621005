"""Scheduler throughput with and without the dask_octopus plugin (CPU, in-process cluster).

Three clusters, measured interleaved in balanced orders (``bench.runner.run_orders``): Dask alone,
the plugin registered (no plan), and the plugin with a balance plan active for another collection
(so ``update_graph`` walks every new task). Each run
computes one graph of ``--blocks`` tiny blocks mapped and summed; reports tasks per second and the ratio to
Dask alone. Tasks are counted where the scheduler ran them (tasks that reached memory), after Dask's
low-level fusion: the graph's own key count is about three times higher.

    python benchmarks/scheduler_overhead.py --blocks 50000 --runs 3 --out benchmarks/results/DIR
"""

from __future__ import annotations

import contextlib
import os
import statistics

import click
import dask.array as da
from distributed import Client, LocalCluster

import dask_octopus
from dask_octopus.bench.options import OutFolder
from dask_octopus.bench.protocol import protocol_of
from dask_octopus.bench.record import header, write_json
from dask_octopus.bench.runner import interleave, timed
from dask_octopus.cli import console as make_console

VARIANTS = ("dask", "registered", "plan-active")


def _tasks_run(dask_scheduler) -> int:
    return sum(prefix.state_counts["memory"] for prefix in dask_scheduler.task_prefixes.values())


def _cluster(variant: str, stack: contextlib.ExitStack) -> Client:
    cluster = stack.enter_context(LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                               dashboard_address=":0"))
    client = stack.enter_context(Client(cluster, set_as_default=False))
    if variant != "dask":
        dask_octopus.register(client, calibrate=False)
    if variant == "plan-active":
        dask_octopus.balance(da.ones((40, 2), chunks=10), client=client).sum().compute()
    return client


@click.command()
@click.option("--blocks", type=click.IntRange(min=1), default=50_000, show_default=True,
              help="tiny blocks per compute (each mapped, then summed 16 at a time)")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--out", type=OutFolder(), default=None, help="folder for the JSON")
def main(blocks: int, runs: int, out: str | None) -> None:
    console = make_console()
    x = (da.ones(blocks, chunks=1) + 1).sum(split_every=16)
    counts: dict[str, set[int]] = {v: set() for v in VARIANTS}

    def one_run(variant: str, client: Client) -> float:
        before = client.run_on_scheduler(_tasks_run)
        seconds, total = timed(lambda: client.compute(x).result())
        if total != blocks * 2:
            raise AssertionError(f"wrong sum {total}")
        counts[variant].add(client.run_on_scheduler(_tasks_run) - before)
        return seconds

    with contextlib.ExitStack() as stack:
        clients = {v: _cluster(v, stack) for v in VARIANTS}
        protocol = protocol_of(clients["dask"])  # in-process clusters: inproc
        times = interleave({v: (lambda run, v=v, c=c: one_run(v, c)) for v, c in clients.items()}, runs)
    if len(set().union(*counts.values())) != 1:
        raise AssertionError(f"the variants ran different numbers of tasks: {counts}")
    n_tasks = counts["dask"].pop()
    rate = {v: n_tasks / statistics.median(t) for v, t in times.items()}
    console.print(f"{n_tasks} tasks run per compute ({len(x.__dask_graph__())} graph keys before fusion)")
    for v in VARIANTS:
        console.print(f"{v:>12}: {rate[v]:8.0f} tasks/s (median of {runs}), {rate[v] / rate['dask']:.3f} of Dask alone")
    if out:
        write_json(os.path.join(out, "scheduler-overhead.json"),
                   header(False, protocol, blocks=blocks, tasks_run=n_tasks,
                          graph_keys=len(x.__dask_graph__()), seconds=times, tasks_per_second=rate))


if __name__ == "__main__":
    main()
