"""Where the time of one annotated chain-and-sum compute goes (1024 persisted NumPy blocks of 64x96, the
8-kernel chain, then .sum(); 1-worker, 1-thread LocalCluster in processes): the scheduler's events for
the fragment task, in seconds after the client's compute call, four computes.

    python benchmarks/results/2026-11-30-cpu-fragments/timeline_probe.py > timeline_probe.txt
"""

import time

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster, wait
from distributed.diagnostics.plugin import SchedulerPlugin

import dask_octopus
from dask_octopus.bench.small_tasks import chain_sum

BLOCKS, SHAPE = 1024, (64, 96)


class Events(SchedulerPlugin):
    """The scheduler's update_graph calls and the fragment task's transitions and start/stops."""

    def __init__(self):
        self.events = []

    def update_graph(self, scheduler, **kwargs):
        self.events.append(("update_graph", time.time()))

    def transition(self, key, start, finish, *args, **kwargs):
        if "octopus-fragments" in str(key):
            self.events.append((f"{start}->{finish}", time.time()))
            for s in kwargs.get("startstops", ()):
                self.events += [(f"{s['action']} start", s["start"]), (f"{s['action']} stop", s["stop"])]


def main() -> None:
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        dask_octopus.register(client, calibrate=False)
        local = np.random.default_rng(0).random((BLOCKS * SHAPE[0], SHAPE[1]))
        x = client.persist(da.from_array(local, chunks=SHAPE))
        wait(x)
        for i in range(4):
            client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.add_plugin(Events(), name="events"))
            t0 = time.time()
            with dask_octopus.annotate():
                future = client.compute(chain_sum(x, f"chain-{i}"))
            future.result()
            total = time.time() - t0
            events = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["events"].events)
            print(f"total {total:.3f} s:", ", ".join(f"{name} {t - t0:.3f}" for name, t in events))


if __name__ == "__main__":
    main()
