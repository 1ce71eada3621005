"""Worker side of fragments and ``map`` batches: run many small tasks in one Dask task.

:func:`run_fragment` runs a fragment (:mod:`dask_octopus.groups.fragment`): on a CPU worker its steps
one after the other; on a GPU worker (CuPy imported, a device present) its chains over a small pool
of non-blocking CUDA streams, reused across tasks, with events where a step reads another stream's
result and one synchronisation at the end; a fragment seen again is captured as one CUDA graph and
replayed (:mod:`dask_octopus.groups.replay`). :func:`run_group` runs independent members (the items
of a ``map`` batch) over the same pool in the order of
:func:`~dask_octopus.groups.planning.launch_order`; members large enough to fill the GPU alone run on
the task's own stream, as Dask would run them. A member whose class is ``"auto"`` is classified from
its first run (bytes moved per second against the worker's streaming bandwidth) and remembered per
function and input shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import copyreg
import functools
import logging
import sys
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import dask.utils
import numpy as np
import tblib
from dask.sizeof import sizeof
from distributed import Reschedule
from distributed.protocol.pickle import dumps, loads

from dask_octopus import config
from dask_octopus._compat import Task
from dask_octopus.groups.collector import collector_paused
from dask_octopus.groups.fragment import Fragment, evaluate, step_key
from dask_octopus.groups.planning import arena_peak, assign_streams, launch_order
from dask_octopus.groups.replay import CapturedGroup, CaptureRefused, GraphCache, capture, capture_fragment
from dask_octopus.plugins.messages import DONE_SHARE

logger = logging.getLogger(__name__)
EXTENSION = "octopus-streams"  #: the name of the :class:`StreamRuntime` in ``Worker.extensions``
#: the key under which the worker plugin reports :meth:`StreamRuntime.stats` in each heartbeat
#: (``Worker.metrics``, hence ``WorkerState.metrics`` on the scheduler)
HEARTBEAT_KEY = "octopus"


def _cupy() -> Any | None:
    """CuPy if the worker already uses it and a device is visible (CPU workers never import it)."""
    cp = sys.modules.get("cupy")
    if cp is None:
        return None
    try:
        return cp if cp.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


@functools.lru_cache(maxsize=16)
def _bytes(size: str | int) -> int:
    """``size`` in bytes (``parse_bytes`` on the hot path of every group, parsed once per value)."""
    return dask.utils.parse_bytes(size)


def _dtype(value: Any) -> Hashable:
    """The dtype of ``value``: NumPy's (also CuPy's) as it is, hashed and compared by value (its name takes
    microseconds to make: 2.4 ms for the 1024 inputs of a fragment on the 2-core machine), others by name."""
    dtype = getattr(value, "dtype", "")
    return dtype if isinstance(dtype, np.dtype) else str(dtype)


def _signature(token: Hashable, inputs: Sequence[Any]) -> tuple:
    return (token, tuple((getattr(a, "shape", None), _dtype(a)) for a in inputs))


class StreamRuntime:
    """What stream groups keep on one worker (a worker extension, :data:`EXTENSION`): each worker
    thread's CUDA stream pool and captured groups (a graph's input buffers must not be shared between
    threads), and the classes of the members measured so far. Bounded: ``max_graphs`` graphs per
    thread, ``max_classes`` member classes. Arguments left ``None`` come from ``dask.config``
    (``octopus.streams.*``), read once here.
    """

    #: streaming bytes/s of this worker (its calibration, once known): members that move bytes at a
    #: quarter of it or more are memory-bound
    bandwidth: float
    #: captured groups kept per thread, least recently used dropped
    max_graphs: int
    #: eager runs of a group before it is captured
    capture_after: int
    #: bytes the captured groups of a thread may hold (least recently used dropped)
    max_graph_bytes: float
    #: remembered member classes, least recently used dropped
    max_classes: int
    #: member signature -> ``"compute"`` or ``"memory"``
    classes: OrderedDict[tuple, str]
    #: why the latest capture on this worker was refused
    last_refusal: str | None
    #: groups run on this worker, and the tasks inside them
    groups: int
    members: int

    def __init__(self, max_graphs: int | None = None, capture_after: int | None = None,
                 max_classes: int = 4096, bandwidth: float = 100e9):
        self.max_graphs = config.get("streams.max-graphs", max_graphs, "max_graphs")
        self.capture_after = config.get("streams.capture-after", capture_after, "capture_after")
        self.max_graph_bytes = _bytes(config.get("streams.max-graph-bytes"))
        self.max_classes = max_classes
        self.bandwidth = bandwidth
        self.classes = OrderedDict()
        self.layouts: OrderedDict[tuple, FragmentLayout] = OrderedDict()
        self.spreads: OrderedDict[tuple, bool] = OrderedDict()  # see eager_layout
        self.last_refusal = None
        self.groups = self.members = 0
        self._local = threading.local()
        self._caches: list[tuple[threading.Thread, GraphCache]] = []  # each thread's (graph_cache)
        self._replays_gone = 0  # replays of the caches of threads that ended
        self._lock = threading.Lock()

    def streams(self, cp: Any, n: int, fresh: bool = False) -> list[Any]:
        """This thread's non-blocking streams on the current device (created once, reused; ``fresh``
        replaces them, e.g. after a refused capture)."""
        pools = getattr(self._local, "pools", None)
        if pools is None:
            pools = self._local.pools = {}
        device = cp.cuda.runtime.getDevice()
        if fresh:
            pools.pop(device, None)
        pool = pools.setdefault(device, [])
        while len(pool) < n:
            pool.append(cp.cuda.Stream(non_blocking=True))
        return pool[:n]

    def layout(self, fragment: Fragment, streams: int | None = None) -> FragmentLayout:
        """The fragment's :class:`FragmentLayout` over ``streams`` streams (``None``:
        ``octopus.streams.max-streams``), made once per shape of fragment seen on this worker (which
        steps read which: the same work on new keys has the same layout) and remembered with the graphs."""
        streams = config.get("streams.max-streams") if streams is None else streams
        shape = (fragment.deps, streams)
        with self._lock:
            layout = self.layouts.get(shape)
            if layout is not None:
                self.layouts.move_to_end(shape)
                return layout
        layout = FragmentLayout(fragment, streams)
        with self._lock:
            self.layouts[shape] = layout
            while len(self.layouts) > 2 * self.max_graphs:  # a fragment's layouts on one stream and on the pool
                self.layouts.popitem(last=False)
        return layout

    def eager_layout(self, cp: Any, fragment: Fragment, inputs: Sequence[Any]) -> FragmentLayout:
        """The layout of an eager run of ``fragment`` on ``inputs``: over the pool's streams
        (:meth:`layout`), or on one stream where those would hold more than one stream does plus the
        largest input (:func:`_extra_bytes`: more streams buy no speed in an eager run, whose launches
        are bound by Python). Estimated once per fragment shape and input sizes (a few milliseconds
        for a few thousand steps), and remembered with the layouts."""
        full = self.layout(fragment)
        if full.used == 1:
            return full
        key = (fragment.reads, fragment.results, full.used,
               tuple(x.nbytes if isinstance(x, cp.ndarray) else None for x in inputs))
        with self._lock:
            spread = self.spreads.get(key)
            if spread is not None:
                self.spreads.move_to_end(key)
        if spread is None:
            spread = _extra_bytes(self, cp, fragment, full, inputs) <= 0
            with self._lock:
                self.spreads[key] = spread
                while len(self.spreads) > 2 * self.max_graphs:
                    self.spreads.popitem(last=False)
        return full if spread else self.layout(fragment, 1)

    def graph_cache(self) -> GraphCache:
        """This thread's captured groups (those of threads that ended are dropped: :meth:`_live_caches`)."""
        cache = getattr(self._local, "graphs", None)
        if cache is None:
            cache = self._local.graphs = GraphCache(self.max_graphs, self.capture_after, self.max_graph_bytes)
            with self._lock:
                self._live_caches()
                self._caches.append((threading.current_thread(), cache))
        return cache

    def _live_caches(self) -> list[GraphCache]:
        """The graph caches of the threads alive, those of threads that ended being dropped (with the lock
        held): Dask replaces a worker's threads (a task that secedes, as ``worker_client`` does, leaves
        its slot to a new thread and its own ends), and their graphs, never replayed again, would hold
        device memory beyond any cache's ``max-graph-bytes``. Their replays stay counted."""
        live = []
        for thread, cache in self._caches:
            if thread.is_alive():
                live.append((thread, cache))
            else:
                self._replays_gone += cache.replays
                cache.drop_graphs()
        self._caches = live
        return [cache for _, cache in live]

    def stats(self) -> dict[str, Any]:
        """Groups run and their tasks, captured group signatures (those read in place, those forked over
        several streams, the bytes they hold) and refused ones, graph replays on this worker (all
        threads, those that ended included), and why the latest capture was refused. The worker plugin
        sends it to the scheduler with each heartbeat, for the dashboard."""
        with self._lock:
            caches = self._live_caches()
            groups, members, replays = self.groups, self.members, self._replays_gone
        graphs = [g for c in caches for g in list(c.graphs.values())]  # a copy: worker threads change them
        return {"groups": groups, "members": members, "graphs": len(graphs),
                "graphs_in_place": sum(g.inputs is None for g in graphs),
                "graph_bytes": sum(g.held_bytes() for g in graphs),
                "graphs_on_streams": sum(g.streams > 1 for g in graphs),
                "refused": sum(len(c.refused) for c in caches), "replays": replays + sum(c.replays for c in caches),
                "last_refusal": self.last_refusal}

    def count(self, members: int) -> None:
        """Count one group of ``members`` tasks run."""
        with self._lock:
            self.groups += 1
            self.members += members

    def resolve_class(self, declared: str, token: Hashable, inputs: Sequence[Any]) -> str | None:
        """The member's class: declared, remembered for its signature, or ``None`` (not measured yet)."""
        if declared != "auto":
            return declared
        signature = _signature(token, inputs)
        with self._lock:  # threads of a worker share the classes
            cls = self.classes.get(signature)
            if cls is not None:
                self.classes.move_to_end(signature)
        return cls

    def classify(self, token: Hashable, inputs: Sequence[Any], output: Any, seconds: float) -> str:
        """Remember the class of member ``token`` on inputs of these shapes from one run: memory-bound
        when it moved bytes at a quarter or more of :attr:`bandwidth`, else compute-bound."""
        moved = sizeof(list(inputs)) + sizeof(output)
        cls = "memory" if seconds > 0 and moved / seconds >= 0.25 * self.bandwidth else "compute"
        with self._lock:
            self.classes[_signature(token, inputs)] = cls
            while len(self.classes) > self.max_classes:
                self.classes.popitem(last=False)
        return cls

    def close(self) -> None:
        """Drop the captured graphs and stream pools, and forget the layouts and member classes
        learned (the worker plugin's teardown; used again, the runtime learns them afresh, counts
        replays and refused signatures anew, and keeps counting groups and its latest refusal)."""
        with self._lock:
            for _, cache in self._caches:
                cache.drop_graphs()
            self._caches.clear()
            self._replays_gone = 0  # (the replays went with the caches)
            self.layouts.clear()
            self.spreads.clear()
            self.classes.clear()
        self._local = threading.local()


