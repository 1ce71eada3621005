"""The fragment executor alone, in one process (no Dask cluster, no UCX): the chain-and-sum fragment
(1024 CuPy blocks 256x384 float32, the 8-kernel chain, a block sum, partial sums of 32, the top) and
the frames fragment (216 frame pipelines), run eagerly over 1 and 8 streams, captured and replayed,
beside the plain loop; the structure hash each new fragment pays; the CuPy pool's peak bytes.

    python benchmarks/results/2026-11-30-h200x2-fragments/executor_probe.py > executor_probe.txt
"""

import cProfile
import pstats
import time

import cupy as cp
import dask

from dask_octopus._compat import Task, TaskRef
from dask_octopus.bench.workloads import elementwise_chain, frame_pipeline, frame_specs, make_frame
from dask_octopus.groups import streams
from dask_octopus.groups.fragment import Fragment


def total(*parts):
    return cp.stack(parts).sum()


def block_sum(b):
    return b.sum()


def chain_sum_fragment(n):
    graph = {}
    for i in range(n):
        graph[("c", i)] = Task(("c", i), elementwise_chain, TaskRef(("x", i)))
        graph[("s", i)] = Task(("s", i), block_sum, TaskRef(("c", i)))
    for j in range(n // 32):
        graph[("p", j)] = Task(("p", j), total, *(TaskRef(("s", i)) for i in range(32 * j, 32 * j + 32)))
    outputs = [("p", j) for j in range(n // 32)]
    return Fragment(graph, outputs, dict.fromkeys(graph, "memory"))


def frames_fragment(n):
    graph = {("h", i): Task(("h", i), frame_pipeline, TaskRef(("f", i))) for i in range(n)}
    return Fragment(graph, list(graph), dict.fromkeys(graph, "memory"))


def timed(fn, runs=5):
    out = []
    for _ in range(runs):
        cp.cuda.Device().synchronize()
        t = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        out.append(time.perf_counter() - t)
    return sorted(out)[len(out) // 2], out


def peak(fn):
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    base = pool.total_bytes()
    fn()
    cp.cuda.Device().synchronize()
    return pool.total_bytes() - base


def main():
    rng = cp.random.default_rng(0)
    blocks = [rng.random((256, 384), dtype=cp.float32) for _ in range(1024)]
    frames = [make_frame(*s, gpu=True) for s in frame_specs(1.0)]
    cases = {"chain-sum": (chain_sum_fragment(1024), blocks,
                           lambda: float(cp.stack([elementwise_chain(b).sum() for b in blocks]).sum())),
             "frames": (frames_fragment(len(frames)), frames, lambda: [frame_pipeline(f) for f in frames])}
    for name, (frag, inputs, loop) in cases.items():
        print(f"== {name}: {len(frag.steps)} steps, {len(frag.inputs)} inputs")
        loop()
        print(f"loop: {1000 * timed(loop)[0]:.1f} ms, pool peak {peak(loop) / 2**20:.1f} MiB")
        t = time.perf_counter()
        frag.structure()
        print(f"structure hash: {1000 * (time.perf_counter() - t):.1f} ms")
        for n in (1, 2, 8):
            streams._process_runtime = None
            with dask.config.set({"octopus.streams.max-streams": n, "octopus.streams.capture": False}):
                def run(frag=frag, inputs=inputs):
                    streams.run_fragment(frag, *inputs)
                first = timed(run, 1)[0]
                med, _ = timed(run)
                print(f"eager, {n} streams: first {1000 * first:.1f} ms, then {1000 * med:.1f} ms, "
                      f"pool peak {peak(run) / 2**20:.1f} MiB")
        streams._process_runtime = None
        with dask.config.set({"octopus.streams.max-streams": 8, "octopus.streams.capture": False}):
            profile = cProfile.Profile()
            profile.enable()
            streams.run_fragment(frag, *inputs)
            cp.cuda.Device().synchronize()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(12)
        streams._process_runtime = None
        with dask.config.set({"octopus.streams.max-streams": 8, "octopus.streams.capture": True}):
            def run(frag=frag, inputs=inputs):
                streams.run_fragment(frag, *inputs)
            run()
            t = time.perf_counter()
            run()  # captured now
            cp.cuda.Device().synchronize()
            print(f"capture run: {1000 * (time.perf_counter() - t):.1f} ms")
            med, all_ = timed(run)
            print(f"replay, 8 streams: {1000 * med:.1f} ms ({[round(1000 * s, 1) for s in all_]})")
            print("stats", streams._process_runtime.stats())


if __name__ == "__main__":
    main()
