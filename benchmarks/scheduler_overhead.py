"""Scheduler throughput with and without the dask_octopus plugin (CPU, in-process cluster).

Three clusters, measured interleaved in balanced orders (``bench.runner.run_orders``): Dask alone,
the plugin registered (no plan), and the plugin with a balance plan active for another collection
(so ``update_graph`` walks every new task). Each run
computes one graph of about ``--tasks`` tiny tasks; reports tasks per second and the ratio to Dask alone.

    python benchmarks/scheduler_overhead.py --tasks 100000 --runs 3 --out benchmarks/results/DIR
"""

from __future__ import annotations

import contextlib
import os
import statistics

import click
import dask.array as da
from distributed import Client, LocalCluster

import dask_octopus
from dask_octopus.bench.protocol import protocol_of
from dask_octopus.bench.record import header, write_json
from dask_octopus.bench.runner import interleave, timed
from dask_octopus.cli import console as make_console

VARIANTS = ("dask", "registered", "plan-active")


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
@click.option("--tasks", type=int, default=100_000, show_default=True)
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--out", default=None, help="folder for the JSON")
def main(tasks: int, runs: int, out: str | None) -> None:
    console = make_console()
    x = (da.ones(tasks // 2, chunks=1) + 1).sum(split_every=16)
    n_tasks = len(x.__dask_graph__())

    def one_run(client: Client) -> float:
        seconds, total = timed(lambda: client.compute(x).result())
        if total != tasks // 2 * 2:
            raise AssertionError(f"wrong sum {total}")
        return seconds

    with contextlib.ExitStack() as stack:
        clients = {v: _cluster(v, stack) for v in VARIANTS}
        protocol = protocol_of(clients["dask"])  # in-process clusters: inproc
        times = interleave({v: (lambda run, c=c: one_run(c)) for v, c in clients.items()}, runs)
    rate = {v: n_tasks / statistics.median(t) for v, t in times.items()}
    for v in VARIANTS:
        console.print(f"{v:>12}: {rate[v]:8.0f} tasks/s (median of {runs}), {rate[v] / rate['dask']:.3f} of Dask alone")
    if out:
        write_json(os.path.join(out, "scheduler-overhead.json"),
                   header(False, protocol, graph_tasks=n_tasks, seconds=times, tasks_per_second=rate))


if __name__ == "__main__":
    main()
