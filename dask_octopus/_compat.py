"""Every private Dask, distributed and CuPy name that dask_octopus uses, imported in one place.

Tested with dask and distributed 2026.7.1 (the GPU machine, with dask-cuda 26.10) and 2026.8.0 (CI).
When a new release moves one of these, this is the only module to change.

- ``dask._task_spec``: the task classes of Dask's graphs (the stream-group rewrite builds and reads
  them; ``_execute_subgraph`` is the function of a task that low-level fusion made).
- ``dask._expr.LLGExpr``: a low-level graph as an expression, so ``map`` submits one graph
  (:class:`AnnotatedLLGExpr` adds per-key annotations, such as the priorities of its tasks).
- ``Scheduler._instances``: the schedulers running in this process (the optimizer asks whether
  all of them group marked tasks).
- ``distributed.utils._offload_executor``: the thread in which a scheduler materializes (and
  optimizes) the graph of ``update_graph`` (``in_offload_thread``: the optimizer reads the scheduler's
  state there only, not where a client builds or a local scheduler runs a graph).
- ``Scheduler._get_prefix_duration``: the duration Dask expects of a task (its prefix's average),
  which ``map``'s stealing weighs against the time to fetch a task's inputs.
- ``WorkStealing.unknown_durations``: the running tasks of prefixes of no known duration, which Dask's
  work stealing keeps until a task of the prefix finishes in memory (``drop_unknown_duration``).
- ``distributed.dashboard.scheduler.template_variables``: the variables of the dashboard's page
  template, whose ``plots`` list is its "More..." menu (the ``/octopus`` page adds itself there).
- The scheduler's ``plugin-add`` message to its workers and ``Scheduler.worker_plugins``: what
  ``register_worker_plugin`` does, with a worker that leaves meanwhile skipped (``add_worker_plugin``).
- How ``Scheduler._apply_annotations`` turns a task's annotations into restrictions
  (``annotated_restrictions``: the optimizer places tasks before their task states exist).
- The text of the scheduler's warning that a key came with another run spec than the one it has
  (``run_spec_collision``: the warning is dropped where the only difference is our grouping), and
  the names low-level fusion gives the tasks it fuses (``fused_name_of``).
- ``Client._scheduler_identity``: the scheduler's identity a client keeps from its connection (its ``id``
  tells whether two clients share a scheduler, whatever address each was given: ``scheduler_id``).
- ``as_completed.queue`` and ``.thread_condition``: where ``next`` of an ``as_completed`` waits for a
  future to finish, which its client's event loop reports (``next_completed`` stops waiting once that
  client closed: the loop then stopped, and ``next`` would wait for ever).
- ``Future._result``: a future's result read on the client's event loop, as ``Future.result`` does
  (``result_unless_lost`` stops reading where the future is lost meanwhile).
- CuPy's ``cupy.fft._fft._exec_fft`` and ``_exec_fftn``, through which every FFT of ``cupy.fft`` and
  ``cupyx.scipy.fft`` runs (``counting_ffts``: a CUDA graph that captured one reads a cuFFT plan that
  CuPy's plan cache may free).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import logging
import math
import re
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Any

from dask._expr import LLGExpr, _AnnotationsTombstone
from dask._task_spec import (
    Alias,
    DataNode,
    GraphNode,
    List,
    Task,
    TaskRef,
    _execute_subgraph,
    convert_legacy_graph,
    parse_input,
    resolve_aliases,
)

__all__ = [
    "SCHEDULER_LOGGER",
    "Alias",
    "AnnotatedLLGExpr",
    "AnnotationsTombstone",
    "DataNode",
    "GraphNode",
    "LLGExpr",
    "List",
    "Task",
    "TaskRef",
    "convert_legacy_graph",
    "counting_ffts",
    "dashboard_menu",
    "execute_subgraph",
    "expected_duration",
    "in_offload_thread",
    "next_completed",
    "parse_input",
    "resolve_aliases",
    "run_spec_collision",
    "running_schedulers",
    "scheduler_id",
]

execute_subgraph = _execute_subgraph
AnnotationsTombstone = _AnnotationsTombstone  # what Dask's per-key annotations give keys they do not annotate


class AnnotatedLLGExpr(LLGExpr):
    """A low-level graph with per-key annotations (``{"priority": {key: value}}``), which the scheduler
    applies as it does a layer's annotations."""

    _parameters = ["dsk", "annotations"]  # noqa: RUF012 (as Dask's own expressions declare them)

    def __dask_annotations__(self) -> dict[str, dict[Any, Any]]:
        return self.operand("annotations")