_process_runtime: StreamRuntime | None = None  # outside a worker (a local scheduler in this process)
_switching = threading.Lock()
_launching = 0  # threads of this process in :func:`launching`
_saved_interval = 0.0  # the switch interval before the first of them
_set_interval = 0.0  # the one they set (as Python reads it back)


@contextlib.contextmanager
def launching() -> Iterator[None]:
    """Python's thread switch interval at most ``octopus.streams.switch-interval`` while the kernels of a
    fragment or ``map`` batch are launched (the process's setting: shortened when the first thread of the
    process starts launching, restored when the last one ends unless something else changed it meanwhile;
    ``off`` leaves it as it is).

    CuPy releases the GIL around each launch, and a thread that always wants it takes it then: Dask's
    event loop on a UCX worker polls the comms' pending receives without sleeping (distributed-ucxx's
    default progress mode), and the launching thread waits up to a switch interval (5 ms by default) to
    get the GIL back, about ten thousand times per second of launches. At 0.1 ms a loop of launches in a
    dask-cuda worker over UCX took 239 ms instead of 321
    (``benchmarks/results/2026-12-01-h200-ucx-progress/README.md``)."""
    global _launching, _saved_interval, _set_interval
    interval = _seconds(config.get("streams.switch-interval"))
    if interval is None:
        yield
        return
    with _switching:
        if _launching == 0:
            _saved_interval = sys.getswitchinterval()
            # (Python keeps whole microseconds: one set under 1us reads back as 0, which it refuses)
            sys.setswitchinterval(max(1e-6, min(interval, _saved_interval)))
            _set_interval = sys.getswitchinterval()
        _launching += 1
    try:
        yield
    finally:
        with _switching:
            _launching -= 1
            if _launching == 0 and sys.getswitchinterval() == _set_interval:
                sys.setswitchinterval(max(1e-6, _saved_interval))


