"""Many small blocks through an elementwise chain and a sum, on one worker: Dask's per-task cost
against fragments (``annotate``), a plain loop in the client process and, on GPU, the floor of
that loop captured once as a CUDA graph.

Each block is small enough that Dask's cost per task (about 1 ms on a CPU worker, 2-4 ms on a
dask-cuda worker) dwarfs its arithmetic: this is where the number of tasks, not the work, sets the
time. Each timed run starts on a settled cluster (:func:`~dask_octopus.bench.runner.settle`): what
the run before it left to release is not counted in it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import dask.array as da
import numpy as np
from distributed import Client

import dask_octopus
from dask_octopus.bench.runner import interleave, settle, timed
from dask_octopus.bench.workloads import array_module, elementwise_chain, persist_on_workers, random_matrix

LOOP = "plain loop in the client"  # the label of the reference way


@dataclass
class Timing:
    """Seconds of one way of running the pipeline, what it runs as, and its result."""

    label: str
    how: str
    seconds: list[float] = field(default_factory=list)
    value: float | None = None
    same: bool | None = None  # whether ``value`` is the plain loop's (within float32 sums' rounding)

    def median(self) -> float:
        return statistics.median(self.seconds)


def differing(timings: list[Timing]) -> str | None:
    """What the ways of ``timings`` that gave another value than the plain loop gave, if any."""
    reference = next(t.value for t in timings if t.label == LOOP)
    wrong = [f"{t.label} gave {t.value}" for t in timings if t.same is False]
    return f"{', '.join(wrong)}; the loop {reference}" if wrong else None


def chain_sum(x: da.Array, name: str) -> da.Array:
    """The pipeline: :func:`~dask_octopus.bench.workloads.elementwise_chain` on every block, then the
    sum of all elements (Dask's tree reduction)."""
    return x.map_blocks(elementwise_chain, name=name, dtype=x.dtype).sum()


def _loop(blocks: list[Any], xp: Any) -> float:
    return float(xp.stack([elementwise_chain(b).sum() for b in blocks]).sum())


def _floor(blocks: list[Any], runs: int) -> list[float] | None:
    """Seconds of the loop's kernels alone: captured once as one CUDA graph forked over 8 streams
    (the stream groups' own capture) and replayed; ``None`` when CUDA refuses the capture."""
    import cupy as cp

    from dask_octopus.groups.replay import CaptureRefused, capture

    def member(b: Any) -> Any:
        return elementwise_chain(b).sum()

    streams = [cp.cuda.Stream(non_blocking=True) for _ in range(8)]
    cp.cuda.Device().synchronize()
    try:
        graph = capture(cp, [member] * len(blocks), [[b] for b in blocks], list(range(len(blocks))), streams)
    except CaptureRefused:
        return None

    def replay() -> None:
        graph.graph.launch(streams[0])
        streams[0].synchronize()

    replay()
    return [timed(replay)[0] for _ in range(runs)]


def _forget_fragments(dask_worker: Any) -> None:
    """Drop what the worker's stream runtime learned (captured graphs, layouts): the next fragment
    runs as the first one."""
    from dask_octopus.groups.streams import EXTENSION

    rt = dask_worker.extensions.get(EXTENSION)
    if rt is not None:
        rt.close()


def _forget_plans() -> None:
    """Drop the plans that the scheduler's process remembers (``octopus.fragments.plan-memo``): the
    next annotated compute is planned from scratch, as a first one (from the third compute of a shape
    on, the plan of the first was reused, renamed for the new keys)."""
    from dask_octopus.groups.memo import plans

    plans.clear()


def forget_everything(client: Client) -> None:
    """What the scheduler and the workers learned of annotated computes (plans, captured graphs,
    layouts) forgotten: the next one runs as a first one."""
    client.run_on_scheduler(_forget_plans)
    client.run(_forget_fragments)


def run_small_tasks(client: Client, *, gpu: bool, blocks: int, shape: tuple[int, int], runs: int,
                    group: int | None) -> list[Timing]:
    """Time the ways of running ``blocks`` blocks of ``shape`` through :func:`chain_sum` on the
    client's (one) worker, and the loop in this process; marks each way's value as the loop's or not
    (``same``: see :func:`differing`)."""
    xp = array_module(gpu)
    x = persist_on_workers(client, random_matrix(blocks * shape[0], shape[1], chunks=shape, gpu=gpu))
    local = client.compute(x).result()
    local_blocks = [local[i * shape[0]:(i + 1) * shape[0]] for i in range(blocks)]
    counter = iter(range(10**9))

    def through_dask(annotated: bool) -> float:
        name = f"chain-{'annotated' if annotated else 'dask'}-{next(counter)}"
        if not annotated:
            return float(client.compute(chain_sum(x, name)).result())
        with dask_octopus.annotate(resource="memory", group=group):
            return float(client.compute(chain_sum(x, name)).result())

    def readme_pattern() -> float:  # annotate around building the blocks; the sum's partials join them
        with dask_octopus.annotate(resource="memory", group=group):
            y = x.map_blocks(elementwise_chain, name=f"chain-pattern-{next(counter)}", dtype=x.dtype)
        return float(client.compute(y.sum()).result())

    replays = "CUDA graphs replayed" if gpu else "no CUDA graphs on CPU: eager again"
    ways = {
        "dask": Timing("Dask, unannotated", "one task per block and per partial sum"),
        "first": Timing("annotated, first run", "one fragment per worker thread, eager" if group is None
                        else f"fragments of up to {group} blocks, eager"),
        "again": Timing("annotated, repeated", f"the same fragments, {replays}"),
        "pattern": Timing("README pattern, repeated", "annotate() around map_blocks only, .sum() outside"),
        "loop": Timing(LOOP, "no Dask: one Python loop over the blocks"),
    }
    through_dask(False)  # warm-up: kernel compilation, first allocations
    _loop(local_blocks, xp)
    for _ in range(runs):  # each the first sighting of its fragment: the cluster forgets what it saw before
        forget_everything(client)
        settle(client)
        seconds, ways["first"].value = timed(lambda: through_dask(True))
        ways["first"].seconds.append(seconds)
    through_dask(True)  # the second sighting of a group: captured (GPU)
    measured = interleave({"dask": lambda run: timed(lambda: through_dask(False)),
                           "again": lambda run: timed(lambda: through_dask(True)),
                           "pattern": lambda run: timed(readme_pattern),
                           "loop": lambda run: timed(lambda: _loop(local_blocks, xp))}, runs,
                          between=lambda: settle(client))  # each from a quiet cluster
    for key, results in measured.items():
        ways[key].seconds = [s for s, _ in results]
        ways[key].value = results[-1][1]
    reference = ways["loop"].value
    for w in ways.values():  # (the callers write what was measured, then fail on a difference: :func:`differing`)
        w.same = bool(np.isclose(w.value, reference, rtol=1e-3))
    out = list(ways.values())
    if gpu:
        floor = _floor(local_blocks, runs)
        if floor is not None:
            out.append(Timing("floor: the loop as one CUDA graph", "captured once over 8 streams, replayed",
                              floor, reference))
    return out