logger = logging.getLogger(__name__)

FFT_EXECUTORS = ("_exec_fft", "_exec_fftn")  #: the functions of ``cupy.fft._fft`` that run each FFT
_ffts = threading.local()  # .counter: the list counting this thread's FFTs, while counting_ffts runs
_ffts_missing: set[str] = set()  # the names of the modules without them (warned once)
_ffts_lock = threading.Lock()


def count_ffts_of(module: Any) -> bool:
    """Make the FFT executors of ``module`` (``cupy.fft._fft``) count the FFTs each thread runs within
    :func:`counting_ffts` (once: other calls go on as before); ``False`` where it has none."""
    with _ffts_lock:
        found = [name for name in FFT_EXECUTORS if callable(getattr(module, name, None))]
        for name in found:
            run = getattr(module, name)
            if getattr(run, "counts_ffts", False):
                continue

            @functools.wraps(run)
            def counted(*args: Any, _run: Callable[..., Any] = run, **kwargs: Any) -> Any:
                counter = getattr(_ffts, "counter", None)
                if counter is not None:
                    counter[0] += 1
                return _run(*args, **kwargs)

            counted.counts_ffts = True  # type: ignore[attr-defined]
            setattr(module, name, counted)
        return bool(found)


@contextlib.contextmanager
def counting_ffts() -> Iterator[list[int]]:
    """``[n]``: the FFTs this thread runs through CuPy meanwhile (``cupy.fft``, ``cupyx.scipy.fft``);
    a warning, once, where CuPy's FFT executors are not found (they are then not counted)."""
    try:
        import cupy.fft._fft as module
    except ImportError:
        module = None
    if module is not None and not count_ffts_of(module) and module.__name__ not in _ffts_missing:
        _ffts_missing.add(module.__name__)
        logger.warning("dask_octopus: CuPy's FFT executors (%s) not found: groups that run FFTs may be captured "
                       "as CUDA graphs, which do not hold the cuFFT plans they read", ", ".join(FFT_EXECUTORS))
    counter = [0]
    previous = getattr(_ffts, "counter", None)
    _ffts.counter = counter
    try:
        yield counter
    finally:
        _ffts.counter = previous


def running_schedulers() -> list[Any] | None:
    """The schedulers of this process that are not closing or closed, or ``None`` when this version
    of distributed does not track its instances."""
    from distributed.core import Status
    from distributed.scheduler import Scheduler

    instances = getattr(Scheduler, "_instances", None)
    if instances is None:
        return None
    done = (Status.closing, Status.closed, Status.failed)
    return [s for s in list(instances) if s.status not in done]


def next_completed(done: Any, closed: Callable[[], bool]) -> Any:
    """``next(done)``, the next future of the ``distributed.as_completed`` ``done`` to finish
    (``StopIteration`` where none is left), but ``None`` once ``closed()`` says that its client closed
    while it waited: the client's event loop, which tells ``done`` of each future that finishes, stopped
    with it (``next`` would wait for ever)."""
    while done.queue.empty() and not done.is_empty():
        if closed():
            return None
        with done.thread_condition:
            done.thread_condition.wait(timeout=0.1)
    return next(done)


LOST = ("lost", "pending")  # a finished future's status once its worker left (or reading it failed: reset)


async def result_unless_lost(future: Any, reads: dict[Any, asyncio.Task], poll: float = 0.1) -> tuple[bool, Any]:
    """``(True, result)`` of the finished ``future``, read as ``await future`` does (its exception raised),
    or ``(False, None)`` where it is lost, before or while its result is read: its worker left, and Dask
    computes it again (``Future.result`` would wait for that; the scheduler says "lost", or reading it
    failed and the client reset it to "pending"; checked every ``poll`` s). A reading begun is kept in
    ``reads`` by the future's key, and taken up again when the future is read next, not cancelled: the
    client shares one gather among the readers of the moment, and its result would come twice."""
    reading = reads.pop(future.key, None)
    if reading is None:
        if future.status in LOST:
            return False, None
        reading = asyncio.ensure_future(future._result())
        reading.add_done_callback(lambda done: done.cancelled() or done.exception())  # (retrieved, if dropped)
    while not (await asyncio.wait([reading], timeout=poll))[0]:
        if future.status in LOST:
            reads[future.key] = reading
            return False, None
    return True, reading.result()