def _seconds(value: str | float | bool) -> float | None:
    """``value`` (a duration, or ``off``: ``None``; YAML reads an unquoted ``off`` as false) in seconds."""
    return None if value is False or value == "off" else dask.utils.parse_timedelta(value)


def runtime() -> StreamRuntime:
    """The :class:`StreamRuntime` of the worker running this task (made on first use if the worker
    plugin did not install one), or the process's own outside a worker."""
    from distributed import get_worker

    global _process_runtime
    try:
        worker = get_worker()
    except ValueError:
        if _process_runtime is None:
            _process_runtime = StreamRuntime()
        return _process_runtime
    rt = worker.extensions.get(EXTENSION)
    if rt is None:
        rt = worker.extensions.setdefault(EXTENSION, StreamRuntime())
    return rt


def run_group(members: Sequence[Callable[..., Any]], inputs: Sequence[Sequence[Any]], declared: Sequence[str],
              tokens: Callable[[], Sequence[Hashable]]) -> list[Any]:
    """Return ``[members[i](*inputs[i]) for i ...]``, run as a group. ``declared[i]`` is the member's
    class: ``"compute"``, ``"memory"`` or ``"auto"``; ``tokens()`` (asked only on GPU workers) gives
    what identifies each member's function and constants: members with equal tokens and input
    shapes do the same work. On a CPU worker members run in launch order, ``"auto"`` as memory-bound."""
    sizes = [float(sizeof(list(x))) for x in inputs]
    rt = runtime()
    rt.count(len(members))
    cp = _cupy()
    if cp is None:
        order = launch_order([d if d != "auto" else "memory" for d in declared], sizes)
        results: list[Any] = [None] * len(members)
        for i in order:
            results[i] = members[i](*inputs[i])
        return results
    member_tokens = tokens()
    with launching():
        return _run_group_on_gpu(cp, rt, members, inputs, declared, member_tokens, sizes)


def _run_group_on_gpu(cp: Any, rt: StreamRuntime, members: Sequence[Callable[..., Any]],
                      inputs: Sequence[Sequence[Any]], declared: Sequence[str], member_tokens: Sequence[Hashable],
                      sizes: Sequence[float]) -> list[Any]:
    """:func:`run_group` on a GPU worker: captured and replayed, or launched over the thread's streams."""
    known = [rt.resolve_class(d, t, x) for d, t, x in zip(declared, member_tokens, inputs, strict=True)]
    order = launch_order([c or "memory" for c in known], sizes)
    n = max(1, min(len(members), config.get("streams.max-streams")))
    ready = cp.cuda.get_current_stream().record()
    if None not in known and config.get("streams.capture"):
        flat = [x for xs in inputs for x in xs]
        signature = (tuple(_signature(t, x) for t, x in zip(member_tokens, inputs)), tuple(known))

        def make(in_place: bool) -> CapturedGroup | None:
            return _capture_within(rt, cp, lambda k: capture(cp, members, inputs, order,
                                                             _ready_streams(rt, cp, k, ready), in_place),
                                   n, max((x.nbytes for x in flat if isinstance(x, cp.ndarray)), default=0))

        cache = rt.graph_cache()
        graph = _cached_graph(cache, signature, _pointers(cp, flat), make)
        if graph is not None:
            cache.replays += 1
            stream = _ready_streams(rt, cp, 1, ready)[0]
            return graph.replay(cp, flat, stream, cp.cuda.get_current_stream())
    streams = _ready_streams(rt, cp, n, ready)  # (fresh ones where a capture was refused)
    return handed_over(cp, run_on_streams(cp, rt, members, member_tokens, inputs, known, order, streams, sizes))


def _nbytes(cp: Any, value: Any) -> int:
    """``sizeof(value)``, for a CuPy array without Dask's dispatch (run for each input of a fragment)."""
    return value.nbytes if type(value) is cp.ndarray else sizeof(value)


def _pointers(cp: Any, inputs: Sequence[Any]) -> tuple | None:
    """Where ``inputs`` lie on the device (``None`` unless all are CuPy arrays)."""
    if not all(isinstance(x, cp.ndarray) for x in inputs):
        return None
    return tuple((x.data.ptr, x.strides) for x in inputs)


def _cached_graph(cache: GraphCache, shapes: Hashable, pointers: tuple | None,
                  make: Callable[[bool], CapturedGroup | None]) -> CapturedGroup | None:
    """The graph of ``cache`` for a group or fragment of signature ``shapes`` whose inputs lie at
    ``pointers`` (:func:`_pointers`; ``None``: not all device arrays, whose capture is refused): one
    captured on these very buffers, which it reads in place, else one that copies its inputs in. Where
    there is none and the cache says it is time, ``make(in_place)`` captures one: in place where these
    buffers came before (persisted blocks, items the workers hold), else copying (inputs that change
    from run to run then share one graph). A refusal (``None``) does not depend on the buffers: it is
    remembered for the shapes, whatever the buffers."""
    placed = (shapes, pointers) if pointers is not None else None
    graph = (cache.get(placed) if placed is not None else None) or cache.get(shapes)
    if graph is not None or shapes in cache.refused:
        return graph
    again = placed is not None and placed in cache.seen  # these very buffers came before
    in_place = placed is not None and cache.should_capture(placed) and again  # (counts this sighting)
    if not in_place and not cache.should_capture(shapes):
        return None
    graph = make(in_place)
    nbytes = graph.held_bytes() if graph is not None else 0
    if not cache.fits(nbytes):  # replayed this once, then the shapes run eagerly
        logger.debug("dask_octopus: a graph of %d bytes is not kept (octopus.streams.max-graph-bytes)", nbytes)
        cache.add(shapes, None)
        return graph
    cache.add(placed if in_place and graph is not None else shapes, graph, nbytes)
    return graph


