"""Worker side of stream groups: run a group's members in one Dask task.

On a GPU worker (CuPy imported, a device present) the members are launched from the task's thread
over a small pool of non-blocking CUDA streams, reused across groups, in the order of
:func:`~dask_octopus.grouping.launch_order`. The pool streams first wait on an event recorded on
the stream that produced the inputs, so no member reads a block before its producer's kernels
finished; the group ends with one synchronisation of the streams it used, so results leaving the
task are complete and memory freed later on another stream cannot be reused early. Members large
enough to fill the GPU alone run on the task's own stream, as Dask would run them. A group seen
again with the same members, shapes and dtypes is captured as a CUDA graph and replayed
(:mod:`dask_octopus.graph_replay`). On a CPU worker (NumPy blocks) the members simply run one
after the other.

A member whose class is ``"auto"`` is classified from its first run (bytes moved per second
against the worker's streaming bandwidth) and remembered per function and input shapes.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import dask.config
import dask.utils

from dask_octopus.graph_replay import GraphCache, capture
from dask_octopus.grouping import launch_order

_local = threading.local()  # per worker thread: stream pools
_graph_caches: dict[int, GraphCache] = {}  # per worker thread (input buffers must not be shared)
_classes: dict[tuple, str] = {}  # (member token, shapes, dtypes) -> "compute" | "memory"
_DEFAULT_BANDWIDTH = 100e9  # bytes/s assumed when the worker was not calibrated


def _cupy() -> Any | None:
    """CuPy if the worker already uses it and a device is visible (CPU workers never import it)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return None
    try:
        return cp if cp.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


def stream_pool(cp: Any, n: int, fresh: bool = False) -> list[Any]:
    """This thread's non-blocking streams on the current device (created once, reused; ``fresh``
    replaces them, e.g. after a refused capture)."""
    pools = getattr(_local, "pools", None)
    if pools is None:
        pools = _local.pools = {}
    device = cp.cuda.runtime.getDevice()
    if fresh:
        pools.pop(device, None)
    pool = pools.setdefault(device, [])
    while len(pool) < n:
        pool.append(cp.cuda.Stream(non_blocking=True))
    return pool[:n]


def graph_cache() -> GraphCache:
    """This thread's captured groups (a graph's input buffers must not be shared between threads)."""
    cache = _graph_caches.get(threading.get_ident())
    if cache is None:
        cache = _graph_caches[threading.get_ident()] = GraphCache(dask.config.get("octopus.streams.max-graphs"),
                                                                  dask.config.get("octopus.streams.capture-after"))
    return cache


def capture_stats() -> dict[str, int]:
    """Captured and refused group signatures in this process (all threads)."""
    caches = list(_graph_caches.values())
    return {"graphs": sum(len(c.graphs) for c in caches), "refused": sum(len(c.refused) for c in caches),
            "replays": sum(c.replays for c in caches)}


def _nbytes(obj: Any) -> int:
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return int(getattr(obj, "nbytes", 0) or 0)


def _signature(token: Hashable, inputs: Sequence[Any]) -> tuple:
    return (token, tuple((getattr(a, "shape", None), str(getattr(a, "dtype", ""))) for a in inputs))


def resolve_class(declared: str, token: Hashable, inputs: Sequence[Any]) -> str | None:
    """The member's class: declared, remembered for its signature, or ``None`` (not measured yet)."""
    if declared != "auto":
        return declared
    return _classes.get(_signature(token, inputs))


def classify(token: Hashable, inputs: Sequence[Any], output: Any, seconds: float, bandwidth: float) -> str:
    """Remember the class of member ``token`` on inputs of these shapes from one run: memory-bound
    when it moved bytes at a quarter or more of the worker's streaming bandwidth, else compute-bound."""
    moved = _nbytes(list(inputs)) + _nbytes(output)
    cls = "memory" if seconds > 0 and moved / seconds >= 0.25 * bandwidth else "compute"
    _classes[_signature(token, inputs)] = cls
    return cls


