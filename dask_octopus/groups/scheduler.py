"""Stream groups formed on the scheduler, from task annotations.

Some marks reach the scheduler only as task annotations: dask-expr dataframes ignore layer
annotations, and a collection *computed* inside ``annotate`` gets the block's annotations as the
graph's global annotations. :func:`group_new_tasks` groups those tasks in the scheduler plugin's
``update_graph``: after Dask has made the TaskStates of the new graph and before it transitions any
of them. The rewrite is :func:`~dask_octopus.groups.rewrite.fragment_graph`'s, applied to the new
tasks: each fragment becomes a TaskState, the consumers of its results read them from it, and the
members (released, wanted by nothing any more) are forgotten. Only tasks that may run in the same
places (the same restrictions, e.g. the pins of a balanced collection, and inputs already held by
the same worker) are grouped together.

Arrays and delayed objects built inside ``annotate`` reach the scheduler with their marks too: the
optimizer that ``annotate`` installs (:mod:`dask_octopus.groups.marks`) runs there, at
materialization, and when every running scheduler of its process has the plugin it only carries
the marks (with the graph's build order, so that the same work groups alike each time and a captured
group can be replayed) through Dask's fusion and leaves the grouping to this module, which knows
where tasks will run. (Otherwise, and with local schedulers, the optimizer groups them itself.)
Group tasks are never regrouped, but a fragment task whose worker left while running it is split
(:func:`hold_if_lost`, :func:`split_fragment`): it runs again as one task per member, so that a
member that takes its worker down fails only what reads it, as Dask fails such a task; so is a
``map`` batch read through a future per item (:func:`split_batch`), one task per item.

Computing the same dataframe again while the scheduler holds the first compute's result (twice at
once, or again before the client has released the first result) works: Dask keeps the task it has,
and the second graph's copies of the members, which nothing reads any more, are forgotten. Dask's
warning that the key came with another run spec (its dependencies differ: the first compute's reads
fragments) is dropped where that is the only difference (:class:`RegroupedRunSpecs`).
"""

from __future__ import annotations

import functools
import logging
import math
import operator
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import dask.config
from dask.typing import Key
from dask.utils import key_split, parse_bytes, parse_timedelta

from dask_octopus import config
from dask_octopus._compat import (
    Alias,
    DataNode,
    GraphNode,
    List,
    Task,
    TaskRef,
    annotated_restrictions,
    fused_name_of,
    in_offload_thread,
    measured_bandwidths,
    run_spec_collision,
    running_schedulers,
)
from dask_octopus.groups.blocksizes import block_bytes
from dask_octopus.groups.planning import ANNOTATION, layer_of
from dask_octopus.groups.rewrite import (
    FRAGMENT_PREFIX,
    fragment_graph,
    fragment_of,
    inner_keys,
    needed_by,
    of_fragments,
    picks_a_result,
    read_before_grouping,
    replaced_keys,
)
from dask_octopus.groups.streams import collected, pick, run_fragment
from dask_octopus.placement.bandwidth import Bandwidths
from dask_octopus.placement.items import pick_item, run_batch
from dask_octopus.placement.pins import ALONE_INFIX, HELD, MAP_INFIX
from dask_octopus.plugins.messages import plannable_memory
from dask_octopus.profiling.working_set import MEASURE

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, TaskState, WorkerState

    from dask_octopus.groups.fragment import Fragment

logger = logging.getLogger(__name__)
hosts: weakref.WeakSet = weakref.WeakSet()  # scheduler plugins of this process that group marked tasks


def _hosts() -> list[Any]:
    """The plugins of :data:`hosts` registered on their scheduler (one unregistered leaves the set at
    its next weight sample; read from Dask's offload thread, while a plugin may start or close on the
    event loop: copied again if the set changed while being copied)."""
    while True:
        try:
            return [p for p in hosts if p.registered()]
        except RuntimeError as e:
            if "changed size during iteration" not in str(e):
                raise


def grouping_here() -> bool:
    """Whether every running scheduler of this process groups marked tasks (has the plugin): the
    array and delayed optimizer, which runs on the scheduler, then leaves the grouping to it. With
    several schedulers in one process and one of them without the plugin, the optimizer groups."""
    ours = {id(p.scheduler) for p in _hosts()}
    schedulers = running_schedulers()
    if schedulers is None:  # not tracked by this version of distributed
        return bool(ours)
    running = {id(s) for s in schedulers}
    return bool(running) and running <= ours


def cluster_threads() -> int | None:
    """The threads of the workers of this process's only scheduler, when called in the thread where
    it optimizes the graphs it gets (they run there); ``None`` elsewhere, or without workers."""
    schedulers = running_schedulers() or []
    if len(schedulers) != 1 or not in_offload_thread():
        return None
    try:
        return sum(ws.nthreads for ws in list(schedulers[0].workers.values())) or None
    except (RuntimeError, KeyError):  # a worker came or went while being read (off the event loop)
        return None


def _inputs(ts: TaskState) -> list[TaskState]:
    """The tasks whose results ``ts`` reads, looking through aliases (dask-expr reads a persisted
    collection through one alias task per partition)."""
    out = []
    for dts in ts.dependencies:
        out.extend(_inputs(dts) if isinstance(dts.run_spec, Alias) and dts.state == "released" else [dts])
    return out


def _home(inputs: Iterable[TaskState]) -> str | None:
    """The worker holding most bytes of ``inputs`` that are in memory (``None``: none is)."""
    held: dict[str, int] = {}
    for dts in inputs:
        for ws in list(dts.who_has or ()):  # a copy: the optimizer reads this off the event loop
            held[ws.address] = held.get(ws.address, 0) + dts.get_nbytes()
    return max(sorted(held), key=held.__getitem__) if held else None


UNSHARED = (ANNOTATION, MEASURE, "retries")  # annotations a fragment's members need not share (retries: per step)


def _hashable(value: Any) -> Hashable:
    if isinstance(value, Mapping):
        return ("mapping", tuple(sorted(((repr(k), _hashable(v)) for k, v in value.items()), key=repr)))
    if isinstance(value, (list, tuple)):
        return ("sequence", tuple(_hashable(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted((_hashable(v) for v in value), key=repr)))
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))  # equal to itself only: such tasks group only with the same object's
    return value