def run_on_streams(cp: Any, rt: StreamRuntime, members: Sequence[Callable[..., Any]], tokens: Sequence[Hashable],
                   inputs: Sequence[Sequence[Any]], known: list[str | None], order: list[int],
                   streams: list[Any], sizes: Sequence[float]) -> list[Any]:
    """Launch the members in ``order``: the small ones round-robin over ``streams``, then one
    synchronisation of those streams; members whose inputs (``sizes[i]`` bytes) are
    ``octopus.streams.large-bytes`` or more each fill the GPU alone, so they run on the task's
    current stream exactly as Dask would run them (in order, returned at launch, no extra
    synchronisation). Members of unknown class
    (``known[i] is None``) are timed with events and classified in ``rt``."""
    large = _bytes(config.get("streams.large-bytes"))
    current = cp.cuda.get_current_stream()
    results: list[Any] = [None] * len(members)
    timed: dict[int, tuple[Any, Any]] = {}
    small = 0
    try:
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
    finally:  # also when a member raises: the members launched before it must end before their inputs go
        for s in streams[:small]:
            s.synchronize()
    for i, (start, end) in timed.items():
        end.synchronize()
        rt.classify(tokens[i], inputs[i], results[i], cp.cuda.get_elapsed_time(start, end) / 1e3)
    return results


class FragmentLayout:
    """How a fragment runs on a GPU worker: the stream of each step (:func:`assign_streams`), the
    steps whose result another stream reads (an event is recorded after them, and their values stay
    alive until the fragment's end: memory freed while another stream may still read it could be
    reused early), and the bytes CuPy's pool would hold after an eager run on these streams."""

    def __init__(self, fragment: Fragment, streams: int):
        self.streams = assign_streams(fragment.deps, streams)
        self.used = len(set(self.streams))
        self.shared = {j for i, deps in enumerate(fragment.deps) for j in deps if self.streams[j] != self.streams[i]}

    def pool_bytes(self, fragment: Fragment, sizes: Mapping[Any, float]) -> float:
        """The estimated bytes CuPy's pool holds after an eager run of ``fragment`` on these streams
        (:func:`arena_peak`: one arena per stream; values read by another stream held to the end; each
        step taken to need temporaries as large as its result while it runs), ``sizes`` being the
        inputs' bytes."""
        estimated, frees = fragment.estimate(sizes)
        return arena_peak(estimated, [[i for i in f if i not in self.shared] for f in frees], self.streams,
                          estimated)


class HeldError:
    """An exception held as a value in place of a result (:class:`StepFailed`, a ``map`` item's
    :class:`~dask_octopus.placement.items.ItemError`). Its traceback is kept as a copy of its frames'
    code and lines (as distributed sends a task's): the frames would keep the locals of the failed call
    and of its callers up the stack (a fragment's or a batch's inputs) alive as long as this value
    lives, which Dask's memory accounting does not see.
    Readers ``raise held.exception()``."""

    __slots__ = ("_sent", "error", "traceback")

    def __init__(self, error: BaseException, note: str | None = None):
        tb = error.__traceback__
        self.error = detached(error)
        if note is not None:
            self.error.add_note(note)
        self.traceback = tblib.Traceback(tb) if tb is not None else None
        self._sent: BaseException | None = None  # the error as it travels (found at the first send)

    def __reduce__(self) -> tuple:
        # so that the other results beside it still reach other workers, and the spill; with the copy
        # of the traceback (a reader on another worker raises it with the failed call's frames)
        if self._sent is None:
            self._sent = sendable(self.error)
        return _held, (type(self), self._sent, self.traceback)

    def exception(self) -> BaseException:
        """A copy of ``error`` (:func:`detached`, its notes kept) with a traceback made from the copy of its
        frames, for a reader to raise: each reader its own exception and traceback, since Python adds
        the frames an exception passes through to the object raised, and readers raising one object,
        one after another or in threads at once, would stack their frames onto one another's. A
        ``StopIteration`` comes as a ``RuntimeError`` caused by it (its notes kept), as Python turns one
        raised inside a generator: a reader inside the arguments of a task (:func:`pick`) runs in the
        ``map`` with which Dask evaluates them, where a ``StopIteration`` would end the arguments there,
        and the task would run on those before it."""
        tb = self.traceback.as_traceback() if self.traceback is not None else None
        error = detached(self.error).with_traceback(tb)
        if not isinstance(error, StopIteration):
            return error
        wrapped = RuntimeError(f"a task raised {type(error).__name__}")
        for note in getattr(error, "__notes__", ()):
            wrapped.add_note(note)
        wrapped.__cause__ = error
        return wrapped


def _held(cls: type[HeldError], error: BaseException, traceback: tblib.Traceback | None) -> HeldError:
    """A :class:`HeldError` as it arrives (:meth:`HeldError.__reduce__`): ``error`` came through pickle,
    so it has no frames and travels as it is again."""
    held = cls.__new__(cls)
    held.error, held.traceback, held._sent = error, traceback, error
    return held


_BUILTIN_REDUCERS = (OSError.__reduce__, BaseException.__reduce__)


def _rebuilt(error: BaseException, args: tuple) -> BaseException:
    """A new exception of ``error``'s class made as tblib makes one, without calling its ``__init__``:
    ``__new__`` given ``args`` (one of the class's own may want them; a group's are its message and
    parts), then ``args``, its slots and, for an ``OSError``, its fields (``__dict__`` is the caller's
    to copy). Raises where the class does not let itself be made so."""
    cls = type(error)
    copied = cls.__new__(cls, *args)
    copied.args = args
    for attr in copyreg._slotnames(cls):
        if hasattr(error, attr):
            setattr(copied, attr, getattr(error, attr))
    if isinstance(error, OSError):
        for attr in ("errno", "strerror", "filename", "filename2"):
            if (value := getattr(error, attr)) is not None:
                setattr(copied, attr, value)
    return copied