def _worker_bandwidth() -> float:
    """The streaming bandwidth this worker measured at calibration, or a default."""
    try:
        from distributed import get_worker

        profile = get_worker().plugins["octopus-worker"].profile
        return float(profile.get("memory") or _DEFAULT_BANDWIDTH)
    except (ValueError, KeyError, AttributeError):
        return _DEFAULT_BANDWIDTH


def run_group(members: Sequence[Callable[..., Any]], inputs: Sequence[Sequence[Any]], declared: Sequence[str],
              tokens: Callable[[], Sequence[Hashable]]) -> list[Any]:
    """Return ``[members[i](*inputs[i]) for i ...]``, run as a group. ``declared[i]`` is the member's
    class: ``"compute"``, ``"memory"`` or ``"auto"``; ``tokens()`` (asked only on GPU workers) gives
    what identifies each member's function and constants: members with equal tokens and input
    shapes do the same work. On a CPU worker members run in launch order, ``"auto"`` as memory-bound."""
    sizes = [float(_nbytes(list(x))) for x in inputs]
    cp = _cupy()
    if cp is None:
        order = launch_order([d if d != "auto" else "memory" for d in declared], sizes)
        results: list[Any] = [None] * len(members)
        for i in order:
            results[i] = members[i](*inputs[i])
        return results
    member_tokens = tokens()
    known = [resolve_class(d, t, x) for d, t, x in zip(declared, member_tokens, inputs, strict=True)]
    order = launch_order([c or "memory" for c in known], sizes)
    streams = stream_pool(cp, max(1, min(len(members), dask.config.get("octopus.streams.max-streams"))))
    ready = cp.cuda.get_current_stream().record()
    for s in streams:
        s.wait_event(ready)
    if None not in known and dask.config.get("octopus.streams.capture"):
        signature = (tuple(_signature(t, x) for t, x in zip(member_tokens, inputs)), tuple(known))
        cache = graph_cache()
        graph = cache.get(signature)
        if graph is None and cache.should_capture(signature):
            graph = capture(cp, members, inputs, order, streams)
            cache.add(signature, graph)
            if graph is None:
                streams = stream_pool(cp, len(streams), fresh=True)
                for s in streams:
                    s.wait_event(ready)
        if graph is not None:
            cache.replays += 1
            results = graph.replay(cp, inputs, streams[0])
            streams[0].synchronize()
            return results
    return run_on_streams(cp, members, member_tokens, inputs, known, order, streams, sizes)


def run_on_streams(cp: Any, members: Sequence[Callable[..., Any]], tokens: Sequence[Hashable],
                   inputs: Sequence[Sequence[Any]], known: list[str | None], order: list[int],
                   streams: list[Any], sizes: Sequence[float]) -> list[Any]:
    """Launch the members in ``order``: the small ones round-robin over ``streams``, then one
    synchronisation of those streams; members whose inputs (``sizes[i]`` bytes) are
    ``octopus.streams.large-bytes`` or more each fill the GPU alone, so they run on the task's
    current stream exactly as Dask would run them (in order, returned at launch, no extra
    synchronisation). Members of unknown class
    (``known[i] is None``) are timed with events and classified."""
    large = dask.utils.parse_bytes(dask.config.get("octopus.streams.large-bytes"))
    current = cp.cuda.get_current_stream()
    results: list[Any] = [None] * len(members)
    timed: dict[int, tuple[Any, Any]] = {}
    small = 0
    for i in order:
        if sizes[i] >= large:
            s = current
        else:
            s = streams[small % len(streams)]
            small += 1
        with s:
            start = s.record() if known[i] is None else None
            results[i] = members[i](*inputs[i])
            if start is not None:
                timed[i] = (start, s.record())
    for s in streams[:small]:
        s.synchronize()
    for i, (start, end) in timed.items():
        end.synchronize()
        classify(tokens[i], inputs[i], results[i], cp.cuda.get_elapsed_time(start, end) / 1e3, _worker_bandwidth())
    return results
