"""Where balance's extra time on transpose_sum comes from, on an even cluster (a probe, not a benchmark).

``(x + x.T).sum()`` over a persisted 20000x20000 float32 array in two row blocks, passes as the suite
times them (build, persist, wait), variants interleaved run by run:

- ``defaults``: Dask's own blocks, plugin registered, no plan;
- ``balance``: ``dask_octopus.balance`` (kept blocks, pins, working sets measured);
- ``balance-nomeasure``: the same, the workers' working-set meters switched off;
- ``balance-nopins``: the same input, its plans dropped on the scheduler before the passes (no pins).

Per variant: median pass, and per pass the bytes each worker fetched and where each task prefix ran.

    python transpose_probe.py --devs 0,0 --protocol ucx --runs 8 --out DIR
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import time

import click
from dask.utils import key_split
from distributed import get_task_stream, wait

import dask_octopus
from dask_octopus.bench.experiment import local_cluster, make_input

VARIANTS = ["defaults", "balance", "balance-nomeasure", "balance-nopins"]


def _fetched(dask_worker) -> int:
    return sum(e.get("total", 0) for e in dask_worker.transfer_incoming_log)


def _meters(on: bool, dask_worker) -> None:
    plugin = dask_worker.plugins.get("octopus-worker")
    if plugin is not None:
        if on and getattr(plugin, "_probe_meter", None) is not None:
            plugin.meter = plugin._probe_meter
        elif not on:
            plugin._probe_meter = plugin._probe_meter if getattr(plugin, "_probe_meter", None) else plugin.meter
            plugin.meter = None


def _drop_plans(dask_scheduler) -> int:
    plugin = dask_scheduler.plugins["octopus"]
    n = len(plugin.placement.plans)
    plugin.placement.plans.clear()
    return n


@click.command()
@click.option("--type", "kind", type=click.Choice(["gpu", "cpu"]), default="gpu")
@click.option("--devs", default="0,0")
@click.option("--protocol", default="ucx")
@click.option("--size", default=20000)
@click.option("--runs", default=8)
@click.option("--passes", default=3)
@click.option("--out", required=True)
def main(kind: str, devs: str, protocol: str, size: int, runs: int, passes: int, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    detail: dict[str, list] = {v: [] for v in VARIANTS}
    gpu = kind == "gpu"
    with local_cluster(gpu, devs if gpu else None, protocol=protocol) as client:
        dask_octopus.register(client)
        for run in range(runs):
            for v in VARIANTS[run % len(VARIANTS):] + VARIANTS[:run % len(VARIANTS)]:
                x = make_input(client, "balance" if v.startswith("balance") else "defaults", size, size, gpu)
                client.run(_meters, v != "balance-nomeasure")
                if v == "balance-nopins":
                    client.run_on_scheduler(_drop_plans)
                for p in range(passes + 1):  # the first pass is a warm-up
                    before = client.run(_fetched)
                    with get_task_stream(client) as ts:
                        t = time.perf_counter()
                        y = client.persist((x + x.T).sum())
                        wait(y)
                        s = time.perf_counter() - t
                    del y
                    after = client.run(_fetched)
                    if p:
                        seconds[v].append(s)
                        where = collections.Counter(f"{key_split(d['key'])}@{sorted(after).index(d['worker'])}"
                                                    for d in ts.data)
                        detail[v].append({"seconds": s, "fetched": [after[w] - before[w] for w in sorted(after)],
                                          "where": dict(sorted(where.items()))})
                del x
                client.run(_meters, True)
        weights = dask_octopus.speeds(client)
    lines = [f"{' '.join(sys.argv)}", f"weights {weights}"]
    base = statistics.median(seconds["defaults"])
    for v in VARIANTS:
        m = statistics.median(seconds[v])
        lines.append(f"{v:20s} median {m * 1e3:7.2f} ms  defaults/this {base / m:.3f}  n={len(seconds[v])}  "
                     f"fetched/pass {statistics.median(sum(d['fetched']) for d in detail[v]) / 1e6:.0f} MB")
        lines.append(f"    where (first timed pass): {detail[v][0]['where']}")
    print("\n".join(lines))
    with open(os.path.join(out, "transpose_probe.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "transpose_probe.json"), "w") as f:
        json.dump({"seconds": seconds, "detail": detail}, f, indent=1)


if __name__ == "__main__":
    main()
