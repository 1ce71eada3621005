"""Image pipelines of very different sizes on a heterogeneous cluster: dask_octopus.map against Dask.

Each item is an image spec ``(height, width, seed)``; the pipeline makes the image on the worker's
device (as a loader would), then Gaussian blur, Sobel edges, normalisation and a 64-bin histogram
(CuPy / cupyx.scipy.ndimage on GPU workers, NumPy / SciPy on CPU workers). The size mixes follow the
octopus-parallel scenarios. Variants: ``octopus`` (dask_octopus.map, group=8), ``one-task-each``
(client.map, Dask defaults), ``equal-batches`` (equal item counts per worker, one task each) and
``loop`` (a plain loop in one task on one worker).

    python examples/images.py --type cpu --scale 0.05            # small, CPU (CI runs this)
    python examples/images.py --type gpu --cotenant 0 --repeat 8  # 2 GPUs, co-tenant on GPU 0
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import click
import numpy as np
from distributed import Client, wait

import dask_octopus
from dask_octopus.cli import console as make_console
from dask_octopus.cotenant import CoTenant
from dask_octopus.experiment import local_cluster
from dask_octopus.mapping import run_group

SCENARIOS: dict[str, list[tuple[int, int, int]]] = {  # (count, height, width)
    "web": [(1, 256, 256), (1, 1080, 1920), (1, 512, 512), (1, 2160, 4096)],
    "thumbnails-8k": [(3, 64, 64), (1, 4320, 7680)],
    "medical": [(5, 512, 512), (1, 4096, 4096)],
    "satellite": [(7, 256, 256), (1, 10000, 10000)],
    "video": [(29, 360, 640), (1, 2160, 3840)],
}


def specs(scenario: str, scale: float, repeat: int) -> list[tuple[int, int, int]]:
    """Image specs ``(height, width, seed)`` of a scenario, sizes scaled, the mix repeated."""
    sizes = [(max(8, int(h * scale)), max(8, int(w * scale)))
             for _ in range(repeat) for count, h, w in SCENARIOS[scenario] for _ in range(count)]
    return [(h, w, seed) for seed, (h, w) in enumerate(sizes)]


def pipeline(spec: tuple[int, int, int]) -> np.ndarray:
    """Blur, edges, normalise and histogram one generated image; returns 64 counts on the host."""
    h, w, seed = spec
    try:
        import cupy as xp
        from cupyx.scipy import ndimage

        xp.cuda.runtime.getDeviceCount()
    except Exception:
        import scipy.ndimage as ndimage

        xp = np
    img = xp.random.default_rng(seed).random((h, w), dtype=np.float32)
    g = ndimage.gaussian_filter(img, 2.0)
    mag = xp.hypot(ndimage.sobel(g, 0), ndimage.sobel(g, 1))
    lo, hi = mag.min(), mag.max()
    hist = xp.histogram((mag - lo) / (hi - lo + 1e-6), bins=64, range=(0.0, 1.0))[0]
    return hist.get() if xp is not np else hist


def run_variant(client: Client, variant: str, items: list, workers: list[str]) -> list:
    if variant == "octopus":
        futs = dask_octopus.map(pipeline, items, cost=[h * w for h, w, _ in items], group=8, client=client)
    elif variant == "one-task-each":
        futs = client.map(pipeline, items, pure=False)
    elif variant == "equal-batches":
        n = len(workers)
        futs = [client.submit(run_group, pipeline, items[k::n], {}, workers=[w], pure=False)
                for k, w in enumerate(workers)]
    elif variant == "loop":
        futs = [client.submit(run_group, pipeline, items, {}, workers=[workers[-1]], pure=False)]
    else:
        raise ValueError(f"unknown variant {variant!r}")
    wait(futs)
    return futs


def in_input_order(results: list, variant: str, n_items: int, n_workers: int) -> list:
    """Per-image results in input order, whatever batching the variant used."""
    if variant == "loop":
        return results[0]
    if variant == "equal-batches":
        flat: list = [None] * n_items
        for k, batch in enumerate(results):
            flat[k::n_workers] = batch
        return flat
    return results


@click.command()
@click.option("--type", "kind", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True)
@click.option("--scenarios", default=",".join(SCENARIOS), show_default=True)
@click.option("--scale", type=float, default=1.0, show_default=True, help="image side scale (CPU: 0.05)")
@click.option("--repeat", type=int, default=1, show_default=True, help="repeat each mix")
@click.option("--runs", type=int, default=3, show_default=True)
@click.option("--devs", default=None)
@click.option("--cotenant", default="", help="GPUs (gpu) or CPU cores (cpu) that get a co-tenant")
@click.option("--variants", default="octopus,one-task-each,equal-batches,loop", show_default=True)
@click.option("--json-out", default=None, help="write every timing here")
def main(kind: str, scenarios: str, scale: float, repeat: int, runs: int, devs: str | None, cotenant: str,
         variants: str, json_out: str | None) -> None:
    """Time each variant on each size mix; check that all variants give the same histograms."""
    gpu = kind == "gpu"
    console = make_console()
    targets = [t for t in cotenant.split(",") if t]
    load = CoTenant(gpus=targets) if gpu else CoTenant(cores=[int(t) for t in targets])
    names = variants.split(",")
    record: dict[str, Any] = {"config": dict(type=kind, scale=scale, repeat=repeat, runs=runs, cotenant=targets)}
    with local_cluster(gpu, devs) as client, load:
        dask_octopus.register(client)
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        for scenario in scenarios.split(","):
            items = specs(scenario, scale, repeat)
            reference = None
            times: dict[str, list[float]] = {v: [] for v in names}
            for _ in range(runs):
                for v in names:  # interleaved
                    t0 = time.perf_counter()
                    futs = run_variant(client, v, items, workers)
                    times[v].append(time.perf_counter() - t0)
                    flat = in_input_order(client.gather(futs), v, len(items), len(workers))
                    if reference is None:
                        reference = flat
                    elif not all(np.array_equal(a, b) for a, b in zip(reference, flat)):
                        raise AssertionError(f"{v} gave different histograms on {scenario}")
            med = {v: statistics.median(t) for v, t in times.items()}
            line = ", ".join(f"{v} {med[v] * 1e3:.0f} ms" for v in names)
            speedups = ", ".join(f"x{med[v] / med['octopus']:.2f} vs {v}" for v in names if v != "octopus")
            console.print(f"{scenario:>14}: {len(items)} images; {line}; octopus {speedups}")
            record[scenario] = {"images": len(items), "seconds": times}
        record["weights"] = dask_octopus.speeds(client)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