def shared_annotations(annotations: Mapping[str, Any] | None) -> Hashable:
    """The Dask annotations of a task that the fragment task running it carries (restrictions, priority,
    any of the user's own; not ``octopus`` nor ``retries``, which each step keeps), as one hashable
    value (``None`` for none), a task's label for
    :func:`~dask_octopus.groups.planning.plan_fragments`: tasks join a fragment only with tasks of
    equal such annotations."""
    shared = tuple(sorted((name, _hashable(v)) for name, v in (annotations or {}).items() if name not in UNSHARED))
    return shared or None


def annotation_labels(annotations: Mapping[Key, Mapping[str, Any]]) -> dict[Key, Hashable]:
    """The label (:func:`shared_annotations`) of each task of ``annotations`` (by key) that has one."""
    return {k: label for k, a in annotations.items() if (label := shared_annotations(a)) is not None}


def _place_of(workers: Iterable[str] = (), hosts: Iterable[str] = (), resources: Mapping[str, float] | None = None,
              loose: bool = False, home: str | None = None) -> Hashable:
    place = (frozenset(workers), frozenset(hosts), tuple(sorted((resources or {}).items())), loose, home)
    return None if place == (frozenset(), frozenset(), (), False, None) else place


def annotated_retries(annotations: Mapping[Key, Mapping[str, Any]]) -> dict[Key, int]:
    """The ``retries`` annotation of each task of ``annotations`` (by key) that has one."""
    return {k: a["retries"] for k, a in annotations.items() if isinstance(a.get("retries"), int)}


def _place(ts: TaskState, follow: bool = True) -> Hashable:
    """Where a task may run, as one hashable value (``None``: anywhere): its restrictions and, when
    its inputs are already in memory and ``follow``, the worker holding most of their bytes (so that a
    fragment does not pull the inputs of members that live on different workers to one of them)."""
    return _place_of(ts.worker_restrictions or (), ts.host_restrictions or (), ts.resource_restrictions,
                     ts.loose_restrictions, _home(_inputs(ts)) if follow else None)


def _fetch(scheduler: Scheduler, places: Mapping[Key, Hashable], loose: Mapping[Key, Hashable],
           inputs: Iterable[TaskState]) -> dict[str, Any]:
    """The arguments of :func:`fragment_graph` that let it fetch the inputs of annotated tasks where
    following the workers holding them (``places``) costs more than moving them (``loose``: where
    the tasks may run wherever their inputs are; ``inputs``: the tasks they read that the scheduler
    has); none where both places group the tasks alike, or the scheduler's overall bandwidth is below a
    byte a second or infinite.
    The costs: a task's (``octopus.fragments.task-cost``), and the bandwidths the workers measured
    moving data (:func:`~dask_octopus._compat.measured_bandwidths`: the scheduler's figure per pair of
    workers, made from transfers of 1 MB or more, where it has one, else its overall figure, which
    starts at ``distributed.scheduler.bandwidth`` and follows every transfer slowly; a pair's below a
    byte a second or infinite counts as none), each rounded to the nearest power of two, so that a graph
    computed again is cut alike (and its plan remembered) while the measurements move a little."""
    if len(set(places.values())) <= len(set(loose.values())):
        return {}
    overall, pairs = measured_bandwidths(scheduler)
    if not _countable(overall):
        return {}
    holders = {ts.key: frozenset(ws.address for d in held for ws in list(d.who_has or ()))
               for ts in inputs if (held := _held(ts))}
    bandwidths = Bandwidths(_power_of_two(overall),
                            {pair: _power_of_two(bw) for pair, bw in pairs.items() if _countable(bw)})
    return {"loose": loose, "holders": holders,
            "fetch_costs": (parse_timedelta(config.get("fragments.task-cost")), bandwidths)}


def _countable(bandwidth: float) -> bool:
    """Whether ``bandwidth`` is a figure :func:`_power_of_two` rounds: a byte a second or more, finite
    (and below ``2 ** 1023``, whose nearest power of two a float may not hold)."""
    return 1 <= bandwidth < 2.0 ** 1023


def _power_of_two(value: float) -> float:
    """``value`` (:func:`_countable`) rounded to the nearest power of two."""
    return 2.0 ** round(math.log2(value))


def _new(ts: TaskState | None) -> bool:
    """Whether the scheduler has no use of a key: no task, or a released one that nothing reads or wants
    (about to be forgotten). Dask reuses the others (results held, tasks in flight), so do fragments."""
    return ts is None or _unread(ts)


def _workers_of(scheduler: Scheduler, place: Hashable) -> dict[str, WorkerState]:
    """The workers that can run tasks of ``place``: its one worker (a pin, or the worker holding its
    inputs), else those its worker, host and resource restrictions allow, else (none there) all."""
    workers = dict(scheduler.workers)  # a copy: the optimizer reads this off the event loop
    one = _worker_of(place)
    if one in workers:
        return {one: workers[one]}
    if place is None:
        return workers
    allowed, hosts, resources = place[0], place[1], place[2]
    fit = {addr: ws for addr, ws in workers.items()
           if (not allowed or addr in allowed) and (not hosts or ws.host in hosts)
           and all(ws.resources.get(r, 0) >= need for r, need in resources)}
    return fit or workers


def _threads(scheduler: Scheduler, place: Hashable) -> int:
    """The worker threads that can run tasks of ``place`` (:func:`_workers_of`)."""
    return max(1, sum(ws.nthreads for ws in _workers_of(scheduler, place).values()))


def _worker_of(place: Hashable) -> str | None:
    """The one worker of ``place`` (a pin, or the worker holding its inputs), ``None`` if not one."""
    if place is None:
        return None
    restricted, home = place[0], place[4]
    return home if home is not None else (next(iter(restricted)) if len(restricted) == 1 else None)


def thread_budget(ws: WorkerState, profile: Mapping[str, Any]) -> float | None:
    """The bytes one task of a worker may hold at once (``octopus.fragments.max-bytes``, which caps
    fragments and ``map``'s batches).

    Parameters
    ----------
    ws
        The worker, as the scheduler knows it (its memory limit and threads).
    profile
        Its calibration (``device``, ``memory_free``, ``memory_total``); empty where not reported.

    Returns
    -------
    float or None
        The setting, read on the scheduler; with ``auto``, ``octopus.balance.memory-fraction`` of the
        worker's memory per worker thread: on GPU workers, of the free device memory at calibration; on
        CPU workers, of the memory limit, and at most the fraction between the one Dask spills results
        down to and the one at which it pauses the worker (:func:`_headroom`), else (no limit) of its
        total memory; ``None`` (no cap) when its memory is not known.
    """
    setting = config.get("fragments.max-bytes")
    if setting != "auto":
        return float(parse_bytes(setting))
    fraction = config.get("balance.memory-fraction")
    memory = plannable_memory(profile, ws.memory_limit)
    if profile.get("device") != "gpu" and ws.memory_limit:  # (without a limit Dask neither spills nor pauses)
        headroom = _headroom()
        fraction = fraction if headroom is None else min(fraction, headroom)
    return memory * fraction / max(1, ws.nthreads) if memory else None


