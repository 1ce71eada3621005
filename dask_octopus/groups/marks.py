"""``dask_octopus.annotate``: mark the tasks built or computed inside it for stream groups.

The marks are Dask layer annotations (``octopus``). Dask's low-level fusion drops layer
annotations, so ``annotate`` installs (once, process-wide) a wrapper around the array and delayed
optimizers: it reads the marks before Dask optimizes, lets Dask optimize as usual (fusion on),
finds the marked tasks again (also inside fused tasks) and groups them
(:mod:`dask_octopus.groups.rewrite`). Graphs without marks pass through unchanged. The other Dask
annotations of the optimized graph's tasks stay with them (a fragment groups tasks of equal ones and
carries them; each step keeps its ``retries``). The optimizer runs where Dask materializes the graph,
which for ``distributed`` is the scheduler.

When every running scheduler of the process has the plugin registered (the optimizer then runs on
one of them), the optimizer only carries the marks through fusion, as per-key annotations with the
graph's build order, and the plugin groups the tasks knowing their pins and where their inputs are
(:mod:`dask_octopus.groups.scheduler`).

Dask also sends the block's annotations with every graph *computed* inside it, as annotations of
all its tasks. dask-expr dataframes (which ignore layer annotations) are grouped from those, by
the registered scheduler plugin.
"""

from __future__ import annotations

import copy
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import dask
import dask.config
from dask.blockwise import Blockwise
from dask.core import flatten
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.system import CPU_COUNT
from dask.typing import Key
from dask.utils import ensure_dict

from dask_octopus import config
from dask_octopus._compat import AnnotationsTombstone, convert_legacy_graph, resolve_aliases
from dask_octopus.groups import blocksizes
from dask_octopus.groups.collector import collector_paused
from dask_octopus.groups.planning import ANNOTATION, check_group_spec, topological
from dask_octopus.groups.rewrite import (
    dependents_of,
    fragment_graph,
    inner_keys,
    needed_by,
    picks_a_result,
    replaced_keys,
)
from dask_octopus.groups.scheduler import (
    annotated_retries,
    annotation_labels,
    cluster_threads,
    fragment_here,
    grouping_here,
)

_IGNORED = r"Dask annotations \{'octopus': \{[^{}]*\}\} detected"  # dask-expr's warning about the mark


class GroupingOptimizer:
    """A collection optimizer that runs ``base`` and then groups the tasks marked by ``annotate``."""

    def __init__(self, base: Callable):
        self.base = base

    def __call__(self, dsk: Any, keys: Any, **kwargs: Any) -> Any:
        grouping = grouping_here()
        if grouping:  # the scheduler plugin may group these tasks (a compute inside annotate): by their sizes
            blocksizes.remember(dsk)
        dsk = pull_marks(dsk)
        specs = marked_keys(dsk)
        if not specs:
            return self.base(dsk, keys, **kwargs)
        with collector_paused():  # Dask's optimizer and ours allocate many short-lived objects
            return self._group(dsk, keys, specs, grouping, **kwargs)

    def _group(self, dsk: Any, keys: Any, specs: Mapping[Key, Mapping[str, Any]], grouping: bool,
               **kwargs: Any) -> Any:
        optimized = self.base(dsk, keys, **kwargs)
        keep = list(dict.fromkeys(flatten(keys)))  # in the order asked for: fragments are planned from them
        wanted = set(keep)
        if specs.keys() <= wanted and isinstance(optimized, HighLevelGraph):
            return optimized  # nothing to group (yet): the marks stay on the layers
        annotations = key_annotations(optimized)
        graph = convert_legacy_graph(ensure_dict(optimized))
        # what the keys asked for need, as Dask's cull would leave it: Dask's array optimizer keeps tasks
        # nothing reads (qr(x)[1] keeps each block's Q extraction), whose inputs would leave a fragment
        needed = needed_by({k: node.dependencies for k, node in graph.items()}, keep)
        if len(needed) < len(graph):
            graph = {k: node for k, node in graph.items() if k in needed}
        dependents = dependents_of(graph)
        resolved = resolve_aliases(graph, wanted, dependents)  # fusion leaves aliases of the fused names
        if resolved.keys() != graph.keys():  # each alias it collapses takes a key out
            dependents = dependents_of(resolved)
        graph = resolved
        marks = inner_marks(graph, specs)
        here = fragment_here(graph, marks, keep, dependents, annotations) if grouping else None
        if here is not None:  # on the scheduler, knowing where the tasks run
            graph = here
            marks = _unmade(marks, graph)
        elif grouping:  # on one of several schedulers with the plugin, or beside one (a client thread): it groups them
            # the graph's order (the order the user built it) travels with the marks: fragments then
            # form the same way each time the same work comes again, so they can be replayed
            marks = {k: {**m, "order": i} for i, (k, m) in enumerate(marks.items())}
        else:
            # a fragment per thread of the cluster (on its scheduler, without the plugin), else of the local scheduler
            threads = cluster_threads() or dask.config.get("num_workers", None) or CPU_COUNT
            graph = fragment_graph(graph, marks, keep, dependents, {}, {None: threads},
                                   retries=annotated_retries(annotations), labels=annotation_labels(annotations))
            # Marked tasks not grouped now (outputs here) keep their marks: Dask optimizes a collection
            # again when it becomes an input of another one (delayed arguments), and they may group then.
            marks = _unmade(marks, graph)
        by_name: dict[str, dict[Key, Any]] = {ANNOTATION: marks} if marks else {}
        for k, node in graph.items() if annotations else ():  # Dask's, by task; a fragment has its first member's
            members = replaced_keys(node)
            for name, value in annotations.get(members[0] if members else k, {}).items():
                if not (members and name == "retries"):  # each step keeps its own
                    by_name.setdefault(name, {})[k] = value
        layer = MaterializedLayer(graph, annotations={name: Marks(v) for name, v in by_name.items()} or None)
        name = f"{ANNOTATION}-{uuid.uuid4().hex}"  # layers merge by name when Dask computes several collections
        return HighLevelGraph({name: layer}, {name: set()})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GroupingOptimizer) and other.base is self.base

    def __hash__(self) -> int:
        return hash(self.base)


