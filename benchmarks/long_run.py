"""Long runs: ``n`` balanced computes and ``n`` grouped ``dask_octopus.map`` calls in a row, with
memory sampled at 25/50/75/100 %: this process's RSS (client and, for the CPU cluster, scheduler and
workers), each worker's RSS and, on GPU workers, CuPy's pool (bytes in use and held), and the
plugin's own tables. Results are checked on every call.

    python benchmarks/long_run.py --type gpu --n 1000 --out DIR
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click
import dask.array as da
import psutil
from distributed import Client

import dask_octopus
from dask_octopus.bench.experiment import local_cluster
from dask_octopus.bench.options import OutFolder
from dask_octopus.bench.protocol import check_cluster, protocol_of, protocol_option
from dask_octopus.bench.record import header, write_json
from dask_octopus.bench.workloads import array_module
from dask_octopus.cli import console as make_console


def plugin_tables(dask_scheduler: Any) -> dict[str, int]:
    """Sizes of the octopus plugin's tables and of the scheduler's task table."""
    p = dask_scheduler.plugins["octopus"]
    return {"plans": len(p.placement.plans), "pins": len(p.placement.pins), "tasks": len(dask_scheduler.tasks),
            "rates": sum(len(per) for per in p.model.rates.values())}


def worker_memory() -> dict[str, float]:
    """This worker's RSS and, when it uses CuPy, its pool's bytes in use and held, and the device's
    memory in use by all processes (MiB)."""
    out = {"rss_mib": psutil.Process().memory_info().rss / 2**20}
    cp = sys.modules.get("cupy")
    if cp is not None:
        pool = cp.get_default_memory_pool()
        free, total = cp.cuda.runtime.memGetInfo()
        out.update(pool_used_mib=pool.used_bytes() / 2**20, pool_held_mib=pool.total_bytes() / 2**20,
                   device_used_mib=(total - free) / 2**20)
    return out


def loop(client: Client, n: int, gpu: bool) -> list[dict[str, Any]]:
    """Run the ``n`` iterations; return the memory samples."""
    xp = array_module(gpu)
    data = xp.arange(400.0).reshape(100, 4)
    x = da.from_array(data, chunks=(10, 4), asarray=False)
    samples = []
    marks = {n // 4, n // 2, 3 * n // 4, n - 1}
    for i in range(n):
        total = dask_octopus.balance(x + i, client=client).sum().compute()
        if float(total) != 79800.0 + 400 * i:
            raise AssertionError(f"iteration {i}: balanced sum {total}")
        got = client.gather(dask_octopus.map(xp.sum, [data[:2], data[2:5] + i], group=2, client=client))
        if [float(v) for v in got] != [float(data[:2].sum()), float((data[2:5] + i).sum())]:
            raise AssertionError(f"iteration {i}: map gave {got}")
        if i in marks:
            samples.append({"iteration": i + 1, "process_rss_mib": psutil.Process().memory_info().rss / 2**20,
                            "workers": client.run(worker_memory), "tables": client.run_on_scheduler(plugin_tables)})
    return samples


@click.command()
@click.option("--type", "kind", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True)
@click.option("--n", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--devs", default=None)
@click.option("--out", type=OutFolder(), default="benchmark-results", show_default=True)
@protocol_option
def main(kind: str, n: int, devs: str | None, out: str, protocol: str) -> None:
    """Run the long loop on a local cluster and write the samples."""
    check_cluster(kind, protocol)
    console = make_console()
    gpu = kind == "gpu"
    with local_cluster(gpu, devs, protocol=protocol) as client:
        used = protocol_of(client)
        dask_octopus.register(client, calibrate=False)
        samples = loop(client, n, gpu)
    for s in samples:
        console.print(f"after {s['iteration']:>5}: process {s['process_rss_mib']:.0f} MiB, tables {s['tables']}, "
                      + "; ".join(f"{w.rsplit(':', 1)[-1]}: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items())
                                  for w, m in sorted(s["workers"].items())))
    record = header(gpu, used, n=n, samples=samples)
    console.print(f"wrote {write_json(os.path.join(out, f'long-run-{kind}.json'), record)}")


if __name__ == "__main__":
    main()