def _headroom() -> float | None:
    """The fraction of a worker's memory limit between Dask's ``distributed.worker.memory.target`` (else
    ``spill``), down to which a worker spills the results it holds, and ``pause`` (else ``terminate``),
    at which it stops starting tasks, as configured where this runs (the scheduler): what the tasks
    running on a worker may hold besides (a fragment or a ``map`` batch holds its inputs and results
    until it ends, where Dask's small tasks would let them spill). Not up to ``terminate``: a finished
    task's results wait there to be sent while the next task runs (Dask alone, one worker of 1 GiB
    sending tasks of 11 results of 32 MiB to the client as they finish, 0.34 of its limit each, died;
    tasks of 8, 0.25, did not). 0 where the target is not below that threshold; ``None`` where either
    is off."""
    memory = dask.config.get("distributed.worker.memory", {}) or {}
    floor = memory.get("target") or memory.get("spill")
    ceiling = memory.get("pause") or memory.get("terminate")
    return max(0.0, float(ceiling) - float(floor)) if floor and ceiling else None


def _budget(scheduler: Scheduler, profiles: Mapping[str, Mapping[str, Any]], place: Hashable) -> float | None:
    """:func:`thread_budget` for fragments of ``place``: of the smallest worker that can run them
    (:func:`_workers_of`); ``None`` (no cap) where no such worker's memory is known."""
    workers = _workers_of(scheduler, place)
    budgets = [b for addr, ws in workers.items() if (b := thread_budget(ws, profiles.get(addr, {}))) is not None]
    return min(budgets) if budgets else None


def _held(ts: TaskState) -> list[TaskState]:
    """The tasks in memory that hold the value of ``ts``: itself, else (an alias of a persisted
    collection) the results it reads that are in memory."""
    if ts.state == "memory":
        return [ts]
    alias = isinstance(ts.run_spec, Alias) and ts.state == "released"
    return [d for d in _inputs(ts) if d.state == "memory"] if alias else []


def _sizes(tasks: Iterable[TaskState]) -> dict[Key, float]:
    """The bytes of each task of ``tasks`` by its key (:func:`_held`); tasks with none in memory left out."""
    return {ts.key: sum(d.get_nbytes() for d in held) for ts in tasks if (held := _held(ts))}


def _behind_reused(graph: Mapping[Key, GraphNode], reusable: Mapping[Key, TaskState], keep: Collection[Key],
                   ) -> set[Key]:
    """The tasks of ``graph`` that only tasks of the scheduler that it reuses (``reusable``, :func:`_new`)
    read, where such a task reads other keys there than in ``graph`` (the same collection computed twice
    at once, or again while its first result is held: that task reads the first compute's fragments).
    Dask keeps the scheduler's task and would make these and never run them: they stay out of the
    fragments, as tasks, which :func:`unread_tasks` finds after ``update_graph``. Kept in the graph, with
    the graph's own spec of the reused task, they still compute it where the scheduler let the task go
    before the graph arrived (its client released it while the graph was being prepared)."""
    differing = {k for k, ts in reusable.items()
                 if isinstance(ts.run_spec, GraphNode) and {d.key for d in ts.dependencies} != graph[k].dependencies}
    if not differing:
        return set()
    # what the graph needs besides what only the differing tasks read
    reached = needed_by({k: () if k in differing else node.dependencies for k, node in graph.items()}, keep)
    return set(graph) - reached


def _failing(had: Mapping[Key, TaskState], dependents: Mapping[Key, Collection[Key]], new: Collection[Key],
             ) -> set[Key]:
    """The keys of ``new`` that read a task of ``had`` that failed (its ``exception_blame`` set by Dask in
    ``update_graph``), directly or through other keys of ``new``."""
    stack = [k for k, ts in had.items() if ts.exception_blame is not None]
    found: set[Key] = set()
    while stack:
        for r in dependents.get(stack.pop(), ()):
            if r in new and r not in found:
                found.add(r)
                stack.append(r)
    return found