def _unmade(marks: Mapping[Key, Any], graph: Mapping[Key, Any]) -> dict[Key, Any]:
    """The marks of the tasks of ``graph`` that no fragment runs (nor picks a result of one)."""
    return {k: v for k, v in marks.items() if k in graph and not picks_a_result(graph[k])}


class Marks(dict):
    """Marks of some keys of a layer, as a per-key layer annotation (``None`` for the others)."""

    def __call__(self, key: Key) -> Mapping[str, Any] | None:
        return self.get(key)


def pull_marks(dsk: Any) -> Any:
    """``dsk`` with the mark of ``annotate`` copied onto the blockwise layers that read only marked
    blockwise layers (such as the first step of an annotated array's reduction, which joins its
    fragments anyway): Dask fuses blockwise layers only when their annotations are equal, so a mark on
    ``map_blocks`` alone would keep the sum's first layer from fusing with it, and Dask would convert
    and fuse twice as many tasks as without ``annotate``. Layers are copied, never changed; anything but
    a ``HighLevelGraph`` is returned as it is."""
    if not isinstance(dsk, HighLevelGraph):
        return dsk
    layers = dict(dsk.layers)
    changed = False
    for name in topological(list(layers), {n: dsk.dependencies.get(n, set()) for n in layers}):
        layer = layers[name]
        deps = sorted(dsk.dependencies.get(name, ()))
        marks = [(layers[d].annotations or {}).get(ANNOTATION) for d in deps]
        if (not isinstance(layer, Blockwise) or ANNOTATION in (layer.annotations or {}) or not deps
                or not all(isinstance(layers[d], Blockwise) for d in deps)
                or not all(isinstance(m, Mapping) and not callable(m) for m in marks)):
            continue
        pulled = copy.copy(layer)
        pulled.annotations = {**(layer.annotations or {}), ANNOTATION: marks[0]}
        layers[name] = pulled
        changed = True
    return HighLevelGraph(layers, dsk.dependencies) if changed else dsk


def marked_keys(dsk: Any) -> dict[Key, Mapping[str, Any]]:
    """Keys of the layers annotated by ``annotate`` and their marks."""
    if not isinstance(dsk, HighLevelGraph):
        return {}
    out = {}
    for layer in dsk.layers.values():
        mark = (layer.annotations or {}).get(ANNOTATION)
        for k in layer.get_output_keys() if mark is not None else ():  # keys without making the tasks
            value = mark(k) if callable(mark) else mark  # Dask's convention: callables are per key
            if isinstance(value, Mapping):  # not None or Dask's tombstone for unannotated keys
                out[k] = value
    return out