def scheduler_id(client: Any) -> str | None:
    """The id of the scheduler that ``client`` is connected to, as it said on connecting (``None`` where
    unknown), without asking it again."""
    return getattr(client, "_scheduler_identity", {}).get("id")


def in_offload_thread() -> bool:
    """Whether this runs in distributed's offload thread, where a scheduler materializes and optimizes
    the graphs that clients send it (``Scheduler.update_graph``)."""
    from distributed.utils import _offload_executor

    return threading.current_thread().name.startswith(_offload_executor._thread_name_prefix)


def dashboard_menu(scheduler: Any) -> list[dict[str, str]] | None:
    """The "More..." menu of distributed's Bokeh dashboard on ``scheduler`` (``{"url", "name"}`` items,
    one list that all its pages render), or ``None`` when that dashboard does not run there."""
    try:
        from bokeh.server.server import BokehTornado
    except ImportError:
        return None
    applications = getattr(getattr(scheduler, "http_application", None), "applications", [])
    if not any(isinstance(app, BokehTornado) for app in applications):
        return None
    from distributed.dashboard.scheduler import template_variables

    plots = template_variables(scheduler).get("plots")
    return plots if isinstance(plots, list) else None


def expected_duration(scheduler: Any, ts: Any) -> float:
    """Seconds Dask expects the task ``ts`` to run (its prefix's average, or the default for unknown
    prefixes)."""
    return scheduler._get_prefix_duration(ts.prefix)


def drop_unknown_duration(scheduler: Any, ts: Any) -> None:
    """Forget ``ts``, a task that stopped running without a result (it failed, or was released), among the
    tasks of unknown duration of Dask's work stealing on ``scheduler``: it keeps them until a task of their
    prefix finishes in memory, never for a prefix whose tasks all failed, and with them their run specs
    (which hold the client's futures of a computation's inputs where the scheduler runs in the client's
    process, as ``LocalCluster``'s does: the inputs then stayed in the workers' memory)."""
    unknown = getattr(scheduler.extensions.get("stealing"), "unknown_durations", None)
    tasks = None if unknown is None else unknown.get(ts.prefix.name)
    if tasks:
        tasks.discard(ts)
        if not tasks:
            del unknown[ts.prefix.name]


def measured_bandwidths(scheduler: Any) -> tuple[float, dict[tuple[str, str], float]]:
    """The bandwidths in bytes/s that ``scheduler`` measured: its overall figure, and one per
    ``(sender, receiver)`` pair of workers (it keeps them receiver first); read from copies, so safe off
    its event loop. A figure that is no number a float holds (set by hand) reads as NaN."""
    return (_figure(scheduler.bandwidth),
            {(sender, receiver): _figure(bw) for (receiver, sender), bw in list(scheduler.bandwidth_workers.items())})


def _figure(value: Any) -> float:
    """``value`` as a float; NaN where it is no number a float holds."""
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def add_worker_plugin(scheduler: Any, plugin: bytes, name: str) -> Coroutine[Any, Any, dict[str, str]]:
    """Set the pickled worker ``plugin`` up on every worker, replacing one of the same ``name``, and on
    those that join later, as ``Scheduler.register_worker_plugin(idempotent=False)`` does, but a worker
    that fails or leaves meanwhile is skipped (Dask logs it) rather than failing the call while the
    others still set it up. The scheduler holds it for the workers that join from now on; the returned
    coroutine sets it up on those there, and returns the error of each worker still there where it
    failed: one whose ``setup`` raised answers with the error; one that cannot unpickle it (its
    environment lacks the plugin's package) raises it in the handler (``Worker.plugin_add`` unpickles
    outside its ``try``), which the broadcast returns, as it returns a lost connection (skipped: the
    worker is leaving)."""
    scheduler.worker_plugins[name] = plugin
    return _set_up_worker_plugin(scheduler, plugin, name)


