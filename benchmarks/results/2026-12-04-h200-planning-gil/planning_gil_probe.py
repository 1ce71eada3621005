"""Where the planning of an annotated compute waits: its wall time against its thread's CPU time.

Runs ``fragment_phases.py``'s chain-sum (1024 persisted blocks, the 8-kernel chain, ``.sum()``) on a
one-worker, one-thread cluster, ``--runs`` computes inside ``annotate()`` after a warm-up, and times
the part of ``annotate``'s optimizer after Dask's (marks, places, fragments: the "octopus plan" phase)
with ``time.perf_counter`` and ``time.thread_time``, then a fixed piece of pure-Python work (the
control: this machine's speed at that moment) in the same thread. The planning is pure Python in one thread: wall
time beyond its CPU time is time spent waiting for the GIL. ``--switch-interval`` sets Python's switch
interval in this process (the client's, the scheduler's) first. Asserts nothing.

    python planning_gil_probe.py --protocol ucx --runs 6 [--switch-interval 0.02]
"""

from __future__ import annotations

import os
import sys
import time

import click

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fragment_phases import chain_sum_builder

import dask_octopus
from dask_octopus.bench.experiment import local_cluster
from dask_octopus.groups import marks


def reference() -> None:
    """A fixed piece of pure-Python work of the planning's kind (dicts, tuples, sets), timed in the
    planning's thread right after it: the control for this machine's speed at that moment."""
    d = {}
    for i in range(60_000):
        d[("key", i)] = (i, str(i))
    s = {k for k, v in d.items() if v[0] % 3}
    sorted(s, key=str)


@click.command()
@click.option("--protocol", default="ucx")
@click.option("--runs", default=6)
@click.option("--switch-interval", type=float, default=None)
@click.option("--gpu/--cpu", default=True)
def main(protocol: str, runs: int, switch_interval: float | None, gpu: bool) -> None:
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    call = marks.GroupingOptimizer.__call__
    timings: list[tuple[float, float, float]] = []

    def timed(self, dsk, keys, **kw):
        base = self.base
        t = {}

        def tb(*a, **k):
            r = base(*a, **k)
            t["wall"], t["cpu"] = time.perf_counter(), time.thread_time()
            return r

        try:
            return call(marks.GroupingOptimizer(tb), dsk, keys, **kw)
        finally:
            wall, cpu = time.perf_counter() - t["wall"], time.thread_time() - t["cpu"]
            c0 = time.thread_time()
            reference()
            timings.append((wall, cpu, time.thread_time() - c0))

    marks.GroupingOptimizer.__call__ = timed
    with local_cluster(gpu, "0" if gpu else None, n_workers=1, protocol=protocol) as client:
        dask_octopus.register(client, calibrate=False)
        build = chain_sum_builder(client, gpu)
        for run in range(runs + 1):
            with dask_octopus.annotate():
                client.compute(build(f"gil-{run}")).result()
    print(f"protocol={protocol} switch_interval={sys.getswitchinterval()} "
          f"UCXPY_PROGRESS_MODE={os.environ.get('UCXPY_PROGRESS_MODE')}")
    for i, (wall, cpu, ref) in enumerate(timings):
        print(f"  compute {i}: octopus plan wall {1000 * wall:6.1f} ms, its thread's CPU {1000 * cpu:6.1f} ms, "
              f"waiting {1000 * (wall - cpu):6.1f} ms; the fixed reference work after it {1000 * ref:6.1f} ms")


if __name__ == "__main__":
    main()