def key_annotations(dsk: Any) -> dict[Key, dict[str, Any]]:
    """The Dask annotations of each key of ``dsk`` other than the mark of ``annotate`` (a callable gives
    each key's value, as Dask applies them); none for a graph that is not a ``HighLevelGraph``: Dask's
    low-level fusion, which makes such graphs, drops the annotations without ``annotate`` too."""
    if not isinstance(dsk, HighLevelGraph):
        return {}
    out: dict[Key, dict[str, Any]] = {}
    for layer in dsk.layers.values():
        annotations = {name: v for name, v in (layer.annotations or {}).items() if name != ANNOTATION}
        for k in layer if annotations else ():
            values = {name: v(k) if callable(v) else v for name, v in annotations.items()}
            values = {name: v for name, v in values.items()
                      if v is not None and not isinstance(v, AnnotationsTombstone)}
            if values:
                out[k] = values
    return out


def inner_marks(graph: Mapping[Key, Any], specs: Mapping[Key, Mapping[str, Any]]) -> dict[Key, Mapping[str, Any]]:
    """The marks of the tasks of an optimized graph: their own, or that of a task fused into them."""
    out = {}
    for k, node in graph.items():
        spec = specs.get(k)  # (its own first: inner_keys lists it first)
        if spec is None:
            spec = next((specs[i] for i in inner_keys(k, node) if i in specs), None)
        if spec is not None:
            out[k] = spec
    return out


def install() -> None:
    """Wrap the array and delayed optimizers (idempotent; keeps an optimizer the user set, and for arrays
    the choice of none: ``array_optimize`` set to ``False``)."""
    from dask.array.optimization import optimize as array_optimize
    from dask.base import dont_optimize
    from dask.delayed import optimize as delayed_optimize

    for key, default, falsy in (("array_optimize", array_optimize, dont_optimize),
                                ("delayed_optimize", delayed_optimize, delayed_optimize)):
        # as Dask reads it (dask.context.GlobalMethod)
        base = dask.config.config[key] or falsy if key in dask.config.config else default
        if not isinstance(base, GroupingOptimizer):
            dask.config.set({key: GroupingOptimizer(base)})


@contextmanager
def annotate(resource: str = "auto", group: int | None = None) -> Iterator[None]:
    """Run each worker thread's share of the marked tasks as one task, a fragment.

    Marks the tasks of the dask arrays and delayed objects built inside this block, and of every
    collection computed inside it (dataframes: with the scheduler plugin registered). The marked
    tasks of each worker thread, with the chains and partial results that read only them, run as one
    task (:mod:`dask_octopus.groups.planning`), in an order that interleaves compute- and
    memory-bound steps, over CUDA streams on GPU workers; a fragment seen again is replayed as one
    CUDA graph. Results keep their keys: ``client.gather`` and persisted collections see nothing
    different, and a failing task fails only what reads it (``docs/fragments.md``, Failures).

    Parameters
    ----------
    resource
        The marked tasks' class: ``"compute"``, ``"memory"`` or ``"auto"`` (run as memory-bound).
    group
        ``None``: one fragment per worker thread; ``g``: at most ``g`` marked source blocks to a
        fragment (an integer >= 1).

    Raises
    ------
    ValueError
        For an unknown ``resource``, a ``group`` that is neither ``None`` nor an integer >= 1, or a
        setting under ``octopus`` in ``dask.config`` that is not what its key takes (naming the key).

    Examples
    --------
    >>> with dask_octopus.annotate(resource="memory", group=8):  # doctest: +SKIP
    ...     z = x.map_blocks(normalise)
    >>> total = z.sum().compute()  # doctest: +SKIP
    """
    group = check_group_spec(resource, group)
    config.check_all()
    install()
    # dask-expr warns that it ignores annotations; the scheduler plugin applies this one (a filter for good:
    # catch_warnings would undo the filters set inside the block, and it is not local to a thread or task;
    # set once: setting a filter makes every module's "once" and "default" warnings show again)
    if not any(f[0] == "ignore" and f[1] is not None and f[1].pattern == _IGNORED and f[2] is UserWarning
               for f in warnings.filters):
        warnings.filterwarnings("ignore", _IGNORED, UserWarning)
    with dask.annotate(**{ANNOTATION: {"resource": resource, "group": group}}):
        yield
