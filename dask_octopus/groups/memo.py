"""Fragment plans remembered by what they were made from: the same collection computed again (the same
keys, task kinds and dependencies, annotations, places, sizes and budgets) reuses its plan instead of
planning it again. A plan is remembered when graphs of its keys are planned a second time, and reused
from then on; a graph computed once leaves only a hash of its keys (remembering every plan made, with
its thousands of objects, made computes of new keys 2-8 ms slower on the 2-core machine, more than the
1 ms of finding no plan).

Dask gives the same collection the same keys each time it is computed (but the final task's, which
:func:`ends_of` names for its kind and the keys it reads), so its fragments come out the same: planning
them again (places, run order, steps) costs a compute of 1024 small blocks about a fifth of its time.
What is reused is the plan (the cut, places, run order), which depends on the graph's shape (its keys,
the kind of each task and the keys it reads) and on what :func:`plan_form` holds besides, not on the
functions and constants the tasks run: each fragment's steps are made anew from the graph's tasks under
its members' keys, checked to be the same steps (fused alike) reading the same values, each one that
planning would group (:class:`~dask_octopus.groups.rewrite.Joins`: none a coroutine function's, say;
else the graph is planned anew), and each guard runs the graph's task, so the
compute at hand's functions and constants are what runs, whether they are those of the compute that
made the plan or not (a script's own functions, unpickled anew on the scheduler each compute; a bag's
partition changed in place; blocks holding arrays). A plan remembered holds no task of a compute: its
fragments' layouts without their steps, its guards without their tasks, the form of its inputs. Finding
it can never fail a compute: a graph whose form has no hash is planned as usual.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from dask.typing import Key

from dask_octopus import config
from dask_octopus._compat import GraphNode
from dask_octopus.groups.blocksizes import BlockBytes
from dask_octopus.groups.planning import layer_of
from dask_octopus.placement.bandwidth import Bandwidths


class PlanInputs(NamedTuple):
    """The arguments of :func:`~dask_octopus.groups.rewrite.fragment_graph`, by the same names."""

    dsk: Mapping[Key, GraphNode]
    specs: Mapping[Key, Mapping[str, Any]]
    keep: Collection[Key]
    dependents: Mapping[Key, Collection[Key]]
    places: Mapping[Key, Any]
    parts: Mapping[Any, int]
    pullable: Collection[Key] | None
    sizes: Mapping[Key, float] | None
    budgets: Mapping[Any, float | None] | None
    retries: Mapping[Key, int] | None
    labels: Mapping[Key, Any] | None
    made_bytes: Mapping[Key, float] | None
    read_through: Collection[Key]
    roots: list[Key] | None
    loose: Mapping[Key, Any] | None
    holders: Mapping[Key, Collection[str]] | None
    fetch_costs: tuple[float, Bandwidths] | None


class Stale(Exception):
    """Raised by the ``fresh`` of :meth:`PlanMemo.plan` where the graph's tasks are not those its plan
    was made for: the graph is planned anew."""


class _End:
    """An output of a graph that nothing in it reads, named for its kind and the keys it reads:
    ``(_End, kind, keys)``, never a Dask key."""


@dataclass
class _Entry:
    form: Hashable  # :func:`plan_form` of the plan's inputs
    graph: dict[Hashable, GraphNode | None]  # the plan, its ends by their names (None: the graph's own task)
    picks: dict[Key, GraphNode]  # the tasks that pick the fragments' results read inline


def ends_of(inputs: PlanInputs) -> dict[Key, Hashable] | None:
    """The keys of ``keep`` and ``roots`` that nothing in the graph reads, each with its name in a plan
    (Dask names a compute's final task anew each time): its kind and the keys it reads. ``None`` where
    two would have one name."""
    dsk, dependents = inputs.dsk, inputs.dependents
    ends = {k: (_End, type(dsk[k]), dsk[k].dependencies) for k in {*inputs.keep, *(inputs.roots or ())}
            if k in dsk and not dependents.get(k)}
    return ends if len(set(ends.values())) == len(ends) else None


def plan_form(inputs: PlanInputs, ends: Mapping[Key, Hashable]) -> Hashable | None:
    """What a plan is made from, in a hashable form (``ends`` by their names): every key, the kind of its
    task and the keys it reads, and the other arguments; ``None`` where one has no hash.
    Only the keys asked for count in their order: Dask lists a graph's tasks, annotations and places in
    orders that change from one compute to the next, and any order of them makes a valid plan."""
    try:
        return _plan_form(inputs, ends)
    except TypeError:
        return None


def _plan_form(inputs: PlanInputs, ends: Mapping[Key, Hashable]) -> Hashable:
    dsk, dependents = inputs.dsk, inputs.dependents

    def name(key: Key) -> Hashable:
        return ends.get(key, key)

    def items(mapping: Mapping[Any, Any] | None) -> Hashable:
        return None if mapping is None else frozenset((name(k), v) for k, v in mapping.items())

    made = inputs.made_bytes
    return (frozenset((name(k), type(node), node.dependencies) for k, node in dsk.items()),
            frozenset((name(k), tuple(mark.items())) for k, mark in inputs.specs.items()),
            tuple(map(name, inputs.keep)),
            frozenset((name(k), frozenset(map(name, v))) for k, v in dependents.items()  # those read from elsewhere
                      if k not in dsk or not dsk.keys() >= v),
            items(inputs.places), items(inputs.parts),
            None if inputs.pullable is None else frozenset(map(name, inputs.pullable)), items(inputs.sizes),
            items(inputs.budgets), items(inputs.retries), items(inputs.labels),
            made.layouts({layer_of(k) for k in dsk if k not in ends}
                         | {layer_of(d) for node in dsk.values() for d in node.dependencies})
            if isinstance(made, BlockBytes) else None,
            frozenset(map(name, inputs.read_through)),
            None if inputs.roots is None else frozenset(map(name, inputs.roots)),
            items(inputs.loose), items(inputs.holders), inputs.fetch_costs)


class PlanMemo:
    """The last plans made (``octopus.fragments.plan-memo`` of them; 0: none), by their graph's keys,
    least recently used dropped first; safe to use from several threads."""

    def __init__(self) -> None:
        self._plans: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()  # hashes of the keys of graphs planned once
        self._lock = threading.Lock()

    def plan(self, inputs: PlanInputs, make: Callable[[], tuple[dict[Key, GraphNode], dict[Key, GraphNode],
                                                                 frozenset[Key]]],
             fresh: Callable[..., GraphNode]) -> dict[Key, GraphNode]:
        """The plan remembered for ``inputs`` (:func:`plan_form` equal), with fresh tasks (``fresh(node, dsk,
        picks)``: the plan's task ``node`` running the graph ``dsk``'s tasks, those that read the plan's
        picks reading them as the plan's did, or raising :class:`Stale` where they are other tasks;
        ``fresh(node)``: ``node`` as the plan keeps it) and the graph's own tasks where the plan kept them
        (reading its picks as the plan's did), else ``make()``'s (the graph, its picks and the keys whose
        tasks are the graph's own, those rewritten to read picks included), remembered where graphs of
        these keys were planned before (a plan is remembered from the second compute on, and reused from
        the third: graphs of new keys, computed once, leave only a hash behind). A compute of new keys
        costs one pass over its keys here."""
        size = config.get("fragments.plan-memo")
        ends = ends_of(inputs) if size else None
        if ends is None or not (inputs.made_bytes is None or isinstance(inputs.made_bytes, BlockBytes)):
            return make()[0]
        outline = frozenset(ends.get(k, k) for k in inputs.dsk)
        with self._lock:
            entry = self._plans.get(outline)
        if entry is None and not self._seen_before(hash(outline), size):  # planned once: maybe never again
            return make()[0]
        form = plan_form(inputs, ends)
        if entry is not None and form is not None and form == entry.form:
            try:
                out = _apply(entry, inputs.dsk, {v: k for k, v in ends.items()}, fresh)
            except Stale:
                pass  # planned anew (and remembered in its place)
            else:
                with self._lock:
                    if outline in self._plans:
                        self._plans.move_to_end(outline)
                return out
        out, picks, own = make()
        if form is not None and ends.keys() <= own:  # (else an end joined a fragment, under this compute's name)
            graph = {ends.get(k, k): None if k in own else fresh(node) for k, node in out.items()}
            with self._lock:
                self._plans[outline] = _Entry(form, graph, dict(picks))
                self._plans.move_to_end(outline)
                while len(self._plans) > size:
                    self._plans.popitem(last=False)
        return out

    def _seen_before(self, outline: int, size: int) -> bool:
        """Whether graphs of these keys (the hash of their outline) were planned before; remembers them."""
        with self._lock:
            seen = outline in self._seen
            self._seen[outline] = None
            self._seen.move_to_end(outline)
            while len(self._seen) > 16 * size:
                self._seen.popitem(last=False)
        return seen

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Forget every plan."""
        with self._lock:
            self._plans.clear()
            self._seen.clear()


def _apply(entry: _Entry, dsk: Mapping[Key, GraphNode], ends: Mapping[Hashable, Key],
           fresh: Callable[..., GraphNode]) -> dict[Key, GraphNode]:
    """The plan of ``entry`` in its order for the graph ``dsk`` (its ends by their names: ``ends``): fresh
    tasks (``fresh``) running ``dsk``'s, and ``dsk``'s own tasks where the plan kept them, reading its picks
    as the plan's did."""
    out: dict[Key, GraphNode] = {}
    picks = entry.picks
    for k, node in entry.graph.items():
        if node is None:
            k = ends.get(k, k)
            node = dsk[k]
            out[k] = node.substitute(picks) if picks.keys() & node.dependencies else node
        else:
            out[k] = fresh(node, dsk, picks)
    return out


#: the plans of this process (the scheduler's optimizer, its plugin, a client without the plugin)
plans = PlanMemo()