async def _set_up_worker_plugin(scheduler: Any, plugin: bytes, name: str) -> dict[str, str]:
    """The workers' part of :func:`add_worker_plugin`."""
    replies = await scheduler.broadcast(msg={"op": "plugin-add", "plugin": plugin, "name": name}, on_error="return")
    failed = {}
    for address, reply in replies.items():
        if isinstance(reply, Exception) and not isinstance(reply, OSError) and address in scheduler.workers:
            # (a worker's error comes as an Exception of its repr; a lost connection, an OSError, is a worker
            # leaving, which Dask handles)
            failed[address] = str(reply) if type(reply) is Exception else repr(reply)
        elif isinstance(reply, dict) and reply.get("status") == "error":
            failed[address] = str(reply.get("exception_text") or reply.get("exception"))
    return failed


def annotated_restrictions(annotation: Mapping[str, Any], coerce: Callable[[Any], str]
                           ) -> tuple[set[str], set[str], Mapping[str, float] | None, bool]:
    """The worker, host and resource restrictions and the ``loose_restrictions`` that ``update_graph``
    sets on a task from its Dask ``annotation``, as ``Scheduler._apply_annotations`` reads them
    (``workers``: addresses or worker names, which ``coerce``, the scheduler's ``coerce_address``,
    resolves, else host names; ``allow_other_workers``; ``resources``)."""
    workers: set[str] = set()
    hosts: set[str] = set()
    resources, loose = None, False
    for name, value in annotation.items():
        if name in ("restrictions", "workers"):
            named, other = set(), set()
            for w in value if isinstance(value, (list, tuple, set)) else [value]:
                try:
                    named.add(coerce(w))
                except ValueError:  # not an address: a host name
                    other.add(w)
            workers, hosts = named or workers, other or hosts
        elif name in ("loose_restrictions", "allow_other_workers"):
            loose = value
        elif name == "resources":
            resources = value
    return workers, hosts, resources, loose


SCHEDULER_LOGGER = "distributed.scheduler"  # where the scheduler logs the warning that run_spec_collision reads
_COLLISION = re.compile(r"Detected different `run_spec` for key (?P<key>.+?) between two consecutive calls to "
                        r"`update_graph`\.", re.DOTALL)
_DEPENDENCIES = re.compile(r"^\s*(?P<which>old|new) dependencies: (?P<keys>.*?)\s*$", re.MULTILINE)


def _key_set(text: str) -> set[Any]:
    """The keys of a set as the warning prints it (``{...}``, ``frozenset({...})``, ``set()``)."""
    if text.startswith("frozenset(") and text.endswith(")"):
        text = text[len("frozenset("):-1] or "set()"
    keys = ast.literal_eval(text)
    if not isinstance(keys, (set, frozenset)):
        raise ValueError(f"not a set of keys: {text[:80]}")
    return set(keys)


def fused_graph_of(node: Any) -> Mapping[Any, Any] | None:
    """The graph that ``node``, a task made by Dask's fusion (``_execute_subgraph``: low-level fusion's,
    and blockwise fusion's, whose graph every block of the layer shares), runs; ``None`` for any other node."""
    if isinstance(node, Task) and node.func is execute_subgraph:
        inner = node.args[0]
        return inner.value if isinstance(inner, DataNode) else inner
    return None


def fused_name_of(key: Any, name: Any) -> bool:
    """Whether ``name`` is a name that Dask's low-level fusion gives a chain of tasks ending at ``key``
    (``dask.optimization.default_fused_keys_renamer``, whose ``key`` stays as an alias of it: the other
    tasks' name prefixes, then ``key``'s name, with ``key``'s index), unless shortened (past 115
    characters, with a hash)."""
    if type(key) is tuple and type(name) is tuple and key and name:
        key, name = key[0], name[0] if name[1:] == key[1:] else None
    return isinstance(key, str) and isinstance(name, str) and name.endswith("-" + key)


def run_spec_collision(message: str) -> tuple[Any, set[Any], set[Any]] | None:
    """The key, the dependencies of the scheduler's task for it and those of the run spec that came
    again, which the scheduler's warning ``message`` names, where it is the warning that
    ``update_graph`` logs for a key that came again with other dependencies than the task it has
    (``Scheduler._generate_taskstates``); ``None`` for any other message, or one whose key or
    dependencies do not read back as Python literals."""
    found = _COLLISION.match(message)
    if found is None:  # (most records: nothing else is read of them)
        return None
    named = {m["which"]: m["keys"] for m in _DEPENDENCIES.finditer(message)}  # the last of each: after the specs
    if named.keys() != {"old", "new"}:
        return None
    try:
        return ast.literal_eval(found["key"]), _key_set(named["old"]), _key_set(named["new"])
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None
