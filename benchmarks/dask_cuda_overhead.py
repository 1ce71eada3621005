"""dask-cuda's own ``local_cupy.py`` against a ``LocalCUDACluster``, with the dask_octopus plugin registered and
without it, alternated (off on, on off, ...): the plugin must cost nothing measurable
when the user does not ask for balancing.

The cluster is a ``LocalCUDACluster`` started here, afresh every ``--rounds-per-cluster`` rounds
(each fresh one takes an untimed call first, and they take turns at starting with plugin off or on);
``local_cupy.py`` (from the installed dask-cuda) connects to it with ``--scheduler-address``. Where
RMM is not installed, CuPy's own memory pool is used and ``local_cupy.py`` is told so through its
external-cluster check (a no-op worker plugin whose name contains ``RMMSetup``).

    python benchmarks/dask_cuda_overhead.py --devs 0,1 --operations transpose_sum,dot --out DIR
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
from functools import partial

import click
import pandas as pd
from distributed import Client
from distributed.diagnostics.plugin import WorkerPlugin

import dask_octopus
from dask_octopus.bench.experiment import local_cluster
from dask_octopus.bench.options import OutFolder
from dask_octopus.bench.protocol import check_cluster, protocol_of, protocol_option
from dask_octopus.bench.record import header, write_json
from dask_octopus.bench.runner import interleave
from dask_octopus.cli import console as make_console


class NoRMM(WorkerPlugin):
    """Marks the workers as set up without RMM (it is not installed): CuPy's pool is used."""

    name = "RMMSetup-not-installed-cupy-pool"


def set_plugin(client: Client, on: bool) -> None:
    registered = "octopus" in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
    if on and not registered:
        dask_octopus.register(client)
    elif registered and not on:
        client.unregister_scheduler_plugin("octopus")
        client.unregister_worker_plugin("octopus-worker")


def run_local_cupy(address: str, protocol: str, operation: str, size: int, chunk_size: int, runs: int, folder: str,
                   label: str) -> list[float]:
    """Wall-clock seconds of each of ``local_cupy.py``'s runs against the cluster at ``address``, which
    talks over ``protocol``."""
    base = os.path.join(folder, label)
    cmd = [sys.executable, "-m", "dask_cuda.benchmarks.local_cupy", "--scheduler-address", address,
           "--protocol", protocol,
           "--operation", operation, "--size", str(size), "--chunk-size", str(chunk_size), "--runs", str(runs),
           "--disable-rmm", "--output-basename", base]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"local_cupy failed ({' '.join(cmd)}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return [float(t) for t in pd.read_json(base + ".json")["wallclock"]]


@click.command()
@click.option("--devs", default="0,1", show_default=True)
@click.option("--operations", default="transpose_sum,dot", show_default=True)
@click.option("--size", type=click.IntRange(min=1), default=20000, show_default=True)
@click.option("--chunk-size", type=click.IntRange(min=1), default=5000, show_default=True)
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True, help="local_cupy runs per call")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="off/on alternations")
@click.option("--rounds-per-cluster", type=click.IntRange(min=1), default=2, show_default=True,
              help="rounds on one cluster before a fresh one starts (many local_cupy calls on one shared GPU "
                   "run it out of memory)")
@click.option("--out", type=OutFolder(), default="benchmark-results", show_default=True)
@protocol_option
def main(devs: str, operations: str, size: int, chunk_size: int, runs: int, rounds: int, rounds_per_cluster: int,
         out: str, protocol: str) -> None:
    """Alternate plugin off and on around ``local_cupy.py`` and report the medians."""
    check_cluster("gpu", protocol, asked="GPU workers (dask-cuda) only")
    console = make_console()
    path = os.path.join(out, "dask-cuda-local-cupy-overhead.json")
    record: dict | None = None
    for op in operations.split(","):
        times: dict[str, list[float]] = {"off": [], "on": []}
        for first in range(0, rounds, rounds_per_cluster):
            with local_cluster(True, devs, protocol=protocol) as client, tempfile.TemporaryDirectory() as folder:
                used = protocol_of(client)
                if record is None:
                    record = header(True, used, rmm_installed=importlib.util.find_spec("rmm") is not None,
                                    config={"size": size, "chunk_size": chunk_size, "runs": runs, "rounds": rounds,
                                            "rounds_per_cluster": rounds_per_cluster, "devs": devs,
                                            "protocol": protocol}, operations={})
                if not record["rmm_installed"]:
                    client.register_plugin(NoRMM())
                address = client.scheduler_info()["address"]
                # a fresh cluster's first call is slower (connections, kernels): one untimed call first
                run_local_cupy(address, used, op, size, chunk_size, 1, folder, f"{op}-warmup-{first}")

                def one_round(state: str, r: int, op: str = op, client: Client = client, address: str = address,
                              folder: str = folder, used: str = used) -> list[float]:
                    set_plugin(client, state == "on")
                    got = run_local_cupy(address, used, op, size, chunk_size, runs, folder, f"{op}-{state}-{r}")
                    console.print(f"{op} round {r} plugin {state}: " + ", ".join(f"{t:.4f}" for t in got))
                    return got

                # the rounds continue from cluster to cluster: which state goes first keeps alternating
                done = interleave({s: partial(one_round, s) for s in ("off", "on")},
                                  min(rounds_per_cluster, rounds - first), start=first)
                for s, got in done.items():
                    times[s] += [t for g in got for t in g]
        med = {s: statistics.median(t) for s, t in times.items()}
        record["operations"][op] = {"seconds": times, "median_seconds": med, "on_over_off": med["on"] / med["off"]}
        write_json(path, record)  # what ran so far
        console.print(f"{op}: plugin off {med['off']:.4f} s, on {med['on']:.4f} s (median of {len(times['on'])}); "
                      f"on / off = {med['on'] / med['off']:.3f}")
    console.print(f"wrote {write_json(path, record)}")


if __name__ == "__main__":
    main()
