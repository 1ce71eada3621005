"""Image pipelines of very different sizes on a heterogeneous cluster: dask_octopus.map against Dask.

Each item is an image spec ``(height, width, seed)``; :func:`dask_octopus.bench.workloads.image_pipeline`
makes the image on the worker's device (as a loader would), then Gaussian blur, Sobel edges,
normalisation and a 64-bin histogram (CuPy on GPU workers, NumPy / SciPy on CPU workers). The size
mixes follow the octopus-parallel scenarios. Variants: ``octopus`` (dask_octopus.map, group=8, a future
per image), ``octopus-gather`` (results gathered per batch, ``gather=True``), ``octopus-gather-host`` (and
copied to host per batch, ``to_host=True``), ``one-task-each`` (client.map, Dask defaults),
``equal-batches`` (equal item counts per worker, one task each) and ``loop`` (a plain loop in one task on
the fastest worker), and the ideal: each image's time alone on each
worker, the total shared by the workers in proportion to their speed.

    python examples/images.py --type cpu --scale 0.05            # small, CPU (CI runs this)
    python examples/images.py --type gpu --cotenant 0 --repeat 8  # 2 GPUs, co-tenant on GPU 0
"""

from __future__ import annotations

from typing import Any

import click

import dask_octopus
from dask_octopus.bench.cotenant import CoTenant
from dask_octopus.bench.experiment import local_cluster
from dask_octopus.bench.images import VARIANTS, measure_scenario
from dask_octopus.bench.options import FiniteRange, Names
from dask_octopus.bench.protocol import check_cluster
from dask_octopus.bench.record import write_json
from dask_octopus.bench.workloads import SCENARIOS, specs
from dask_octopus.cli import console as make_console


@click.command()
@click.option("--type", "kind", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True)
@click.option("--scenarios", type=Names(SCENARIOS), default=",".join(SCENARIOS), show_default=True)
@click.option("--scale", type=FiniteRange(min=0, min_open=True), default=None,
              help="image side scale [default: 1.0 gpu, 0.05 cpu]")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="repeat each mix")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--devs", default=None)
@click.option("--cotenant", default="", help="GPUs (gpu) or CPU cores (cpu) that get a co-tenant")
@click.option("--variants", type=Names(VARIANTS), default=",".join(VARIANTS), show_default=True)
@click.option("--json-out", default=None, help="write every timing here")
def main(kind: str, scenarios: list[str], scale: float | None, repeat: int, runs: int, devs: str | None,
         cotenant: str, variants: list[str], json_out: str | None) -> None:
    """Time each variant on each size mix; check that all variants give the same histograms."""
    gpu = kind == "gpu"
    check_cluster(kind, "tcp")
    scale = scale if scale is not None else 1.0 if gpu else 0.05  # (4K frames in NumPy take minutes each mix)
    console = make_console()
    load = CoTenant.from_option(cotenant, gpu)
    targets = [target for _, target in load.targets]
    names = variants
    record: dict[str, Any] = {"config": dict(type=kind, scale=scale, repeat=repeat, runs=runs, cotenant=targets)}
    with local_cluster(gpu, devs) as client, load:
        dask_octopus.register(client)
        for scenario in scenarios:
            items = specs(scenario, scale, repeat)
            record[scenario], _ = measure_scenario(client, items, names, runs)
            med = record[scenario]["median_seconds"]
            line = ", ".join(f"{v} {med[v] * 1e3:.0f} ms" for v in names)
            lead = next((v for v in ("octopus-gather", "octopus") if v in names), names[0])
            speedups = ", ".join(f"x{med[v] / med[lead]:.2f} vs {v}" for v in names if not v.startswith("octopus"))
            console.print(f"{scenario:>14}: {len(items)} images; {line}; ideal "
                          f"{record[scenario]['ideal_seconds'] * 1e3:.0f} ms; {lead} {speedups}")
        record["weights"] = dask_octopus.speeds(client)
    if json_out:
        write_json(json_out, record)
    differ = [f"{variant} on {scenario}" for scenario in scenarios
              for variant, same in record[scenario]["same_values_as_reference"].items() if not same]
    if differ:  # (after the JSON: it holds what each variant measured)
        raise click.ClickException(f"histograms differ from the first variant's: {', '.join(differ)}")


if __name__ == "__main__":
    main()