def fragment_here(graph: Mapping[Key, GraphNode], marks: Mapping[Key, Mapping[str, Any]], keep: Collection[Key],
                  dependents: Mapping[Key, set[Key]], annotations: Mapping[Key, Mapping[str, Any]] | None = None,
                  ) -> dict[Key, GraphNode] | None:
    """Fragments of an optimized graph made where the optimizer runs, on the one scheduler of this process
    (which has the plugin): the places of its marked tasks are their plans' workers or the restrictions
    of their Dask annotations (``workers``, ``resources``) and the worker holding their inputs, as
    :func:`group_new_tasks` finds them later, but before Dask makes a task state for each of the graph's
    tasks (most of the cost of a graph of small tasks), and their other Dask annotations
    (``annotations``, by key: tasks group only with tasks of equal such annotations,
    :func:`shared_annotations`; each step keeps its ``retries``). Tasks the scheduler has already (held,
    running, or wanted by a client: Dask reuses them) are not grouped, nor the tasks that only such
    tasks read where they read other keys there (:func:`_behind_reused`), and new tasks that read a task
    that failed (held by a client), directly or through other new tasks, are not grouped: Dask fails
    them as it gets them (:func:`_failing`). ``None`` when not exactly one such scheduler runs here,
    when this does not run where that scheduler materializes the graphs it gets (distributed's offload
    thread: not a client building a graph, nor a local scheduler running one) or when the scheduler's
    state changed while being read (Dask runs the optimizer in its offload thread): then the marks
    travel to ``update_graph``."""
    plugins = _hosts()
    if len(plugins) != 1 or len(running_schedulers() or ()) != 1 or not in_offload_thread():
        return None
    plugin = plugins[0]
    scheduler, placement = plugin.scheduler, plugin.placement
    try:  # Dask runs the optimizer in its offload thread, beside the event loop that changes this state
        annotations = annotations or {}
        reusable = {k: ts for k in graph if not _new(ts := scheduler.tasks.get(k))}  # Dask reuses these
        behind = _behind_reused(graph, reusable, keep)
        new = {k for k in graph if k not in reusable and k not in behind}
        marks = {k: m for k, m in marks.items() if k in new}
        places: dict[Key, Hashable] = {}
        loose: dict[Key, Hashable] = {}  # where they may run, wherever their inputs are
        # what the new tasks read that the scheduler has: sized (also through the aliases read through), and
        # where it is in memory, the home of the marked tasks that read it
        had = {d: ts for k in new for d in graph[k].dependencies
               if d not in new and (ts := scheduler.tasks.get(d)) is not None}
        failing = _failing(had, dependents, new)
        if failing:
            new -= failing
            marks = {k: m for k, m in marks.items() if k not in failing}
        sizes = _sizes(had.values())
        coerce = functools.lru_cache(maxsize=None)(scheduler.coerce_address)  # (it may look a host name up)
        homes: dict[str | None, Hashable] = {}  # the place of an unannotated task, by its inputs' home
        for k in marks:
            node = graph[k]
            worker = placement.planned_worker(k, node)
            held = [had[d] for d in node.dependencies if d in had]
            if worker is not None:
                places[k] = loose[k] = _place_of([worker])
            elif k in annotations:
                restrictions = annotated_restrictions(annotations[k], coerce)
                places[k], loose[k] = _place_of(*restrictions, _home(held)), _place_of(*restrictions)
            else:
                home = _home(held)
                places[k] = homes[home] if home in homes else homes.setdefault(home, _place_of(home=home))
                loose[k] = None
        kinds = set(places.values()) | set(loose.values()) | {None}  # None: pulled-in tasks
        threads = {p: _threads(scheduler, p) for p in kinds}
        budgets = {p: _budget(scheduler, plugin.profiles, p) for p in kinds}
        fetch = _fetch(scheduler, places, loose, had.values())
    except RuntimeError:  # a worker or a task changed while being read: update_graph makes the fragments
        logger.debug("dask_octopus: scheduler state changed while planning fragments", exc_info=True)
        return None
    return fragment_graph(graph, marks, keep, dependents, places, threads, new, sizes=sizes, budgets=budgets,
                          retries=annotated_retries(annotations), labels=annotation_labels(annotations),
                          made_bytes=block_bytes(), read_through=_read_through(graph, new, placement.planned_block),
                          **fetch)


def _read_through(graph: Mapping[Key, GraphNode], new: Iterable[Key], planned: Callable[[Key, Any], Any] | None,
                  ) -> set[Key]:
    """The aliases among the ``new`` tasks of ``graph`` whose targets fragments may read instead: those
    no plan pins (``planned``: the plan's block of a key and its run spec, if any)."""
    return {k for k in new if type(node := graph[k]) is Alias and (planned is None or planned(k, node) is None)}


def _groupable(ts: TaskState, new: Mapping[Key, TaskState], wanted: Collection[Key]) -> bool:
    """A new task (or alias: it may run as a guard) that only tasks of this graph read, that is not an
    output and not a group (or the pick of a group's result) already."""
    return (isinstance(ts.run_spec, (Task, Alias)) and not of_fragments(ts.run_spec) and ts.key not in wanted
            and not ts.who_wants and not ts.actor and all(d.key in new for d in ts.dependents))


Restrictions = tuple[Any, Any, Any, bool]  # a task's worker, host and resource restrictions, and whether loose


def _restrictions(ts: TaskState) -> Restrictions:
    """A copy of the restrictions of ``ts``."""
    return (set(ts.worker_restrictions) if ts.worker_restrictions else None,
            set(ts.host_restrictions) if ts.host_restrictions else None,
            dict(ts.resource_restrictions) if ts.resource_restrictions else None, ts.loose_restrictions)


def _restrict(ts: TaskState, restrictions: Restrictions) -> None:
    ts.worker_restrictions, ts.host_restrictions, ts.resource_restrictions, ts.loose_restrictions = restrictions


def _relink(ts: TaskState, dependencies: set[Key], tasks: Mapping[Key, TaskState]) -> None:
    for dts in [d for d in ts.dependencies if d.key not in dependencies]:
        ts.dependencies.discard(dts)
        dts.dependents.discard(ts)
    for key in dependencies:
        ts.add_dependency(tasks[key])


