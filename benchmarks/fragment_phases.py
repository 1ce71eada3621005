"""Where the time of one annotated compute goes, phase by phase: the floor Dask itself sets.

Two workloads of ``stream_groups.py``, each computed inside ``dask_octopus.annotate()`` on a
one-worker, one-thread cluster, ``--runs`` times after an annotated warm-up compute (on GPU the
first measured compute sees the warm-up's fragment again and captures it, running it eagerly once
more; the later ones replay the CUDA graph): ``chain-sum`` (1024 persisted float32 blocks, 256x384 on GPU and 64x96 on
CPU, the 8-kernel elementwise chain, then ``.sum()``) and ``frames`` (216 persisted frames, 256x256
to 4K on GPU, a tenth of the side on CPU, through blur, Sobel, normalise and histogram, the
histograms stacked on the host). Each compute is cut into phases by timestamps taken in
this process (the scheduler runs here) and the fragment task's start and stop on the worker:

- ``build``: the client builds the collection (Dask array code);
- ``submit``: from the compute call until the scheduler's ``update_graph`` starts;
- ``materialize``: from there until the optimizer is called (Dask expands the expression's graph);
- ``dask optimize``: Dask's own array optimizer (blockwise fusion, culling, low-level fusion; with
  Python's garbage collector paused by ``annotate``'s wrapper, as it is around the whole optimizer);
- ``octopus plan``: the rest of the optimizer call, ``annotate``'s wrapper: the marks read before
  Dask's optimizer, and the places and fragments after it;
- ``update_graph``: the rest of Dask's ``update_graph`` (task states, transitions, sending; the
  plugin's own ``update_graph`` hook, its pins, is in here: a few ms);
- ``dispatch``: until the fragment task starts on the worker (transfer, unpickling the fragment);
- ``fragment``: the fragment task itself (eager on streams, or the graph's replay);
- ``finish``: until the client has the result (the top of the tree, the result's way back).

Each run's chain-sum has new keys (as a loop over new data would); ``--same-keys`` computes the same
collection each time instead (as a user computing it again would), whose plan the scheduler then
remembers (``octopus.fragments.plan-memo``): ``octopus plan`` is then what finding it costs.

The phases outside ``octopus plan`` and ``fragment`` are Dask's own per-compute cost for this graph,
paid with or without dask-octopus: the floor a compute of this shape cannot go under. Asserts nothing.

    python benchmarks/fragment_phases.py --type cpu --out benchmarks/results/cpu
    python benchmarks/fragment_phases.py --type gpu --devs 0 --out benchmarks/results/gpu
    python benchmarks/fragment_phases.py --type cpu --workloads chain-sum --same-keys --out benchmarks/results/cpu
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import click
import dask
from distributed import Client, wait
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.scheduler import Scheduler

import dask_octopus
from dask_octopus.bench.experiment import local_cluster
from dask_octopus.bench.options import Names, OutFolder
from dask_octopus.bench.protocol import check_cluster, protocol_of, protocol_option
from dask_octopus.bench.record import header, write_json
from dask_octopus.bench.small_tasks import chain_sum
from dask_octopus.bench.workloads import (
    frame_pipeline,
    frame_specs,
    make_frame,
    persist_on_workers,
    random_matrix,
    stack_to_host,
)
from dask_octopus.cli import console as make_console
from dask_octopus.groups import marks
from dask_octopus.groups.rewrite import FRAGMENT_PREFIX

PHASES = ["build", "submit", "materialize", "dask optimize", "octopus plan", "update_graph", "dispatch",
          "fragment", "finish"]


class Stamps(SchedulerPlugin):
    """The start and stop of the fragment task (worker clock: the same host)."""

    def __init__(self) -> None:
        self.compute: list[tuple[float, float]] = []

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if FRAGMENT_PREFIX in str(key) and finish == "memory":  # this run (a worker that ran the same key
            # before, and kept its state, reports the earlier runs too)
            self.compute += [(s["start"], s["stop"]) for s in kwargs.get("startstops", ())
                             if s["action"] == "compute"][-1:]


def _fragments_held(dask_worker: Any) -> int:
    return sum(FRAGMENT_PREFIX in str(key) for key in dask_worker.state.tasks)


def forget_fragments(client: Client, timeout: float = 10.0) -> None:
    """Wait until no worker holds a fragment task (or ``timeout`` seconds passed): a run computing the
    same keys as the run before sends the same fragment key, and a worker still holding the earlier
    one reports it, with the earlier run's start and stop, instead of running it."""
    deadline = time.monotonic() + timeout
    while any(client.run(_fragments_held).values()) and time.monotonic() < deadline:
        time.sleep(0.01)


@contextlib.contextmanager
def instrumented(scheduler: Scheduler, events: dict[str, float]) -> Iterator[None]:
    """Record, in ``events``, when ``scheduler``'s ``update_graph`` starts and ends and when the optimizer
    of ``annotate`` starts, hands over to Dask's optimizer and back, and ends (the scheduler runs here);
    both put back as they were on the way out (the next workload's timings would nest in these)."""
    update_graph = scheduler.stream_handlers["update-graph"]

    @functools.wraps(update_graph)
    async def timed_update_graph(*args: Any, **kwargs: Any) -> Any:
        events["update_graph>"] = time.time()
        try:
            return await update_graph(*args, **kwargs)
        finally:
            events["update_graph<"] = time.time()

    call = marks.GroupingOptimizer.__call__

    def timed_call(self: marks.GroupingOptimizer, dsk: Any, keys: Any, **kwargs: Any) -> Any:
        events["optimize>"] = time.time()
        base = self.base

        def timed_base(*args: Any, **kw: Any) -> Any:
            events["dask>"] = time.time()
            try:
                return base(*args, **kw)
            finally:
                events["dask<"] = time.time()

        try:
            return call(marks.GroupingOptimizer(timed_base), dsk, keys, **kwargs)
        finally:
            events["optimize<"] = time.time()

    scheduler.stream_handlers["update-graph"] = timed_update_graph
    marks.GroupingOptimizer.__call__ = timed_call
    try:
        yield
    finally:
        scheduler.stream_handlers["update-graph"] = update_graph
        marks.GroupingOptimizer.__call__ = call