def _copy_error(error: BaseException) -> BaseException:
    """A shallow copy of ``error``. An exception class with an ``__init__`` of its own in Python but
    Python's reducer (``cls(*args)``) is made without calling that ``__init__`` (:func:`_rebuilt`), as
    tblib (distributed's) rebuilds it: such an ``__init__`` often formats its arguments into the message
    it gives ``Exception`` (``Wrapped("boom")`` with the message ``"wrapped(boom)"``), and called again on
    the formatted ``args`` it would format them twice, or fail where it takes other arguments than it
    passes on."""
    cls = type(error)
    if cls.__reduce__ not in _BUILTIN_REDUCERS or not isinstance(cls.__init__, types.FunctionType):
        return copy.copy(error)  # rebuilt by its own reducer, or by an __init__ in C (Python's own classes)
    try:
        return _rebuilt(error, error.args)
    except Exception:  # a __new__ of its own that wants other arguments, an args without a setter: as pickle would
        return copy.copy(error)


def _copy_group(group: BaseExceptionGroup, copies: dict[int, BaseException]) -> BaseException:
    """A copy of ``group`` (an ``ExceptionGroup``) holding detached copies of its exceptions (their frames
    would keep their calls' locals alive as the group's own would), made by :func:`_rebuilt` (else as
    :func:`_copy_error` makes one, its exceptions the caller's)."""
    try:
        return _rebuilt(group, (group.message, [detached(e, copies) for e in group.exceptions]))
    except Exception:  # a __new__ of its own that wants other arguments
        return _copy_error(group)


def detached(error: BaseException, _copies: dict[int, BaseException] | None = None) -> BaseException:
    """A copy of ``error`` without frames: no traceback, and its cause and context (``raise ... from``,
    a raise inside ``except``) copied likewise, as their frames would keep the failed call's locals
    and its callers' (a fragment's inputs) alive, and an exception group's exceptions likewise. The
    caller's object is left as it is (one exception object raised by several members, a cached failure
    raised again, gathers no notes of theirs; the copy is made as tblib makes one, :func:`_copy_error`).
    An exception that cannot be copied even so is stripped of its frames itself."""
    copies = {} if _copies is None else _copies  # (a chain that loops back copies each link once)
    if id(error) in copies:
        return copies[id(error)]
    try:
        copied = _copy_error(error) if not isinstance(error, BaseExceptionGroup) else _copy_group(error, copies)
    except Exception:
        copied = error
    copies[id(error)] = copied
    copied.__traceback__ = None
    if copied is not error:  # (copy.copy can hand the copy the original's __dict__ itself)
        copied.__dict__ = dict(error.__dict__)
        if hasattr(error, "__notes__"):
            copied.__notes__ = list(error.__notes__)
    for attr in ("__cause__", "__context__"):
        link = getattr(error, attr)
        setattr(copied, attr, None if link is None else detached(link, copies))
    copied.__suppress_context__ = error.__suppress_context__
    return copied


class StepFailed(HeldError):
    """The value of a fragment step that raised, or that read such a value: the steps that do not
    depend on it still run, and a task that reads it from the fragment raises ``error``
    (:func:`pick`), as it would have raised reading the failed task's result without fragments."""

    __slots__ = ()


def sendable(error: BaseException) -> BaseException:
    """``error`` as distributed sends a task's error: itself where it comes back from pickle, else an
    ``Exception`` of its repr, with its notes."""
    try:
        loads(dumps(error))
        return error
    except Exception:
        sent = Exception(repr(error))
        for note in getattr(error, "__notes__", ()):
            sent.add_note(note)
        return sent


def pick(outputs: Sequence[Any], i: int) -> Any:
    """Output ``i`` of a fragment task, raising the error of a step that failed."""
    value = outputs[i]
    if type(value) is StepFailed:
        raise value.exception()
    return value


def collected(n: int, positions: Sequence[int], *values: Any) -> tuple[Any, ...]:
    """The outputs of a fragment task split into its parts, as the fragment would return them: ``values``
    at ``positions`` of ``n`` (``None`` at the others, which the reader does not pick)."""
    out: list[Any] = [None] * n
    for i, value in zip(positions, values, strict=True):
        out[i] = value
    return tuple(out)


_TASK_CALL = Task.__call__.__code__  # the frame in which Dask calls a task's function


def attempt(func: Callable[..., Any], args: Sequence[Any], retries: int, name: Any,
            check: Callable[[], None] | None = None) -> tuple[bool, Any]:
    """``(True, func(*args))``, or ``(False, the exception)`` once it raised ``retries + 1`` times (each
    retry logged under ``name``): as a Dask worker runs a task, any exception is caught but
    ``SystemExit`` and ``KeyboardInterrupt`` (``asyncio.CancelledError`` among those caught), and the
    task runs again as often as its ``retries`` allow. ``distributed.Reschedule`` ends the fragment or
    batch, which the worker then reschedules as a whole, as it would the member's own task (kept as a
    failure, it failed every task reading it, rescheduled again and again without end). ``check``
    (:meth:`RunningTask.check`) is called before each retry: it raises once Dask released the task,
    which ends the retries. The exception's traceback starts in ``func``'s callees, the user's code,
    as without fragments or batches (past Dask's ``Task.__call__`` where ``func`` is a task)."""
    tries = 0
    while True:
        try:
            return True, func(*args)
        except (SystemExit, KeyboardInterrupt, Reschedule):
            raise
        except BaseException as e:
            if tries == retries:
                tb = e.__traceback__
                while tb is not None and tb.tb_frame.f_code in (attempt.__code__, evaluate.__code__, _TASK_CALL):
                    tb = tb.tb_next
                return False, e.with_traceback(tb)
            tries += 1
            logger.info("dask_octopus: task %r raised %r; retrying it (%d of %d)", name, e, tries, retries)
            if check is not None:
                check()


def _step(name: Any, spec: Any, reads: Sequence[int], values: dict[int, Any], retries: int = 0,
          task: RunningTask | None = None) -> Any:
    args = []
    for v in reads:
        value = values[v]
        if type(value) is StepFailed:
            return value
        args.append(value)
    key = step_key(name)
    return _failed_as_value(evaluate, (spec, args), retries, key, " of a fragment",
                            task.check if task is not None else None)