def group_new_tasks(scheduler: Scheduler, keys: Iterable[Key], marks: Mapping[Key, Mapping[str, Any]],
                    wanted: Collection[Key], profiles: Mapping[str, Mapping[str, Any]] | None = None,
                    unread: Collection[Key] = (), planned: Callable[[Key, Any], Any] | None = None,
                    ) -> tuple[dict[Key, list[Key]], list[Key]]:
    """Group the marked tasks among the new, released tasks ``keys`` of one ``update_graph``, but
    those ``unread`` (:func:`unread_tasks`).

    ``marks`` are the ``octopus`` annotations of the tasks (``resource``, ``group``); ``wanted`` are
    the keys the client asked for, which keep their own tasks; ``profiles`` (the workers' calibrations)
    size the memory budget of ``octopus.fragments.max-bytes: auto``. The fragments read what the new
    aliases name (dask-expr reads a persisted dataframe through one alias task per partition), but
    for the aliases that ``planned`` (a key and its run spec: the plan's block, if any,
    :meth:`~dask_octopus.placement.pins.Placement.planned_block`) says a plan pins. Returns each new
    group task's key with its members' keys, and the keys of the tasks that nothing reads any more
    (members, tasks run as guards, aliases read through that only fragments, guards or other such
    aliases read). Forget those with :func:`forget_unread` after ``update_graph``, so that plugins
    called after this one still find every key they are given.
    """
    tasks = scheduler.tasks
    new = {k: tasks[k] for k in keys if k in tasks and k not in unread and tasks[k].state == "released"
           and isinstance(tasks[k].run_spec, GraphNode)}
    dependents = {k: {d.key for d in ts.dependents} for k, ts in new.items()}
    # Dask blames only the direct readers of a failed task before plugins run (it fails the rest as its
    # transitions reach them): a fragment of their readers would wait for that task forever, or fail whole
    had = {d.key: d for ts in new.values() for d in ts.dependencies if d.key not in new}
    failing = _failing(had, {**dependents, **{k: {d.key for d in ts.dependents} for k, ts in had.items()}}, new)
    groupable = {k for k, ts in new.items() if k not in failing and _groupable(ts, new, wanted)}
    specs = {k: m for k, m in marks.items() if k in groupable}
    if len(specs) < 2:
        return {}, []
    # in the order the marks carry (the graph's build order), else Dask's: the same work groups alike
    ranked = sorted(new, key=lambda k: (specs[k].get("order", len(specs)) if k in specs else len(specs)))
    dsk = {k: new[k].run_spec for k in ranked}
    places = {k: _place(new[k]) for k in specs}
    loose = {k: _place(new[k], follow=False) for k in specs}
    kinds = set(places.values()) | set(loose.values()) | {None}
    # what the outputs need: the keys asked for, and the tasks that a task of an earlier graph reads
    outputs = [k for k, ts in new.items()
               if k in wanted or ts.who_wants or any(d.key not in new for d in ts.dependents)]
    out = fragment_graph(dsk, specs, set(), dependents, places, {p: _threads(scheduler, p) for p in kinds},
                         groupable, roots=outputs,
                         sizes=_sizes(had.values()),
                         budgets={p: _budget(scheduler, profiles or {}, p) for p in kinds},
                         retries={k: new[k].retries for k in groupable},
                         labels={k: shared_annotations(ts.annotations) for k, ts in new.items()},
                         made_bytes=block_bytes(), read_through=_read_through(dsk, dsk, planned),
                         **_fetch(scheduler, places, loose, had.values()))
    made = {k: replaced_keys(node) for k, node in out.items() if k not in new}
    # another compute's fragment or guard of the same tasks (the same key: the same work), read as it is
    # (as Dask reads a task of another graph; left ungrouped, its members, whose specs Dask just filled
    # in from this graph, would run again for the new readers); but not where one failed as a whole (its
    # worker lost, say): Dask fails the readers of failed tasks before plugins run, and new readers
    # linked to it would wait for it forever
    shared = {k for k in made if k in tasks}
    if not made or any(tasks[k].state == "erred" for k in shared):
        return {}, []
    # the members (not the results picked as tasks), the guarded tasks and the aliases read through
    members = [k for k in new if k not in out]
    made = {k: ms for k, ms in made.items() if k not in shared}
    computation = scheduler.computations[-1] if scheduler.computations else None
    for gkey, members_of in made.items():
        first = tasks[members_of[0]]
        gts = scheduler.new_task(gkey, out[gkey], "released", computation=computation)
        gts.priority = min(tasks[m].priority for m in members_of)
        # a group task does the work of several blocks: not measured as one; each step retries as its own
        # member would (the fragment keeps them), the task as its most retried member
        gts.annotations = {k: v for k, v in (first.annotations or {}).items() if k not in (MEASURE, "retries")}
        _restrict(gts, _restrictions(first))
        gts.retries = max(tasks[m].retries for m in members_of)
    for gkey in made:  # a group may read members of another group
        _relink(tasks[gkey], out[gkey].dependencies, tasks)
    for k, node in out.items():
        if k in new and node is not dsk[k]:  # reads a member: now from its group task
            new[k].run_spec = node
            _relink(new[k], node.dependencies, tasks)
    for m in members:  # their work is the fragments' now: no spec until forgotten, so that another client's
        # graph that names one meanwhile gives it its own spec and inputs (Dask fills in a missing spec)
        _relink(tasks[m], set(), tasks)
        tasks[m].run_spec = None
    spans = scheduler.extensions.get("spans")
    if spans is not None:
        spans.observe_tasks([tasks[g] for g in made], code=(), span_metadata={})
    return made, members


def _read_before(ts: TaskState) -> frozenset[Key] | None:
    """The keys the task ``ts`` read before the grouping rewrote its run spec: a member kept as a task
    that picks its value from its fragment (or, once that was split, from the task gathering the parts'
    results for it: :func:`split_fragment`) read what the member read
    (:attr:`~dask_octopus.groups.fragment.Fragment.read_before`, which the parts keep for their
    members), a consumer that reads results of fragments inline what
    :func:`~dask_octopus.groups.rewrite.read_before_grouping` says. ``None`` for a task the grouping did
    not rewrite (or whose fragment no longer says)."""
    if not picks_a_result(ts.run_spec):
        return read_before_grouping(ts.run_spec)
    for dts in ts.dependencies:
        gatherer = isinstance(dts.run_spec, Task) and dts.run_spec.func is collected
        for source in (dts, *(dts.dependencies if gatherer else ())):
            fragment = fragment_of(source.run_spec)
            if fragment is not None and ts.key in fragment.read_before:
                return fragment.read_before[ts.key]
    return None


def regrouped(ts: TaskState, dependencies: Collection[Key]) -> bool:
    """Whether the task ``ts``, rewritten by the grouping, is the task of a run spec reading ``dependencies``
    as grouped since: they are what it read before (:func:`_read_before`), or, for a member kept as a
    task or a fused task run whole when its fragment was split, the one key that Dask's fusion names a
    chain of tasks ending at the task's key (its own work under the alias that Dask's graph gives it;
    our graph resolved that alias: :func:`~dask_octopus._compat.fused_name_of`). A plain task of one
    key is never taken for grouped, whatever its new dependency's name. The other way round, a task
    that is such an alias (computed without annotations) is the same work as the fused task it names,
    which our graph put under its key: the new run spec reads what that task read."""
    new = set(dependencies)
    if (len(new) == 1 and fused_name_of(ts.key, next(iter(new)))  # a member kept as a task, or run whole
            and (picks_a_result(ts.run_spec) or len(inner_keys(ts.key, ts.run_spec)) > 1)):
        return True
    if type(ts.run_spec) is Alias and len(ts.dependencies) == 1:  # Dask's alias held, its target resolved now
        (target,) = ts.dependencies
        if fused_name_of(ts.key, target.key) and {d.key for d in target.dependencies} == new:
            return True
    before = _read_before(ts)
    return before is not None and new == before