def chain_sum_builder(client: Client, gpu: bool) -> Callable[[str], Any]:
    """Builds the chain-and-sum collection over 1024 persisted blocks, named by its argument."""
    shape = (256, 384) if gpu else (64, 96)
    x = persist_on_workers(client, random_matrix(1024 * shape[0], shape[1], chunks=shape, gpu=gpu))
    return lambda name: chain_sum(x, name)


def frames_builder(client: Client, gpu: bool) -> Callable[[str], Any]:
    """Builds the frames' histograms, stacked on the host, over 216 persisted frames."""
    frames = [client.submit(make_frame, *spec, gpu=gpu, pure=False) for spec in frame_specs(1.0 if gpu else 0.1)]
    wait(frames)
    return lambda name: dask.delayed(stack_to_host)([dask.delayed(frame_pipeline, pure=False)(f) for f in frames])


WORKLOADS = {"chain-sum": chain_sum_builder, "frames": frames_builder}


def phases(client: Client, build: Callable[[str], Any], runs: int, same_keys: bool) -> list[dict[str, float]]:
    with dask_octopus.annotate():  # kernels compiled, first allocations, captured once
        client.compute(build("phases" if same_keys else "warm-up")).result()
    events: dict[str, float] = {}
    scheduler = client.cluster.scheduler  # in this process: its handlers and plugins are these objects
    stamps = Stamps()
    scheduler.add_plugin(stamps, name="octopus-phases")
    try:
        with instrumented(scheduler, events):
            return [_timed_run(client, build, run, same_keys, events, stamps) for run in range(runs)]
    finally:
        scheduler.remove_plugin(name="octopus-phases")


def _timed_run(client: Client, build: Callable[[str], Any], run: int, same_keys: bool, events: dict[str, float],
               stamps: Stamps) -> dict[str, float]:
    """The phases of one annotated compute (:func:`phases`)."""
    if same_keys:
        forget_fragments(client)
    events.clear()
    stamps.compute.clear()
    t0 = time.time()
    with dask_octopus.annotate():
        y = build("phases" if same_keys else f"phases-{run}")
        built = time.time()
        future = client.compute(y)
    future.result()
    done = time.time()
    if not stamps.compute:
        raise RuntimeError("no fragment task ran: the annotated compute was not made into a fragment")
    start, stop = min(s for s, _ in stamps.compute), max(s for _, s in stamps.compute)
    e = events
    spans = [built - t0, e["update_graph>"] - built, e["optimize>"] - e["update_graph>"], e["dask<"] - e["dask>"],
             (e["dask>"] - e["optimize>"]) + (e["optimize<"] - e["dask<"]), e["update_graph<"] - e["optimize<"],
             start - e["update_graph<"], stop - start, done - stop]
    return dict(zip(PHASES, spans, strict=True)) | {"total": done - t0}


@click.command()
@click.option("--type", "kind", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True)
@click.option("--devs", default="0", show_default=True, help="the GPU of the one worker (CUDA_VISIBLE_DEVICES)")
@click.option("--workloads", "names", type=Names(WORKLOADS), default="chain-sum,frames", show_default=True,
              help="comma-separated: chain-sum, frames")
@click.option("--runs", type=click.IntRange(min=1), default=6, show_default=True)
@click.option("--out", type=OutFolder(), default="benchmark-results", show_default=True)
@click.option("--tag", default="fragment-phases", show_default=True)
@click.option("--same-keys/--new-keys", default=False, show_default=True,
              help="chain-sum: compute the same collection each time (its plan remembered: "
                   "octopus.fragments.plan-memo), or one of new keys; the frames' calls are impure: new keys")
@protocol_option
def main(kind: str, devs: str, names: list[str], runs: int, out: str, tag: str, same_keys: bool, protocol: str) -> None:
    """Time the phases of annotated computes and write one JSON file."""
    check_cluster(kind, protocol)
    console = make_console()
    gpu = kind == "gpu"
    with local_cluster(gpu, devs if gpu else None, n_workers=1, protocol=protocol) as client:
        record = header(gpu, protocol_of(client))
        dask_octopus.register(client, calibrate=False)
        record["workloads"] = {}
        record["keys"] = "same" if same_keys else "new"
        for name in names:
            runs_ = phases(client, WORKLOADS[name](client, gpu), runs, same_keys)
            medians = {p: statistics.median(r[p] for r in runs_[1:] or runs_) for p in [*PHASES, "total"]}
            record["workloads"][name] = {"runs": runs_, "median_after_first": medians}
            console.print(f"[bold]{name}[/bold]")
            for p in [*PHASES, "total"]:
                console.print(f"{p:>14}: first {1000 * runs_[0][p]:7.1f} ms, then median {1000 * medians[p]:7.1f} ms")
    console.print(f"wrote {write_json(os.path.join(out, f'{tag}-{kind}.json'), record)}")


if __name__ == "__main__":
    main()
