"""Fragment plans remembered by what they were made from: the same collection computed again (the same
keys, functions, annotations, places, sizes and budgets) reuses its plan instead of planning it again.
A plan is remembered when graphs of its keys are planned a second time, and reused from then on; a graph
computed once leaves only a hash of its keys (remembering every plan made, with its thousands of objects,
made computes of new keys 2-8 ms slower on the 2-core machine, more than the 1 ms of finding no plan).

Dask gives the same collection the same keys each time it is computed (but the final task's, which
:func:`ends_of` names for its kind and the keys it reads), so its fragments come out the same: planning
them again (places, run order, steps) costs a compute of 1024 small blocks about a fifth of its time.
Like Dask, which reuses a task it holds under the same key, a plan trusts a layer name that Dask made by
hashing what the layer computes (``sum-`` and 32 hex digits) to name its work, and checks one task of
each such layer in full (functions by identity, but lambdas and local functions, made anew each time, by
their code, module and what they close over, defaults and attributes; numbers by type and bits, so
that ``0.0`` and ``-0.0`` differ; strings and containers by value), and every task under a key named
by the user (``dask_key_name``, ``map_blocks(name=...)``; also one that low-level fusion put inside
another task; a name the user gave that ends as Dask's do counts as
Dask's), which may hold other constants from one compute to the next, before anything else (a graph
rebuilt with other functions costs no more): what computes something else now is planned anew. What is
reused is the plan (the cut, places, run order); the tasks are the compute at hand's: each fragment's
steps are made anew from the graph's tasks under its members' keys, checked to be the same steps
reading the same values (else the graph is planned anew), and each guard runs the graph's task, so a
constant that differs under a key Dask named (a bag's partition changed in place, a dict that Dask's
token reads in any order) is computed as Dask computes it. A graph whose compared tasks hold data
(arrays, objects that are neither plain values nor callable) is not remembered; a plan remembered
holds the forms of its compared tasks (functions by identity) but no steps (its fragments' layouts
without them, its guards without their tasks), and until its form is made its graph, until newer
plans replace it. No pickled bytes of an earlier compute travel with a reused plan. Finding it can
never fail a compute: a graph whose form has no hash is planned as usual.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass
from types import BuiltinFunctionType, FunctionType, MethodType
from typing import Any, NamedTuple

import numpy as np
from dask.typing import Key
from toolz.functoolz import Compose

from dask_octopus import config
from dask_octopus._compat import Alias, DataNode, GraphNode, Task, TaskRef, fused_graph_of
from dask_octopus.groups.blocksizes import BlockBytes
from dask_octopus.groups.planning import layer_of
from dask_octopus.placement.bandwidth import Bandwidths

_NUMBERS = (bool, int, float, complex)
_AS_THEY_ARE = (str, bytes, type(None), type(Ellipsis), FunctionType, BuiltinFunctionType, MethodType, type,
                np.ufunc)  # compared as Python compares them (functions: by identity)


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


class _Data(Exception):
    """A task holds data (not a function) by identity: its graph's plan is not remembered."""


