"""Calibration figures of a local cluster with and without a co-tenant on its first worker.

    python benchmarks/calibration.py --type gpu --devs 0,1 --out benchmarks/results/gpu
"""

from __future__ import annotations

import os

import click

import dask_octopus
from dask_octopus.bench.cotenant import CoTenant
from dask_octopus.bench.experiment import local_cluster, slowest_target
from dask_octopus.bench.options import OutFolder
from dask_octopus.bench.protocol import check_cluster, protocol_of, protocol_option
from dask_octopus.bench.record import header, write_json
from dask_octopus.cli import console as make_console
from dask_octopus.cli import profile_table


@click.command()
@click.option("--type", "kind", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True)
@click.option("--devs", default=None, help="GPUs for LocalCUDACluster")
@click.option("--out", type=OutFolder(), default="benchmark-results", show_default=True)
@protocol_option
def main(kind: str, devs: str | None, out: str, protocol: str) -> None:
    check_cluster(kind, protocol)
    gpu = kind == "gpu"
    console = make_console()
    record: dict = {}
    for case in ("alone", "cotenant"):
        with local_cluster(gpu, devs, protocol=protocol) as client:
            record = record or header(gpu, protocol_of(client))
            slow, load = slowest_target(client, gpu)
            with CoTenant(**load) if case == "cotenant" else CoTenant():
                dask_octopus.register(client)
                profiles = dask_octopus.profiles(client)
                memory = dask_octopus.speeds(client, "memory")
            title = f"{case}: co-tenant {load if case == 'cotenant' else 'none'}"
            console.print(profile_table(profiles, memory, title))
            record[case] = {"cotenant_worker": slow if case == "cotenant" else None, "profiles": profiles,
                            "memory_weights": memory}
    console.print(f"wrote {write_json(os.path.join(out, f'calibration-{kind}.json'), record)}")


if __name__ == "__main__":
    main()