class RegroupedRunSpecs(logging.Filter):
    """A filter of the scheduler's log that drops its warning that a key came again with another run
    spec (other dependencies) where the scheduler's task for that key differs only by our grouping
    (:func:`regrouped`): the same annotated collection computed again while the first result is held,
    whose first run read fragments. Dask keeps its task, as for any such key; the warning, which says
    this may fail or deadlock, is about keys reused for other work. Any other record passes."""

    def __init__(self, scheduler: Scheduler):
        super().__init__()
        self._scheduler = weakref.ref(scheduler)

    def filter(self, record: logging.LogRecord) -> bool:
        scheduler = self._scheduler()
        if scheduler is None or record.levelno < logging.WARNING or not isinstance(record.msg, str):
            return True
        collision = run_spec_collision(record.msg)
        if collision is None:
            return True
        key, held, dependencies = collision
        try:  # (the logger is the process's: another scheduler's record, logged from its event loop, may
            # name a key this scheduler has too, and read its task while this one's loop changes it)
            ts = scheduler.tasks.get(key)
            return ts is None or {d.key for d in ts.dependencies} != held or not regrouped(ts, dependencies)
        except Exception:  # a filter that raises would fail the update_graph that logs
            return True


def _is_fragment_key(key: Key) -> bool:
    return type(key) is tuple and bool(key) and type(key[0]) is str and key[0].startswith(FRAGMENT_PREFIX)


class SentFragments:
    """The fragments of the fragment tasks a scheduler holds, each released
    (:meth:`~dask_octopus.groups.fragment.Fragment.release`) as Dask forgets its task: Dask's log of the
    messages sent to the workers keeps the last thousand, and with them every fragment sent."""

    def __init__(self) -> None:
        self._by_key: dict[Key, Fragment] = {}

    def add(self, scheduler: Scheduler, keys: Iterable[Key]) -> None:
        """Keep the fragments of the fragment tasks among ``keys``, new in ``scheduler``'s graph (told by
        what they run, whatever their names: a split fragment's parts are named for their members)."""
        tasks, by_key = scheduler.tasks, self._by_key
        for key in keys:
            if (ts := tasks.get(key)) is not None and (fragment := fragment_of(ts.run_spec)) is not None:
                by_key[key] = fragment

    def forget(self, key: Key) -> None:
        """Release the fragment of task ``key``, which Dask forgot (nothing for another task)."""
        fragment = self._by_key.pop(key, None)
        if fragment is not None:
            fragment.release()


def place_readers(scheduler: Scheduler, key: Key, worker: str) -> None:
    """Where the fragment task ``key`` finished on ``worker``, run the tasks that read nothing else
    there too (those that pick one of its results, :func:`~dask_octopus.groups.rewrite.picks_a_result`,
    and those that read them inline), loosely restricted (elsewhere if it leaves), but those restricted
    already (a plan's pins, the user's): many of one key prefix reading a few tasks, Dask would take
    them for root tasks and place them anywhere, each fetching all of the fragment's results."""
    if not _is_fragment_key(key):
        return
    ts = scheduler.tasks.get(key)
    for dts in ts.dependents if ts is not None else ():
        if (len(dts.dependencies) == 1 and not dts.worker_restrictions and not dts.host_restrictions
                and not dts.resource_restrictions):
            dts.worker_restrictions = {worker}
            dts.loose_restrictions = True


def _unread(ts: TaskState) -> bool:
    return ts.state == "released" and not ts.dependents and not ts.who_wants


def unread_tasks(scheduler: Scheduler, keys: Iterable[Key], wanted: Collection[Key]) -> list[Key]:
    """The tasks among ``keys`` (those of one ``update_graph``) that are released, that no task reads
    and no client wants (not among ``wanted``): Dask would keep them so for good. A graph leaves such
    where the scheduler holds some of its keys with other run specs (Dask keeps those, and the new
    tasks they read in this graph are read by none): a graph computed again while its first run, whose
    consumers read fragments, is still held, annotated or not; and fragment tasks that
    :func:`fragment_here` makes when the same work is in flight already, cut otherwise."""
    tasks = scheduler.tasks
    return [k for k in keys if (ts := tasks.get(k)) is not None and _unread(ts) and k not in wanted]


def forget_unread(scheduler: Scheduler, keys: Iterable[Key], stimulus_id: str) -> None:
    """Forget the tasks among ``keys`` that are still released and read or wanted by nothing."""
    recs: dict[Key, str] = {}
    for k in keys:
        ts = scheduler.tasks.get(k)
        if ts is not None and _unread(ts):
            recs[k] = "forgotten"
    if recs:
        scheduler.transitions(recs, stimulus_id)


GATHER_PREFIX = "octopus-gathered"  # a split fragment's results that one of its readers picks


def _hold(ts: TaskState) -> Restrictions:
    """Keep the task ``ts`` from running (Dask finds it no worker) until :func:`split_fragment`; returns
    its restrictions, which that puts back."""
    held = _restrictions(ts)
    _restrict(ts, ({HELD}, None, None, False))
    return held


def hold_if_lost(ts: TaskState) -> Restrictions | None:
    """Hold the task ``ts`` (:func:`_hold`) if a worker left while running it (Dask counts it *suspicious*)
    and it is a fragment task of two members or more, or a ``map`` batch task of two items or more read
    through a future per item (:func:`split_batch`); ``None``: not held."""
    if not ts.suspicious:
        return None
    fragment = fragment_of(ts.run_spec)
    if (fragment is not None and len(fragment.members) > 1) or _batch_items(ts) is not None:
        return _hold(ts)
    return None


def _picked_item(node: Any, key: Key) -> int | None:
    """The position of the item of the ``map`` batch task ``key`` that ``node`` (a run spec) picks, where
    it is such a pick (a future per item); else ``None``."""
    if (isinstance(node, Task) and node.func is pick_item and isinstance(node.args[0], TaskRef)
            and node.args[0].key == key):
        return node.args[1]
    return None


def _batch_items(ts: TaskState) -> list[Any] | None:
    """The items of ``ts``, a ``map`` batch task of two items or more that only tasks picking one of its
    items read (futures per item), as its run spec gives them (values, or nodes reading futures); else
    ``None``."""
    spec = ts.run_spec
    if not (isinstance(spec, Task) and spec.func is run_batch) or ts.who_wants or not ts.dependents:
        return None
    items = spec.args[1]
    items = list(items.args) if isinstance(items, List) else items
    if (not isinstance(items, list) or len(items) < 2
            or any(_picked_item(rts.run_spec, ts.key) is None for rts in ts.dependents)):
        return None
    return items