RAISED_BY = "dask_octopus: raised by task "  #: the note on the error of a step of a fragment, naming its task


def _failed_as_value(func: Callable[..., Any], args: Sequence[Any], retries: int, key: Any, where: str,
                     check: Callable[[], None] | None) -> Any:
    """``func(*args)`` (:func:`attempt`), or a :class:`StepFailed` holding its exception, noted as
    raised by task ``key`` and ``where`` (" of a fragment", ", read by fragments")."""
    ok, value = attempt(func, args, retries, key, check)
    if ok:
        return value
    return StepFailed(value, f"{RAISED_BY}{key!r}{where}"
                             + (f" (and on {retries} retries)" if retries else ""))


class RunningTask:
    """The Dask task that runs a fragment in this thread: the retries Dask grants it (its ``retries``
    annotation, as ``compute(retries=n)`` or ``dask.annotate(retries=n)`` set it; 0 outside a worker),
    :meth:`first_in_line`, which steps back for ready tasks of higher priority, :meth:`check`, which
    stops the run once Dask released the task, and :meth:`done_share`."""

    every = 0.05  #: seconds between two looks at the worker's state
    collect_after = 0.2  #: seconds of a run with the garbage collector paused at most (:meth:`collector_paused`)

    def __init__(self) -> None:
        from distributed import get_worker

        try:
            self._worker: Any = get_worker()
            self._key = self._worker.get_current_task()
            ts = self._worker.state.tasks.get(self._key)
        except (ValueError, KeyError):  # not in a worker, or not in the thread of a task
            self._worker, ts = None, None
        self._ts = ts
        self._run_id = ts.run_id if ts is not None else None
        retries = (ts.annotations or {}).get("retries", 0) if ts is not None else 0
        self.retries = retries if isinstance(retries, int) and retries > 0 else 0
        self._next = time.perf_counter() + self.every

    @contextlib.contextmanager
    def collector_paused(self) -> Iterator[None]:
        """Pause Python's cyclic garbage collector (:func:`~dask_octopus.groups.collector.collector_paused`)
        for the block, on a worker of one thread, for :attr:`collect_after` seconds at most (the worker's
        event loop then ends the pause, also within a long step): the steps' specs, unpickled as a
        fragment starts, and each step's short-lived objects are then freed by reference counting
        instead of being promoted to the oldest generation, whose full collections of the worker's heap
        otherwise came every few computes of a fragment of small steps. A longer run collects as Dask's
        tasks do. On a worker of several threads the collector is left running (their runs, back to
        back, would keep it paused)."""
        if self._worker is None or self._worker.state.nthreads != 1:
            yield
            return
        with collector_paused() as resume:
            loop = self._worker.loop
            loop.add_callback(loop.call_later, self.collect_after, resume)  # (add_callback: from any thread)
            yield

    def first_in_line(self) -> None:
        """Raise ``distributed.Reschedule`` where a task of higher priority than this one waits, ready, on
        the worker (called before the fragment's first step): sent together (one compute, or computes
        submitted together), the worker started whichever the scheduler sent first, and a fragment holds
        its thread for its whole share, where after one small task the worker would take its ready tasks
        in priority order. Stepping back before its first step, the fragment loses no work; the scheduler
        sends it again, and the worker runs it after the tasks of higher priority. Higher: of a higher
        ``priority`` annotation, or of an older graph (the first two of Dask's three priorities); the
        order within one graph (Dask's ``dask.order``, the third) does not make the parts of a worker's
        fragment step back for each other."""
        if self._ts is None or not len(self._worker.state.ready):  # (read from this thread: a length)
            return
        state = self._worker.state

        async def first_ready() -> Any:  # (on the worker's event loop, which changes its queue)
            return state.ready.peek().priority if state.ready else None

        try:
            ready = asyncio.run_coroutine_threadsafe(first_ready(), self._worker.loop.asyncio_loop).result(5)
        except (TimeoutError, RuntimeError):  # (the worker closing: its loop stopped)
            return
        if ready is not None and self._ts.priority is not None and ready[:2] < self._ts.priority[:2]:
            raise Reschedule(f"task {self._key!r} stepped back for a task of higher priority")

    def check(self) -> None:
        """Raise ``distributed.Reschedule`` once the worker no longer wants the task's result (looked up
        every :attr:`every` seconds at most): as a cancelled small task would end, the fragment ends
        within one step instead of running its whole share for nothing. The worker then releases the
        task, or, where the task was asked for again meanwhile, has the scheduler run it again: also where
        it was cancelled and asked for again between two looks (the worker resumed it under a new run id,
        and the scheduler would drop this run's result as stale, and run it again only then)."""
        if self._worker is None or time.perf_counter() < self._next:
            return
        self._next = time.perf_counter() + self.every
        ts = self._worker.state.tasks.get(self._key)
        if ts is None or ts.state == "cancelled" or ts.run_id != self._run_id:
            raise Reschedule(f"task {self._key!r} was released while its fragment ran")

    def done_share(self, values: Sequence[Any], failed: type, partial: bool) -> None:
        """Where some of ``values`` (the task's results) are ``failed``, tell the scheduler the share of
        the task's work done (:data:`~dask_octopus.plugins.messages.DONE_SHARE`): with ``partial``, the
        share of the values that are not (items each a share of the work), else none."""
        if self._ts is None or not values:
            return
        bad = sum(type(v) is failed for v in values)
        if bad:
            self._ts.metadata[DONE_SHARE] = 1 - bad / len(values) if partial else 0.0
        else:  # (the worker's state of a task run again, after a retry, keeps its metadata)
            self._ts.metadata.pop(DONE_SHARE, None)


def _retries(fragment: Fragment, task: RunningTask | None) -> list[int]:
    return fragment.step_retries(task.retries) if task is not None else [0] * len(fragment.names)


