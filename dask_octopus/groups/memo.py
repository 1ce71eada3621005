"""Fragment plans remembered by what they were made from: the same collection computed again (the same
keys, task kinds and dependencies, annotations, places, sizes and budgets) reuses its plan instead of
planning it again, and so does the same work on new data (new keys of the same shape). A plan is
remembered when graphs of its keys, or of its shape, are planned a second time, and reused from then
on; a graph computed once leaves only a hash of its outline (:func:`outline_of`) or shape (remembering
every plan made, with its thousands of objects, made computes of new keys 2-8 ms slower on the 2-core
machine, more than the 1 ms of finding no plan).

Dask gives the same collection the same keys each time it is computed (but the final task's, which
:func:`ends_of` names for its kind and the keys it reads), so its fragments come out the same: planning
them again (places, run order, steps) costs a compute of 1024 small blocks about a fifth of its time. The
same work on new data (or under a layer name the user makes anew each time) comes under new keys: where
no plan of its keys is remembered, the plan of its shape serves it renamed: the plan of a graph whose
form is equal with each layer named for its place in the graph rather than by Dask's token
(:func:`shape_of`; looked for where a plan of the graph's outline is remembered). What is reused is the
plan (the cut, places, run order), which depends on the graph's shape (its keys, the kind of each task
and the keys it reads) and on what :func:`plan_form` holds besides, not on the functions and constants
the tasks run: each fragment's steps are made anew from the graph's tasks under its members' keys,
checked to be the same steps (fused alike) reading the same values, each one that planning would group
(:class:`~dask_octopus.groups.rewrite.Joins`: none a coroutine function's, say; else the graph is planned
anew), and each guard runs the graph's task, so the compute at hand's functions and constants are what
runs, whether they are those of the compute that made the plan or not (a script's own functions,
unpickled anew on the scheduler each compute; a bag's partition changed in place; blocks holding arrays).
Remaking the steps is most of what reusing a plan costs. A plan remembered holds no task of a compute:
its fragments' layouts without their steps, its guards without their tasks, the forms of its inputs.
Finding it can never fail a compute: a graph whose form has no hash is planned as usual.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from dask.typing import Key
from dask.utils import key_split

from dask_octopus import config
from dask_octopus._compat import GraphNode, fused_graph_of
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


class _Layer:
    """A layer named for its shape (:func:`layer_names`): ``(_Layer, prefix, signature)``, never a Dask key."""


Renaming = Callable[[dict[Hashable, GraphNode | None], dict[Key, GraphNode], Mapping[Hashable, Hashable]],
                    tuple[dict[Hashable, GraphNode | None], dict[Key, GraphNode]]]


@dataclass
class Shape:
    """A graph's shape (:func:`shape_of`): the names of its layers and the form of its plan's inputs
    by those names."""

    layers: dict[Hashable, Hashable]  # the layers of its keys and of those they read, by their names
    form: Hashable  # :func:`plan_form` of its plan's inputs, keys by the names of their layers
    key: int  # the hash of the form (0 where it has none)


@dataclass
class _Entry:
    form: Hashable  # :func:`plan_form` of the plan's inputs
    graph: dict[Hashable, GraphNode | None]  # the plan, its ends by their names (None: the graph's own task)
    picks: dict[Key, GraphNode]  # the tasks that pick the fragments' results read inline
    shape: Shape  # of the graph it was made for
    keys: Hashable  # the keys it was made for (its ends by their names)
    outline: Hashable  # the outline of the graph it was made for (outline_of)


def _itself(key: Key) -> Hashable:
    return key


def outline_of(dsk: Mapping[Key, GraphNode]) -> Hashable:
    """What graphs of one shape share, in one pass over the keys: how many layers of each prefix
    (:func:`dask.utils.key_split`) hold how many keys."""
    counts: dict[Hashable, int] = {}
    for k in dsk:
        layer = layer_of(k)
        counts[layer] = counts.get(layer, 0) + 1
    return frozenset(Counter((key_split(layer) if isinstance(layer, str) else layer, n)
                             for layer, n in counts.items()).items())


def shape_of(inputs: PlanInputs) -> Shape:
    """The shape of the graph of ``inputs``: its layers by their names (:func:`layer_names`) and the form of
    the plan's inputs with its keys by those names (``None`` where that has no hash, or two ends would
    have one name)."""
    layers = layer_names(inputs.dsk)
    ends = ends_of(inputs, named_by(layers))
    form = None if ends is None else plan_form(inputs, ends, layers)
    return Shape(layers, form, 0 if form is None else hash(form))


def layer_names(dsk: Mapping[Key, GraphNode]) -> dict[Hashable, Hashable]:
    """The layers of the graph's keys and of the keys they read (:func:`~dask_octopus.groups.planning.layer_of`),
    each with a name that the layer of the same place in a graph of the same shape gets too, whatever its
    token or number (Dask names the layers of a compute on new data anew): its prefix
    (:func:`dask.utils.key_split`), its count of keys in the graph and the names of the layers it reads.
    Where two layers would have one name (the same function applied twice to one input, say), or layers
    read each other in a cycle, each layer is named for itself: plans are then reused for the same keys
    only."""
    counts: dict[Hashable, int] = {}
    reads: dict[Hashable, set[Hashable]] = {}
    for k, node in dsk.items():
        layer = layer_of(k)
        counts[layer] = counts.get(layer, 0) + 1
        read = reads.get(layer)
        if read is None:
            read = reads[layer] = set()
        for d in node.dependencies:
            read.add(layer_of(d))
        inner = fused_graph_of(node)
        if inner is not None:
            _add_fused(layer, inner, counts, reads)
    for layer in [d for read in reads.values() for d in read if d not in reads]:
        reads[layer] = set()  # read from elsewhere
    for layer, read in reads.items():
        read.discard(layer)
    names: dict[Hashable, Hashable] = {}
    todo = [layer for layer, read in reads.items() if not read]
    readers: dict[Hashable, list[Hashable]] = {}
    for layer, read in reads.items():
        for d in read:
            readers.setdefault(d, []).append(layer)
    left = {layer: len(read) for layer, read in reads.items()}
    while todo:  # each layer after those it reads
        layer = todo.pop()
        prefix = key_split(layer) if isinstance(layer, str) else layer
        names[layer] = (_Layer, prefix, hash((prefix, counts.get(layer, 0),
                                               tuple(sorted(hash(names[d]) for d in reads[layer])))))
        for r in readers.get(layer, ()):
            left[r] -= 1
            if not left[r]:
                todo.append(r)
    if len(names) < len(reads) or len(set(names.values())) < len(names):
        return {layer: layer for layer in reads}
    return names


def _add_fused(layer: Hashable, inner: Mapping[Key, GraphNode], counts: dict[Hashable, int],
               reads: dict[Hashable, set[Hashable]]) -> None:
    """Count the keys of ``inner``, the graph fused into a task of ``layer`` (Dask names them by layers
    that may be nowhere else: a map's blocks fused into a sum's), as layers that ``layer`` reads."""
    for k, child in inner.items():
        fused = layer_of(k)
        counts[fused] = counts.get(fused, 0) + 1
        reads[layer].add(fused)
        reads.setdefault(fused, set())
        nested = fused_graph_of(child)
        if nested is not None:
            _add_fused(fused, nested, counts, reads)


def named_by(layers: Mapping[Hashable, Hashable]) -> Callable[[Key], Hashable]:
    """The name of each key by the name that ``layers`` give its layer (:func:`layer_names`; a layer not
    among them keeps its own), the index of a block kept; an end's name (:func:`ends_of`) by the names of
    the keys it reads."""
    def name(key: Key) -> Hashable:
        if type(key) is tuple and key:
            if key[0] is _End:
                return (_End, key[1], frozenset(map(name, key[2])))
            layer = layers.get(key[0])
            return key if layer is None else (layer, *key[1:])
        return layers.get(key, key)
    return name


def ends_of(inputs: PlanInputs, name: Callable[[Key], Hashable]) -> dict[Key, Hashable] | None:
    """The keys of ``keep`` and ``roots`` that nothing in the graph reads, each with its name in a plan
    (Dask names a compute's final task anew each time): its kind and the keys it reads (by ``name``).
    ``None`` where two would have one name."""
    dsk, dependents = inputs.dsk, inputs.dependents
    ends = {k: (_End, type(dsk[k]), frozenset(map(name, dsk[k].dependencies)))
            for k in {*inputs.keep, *(inputs.roots or ())} if k in dsk and not dependents.get(k)}
    return ends if len(set(ends.values())) == len(ends) else None


def plan_form(inputs: PlanInputs, ends: Mapping[Key, Hashable],
              layers: Mapping[Hashable, Hashable] | None = None) -> Hashable | None:
    """What a plan is made from, in a hashable form (``ends`` by their names, other keys as they are or by
    the names of their ``layers``, :func:`named_by`): every key, the kind of its task and the keys it
    reads, and the other arguments; ``None`` where one has no hash.
    Only the keys asked for count in their order: Dask lists a graph's tasks, annotations and places in
    orders that change from one compute to the next, and any order of them makes a valid plan."""
    try:
        return _plan_form(inputs, ends, layers)
    except TypeError:
        return None


def _plan_form(inputs: PlanInputs, ends: Mapping[Key, Hashable], layers: Mapping[Hashable, Hashable] | None,
               ) -> Hashable:
    dsk, dependents = inputs.dsk, inputs.dependents
    named = _itself if layers is None else named_by(layers)

    def name(key: Key) -> Hashable:
        end = ends.get(key)
        return named(key) if end is None else end

    def reads(node: GraphNode) -> Hashable:
        return node.dependencies if layers is None else frozenset(map(name, node.dependencies))

    def items(mapping: Mapping[Any, Any] | None) -> Hashable:
        return None if mapping is None else frozenset((name(k), v) for k, v in mapping.items())

    made = inputs.made_bytes
    return (frozenset((name(k), type(node), reads(node)) for k, node in dsk.items()),
            frozenset((name(k), tuple(mark.items())) for k, mark in inputs.specs.items()),
            tuple(map(name, inputs.keep)),
            frozenset((name(k), frozenset(map(name, v))) for k, v in dependents.items()  # those read from elsewhere
                      if k not in dsk or not dsk.keys() >= v),
            items(inputs.places), items(inputs.parts),
            None if inputs.pullable is None else frozenset(map(name, inputs.pullable)), items(inputs.sizes),
            items(inputs.budgets), items(inputs.retries), items(inputs.labels),
            frozenset(((layers or {}).get(n, n), layout) for n, layout in made.layouts(
                {layer_of(k) for k in dsk if k not in ends} | {layer_of(d) for node in dsk.values()
                                                               for d in node.dependencies}))
            if isinstance(made, BlockBytes) else None,
            frozenset(map(name, inputs.read_through)),
            None if inputs.roots is None else frozenset(map(name, inputs.roots)),
            items(inputs.loose), items(inputs.holders), inputs.fetch_costs)


class PlanMemo:
    """The last plans made (``octopus.fragments.plan-memo`` of them; 0: none), by their graph's keys and
    shape, least recently used dropped first; safe to use from several threads."""

    def __init__(self) -> None:
        self._plans: OrderedDict[Hashable, _Entry] = OrderedDict()  # by the keys they were made for
        self._outlines: dict[Hashable, int] = {}  # how many plans of each outline are remembered
        self._shapes: dict[int, Hashable] = {}  # the keys of the latest plan of each shape (by its key)
        self._seen: OrderedDict[int, None] = OrderedDict()  # hashes of the outlines and shapes planned once
        self._lock = threading.Lock()

    def plan(self, inputs: PlanInputs, make: Callable[[], tuple[dict[Key, GraphNode], dict[Key, GraphNode],
                                                                 frozenset[Key]]],
             fresh: Callable[..., GraphNode], rename: Renaming) -> dict[Key, GraphNode]:
        """The plan remembered for ``inputs`` (:func:`plan_form` equal), with fresh tasks (``fresh(node, dsk,
        picks)``: the plan's task ``node`` running the graph ``dsk``'s tasks, those that read the plan's
        picks reading them as the plan's did, or raising :class:`Stale` where they are other tasks;
        ``fresh(node)``: ``node`` as the plan keeps it) and the graph's own tasks where the plan kept them
        (reading its picks as the plan's did), else ``make()``'s (the graph, its picks and the keys whose
        tasks are the graph's own, those rewritten to read picks included). Where no plan of these keys
        is remembered but one of their outline (:func:`outline_of`) is, the plan of the graph's shape
        (:func:`shape_of`) is reused renamed (``rename(graph, picks, layers)``: the plan's tasks and picks
        with the keys of each layer of ``layers`` in the one it names, fragment tasks and guards under keys
        of their own). A plan made is remembered where graphs of its keys, or of its shape, were planned
        before (from the second compute on; reused from the third: graphs computed once leave only a
        hash behind). A compute of a new outline costs two passes over its keys here."""
        size = config.get("fragments.plan-memo")
        if not size or not (inputs.made_bytes is None or isinstance(inputs.made_bytes, BlockBytes)):
            return make()[0]
        ends = ends_of(inputs, _itself)
        if ends is None:
            return make()[0]
        keys = frozenset(ends.get(k, k) for k in inputs.dsk)
        outline = outline_of(inputs.dsk)
        with self._lock:
            entry = self._plans.get(keys)
            known = entry is None and outline in self._outlines  # a plan of this outline: maybe of this shape
        form = shape = None
        if entry is not None:
            form = plan_form(inputs, ends)
            if form is not None and form == entry.form:
                out = self._reuse(entry, inputs.dsk, ends, fresh)
                if out is not None:
                    return out
        elif known:
            shape = shape_of(inputs)
            with self._lock:
                similar = self._plans.get(self._shapes.get(shape.key))
            if similar is not None and shape.form == similar.shape.form:
                now = {name: layer for layer, name in shape.layers.items()}
                moved = {layer: now[name] for layer, name in similar.shape.layers.items()
                         if now.get(name, layer) != layer}
                out = self._reuse(similar, inputs.dsk, ends, fresh, rename, moved)
                if out is not None:
                    return out
            if shape.form is None or not self._seen_before(shape.key, size):
                return make()[0]  # a shape planned once: maybe never again
        elif not self._seen_before(hash(outline), size):
            return make()[0]  # planned once: maybe never again
        out, picks, own = make()
        if form is None:
            form = plan_form(inputs, ends)
        if form is not None and ends.keys() <= own:  # (else an end joined a fragment, under this compute's name)
            shape = shape or shape_of(inputs)
            graph = {ends.get(k, k): None if k in own else fresh(node) for k, node in out.items()}
            self._remember(_Entry(form, graph, dict(picks), shape, keys, outline), size)
        return out

    def _remember(self, entry: _Entry, size: int) -> None:
        """Remember ``entry`` (in place of a plan of its keys), dropping the least recently used beyond ``size``."""
        with self._lock:
            self._forget(self._plans.pop(entry.keys, None))
            self._plans[entry.keys] = entry
            self._outlines[entry.outline] = self._outlines.get(entry.outline, 0) + 1
            if entry.shape.form is not None:
                self._shapes[entry.shape.key] = entry.keys
            while len(self._plans) > size:
                self._forget(self._plans.popitem(last=False)[1])

    def _forget(self, gone: _Entry | None) -> None:
        """Drop what indexes ``gone``, a plan no longer remembered (under the lock)."""
        if gone is None:
            return
        self._outlines[gone.outline] -= 1
        if not self._outlines[gone.outline]:
            del self._outlines[gone.outline]
        if self._shapes.get(gone.shape.key) == gone.keys:
            del self._shapes[gone.shape.key]

    def _reuse(self, entry: _Entry, dsk: Mapping[Key, GraphNode], ends: Mapping[Key, Hashable],
               fresh: Callable[..., GraphNode], rename: Renaming | None = None,
               moved: Mapping[Hashable, Hashable] | None = None) -> dict[Key, GraphNode] | None:
        """The plan of ``entry`` for the graph ``dsk`` (:func:`_apply`; ``ends`` its outputs by their names),
        renamed where ``moved`` names layers of the plan's keys that are others in ``dsk`` (``rename``, its
        ends too); ``None`` where it is stale."""
        graph, picks = entry.graph, entry.picks
        try:
            if moved:
                graph, picks = rename(graph, picks, moved)
            out = _apply(graph, picks, dsk, {v: k for k, v in ends.items()}, fresh)
        except Stale:
            return None  # planned anew (and remembered in its place)
        with self._lock:
            if entry.keys in self._plans:
                self._plans.move_to_end(entry.keys)
        return out

    def _seen_before(self, outline: int, size: int) -> bool:
        """Whether graphs of this outline, or this shape (a hash of either), were planned before; remembers
        them."""
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
            self._outlines.clear()
            self._shapes.clear()
            self._seen.clear()


def _apply(graph: Mapping[Hashable, GraphNode | None], picks: Mapping[Key, GraphNode], dsk: Mapping[Key, GraphNode],
           ends: Mapping[Hashable, Key], fresh: Callable[..., GraphNode]) -> dict[Key, GraphNode]:
    """The plan ``graph`` in its order for the graph ``dsk`` (its ends by their names: ``ends``): fresh
    tasks (``fresh``) running ``dsk``'s, and ``dsk``'s own tasks where the plan kept them, reading its
    ``picks`` as the plan's did."""
    out: dict[Key, GraphNode] = {}
    for k, node in graph.items():
        if node is None:
            k = ends.get(k, k)
            node = dsk.get(k)
            if node is None:
                raise Stale(f"{k!r} is not in the graph")
            out[k] = node.substitute(picks) if picks.keys() & node.dependencies else node
        else:
            out[k] = fresh(node, dsk, picks)
    return out


#: the plans of this process (the scheduler's optimizer, its plugin, a client without the plugin)
plans = PlanMemo()
