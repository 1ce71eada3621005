"""CUDA graph capture and replay of a repeated stream group.

When a group with the same member functions, input shapes and dtypes runs again, its launches are
captured once into a CUDA graph (forked over the group's streams and joined back, as Opara does, or
on one stream where a fragment's streams would hold too much memory) and replayed: a graph captured
on the very input buffers it is given again (persisted blocks or items) reads them in place, others
copy new inputs into the graph's own input buffers; the graph is launched and its outputs are copied out.
Allocations made while capturing come from a memory pool private to the graph, so the addresses
baked into it are never handed to anything else. Capture refused (cuBLAS, cuRAND, a host
synchronisation, outputs that are not CuPy arrays, an FFT: the graph would read a cuFFT plan that
CuPy's plan cache frees when it holds 16 others, and a replay then crashes the worker; no device
memory left for the copies of the inputs) is remembered per group signature, and that group keeps
running eagerly.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from dask_octopus._compat import counting_ffts


class CaptureRefused(RuntimeError):
    """CUDA or CuPy refused to capture a group; the message says why."""


class CapturedGroup:
    """A captured group or fragment: the graph, the buffers it reads (``None``: it reads its inputs in
    place, the very buffers it was captured on) and writes, the pool it allocated from, the number
    of streams it forks over, and what its launches read besides their inputs (the members' or steps'
    constants and closures: device arrays among them are read by every replay, at the addresses of
    the capture, so they live as long as the graph)."""

    def __init__(self, graph: Any, inputs: list[Any] | None, outputs: list[Any], pool: Any, streams: int = 1,
                 constants: Any = None):
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.pool = pool
        self.streams = streams
        self.constants = constants

    def held_bytes(self) -> int:
        """The device memory the graph holds: its private pool (its intermediates and outputs) and the
        buffers its inputs are copied into."""
        return int(self.pool.total_bytes()) + sum(x.nbytes for x in self.inputs or ())

    def replay(self, cp: Any, inputs: Sequence[Any], stream: Any, into: Any) -> list[Any]:
        """Copy ``inputs`` in (unless read in place) and launch on ``stream``; return copies of the
        outputs made on ``into`` (the task's stream: the memory of a copy that its readers free goes
        back to that stream's part of CuPy's pool, where later work is ordered after theirs), once
        they are there."""
        with stream:
            if self.inputs is not None:  # None: the graph reads the inputs in place
                for dst, src in zip(self.inputs, inputs, strict=True):
                    cp.copyto(dst, src)
            self.graph.launch(stream)
        into.wait_event(stream.record())
        with into:
            outputs = [out.copy() for out in self.outputs]
        into.record().synchronize()
        return outputs


def _is_device_array(cp: Any, obj: Any) -> bool:
    return isinstance(obj, cp.ndarray)


def _capture(cp: Any, streams: Sequence[Any], launch: Callable[[], Any]) -> tuple[Any, Any, Any]:
    """Capture ``launch()`` (launches over ``streams``, forked from and joined back to the first) with
    allocations from a pool private to the graph; returns the graph, the pool and what ``launch``
    returned, or raises :class:`CaptureRefused` when CUDA or CuPy refuses."""
    origin = streams[0]
    pool = cp.cuda.MemoryPool(allocator=_allocator(cp))
    try:
        with cp.cuda.using_allocator(pool.malloc), origin, counting_ffts() as ffts:
            origin.begin_capture()
            try:
                fork = origin.record()
                for s in streams[1:]:
                    s.wait_event(fork)
                launched = launch()
                for s in streams[1:]:
                    origin.wait_event(s.record())
            except BaseException:  # the capture ends; the launch's error is the reason (CUDA's own, on ending
                with contextlib.suppress(Exception):  # a capture that a refused call invalidated, says less)
                    origin.end_capture()
                raise
            graph = origin.end_capture()
    except Exception as e:
        raise CaptureRefused(f"{type(e).__name__}: {e}") from e
    if ffts[0]:
        raise CaptureRefused(f"{ffts[0]} FFTs: a CUDA graph does not hold the cuFFT plans it reads")
    return graph, pool, launched


def _allocator(cp: Any) -> Callable[[int], Any]:
    """The allocator of a graph's private pool: ``cudaMalloc``, whose failure refuses the capture
    (:class:`CaptureRefused`). Given CUDA's out-of-memory error, CuPy's pool would free its free blocks
    and try again, but a private pool's free blocks are intermediates freed inside the capture, whose
    memory the kernels recorded so far still use: another allocation, or another process, could then
    be handed that memory, and every replay would write into it."""
    def malloc(nbytes: int) -> Any:
        try:
            return cp.cuda.MemoryPointer(cp.cuda.Memory(nbytes), 0)
        except cp.cuda.runtime.CUDARuntimeError as e:
            raise CaptureRefused(f"device memory ran out while capturing ({e})") from None

    return malloc


def _copies(xs: Any) -> list[Any]:
    """Copies of the arrays ``xs`` for a graph to read; :class:`CaptureRefused` where they do not fit."""
    try:
        return [x.copy() for x in xs]
    except Exception as e:  # (CuPy's OutOfMemoryError): the group runs eagerly, as it did
        raise CaptureRefused(f"copying the inputs: {type(e).__name__}: {e}") from e


def _check_outputs(cp: Any, outputs: Sequence[Any]) -> None:
    if not all(_is_device_array(cp, out) for out in outputs):
        raise CaptureRefused("an output is not a CuPy array")


def capture(cp: Any, members: Sequence[Callable[..., Any]], inputs: Sequence[Sequence[Any]], order: Sequence[int],
            streams: Sequence[Any], in_place: bool = False) -> CapturedGroup:
    """Capture the group's launches (not run), members round-robin over ``streams`` in ``order``,
    reading the inputs in place (the very buffers of each replay: persisted items) or from copies;
    raises :class:`CaptureRefused` when CUDA or CuPy refuses. The streams must already wait for the
    inputs."""
    if not all(_is_device_array(cp, x) for xs in inputs for x in xs):
        raise CaptureRefused("an input is not a CuPy array")
    with streams[0]:
        static = [list(xs) if in_place else _copies(xs) for xs in inputs]
    outputs: list[Any] = [None] * len(members)

    def launch() -> None:
        for slot, i in enumerate(order):
            with streams[slot % len(streams)]:
                outputs[i] = members[i](*static[i])

    graph, pool, _ = _capture(cp, streams, launch)
    _check_outputs(cp, outputs)
    return CapturedGroup(graph, None if in_place else [x for xs in static for x in xs], outputs, pool, len(streams),
                         members)


def capture_fragment(cp: Any, launch: Callable[[dict, Sequence[Any]], Any], values: dict, inputs: Sequence[Hashable],
                     outputs: Sequence[Hashable], streams: Sequence[Any], in_place: bool,
                     constants: Any = None) -> CapturedGroup:
    """Capture ``launch(values, streams)`` (a fragment's launches over ``streams``, reading ``constants``
    besides its inputs: the steps' specs) reading the input values of ``values`` at the keys ``inputs``
    in place or from copies, the results being those at ``outputs``; raises :class:`CaptureRefused`
    when CUDA or CuPy refuses. The streams must already wait for the inputs."""
    given = [values[k] for k in inputs]
    with streams[0]:
        static = dict(zip(inputs, given if in_place else _copies(given), strict=True))
    captured = dict(static)
    # what launch holds for other streams is dropped after the capture: the private pool is never
    # allocated from again, so what it holds stays the graph's
    graph, pool, _ = _capture(cp, streams, lambda: launch(captured, streams))
    results = [captured[o] for o in outputs]
    _check_outputs(cp, results)
    return CapturedGroup(graph, None if in_place else [static[k] for k in inputs], results, pool, len(streams),
                         constants)


class GraphCache:
    """Cache of one worker thread's captured groups by signature, with the signatures that refused capture.
    A group is captured the ``after``-th time its signature is seen (the first runs are eager, to
    warm up and classify its members); at most ``size`` graphs holding at most ``max_bytes`` in all
    (``None``: any) are kept, the least recently used going first."""

    def __init__(self, size: int = 64, after: int = 1, max_bytes: float | None = None):
        self.size = size
        self.after = after
        self.max_bytes = max_bytes
        self.graphs: OrderedDict[Hashable, CapturedGroup] = OrderedDict()
        self.nbytes: dict[Hashable, int] = {}  # what each graph holds
        self.bytes = 0  # what they hold in all
        self.refused: OrderedDict[Hashable, None] = OrderedDict()
        self.seen: OrderedDict[Hashable, int] = OrderedDict()
        self.replays = 0

    def get(self, signature: Hashable) -> CapturedGroup | None:
        graph = self.graphs.get(signature)
        if graph is not None:
            self.graphs.move_to_end(signature)
        return graph

    def should_capture(self, signature: Hashable) -> bool:
        """Count a sighting; true when it is time to capture this signature."""
        if signature in self.refused or signature in self.graphs:
            return False
        self.seen[signature] = n = self.seen.pop(signature, 0) + 1
        while len(self.seen) > 16 * self.size:  # signatures seen once and never again (new input buffers)
            self.seen.popitem(last=False)
        return n > self.after

    def drop_graphs(self) -> None:
        """Drop every graph kept (their memory goes with the last reference to each)."""
        self.graphs.clear()
        self.nbytes.clear()
        self.bytes = 0

    def fits(self, nbytes: int) -> bool:
        """Whether a graph holding ``nbytes`` may be kept (alone, if need be)."""
        return self.max_bytes is None or nbytes <= self.max_bytes

    def add(self, signature: Hashable, graph: CapturedGroup | None, nbytes: int = 0) -> None:
        """Keep ``graph`` (holding ``nbytes``: :meth:`CapturedGroup.held_bytes`) for ``signature``, dropping
        the least recently used graphs beyond ``size`` or ``max_bytes``; ``None``: the capture was refused."""
        self.seen.pop(signature, None)
        if graph is None:
            self.refused[signature] = None
            while len(self.refused) > 16 * self.size:
                self.refused.popitem(last=False)
            return
        self.graphs[signature] = graph
        self.nbytes[signature] = nbytes
        self.bytes += nbytes
        while len(self.graphs) > self.size or (len(self.graphs) > 1 and not self.fits(self.bytes)):
            self.bytes -= self.nbytes.pop(self.graphs.popitem(last=False)[0])
