"""A screenshot of the ``/octopus`` dashboard page while balanced computations run, one worker slowed by a
co-tenant process, taken with headless Chromium.

Each round re-plans a persisted matrix with ``dask_octopus.balance`` (by the weights of the moment)
and runs passes of ``sum_i Y_i^T (Y_i W)`` over it, one graph each, every other round in stream
groups, so the page shows weights that move, plans with observed finish times and group counts.
``--html`` also saves the page (Bokeh inline: it renders offline), and ``--from-html`` screenshots a
saved page without a cluster, e.g. one saved on the GPU machine, which has no browser:

    python benchmarks/dashboard_screenshot.py --type cpu --png docs/dashboard-cpu.png
    python benchmarks/dashboard_screenshot.py --type gpu --devs 0,1 --html octopus-gpu.html --no-png
    python benchmarks/dashboard_screenshot.py --from-html octopus-gpu.html --png docs/dashboard-gpu.png
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import urllib.request

import click
import dask.array as da
import numpy as np
from distributed import Client, wait

import dask_octopus
from dask_octopus.bench.cotenant import CoTenant
from dask_octopus.bench.experiment import local_cluster, slowest_target
from dask_octopus.bench.options import FiniteRange
from dask_octopus.bench.protocol import check_cluster, protocol_option
from dask_octopus.bench.workloads import array_module, block_gram, random_matrix
from dask_octopus.cli import console as make_console

DEFAULTS = {"cpu": (200_000, 256, 128), "gpu": (1_000_000, 2048, 2048)}  # rows, cols, width


def screenshot(url: str, png: str, window: str, chromium: str) -> None:
    """Load ``url`` in headless Chromium, give its scripts a few seconds, and save a PNG."""
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: no state from another run
        subprocess.run([chromium, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--window-size={window}", "--virtual-time-budget=4000",
                        f"--screenshot={os.path.abspath(png)}", url],
                       check=True, capture_output=True, timeout=120)


def one_pass(client: Client, y: da.Array, w: da.Array, grouped: bool, gpu: bool) -> None:
    """``sum_i Y_i^T (Y_i W)`` in one graph: the per-block products (pinned to the blocks' workers, in stream
    groups of two when ``grouped``) and their sum."""
    xp = array_module(gpu)
    with dask_octopus.annotate(resource="compute", group=2) if grouped else contextlib.nullcontext():
        parts = da.blockwise(block_gram, "ijk", y, "ij", w, "jk", adjust_chunks={"i": 1}, dtype=np.float32,
                             meta=xp.empty((0, 0, 0), dtype=np.float32))
    client.compute(parts.sum(axis=0)).result()


def rounds(client: Client, stop: threading.Event, rows: int, cols: int, width: int, passes: int,
           gpu: bool) -> list[BaseException]:
    """Re-balance and run ``passes`` passes until ``stop`` is set; return the errors met (none expected)."""
    errors: list[BaseException] = []
    xp = array_module(gpu)
    try:
        x = client.persist(random_matrix(rows, cols, chunks=(rows // 4, cols), gpu=gpu))
        w = client.persist(da.ones((cols, width), dtype=np.float32, chunks=(cols, width)).map_blocks(xp.asarray))
        wait([x, w])
    except Exception as e:  # reported by the caller, as those of the rounds
        stop.set()
        return [e]
    n = 0
    while not stop.is_set():
        try:
            y = client.persist(dask_octopus.balance(x, client=client, per_worker=2))
            wait(y)
            for _ in range(passes):
                one_pass(client, y, w, grouped=n % 2 == 1, gpu=gpu)
            del y
        except Exception as e:  # reported by the caller once the page is saved
            errors.append(e)
            stop.set()
        n += 1
    return errors


@click.command()
@click.option("--type", "kind", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
              help="cpu: two pinned CPU workers; gpu: LocalCUDACluster")
@click.option("--devs", default=None, help="GPUs for LocalCUDACluster (default: all)")
@click.option("--rows", type=click.IntRange(min=4), default=None,
              help="rows of the matrix, in 4 blocks [default: 200000 cpu, 1000000 gpu]")
@click.option("--cols", type=click.IntRange(min=1), default=None, help="columns [default: 256 cpu, 2048 gpu]")
@click.option("--width", type=click.IntRange(min=1), default=None, help="subspace width [default: 128 cpu, 2048 gpu]")
@click.option("--passes", type=click.IntRange(min=1), default=3, show_default=True, help="passes per balanced round")
@click.option("--seconds", type=FiniteRange(min=0, min_open=True, max=86400), default=40.0, show_default=True,
              help="how long the rounds run before the screenshot")
@click.option("--cotenant/--no-cotenant", default=True, show_default=True, help="slow the first worker down")
@click.option("--png", default=None, help="the screenshot [default: dashboard-TYPE.png]")
@click.option("--no-png", "skip_png", is_flag=True, help="save no screenshot (e.g. no browser on this machine)")
@click.option("--html", default=None, help="also save the page's HTML here (renders offline)")
@click.option("--metrics", default=None, help="also save the dask_octopus_* lines of /metrics here")
@click.option("--from-html", type=click.Path(exists=True, dir_okay=False), default=None,
              help="screenshot this saved page; no cluster")
@click.option("--window", default="1400,1320", show_default=True, help="browser window, WIDTH,HEIGHT")
@click.option("--chromium", default=shutil.which("chromium") or "chromium", show_default=True)
@protocol_option
def main(kind: str, devs: str | None, rows: int | None, cols: int | None, width: int | None, passes: int,
         seconds: float, cotenant: bool, png: str | None, skip_png: bool, html: str | None, metrics: str | None,
         from_html: str | None, window: str, chromium: str, protocol: str) -> None:
    console = make_console()
    png = None if skip_png else png or f"dashboard-{kind}.png"
    if png and not shutil.which(chromium):  # (before the run, which would end in a FileNotFoundError)
        raise click.UsageError(f"--png needs Chromium, and {chromium!r} is not found: give --chromium PATH, or "
                               "--no-png")
    if from_html:
        if png:
            screenshot("file://" + os.path.abspath(from_html), png, window, chromium)
            console.print(f"wrote {png} from {from_html}")
        return
    check_cluster(kind, protocol)
    gpu = kind == "gpu"
    d_rows, d_cols, d_width = DEFAULTS[kind]
    with local_cluster(gpu, devs, protocol=protocol) as client:
        slow, load = slowest_target(client, gpu)
        with CoTenant(**load) if cotenant else CoTenant():
            dask_octopus.register(client)  # calibrated with the co-tenant running
            console.print(f"co-tenant: {load if cotenant else 'none'} (worker {slow}); running for {seconds:g} s")
            stop = threading.Event()
            errors: list[BaseException] = []
            worker = threading.Thread(target=lambda: errors.extend(
                rounds(client, stop, rows or d_rows, cols or d_cols, width or d_width, passes, gpu)))
            worker.start()
            try:
                stop.wait(seconds)
                port = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.http_server.port)
                url = f"http://127.0.0.1:{port}/octopus"
                if html:
                    with urllib.request.urlopen(url, timeout=60) as page, open(html, "wb") as f:
                        f.write(page.read())
                    console.print(f"wrote {html}")
                if metrics:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as page:
                        lines = [ln for ln in page.read().decode().splitlines() if "dask_octopus_" in ln]
                    with open(metrics, "w") as f:
                        f.write("\n".join(lines) + "\n")
                    console.print(f"wrote {metrics}: {len(lines)} dask_octopus_ lines")
                if png:
                    screenshot(url, png, window, chromium)
                    console.print(f"wrote {png} from {url}")
            finally:
                stop.set()
                worker.join()
    if errors:
        raise errors[0]


if __name__ == "__main__":
    main()