def hold_if_too_large(scheduler: Scheduler, ts: TaskState,
                      profiles: Mapping[str, Mapping[str, Any]]) -> tuple[Restrictions, float, float] | None:
    """Hold the task ``ts``, ready to run (its inputs all in memory), (:func:`_hold`) if it is a fragment
    task of two members or more reading two inputs or more (its parts then hold fewer at once) whose
    inputs (sized now that they exist) and estimated intermediates
    (:meth:`~dask_octopus.groups.fragment.Fragment.peak_bytes`) exceed its place's budget
    (``octopus.fragments.max-bytes``): inputs made by the same graph, but blocks of dask arrays of known
    chunks, are not sized when the fragments are cut (:func:`_input_sizes`). Its parts then hold their
    own inputs only, as Dask's tasks would (the others may spill). Returns its restrictions, the
    estimate and the budget; ``None``: not held."""
    fragment = fragment_of(ts.run_spec)
    if fragment is None or len(fragment.members) < 2 or len(fragment.inputs) < 2:
        return None
    budget = _budget(scheduler, profiles, _place(ts))
    if budget is None:
        return None
    sizes = _input_sizes(ts, fragment)
    same = {name: arg.key for name, arg in zip(fragment.inputs, ts.run_spec.args[1:]) if isinstance(arg, TaskRef)}
    return (_hold(ts), fragment.peak_bytes(sizes, same), budget) if fragment.exceeds(sizes, budget, same) else None


def _input_sizes(ts: TaskState, fragment: Fragment) -> dict[Key, float]:
    """The bytes of the inputs of the fragment task ``ts``, all in memory, by name: those it reads as
    tasks, the tasks'; those it picks inline from the result of another task (a fragment task, or the
    gatherer of a split one), an equal share of that task's bytes (among the fragment's results, or the
    gatherer's picks), or their estimate before they existed
    (:attr:`~dask_octopus.groups.fragment.Fragment.made`) where that is more, but no more than the task's."""
    reads = {dts.key: dts for dts in ts.dependencies}
    args = ts.run_spec.args[1:]
    read = [arg.key if isinstance(arg, TaskRef) else next(iter(arg.dependencies), None) for arg in args]
    picks = Counter(read)
    sizes = {}
    for name, arg, k in zip(fragment.inputs, args, read, strict=True):
        if k is None:  # (an inline value reading no task: none of a task's bytes)
            continue
        nbytes = float(reads[k].get_nbytes())
        if isinstance(arg, TaskRef):
            sizes[name] = nbytes
            continue
        picked = fragment_of(reads[k].run_spec)
        share = nbytes / (len(picked.outputs) if picked is not None else picks[k])
        sizes[name] = min(nbytes, max(share, fragment.made.get(name, 0.0)))
    return sizes


def run_whole(scheduler: Scheduler, ts: TaskState, held: Restrictions, stimulus_id: str) -> None:
    """Undo :func:`hold_if_lost` or :func:`hold_if_too_large` (where the task is still held): ``ts`` runs
    whole, as Dask would run it."""
    if ts.worker_restrictions == {HELD}:
        _restrict(ts, held)
    if scheduler.tasks.get(ts.key) is ts and ts.state == "no-worker":
        scheduler.transitions({ts.key: "released"}, stimulus_id)  # and on: waiting, or forgotten


def _picked(node: GraphNode, key: Key) -> set[int]:
    """The results of fragment task ``key`` that ``node`` picks (as a task, or inline)."""
    out, stack = set(), [node]
    while stack:
        n = stack.pop()
        if isinstance(n, Task):
            if n.func is pick and isinstance(n.args[0], TaskRef) and n.args[0].key == key:
                out.add(n.args[1])
            stack.extend(a for a in (*n.args, *n.kwargs.values()) if isinstance(a, GraphNode))
    return out


def _named_for(key: Key, fkey: Key, prefix: str, j: int) -> Key:
    """The key of the ``j``-th task of kind ``prefix`` made of fragment task ``fkey`` when it is split,
    named for the task ``key`` it runs or serves: that task's name and index, with ``fkey``'s name (its
    prefix replaced) and number after the name, so an error that names the task (``KilledWorker``) shows
    the user's block, and the tasks made for one layer of one fragment share a task group, as its tasks
    do (root tasks are queued: a worker that goes down takes few of them with it); for keys of other kinds, ``key``'s
    prefix and ``j``; for a fragment task (a reader: no user's name to keep), ``fkey``'s and ``j``."""
    name = fkey[0].replace(FRAGMENT_PREFIX, prefix, 1)
    head = layer_of(key)
    if isinstance(head, str) and head.startswith(FRAGMENT_PREFIX):
        return (name, fkey[1], j)
    if isinstance(key, str):
        return f"{key}-{name}-{fkey[1]}"
    if type(key) is tuple and key and isinstance(key[0], str):
        return (f"{key[0]}-{name}-{fkey[1]}", *key[1:])
    return (f"{key_split(key)}-{name}", fkey[1], j)


def split_fragment(scheduler: Scheduler, ts: TaskState, held: Restrictions, stimulus_id: str,
                   made: Callable[[list[Key], list[Key]], None] | None = None) -> list[Key]:
    """Run the fragment task ``ts``, held by :func:`hold_if_lost` after its worker left while running it
    or by :func:`hold_if_too_large`, as one fragment task per member
    (:meth:`~dask_octopus.groups.fragment.Fragment.split`), so that a member that takes its worker down
    fails (``KilledWorker``) only what reads it, and each part holds its own inputs only, as without
    fragments. Each task that read the fragment reads, instead, a task that gathers the results it
    picks from the parts that make them; the parts run in the fragment's order (their priorities), the
    fragment task is forgotten. ``made`` is called with the parts' keys and the gatherers' before
    any runs and before the fragment task is forgotten (the plugin pins them as the fragment was).
    Returns the parts' keys; ``[]`` where the task is left as it was, no longer held: it is not waiting
    to run (forgotten, cancelled), has one member, or a :class:`ValueError` said why it cannot be split,
    before anything changed.
    """
    key = ts.key
    if scheduler.tasks.get(key) is not ts:  # forgotten meanwhile (and perhaps made again)
        return []
    if ts.worker_restrictions == {HELD}:
        _restrict(ts, held)  # (what the parts take)
    fragment = fragment_of(ts.run_spec)
    if ts.state not in ("waiting", "no-worker") or not ts.dependents or len(fragment.members) < 2:
        run_whole(scheduler, ts, held, stimulus_id)
        return []
    given = dict(zip(fragment.inputs, ts.run_spec.args[1:], strict=True))  # plain keys, or guards'
    order = {name: i for i, name in enumerate(fragment.names)}
    parts = {_named_for(part.members[0], key, FRAGMENT_PREFIX, j): part for j, part in enumerate(fragment.split())}
    where = {name: (pkey, i) for pkey, part in parts.items() for i, name in enumerate(part.outputs)}

    def read(name: Key) -> GraphNode:
        return given[name] if name in given else Task(name, operator.getitem, TaskRef(where[name][0]), where[name][1])

    specs = {pkey: Task(pkey, run_fragment, DataNode(None, part), *map(read, part.inputs))
             for pkey, part in parts.items()}
    after = {pkey: order[part.members[0]] for pkey, part in parts.items()}  # where its member ends in the run
    readers = {}
    for j, rts in enumerate(sorted(ts.dependents, key=lambda d: str(d.key))):
        positions = sorted(_picked(rts.run_spec, key))
        if not positions:
            raise ValueError(f"task {rts.key!r} reads fragment task {key!r} other than by picking its results")
        ckey = _named_for(rts.key, key, GATHER_PREFIX, j)
        specs[ckey] = Task(ckey, collected, len(fragment.outputs), DataNode(None, tuple(positions)),
                           *(read(fragment.outputs[i]) for i in positions))
        after[ckey] = max(order[fragment.outputs[i]] for i in positions)
        readers[rts] = ckey
    if scheduler.tasks.keys() & specs.keys():
        raise ValueError(f"the parts of fragment task {key!r} exist already (split before, still held)")
    # nothing changed so far; from here on nothing raises
    _install(scheduler, ts, specs, after, _restrictions(ts),
             {rts: rts.run_spec.substitute({key: ckey}) for rts, ckey in readers.items()}, stimulus_id,
             None if made is None else lambda: made(list(parts), list(readers.values())))
    return list(parts)