class _Same:
    """A callable object compared by identity."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is _Same and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def _form(value: Any) -> Hashable:
    """A hashable form of ``value`` that equals another's only where both compute alike; raises
    :class:`_Data` for a value that is neither a plain value, a container of such, nor callable."""
    kind = type(value)
    if kind is FunctionType and "<" in value.__qualname__:  # a lambda or a local function, made anew each time
        return _local_function_form(value)
    if kind in _AS_THEY_ARE:
        return value
    if kind is float:  # by its bits: 0.0 == -0.0, and a plan made for one would compute the other
        return kind, value.hex()
    if kind is complex:
        return kind, value.real.hex(), value.imag.hex()
    if kind in _NUMBERS or kind is np.dtype or isinstance(value, np.dtype):  # 1, 1.0, True differ
        return kind, value
    if isinstance(value, np.generic):  # by dtype and bits: float32(-0.0) == 0.0, timedelta64(1, 'D') == (24, 'h')
        return kind, value.dtype.str, value.tobytes()
    if kind is tuple or kind is list:
        return (kind, *[_form(v) for v in value])
    if kind is dict:
        return (dict, *[(_form(k), _form(v)) for k, v in value.items()])
    if kind is set or kind is frozenset:
        return kind, frozenset(_form(v) for v in value)
    if kind is slice:
        return slice, _form(value.start), _form(value.stop), _form(value.step)
    if kind is functools.partial:
        return functools.partial, _form(value.func), _form(value.args), _form(value.keywords)
    if kind is Compose:  # toolz's, as Dask's reductions make them
        return Compose, _form(value.first), _form(value.funcs)
    if isinstance(value, TaskRef):  # and distributed's Future
        return TaskRef, value.key
    if isinstance(value, GraphNode):
        return _node_form(value)
    if callable(value) and not hasattr(value, "__array__"):
        return _Same(value)
    raise _Data


def _local_function_form(func: FunctionType) -> Hashable:
    """:func:`_form` of a lambda or local function: its code, its module's globals (the same dict, read
    live by any function of that module), what it closes over, its defaults and attributes."""
    try:
        cells = tuple(cell.cell_contents for cell in func.__closure__ or ())
    except ValueError:  # a cell not filled yet
        raise _Data from None
    return (FunctionType, func.__code__, id(func.__globals__), _form(cells), _form(func.__defaults__),
            _form(func.__kwdefaults__), _form(func.__dict__))


def _node_form(node: GraphNode) -> Hashable:
    """:func:`_form` of a task of Dask's graph."""
    kind = type(node)
    if kind is Alias:
        return Alias, node.key, node.target
    if kind is DataNode:
        return DataNode, node.key, _form(node.value)
    if isinstance(node, Task) and kind.__call__ is Task.__call__:  # Task, Dask's List, Dict..., UnfusedTask
        return kind, node.key, node.data_producer, _form(node.func), _form(node.args), _form(node.kwargs)
    return _Same(node)  # another kind of task (a P2P barrier, say): only itself is the same


class _End:
    """An output of a graph that nothing in it reads, named for its kind and the keys it reads:
    ``(_End, kind, keys)``, never a Dask key."""


class _Key:
    """A task sampled alone (:func:`sampled`): ``(_Key, key)``, never a layer's name."""


@dataclass
class _Entry:
    samples: Hashable  # their forms when the plan was made
    graph: dict[Hashable, GraphNode | None]  # the plan, its ends by their names (None: the graph's own task)
    picks: dict[Key, GraphNode]  # the tasks that pick the fragments' results read inline
    inputs: PlanInputs | None  # the plan's inputs, until their form is made (when samples of them come again)
    ends: dict[Key, Hashable]
    form: Hashable = None

    def form_of_inputs(self) -> Hashable:
        """:func:`plan_form` of the plan's inputs (made once; the inputs are dropped then)."""
        inputs = self.inputs
        if inputs is not None:
            self.form, self.inputs = plan_form(inputs, self.ends), None
        return self.form


def ends_of(inputs: PlanInputs) -> dict[Key, Hashable] | None:
    """The keys of ``keep`` and ``roots`` that nothing in the graph reads, each with its name in a plan
    (Dask names a compute's final task anew each time): its kind and the keys it reads. ``None`` where
    two would have one name."""
    dsk, dependents = inputs.dsk, inputs.dependents
    ends = {k: (_End, type(dsk[k]), dsk[k].dependencies) for k in {*inputs.keep, *(inputs.roots or ())}
            if k in dsk and not dependents.get(k)}
    return ends if len(set(ends.values())) == len(ends) else None


_TOKEN = re.compile(r"-[0-9a-f]{32}$")  # the end of a layer name that Dask made by hashing what it computes


class _Vouched:
    """Whether a task of a graph is vouched for by its layer's sampled task: a task of a layer that Dask
    named by hashing what it computes (its name ends in ``-`` and 32 hex digits: the same name, the
    same work, as Dask trusts it) does what any other task of its layer does, but for its inputs (keys,
    compared in full). A task named by the user (``dask_key_name``, ``map_blocks(name=...)``, any other
    key) may hold other constants under the same key from one compute to the next, and so may a task
    fused into another (low-level fusion keeps their keys inside it): those are compared each. A
    graph that blockwise fusion made is shared by every task of its layer (made-up inner names), and
    vouched for by the sample."""

    def __init__(self, dsk: Mapping[Key, GraphNode]):
        seen: set[int] = set()
        self._shared: set[int] = set()  # the fused graphs run by several tasks, at any depth (low-level
        stack = list(dsk.values())  # fusion puts a blockwise-fused task, and its shared graph, inside its own)
        while stack:
            inner = fused_graph_of(stack.pop())
            if inner is None:
                continue
            if id(inner) in seen:
                self._shared.add(id(inner))
            else:
                seen.add(id(inner))
                stack.extend(inner.values())
        self._names: dict[Any, bool] = {}

    def _named_by_dask(self, key: Key) -> bool:
        layer = layer_of(key)
        known = self._names.get(layer)
        if known is None:
            known = self._names[layer] = type(layer) is str and _TOKEN.search(layer) is not None
        return known

    def __call__(self, key: Key, node: GraphNode) -> bool:
        if not self._named_by_dask(key):
            return False
        inner = fused_graph_of(node)
        return inner is None or id(inner) in self._shared or all(self(k, child) for k, child in inner.items())


