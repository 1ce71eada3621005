"""What the registered plugin costs dask-cuda's ``local_cupy.py`` and why (a probe, not a benchmark).

States, rotated round by round on one ``LocalCUDACluster``: ``off`` (no plugin), ``on`` (registered,
no plan) and ``on-untimed`` (registered, the workers' CUDA-event task timers stopped: the one thing
the plugin does per task on a GPU worker). Each worker's CuPy pool is emptied before each call, so
that many calls on one shared GPU do not run it out of memory (the pools keep what ``local_cupy.py``
freed; UCX's receive buffers come from the device).

    python registered_probe.py --devs 0,0 --rounds 4 --out DIR
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import tempfile

import click

import dask_octopus
from dask_octopus.bench.experiment import local_cluster
from dask_octopus.bench.protocol import protocol_of
from dask_octopus.bench.runner import interleave

_spec = importlib.util.spec_from_file_location(
    "overhead", os.path.join(os.path.dirname(__file__), "..", "..", "dask_cuda_overhead.py"))
overhead = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(overhead)


def _empty_pool() -> None:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()


def _stop_timer(dask_worker) -> bool:
    plugin = dask_worker.plugins.get("octopus-worker")
    if plugin is None or plugin.timer is None:
        return False
    plugin.timer.stop()
    plugin.timer = None
    return True


@click.command()
@click.option("--devs", default="0,0")
@click.option("--protocol", default="ucx")
@click.option("--operation", default="dot")
@click.option("--rounds", default=4)
@click.option("--runs", default=3)
@click.option("--out", required=True)
def main(devs: str, protocol: str, operation: str, rounds: int, runs: int, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with local_cluster(True, devs, protocol=protocol) as client, tempfile.TemporaryDirectory() as folder:
        used = protocol_of(client)
        if importlib.util.find_spec("rmm") is None:
            client.register_plugin(overhead.NoRMM())
        address = client.scheduler_info()["address"]

        def one(state: str, r: int) -> list[float]:
            if state == "off":
                overhead.set_plugin(client, False)
            else:  # registered afresh, so that the timers run again after on-untimed
                overhead.set_plugin(client, False)
                dask_octopus.register(client)
                if state == "on-untimed":
                    assert all(client.run(_stop_timer).values()), "no CUDA-event timer to stop"
            client.run(_empty_pool)
            got = overhead.run_local_cupy(address, used, operation, 20000, 5000, runs, folder, f"{state}-{r}")
            print(f"round {r} {state}: " + ", ".join(f"{t:.4f}" for t in got), flush=True)
            return got

        res = interleave({s: (lambda r, s=s: one(s, r)) for s in ("off", "on", "on-untimed")}, rounds)
    times = {s: [t for got in v for t in got] for s, v in res.items()}
    med = {s: statistics.median(t) for s, t in times.items()}
    lines = [f"{operation}: median of {len(times['off'])} runs each: "
             + ", ".join(f"{s} {m:.4f} s" for s, m in med.items()),
             f"on / off {med['on'] / med['off']:.3f}; on-untimed / off {med['on-untimed'] / med['off']:.3f}"]
    print("\n".join(lines))
    with open(os.path.join(out, "registered_probe.json"), "w") as f:
        json.dump({"seconds": times, "median_seconds": med, "summary": lines}, f, indent=1)


if __name__ == "__main__":
    main()