def split_batch(scheduler: Scheduler, ts: TaskState, held: Restrictions, stimulus_id: str, pinned: bool,
                made: Callable[[list[Key]], None] | None = None) -> list[Key]:
    """Run the ``map`` batch task ``ts``, held by :func:`hold_if_lost` after its worker left while running
    it, as one batch task per item, each read by the task that picked that item (the item's future), so
    that an item that takes its workers down fails (``KilledWorker``) alone, as a task of ``client.map``
    does. ``pinned``: ``ts`` was pinned by a plan (the parts are not: Dask places and queues them, as
    ``client.map``'s tasks; else they keep its restrictions, the user's). The parts count no death of the
    workers that ran the batch (Dask's *suspicious*): the scheduler cannot tell which item was running,
    and an item counted for another's death would fail at its own first one; the item that kills its
    workers then takes one more of them than its own task would (Dask's ``allowed-failures`` + 2).
    ``made`` is called with the parts' keys once they exist, before any runs and before ``ts`` is
    forgotten. Returns the parts' keys; ``[]`` where the task is left as it was, no longer held: it is
    not waiting to run (forgotten, cancelled) or no longer read so; a :class:`ValueError` says why it
    cannot be split, before anything changed.
    """
    key = ts.key
    if scheduler.tasks.get(key) is not ts:  # forgotten meanwhile (and perhaps made again)
        return []
    items = _batch_items(ts)
    if ts.state not in ("waiting", "no-worker") or items is None:
        run_whole(scheduler, ts, held, stimulus_id)
        return []
    func, _, kwargs, resource, group, to_host = ts.run_spec.args
    name = key[0].replace(MAP_INFIX, ALONE_INFIX, 1)
    readers = {rts: (name, *key[1:], _picked_item(rts.run_spec, key)) for rts in ts.dependents}
    specs = {part: Task(part, run_batch, func, List(items[part[-1]]), kwargs, resource, group, to_host)
             for part in readers.values()}
    if scheduler.tasks.keys() & specs.keys():
        raise ValueError(f"the parts of map batch task {key!r} exist already (split before, still held)")
    # nothing changed so far; from here on nothing raises
    _install(scheduler, ts, specs, {part: part[-1] for part in specs},
             (None, held[1], held[2], False) if pinned else held,
             {rts: Task(rts.key, pick_item, TaskRef(part), 0) for rts, part in readers.items()}, stimulus_id,
             None if made is None else lambda: made(list(specs)))
    return list(specs)


def _install(scheduler: Scheduler, ts: TaskState, specs: Mapping[Key, Task], after: Mapping[Key, int],
             restrictions: Restrictions, readers: Mapping[TaskState, GraphNode], stimulus_id: str,
             made: Callable[[], None] | None = None) -> None:
    """Run the held task ``ts`` as the new tasks ``specs``, each taking its priority (then ``after[k]``),
    retries, annotations and span, and ``restrictions``: each task that read ``ts`` runs
    its new spec (``readers``, reading those tasks instead; those waiting, or wanted and not in memory,
    then wait for them), and ``ts``, read by none, is forgotten. ``made`` is called once the new tasks
    exist, before any runs."""
    key, tasks = ts.key, scheduler.tasks
    computation = next((c for c in reversed(scheduler.computations) if ts.group in c.groups), None)
    for k, spec in specs.items():
        nts = scheduler.new_task(k, spec, "released", computation=computation)
        nts.priority, nts.retries = (*ts.priority, after[k]), ts.retries
        nts.annotations = dict(ts.annotations or {})
        _restrict(nts, restrictions)
        if nts.group.span_id is None:
            nts.group.span_id = ts.group.span_id
    for k, spec in specs.items():  # (a part may read a part made after it)
        _relink(tasks[k], spec.dependencies, tasks)
    if made is not None:
        made()
    needed = {}
    for rts, spec in readers.items():
        rts.run_spec = spec
        _relink(rts, spec.dependencies, tasks)
        news = [tasks[d] for d in spec.dependencies if d in specs]
        if rts.waiting_on and ts in rts.waiting_on:  # (a new task's waiters are set as it starts waiting)
            rts.waiting_on.discard(ts)
            rts.waiting_on.update(news)
            if ts.waiters:
                ts.waiters.discard(rts)
        if rts.state == "waiting" or (rts.state == "released" and rts.who_wants):
            needed.update((d.key, "waiting") for d in news)
    spans = scheduler.extensions.get("spans")
    if spans is not None:
        spans.observe_tasks([tasks[k] for k in specs], code=(), span_metadata={})
    # one stimulus: the new tasks that a waiting reader waits on start waiting (and with them the tasks
    # they read); ``ts``, read by none, is forgotten (recommendations run last first)
    scheduler.transitions({key: "forgotten", **needed}, stimulus_id)