def walk(fragment: Fragment, specs: Sequence[Any], values: dict[int, Any], task: RunningTask | None = None) -> None:
    """Run the steps (``specs``: :meth:`Fragment.specs`) one after the other into ``values`` (slots to
    values, the inputs' first), dropping each value after its last reader. With ``task`` (the
    :class:`RunningTask`), a step that raises runs again as often as its member's retries allow
    (:meth:`Fragment.step_retries`, the task's where the member has none), and the run stops once Dask
    released the task (:meth:`RunningTask.check`)."""
    slot = len(fragment.inputs)
    for name, spec, reads, drop, again in zip(fragment.names, specs, fragment.reads, fragment.drop,
                                              _retries(fragment, task)):
        values[slot] = _step(name, spec, reads, values, again, task)
        slot += 1
        for d in drop:
            del values[d]
        if task is not None:
            task.check()


def launch(fragment: Fragment, specs: Sequence[Any], layout: FragmentLayout, values: dict[int, Any],
           streams: Sequence[Any], task: RunningTask | None = None) -> list[Any]:
    """Launch the steps (``specs``: :meth:`Fragment.specs`) on their streams into ``values`` (slots to
    values), waiting on an event where a step reads another stream's result (with ``task``, retries and
    release as in :func:`walk`; without, as when captured, a step that raises ends the launches, its
    exception the capture's reason to refuse: run again, its launches would stay in the graph, and held
    as a value, the capture would fail later for a reason that hides it); returns the values kept alive
    for other streams (the caller holds them until those streams are done)."""
    events: dict[int, Any] = {}
    held = []
    first = len(fragment.inputs)
    again = _retries(fragment, task)
    for i, (name, spec, reads, drop) in enumerate(zip(fragment.names, specs, fragment.reads, fragment.drop)):
        s = streams[layout.streams[i]]
        for j in fragment.deps[i]:
            if j in layout.shared and layout.streams[j] != layout.streams[i]:
                s.wait_event(events[j])
        with s:
            if task is None:
                values[first + i] = evaluate(spec, [values[v] for v in reads])
            else:
                values[first + i] = _step(name, spec, reads, values, again[i], task)
            if i in layout.shared:
                events[i] = s.record()
        for d in drop:
            value = values.pop(d)
            if d - first in layout.shared:
                held.append(value)
        if task is not None:
            task.check()
    return held


def run_guarded(key: Hashable, node: Callable[[Mapping[Hashable, Any]], Any], reads: Sequence[Hashable],
                retries: int | None, *values: Any) -> Any:
    """Body of a task that only fragments read (a guard, made by
    :func:`~dask_octopus.groups.rewrite.fragment_graph`): the value of ``node``, the task ``key`` of
    Dask's graph, on ``values`` (those of the keys ``reads``, which ``node`` reads). Where it raises
    (after running again, in place, ``retries`` times, ``None``: as often as this task's ``retries``
    allow, :class:`RunningTask`), or reads a :class:`StepFailed`, its value is a :class:`StepFailed`
    holding the exception instead: a fragment task runs only once all its inputs are in memory, so a
    failed input would fail all of it, where the fragment fails only the steps that read the value,
    as Dask fails only the tasks that read a failed task."""
    task = RunningTask()
    value = next((v for v in values if type(v) is StepFailed), None)
    if value is None:
        value = _failed_as_value(node, (dict(zip(reads, values, strict=True)),),
                                 task.retries if retries is None else retries, key, ", read by fragments", task.check)
    task.done_share((value,), StepFailed, partial=False)
    return value


def run_fragment(fragment: Fragment, *inputs: Any) -> tuple[Any, ...]:
    """Body of a fragment task: run its steps on ``inputs`` (the values of ``fragment.inputs``) and
    return the values of ``fragment.outputs``.

    On a CPU worker the steps run one after the other. On a GPU worker a chain of steps stays on one
    stream of the thread's pool and independent chains take other streams; events order the steps
    that read another stream's result, and the fragment ends with one synchronisation of its
    streams. A fragment whose inputs are ``octopus.streams.large-bytes`` or more on average fills
    the GPU with each step: it runs on the task's own stream, as Dask would run it. A fragment seen
    again with the same structure and input shapes is captured as one CUDA graph, over the pool's streams
    or on one stream, whichever holds no more than ``octopus.streams.capture-spare-bytes`` beyond the
    other, and replayed; inputs that are the very buffers of the capture (persisted blocks) are read in place.
    A step that raises runs again, in place, as many times as its ``retries`` allow (Dask
    would re-run the failed task that many times); then it does not stop the others: its value, and
    that of every step that reads it, is a :class:`StepFailed` holding its exception (with the
    step's key in its notes), which the tasks that read it from the fragment raise. A run whose task
    Dask releases meanwhile (a cancel, a restart) stops within a step or a retry of one
    (:class:`RunningTask`; a replayed graph, one launch, runs to its end); one started where a task of
    higher priority waits on the worker steps back before its first step
    (:meth:`RunningTask.first_in_line`). On a GPU worker Python's thread switch interval is shortened
    while it runs (:func:`launching`)."""
    if len(inputs) != len(fragment.inputs):
        raise ValueError(f"a fragment of {len(fragment.inputs)} inputs was given {len(inputs)}")
    values = dict(enumerate(inputs))
    task = RunningTask()
    task.first_in_line()
    rt = runtime()
    rt.count(len(fragment.names))
    cp = _cupy()
    with task.collector_paused(), launching() if cp is not None else contextlib.nullcontext():
        if cp is not None and not (inputs and sum(_nbytes(cp, x) for x in inputs) / len(inputs) >= _bytes(
                config.get("streams.large-bytes"))):
            out = _run_on_gpu(cp, rt, fragment, values, inputs, task)
        else:
            walk(fragment, fragment.specs(), values, task)  # (large inputs on a GPU: on the task's own stream)
            out = tuple(values[s] for s in fragment.results)
    task.done_share(out, StepFailed, partial=False)
    return out


def handed_over(cp: Any, results: list[Any]) -> list[Any]:
    """``results`` of a group or fragment run on this thread's pool streams, for its readers. Memory
    that a reader frees goes back to the part of CuPy's pool of the stream it was made on, and later
    work there is not ordered after the reader's (on the task's stream): this thread's next run waits
    for the task's stream as it starts, so with one worker thread a reader's kernels are done before
    the memory is used again; on a worker of several threads, a reader on another thread could still
    be reading when this thread's run uses it. There, each device array is copied on the task's stream
    (one at a time: the copies hold one result more than the results), whose part of the pool orders
    its reuse after the reader's work; so is each device array inside a dict, list or tuple (Dask's
    reductions' chunks return dicts of arrays)."""
    if not _several_threads():
        return results
    current = cp.cuda.get_current_stream()
    for i, value in enumerate(results):
        results[i] = _copied(cp, current, value)
        del value  # (its memory goes back to its stream's part: the next run there waits for the copy)
    current.record().synchronize()
    return results


