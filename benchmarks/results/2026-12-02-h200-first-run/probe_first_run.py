"""Where the first (eager) run of the chain-sum fragment spends its time inside the worker.

One worker, one thread (as stream_groups.py); 1024 persisted blocks (256x384 float32 on GPU, 64x96
float64 on CPU), the 8-kernel chain and a sum, computed inside ``annotate()``:
  A. first runs: the worker's stream runtime reset before each (no graph captured, no layout known);
  B. eager repeats: capture off on the worker, layouts kept;
  C. one first run under cProfile inside the worker (the fragment task only);
  D. the same work as one Dask task with a plain loop inside (the worker's blocks);
  E. the plain loop in the client process.
For each: the wall time of the compute and, for A/B, the fragment task's own time (startstops).
Usage: python probe_first_run.py --type gpu|cpu --protocol ucx|tcp --out DIR
"""
import argparse, cProfile, io, json, os, pstats, statistics, sys, time

import dask
import numpy as np
from distributed import wait
from distributed.diagnostics.plugin import SchedulerPlugin

import dask_octopus
from dask_octopus.bench.experiment import local_cluster
from dask_octopus.bench.small_tasks import chain_sum
from dask_octopus.bench.workloads import array_module, elementwise_chain, persist_on_workers, random_matrix
from dask_octopus.groups.rewrite import FRAGMENT_PREFIX


class Stamps(SchedulerPlugin):
    def __init__(self):
        self.compute = []

    def transition(self, key, start, finish, *args, **kwargs):
        if FRAGMENT_PREFIX in str(key) and finish == "memory":
            self.compute += [s["stop"] - s["start"] for s in kwargs.get("startstops", ()) if s["action"] == "compute"]


def reset_runtime(dask_worker):
    from dask_octopus.groups.streams import EXTENSION
    rt = dask_worker.extensions.get(EXTENSION)
    if rt is not None:
        rt.close()
        rt.layouts.clear()


def spread_choices(dask_worker):
    from dask_octopus.groups.streams import EXTENSION
    rt = dask_worker.extensions.get(EXTENSION)
    return [{"streams": k[2], "spread": v} for k, v in getattr(rt, "spreads", {}).items()]


def set_capture(on):
    dask.config.set({"octopus.streams.capture": on})


def install_profiler(dask_worker):
    from dask_octopus.groups import streams
    if getattr(streams.run_fragment, "probe", False):
        return
    orig = streams.run_fragment
    dask_worker.probe_profiles = []

    def run_fragment(fragment, *inputs):
        if not dask_worker.probe_on:
            return orig(fragment, *inputs)
        pr = cProfile.Profile()
        pr.enable()
        try:
            return orig(fragment, *inputs)
        finally:
            pr.disable()
            s = io.StringIO()
            st = pstats.Stats(pr, stream=s)
            st.sort_stats("tottime").print_stats(30)
            st.sort_stats("cumulative").print_stats(40)
            dask_worker.probe_profiles.append(s.getvalue())

    run_fragment.probe = True
    run_fragment.__qualname__ = orig.__qualname__
    streams.run_fragment = run_fragment
    dask_worker.probe_on = False


def probe_on(on, dask_worker=None):
    dask_worker.probe_on = on


def profiles(dask_worker):
    return dask_worker.probe_profiles


def loop_task(blocks, gpu):
    xp = array_module(gpu)
    out = float(xp.stack([elementwise_chain(b).sum() for b in blocks]).sum())
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="cpu")
    ap.add_argument("--protocol", default="tcp")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="probe-out")
    a = ap.parse_args()
    gpu = a.type == "gpu"
    os.makedirs(a.out, exist_ok=True)
    shape = (256, 384) if gpu else (64, 96)
    rec = {"type": a.type, "protocol": a.protocol, "shape": shape}
    with local_cluster(gpu, "0" if gpu else None, n_workers=1, protocol=a.protocol) as client:
        dask_octopus.register(client, calibrate=False)
        x = persist_on_workers(client, random_matrix(1024 * shape[0], shape[1], chunks=shape, gpu=gpu))
        stamps = Stamps()
        client.cluster.scheduler.add_plugin(stamps, name="probe-stamps")
        n = iter(range(10**6))

        def annotated():
            with dask_octopus.annotate(resource="memory"):
                return float(client.compute(chain_sum(x, f"probe-{next(n)}")).result())

        def timed(f):
            t = time.perf_counter(); v = f(); return time.perf_counter() - t, v

        client.compute(chain_sum(x, "warm")).result()  # kernels compiled
        annotated()
        # A: first runs
        first, ftask = [], []
        for _ in range(a.runs):
            client.run(reset_runtime)
            stamps.compute.clear()
            first.append(timed(annotated)[0]); ftask.append(sum(stamps.compute))
        rec["A_first_runs"] = {"wall_ms": [1e3 * s for s in first], "fragment_ms": [1e3 * s for s in ftask]}
        # B: eager repeats, capture off
        client.run(set_capture, False)
        eager, etask = [], []
        for _ in range(a.runs):
            stamps.compute.clear()
            eager.append(timed(annotated)[0]); etask.append(sum(stamps.compute))
        rec["B_eager_repeats"] = {"wall_ms": [1e3 * s for s in eager], "fragment_ms": [1e3 * s for s in etask]}
        rec["eager_spread_choices"] = list(client.run(spread_choices).values())
        client.run(set_capture, True)
        # C: one first run profiled
        client.run(install_profiler)
        client.run(reset_runtime)
        client.run(probe_on, True)
        annotated()
        client.run(probe_on, False)
        (prof,) = client.run(profiles).values()
        with open(os.path.join(a.out, f"first-run-profile-{a.type}.txt"), "w") as fh:
            fh.write("\n".join(prof))
        # D: one task, loop inside
        futs = client.futures_of(x)
        loop_in = [timed(lambda: client.submit(loop_task, futs, gpu, pure=False).result())[0] for _ in range(a.runs)]
        rec["D_one_task_loop_ms"] = [1e3 * s for s in loop_in]
        # E: loop in the client
        local = client.compute(x).result()
        blocks = [local[i * shape[0]:(i + 1) * shape[0]] for i in range(1024)]
        loop_task(blocks, gpu)
        rec["E_client_loop_ms"] = [1e3 * timed(lambda: loop_task(blocks, gpu))[0] for _ in range(a.runs)]
    for k, v in rec.items():
        if isinstance(v, dict):
            print(k, {kk: f"median {statistics.median(vv):.1f} (min {min(vv):.1f}, max {max(vv):.1f})" for kk, vv in v.items()})
        elif isinstance(v, list) and v and isinstance(v[0], float):
            print(k, f"median {statistics.median(v):.1f} (min {min(v):.1f}, max {max(v):.1f})")
    with open(os.path.join(a.out, f"probe-first-run-{a.type}.json"), "w") as fh:
        json.dump(rec, fh, indent=1)


if __name__ == "__main__":
    main()