def sampled(inputs: PlanInputs, ends: Collection[Key]) -> dict[Any, GraphNode]:
    """The tasks of the graph (but its ends) whose forms a plan is checked against: one task of each layer
    to vouch for the others of their layers (:class:`_Vouched`), the same one each time in this process,
    in whatever order the graph lists them (of smallest hash), by layer; and each task not vouched for so,
    by ``(_Key, key)``."""
    chosen: dict[Any, tuple[int, Key]] = {}
    each: dict[Any, GraphNode] = {}
    vouched = _Vouched(inputs.dsk)
    for k, node in inputs.dsk.items():
        if k in ends:
            continue
        if vouched(k, node):
            layer, h = layer_of(k), hash(k)
            if layer not in chosen or h < chosen[layer][0]:
                chosen[layer] = h, k
        else:
            each[(_Key, k)] = node
    return {layer: inputs.dsk[k] for layer, (_, k) in chosen.items()} | each


def samples(tasks: Mapping[Any, GraphNode]) -> Hashable | None:
    """The forms of the sampled ``tasks`` (:func:`sampled`), as they are now; ``None`` where one holds data."""
    try:
        return frozenset((layer, _node_form(node)) for layer, node in tasks.items())
    except (_Data, TypeError, ValueError, RecursionError):  # (no hash: a NumPy structured scalar; recursion: a
        return None  # local function that closes over itself, a list that holds itself)


def plan_form(inputs: PlanInputs, ends: Mapping[Key, Hashable]) -> Hashable | None:
    """What a plan is made from, in a hashable form (``ends`` by their names) but the samples: every key,
    the kind of its task and the keys it reads, and the other arguments; ``None`` where one has no hash.
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
        """The plan remembered for ``inputs`` (:func:`plan_form` and :func:`samples` equal), with fresh
        tasks (``fresh(node, dsk, picks)``: the plan's task ``node`` running the graph ``dsk``'s tasks, those
        that read the plan's picks reading them as the plan's did, or raising :class:`Stale` where they
        are other tasks; ``fresh(node)``: ``node`` as the plan keeps it) and the
        graph's own tasks where the plan kept them (reading its picks as the plan's did), else ``make()``'s
        (the graph, its picks and the keys whose tasks are the graph's own, those rewritten to read picks
        included), remembered where graphs of these keys were planned before (a
        plan is remembered from the second compute on, and reused from the third: graphs of new keys,
        computed once, leave only a hash behind). A compute of new keys costs one pass over its keys
        here."""
        size = config.get("fragments.plan-memo")
        ends = ends_of(inputs) if size else None
        if ends is None or not (inputs.made_bytes is None or isinstance(inputs.made_bytes, BlockBytes)):
            return make()[0]
        outline = frozenset(ends.get(k, k) for k in inputs.dsk)
        with self._lock:
            entry = self._plans.get(outline)
        found = form = None
        if entry is not None:  # the samples first: a graph rebuilt with other functions differs there
            tasks = sampled(inputs, ends)
            found = samples(tasks)
            if found is not None and found == entry.samples:
                form = plan_form(inputs, ends)
                if form is not None and form == entry.form_of_inputs():
                    try:
                        out = _apply(entry, inputs.dsk, {v: k for k, v in ends.items()}, fresh)
                    except Stale:
                        pass  # planned anew (and remembered in its place)
                    else:
                        with self._lock:
                            if outline in self._plans:
                                self._plans.move_to_end(outline)
                        return out
        elif not self._seen_before(hash(outline), size):  # planned once: maybe never again
            return make()[0]
        else:
            tasks = sampled(inputs, ends)
        out, picks, own = make()
        if not ends.keys() <= own:  # an end joined a fragment (under its name of this compute)
            return out
        found = found if found is not None else samples(tasks)
        if found is not None:  # (the callers make the inputs for this call alone: they stay as they are)
            graph = {ends.get(k, k): None if k in own else fresh(node) for k, node in out.items()}
            with self._lock:
                self._plans[outline] = _Entry(found, graph, dict(picks), None if form is not None else inputs, ends,
                                              form)
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