def _copied(cp: Any, stream: Any, value: Any) -> Any:
    """``value`` with each device array in it (itself, or inside dicts, lists and tuples) copied on ``stream``."""
    if isinstance(value, cp.ndarray):
        with stream:
            return value.copy()
    kind = type(value)
    if kind is dict:
        return {k: _copied(cp, stream, v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return kind(_copied(cp, stream, v) for v in value)
    return value


def _several_threads() -> bool:
    """Whether this task runs on a worker of more than one thread (False outside a worker)."""
    from distributed import get_worker

    try:
        return get_worker().state.nthreads > 1
    except ValueError:
        return False


def _ready_streams(rt: StreamRuntime, cp: Any, n: int, ready: Any) -> list[Any]:
    """The first ``n`` streams of this thread's pool, waiting for ``ready`` (the inputs)."""
    streams = rt.streams(cp, n)
    for s in streams:
        s.wait_event(ready)
    return streams


def _extra_bytes(rt: StreamRuntime, cp: Any, fragment: Fragment, layout: FragmentLayout,
                 inputs: Sequence[Any]) -> float:
    """The estimated bytes ``layout``'s streams would hold beyond one stream plus the largest input
    (:meth:`FragmentLayout.pool_bytes`: one pool arena per stream)."""
    sizes = {name: x.nbytes for name, x in zip(fragment.inputs, inputs, strict=True) if isinstance(x, cp.ndarray)}
    one = rt.layout(fragment, 1)
    return layout.pool_bytes(fragment, sizes) - one.pool_bytes(fragment, sizes) - max(sizes.values(), default=0)


def _capture_within(rt: StreamRuntime, cp: Any, capture_on: Callable[[int], CapturedGroup], n_streams: int,
                    largest: int) -> CapturedGroup | None:
    """The graph captured over ``n_streams`` streams of the pool (``capture_on(n)`` captures on the first
    ``n``, waiting for the inputs) if it holds at most ``octopus.streams.capture-spare-bytes`` plus
    ``largest`` (the largest input's bytes) more than the graph captured on one stream, else the
    one-stream graph (also where the capture over the streams is refused): each stream of a pool
    reuses only its own freed memory, so a graph forked over 8 streams may hold 8 working sets.
    ``None`` where the capture on one stream is refused (the reason kept in ``rt.last_refusal``)."""
    graphs: list[CapturedGroup] = []
    for n in [1] + ([n_streams] if n_streams > 1 else []):
        try:
            graphs.append(capture_on(n))
        except CaptureRefused as e:
            rt.last_refusal = str(e) if not graphs else f"over {n} streams (kept on one): {e}"
            if graphs:
                logger.debug("dask_octopus: not captured over %d streams, the one-stream graph is kept: %s", n, e)
            else:
                logger.debug("dask_octopus: not captured, it runs eagerly: %s", e)
            rt.streams(cp, n, fresh=True)
            return graphs[0] if graphs else None
    if len(graphs) == 1:
        return graphs[0]
    one, spread = graphs
    allowance = one.held_bytes() + largest + _bytes(config.get("streams.capture-spare-bytes"))
    return spread if spread.held_bytes() <= allowance else one


def _run_on_gpu(cp: Any, rt: StreamRuntime, fragment: Fragment, values: dict[int, Any], inputs: Sequence[Any],
                task: RunningTask) -> tuple[Any, ...]:
    # Eagerly, more streams may hold one block more than one stream does (one pool arena per stream): they
    # buy no speed there (launches are bound by Python). A graph captured over several streams (Opara's
    # speed) may hold octopus.streams.capture-spare-bytes more than the same graph captured on one stream
    # plus a block: both are captured, measured and the other is dropped. A replay needs no layout.
    # The pool's streams wait for `ready`, recorded on the task's stream once the inputs are there and,
    # where the steps' specs are unpickled, once the device arrays among their constants are uploaded.
    current = cp.cuda.get_current_stream()
    ready = current.record()
    if config.get("streams.capture") and all(isinstance(x, cp.ndarray) for x in inputs):
        def make(in_place: bool) -> CapturedGroup | None:
            nonlocal ready
            specs = fragment.specs()
            ready = current.record()  # after the specs' device constants are uploaded
            full = rt.layout(fragment)

            def capture_on(n: int) -> CapturedGroup:  # each capture runs the steps' Python code once, without
                layout = full if n > 1 else rt.layout(fragment, 1)  # retries: a raising step refuses it
                return capture_fragment(cp, lambda v, st: launch(fragment, specs, layout, v, st), values,
                                        range(len(inputs)), fragment.results, _ready_streams(rt, cp, n, ready),
                                        in_place, specs)

            return _capture_within(rt, cp, capture_on, full.used, max((x.nbytes for x in inputs), default=0))

        cache = rt.graph_cache()
        graph = _cached_graph(cache, _signature(fragment.structure(), inputs), _pointers(cp, inputs), make)
        if graph is not None:
            cache.replays += 1
            stream = _ready_streams(rt, cp, 1, ready)[0]
            return tuple(graph.replay(cp, inputs, stream, current))
    specs = fragment.specs()  # their constants (device arrays among them) live until the streams are done
    held: list[Any] = []  # and so do the values other streams read
    layout = rt.eager_layout(cp, fragment, inputs)
    streams = _ready_streams(rt, cp, layout.used, current.record())
    try:
        if layout.used == 1:  # the steps in order on one stream, entered once
            with streams[0]:
                walk(fragment, specs, values, task)
        else:
            held = launch(fragment, specs, layout, values, streams, task)
    finally:  # also when a step raises: the steps launched before it must end before their inputs go
        for s in streams:
            s.synchronize()
    del held, specs
    results = [values[s] for s in fragment.results]
    values.clear()  # (the results alone hold them: handed over one at a time)
    return tuple(handed_over(cp, results))
