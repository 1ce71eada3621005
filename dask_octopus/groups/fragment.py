"""A fragment's run, made once where the graph is rewritten: its steps in order, flattened.

The members of a fragment are tasks of Dask's graph, some of them made by Dask's low-level fusion
(``_execute_subgraph`` of a small graph, which runs ``dask.order`` on that graph each time it is
called: most of a small fused task's time). A :class:`Fragment` flattens fused members into their
inner tasks (renamed, since fusion reuses names across levels), orders all steps once
(depth first from the fragment's results: a chain or a branch of a reduction tree finishes before
the next one starts, so few intermediates are alive at once), and lists what each
step reads and which values can be dropped after it. Running it is then a walk over the steps.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

from dask.base import tokenize
from dask.typing import Key

from dask_octopus._compat import Alias, DataNode, GraphNode, Task, TaskRef, execute_subgraph
from dask_octopus.groups.planning import interleave, live_peak, topological


def _unwrap(arg: Any) -> Any:
    return arg.value if isinstance(arg, DataNode) else arg


def _flatten(key: Key, node: GraphNode, names: Mapping[Key, Key], out: dict[Key, tuple[GraphNode, dict, Key]],
             covers: list[Key], member: Key) -> None:
    """Add ``node`` under ``key`` to ``out`` with the names of the values it reads, looking into fused
    tasks (whose inner keys, as the graph named them, go to ``covers``). ``names`` renames the keys of
    the enclosing scope (the inputs of a fused task); ``member`` is the member task it belongs to."""
    if isinstance(node, Task) and node.func is execute_subgraph:
        inner, outkey, inkeys = _unwrap(node.args[0]), _unwrap(node.args[1]), _unwrap(node.args[2])
        scope = {}
        for ik, arg in zip(inkeys, node.args[3:], strict=True):
            if isinstance(arg, TaskRef):
                scope[ik] = names.get(arg.key, arg.key)
            else:  # a constant or an inline task given to the fused graph: a step of its own
                scope[ik] = ("octopus-inner", key, ik)
                _flatten(scope[ik], arg, names, out, covers, member)
        scope.update((k, key if k == outkey else ("octopus-inner", key, k)) for k in inner)
        covers.extend(inner)
        for k, child in inner.items():
            _flatten(scope[k], child, scope, out, covers, member)
        return
    out[key] = (node, {d: names.get(d, d) for d in node.dependencies}, member)


class Fragment:
    """The steps of one fragment, ready to run.

    ``steps[i]`` is ``(name, node, reads)``: the graph node to call, and ``reads`` the pairs
    ``(key the node asks for, name of the value)``; ``inputs`` are the names of the values the
    fragment receives (results of tasks outside it), ``outputs`` those it returns, in that order;
    ``drop[i]`` the names no later step reads (freed after step ``i``); ``deps[i]`` the earlier steps
    that step ``i`` reads; ``covers`` the keys whose work the fragment does (members and the keys
    fused into them). ``resources`` maps each member to its declared class (``"compute"``, ``"memory"``
    or ``"auto"``, run as memory-bound): where steps of both classes are ready they alternate.
    """

    def __init__(self, members: Mapping[Key, GraphNode], outputs: Iterable[Key], resources: Mapping[Key, str]):
        flat: dict[Key, tuple[GraphNode, dict, Key]] = {}
        covers: list[Key] = []
        for key, node in members.items():
            covers.append(key)
            _flatten(key, node, {}, flat, covers, key)
        reads = {name: [d for d in pairs.values() if d in flat] for name, (_, pairs, _) in flat.items()}
        read = {d for deps in reads.values() for d in deps}
        # depth first from the results (each one's inputs just before it): a chain or a branch of a
        # reduction tree finishes before the next starts, so few intermediates are alive at a time
        names = topological([n for n in flat if n not in read] + [n for n in flat if n in read], reads)
        position = {name: i for i, name in enumerate(names)}
        # then compute- and memory-bound steps alternate where both are ready ("auto": memory, as on CPU)
        classes = [resources[flat[name][2]] for name in names]
        names = [names[i] for i in interleave([[position[d] for d in reads[n]] for n in names],
                                              [c if c != "auto" else "memory" for c in classes])]
        position = {name: i for i, name in enumerate(names)}
        self.inputs: tuple[Key, ...] = tuple(sorted({d for _, pairs, _ in flat.values() for d in pairs.values()}
                                                    - flat.keys(), key=str))
        self.outputs: tuple[Key, ...] = tuple(outputs)
        self.steps = tuple((name, flat[name][0], tuple(flat[name][1].items())) for name in names)
        self.deps = tuple(tuple(sorted(position[d] for d in reads[name])) for name in names)
        last: dict[Key, int] = {}
        for i, (_, _, pairs) in enumerate(self.steps):
            for _, value in pairs:
                last[value] = i
        keep = set(self.outputs)
        drop: list[list[Key]] = [[] for _ in names]
        for value, i in last.items():
            if value not in keep:
                drop[i].append(value)
        self.drop = tuple(tuple(d) for d in drop)
        self.covers = tuple(dict.fromkeys(covers))
        self.members: tuple[Key, ...] = tuple(members)

    def estimate(self, sizes: Mapping[Key, float]) -> tuple[list[float], list[list[int]]]:
        """Each step's estimated result bytes, as large as the largest value it reads (elementwise work;
        0 for a step reading none: Dask does not say how large a result will be before it exists), from
        ``sizes``, the bytes of the inputs (those missing count 0); and the steps whose results are freed
        after each step."""
        position = {name: i for i, (name, _, _) in enumerate(self.steps)}
        estimated: list[float] = []
        for _, _, reads in self.steps:
            estimated.append(max((estimated[position[v]] if v in position else sizes.get(v, 0) for _, v in reads),
                                 default=0))
        return estimated, [[position[v] for v in drop if v in position] for drop in self.drop]

    def peak_bytes(self, sizes: Mapping[Key, float]) -> float:
        """The estimated peak of the bytes of intermediate results held while the steps run in their order
        on one stream, outputs held to the end (:meth:`estimate`, :func:`live_peak`). The inputs are not
        counted: Dask holds them for the unannotated run too."""
        return live_peak(*self.estimate(sizes))

    def structure(self) -> str:
        """What the fragment computes, whatever its keys: a token of its steps' functions and constants,
        with the values they read named by position (constants that cannot be hashed, such as arrays,
        are tokenized). Equal structures on equal input shapes do equal work."""
        position = {name: ("in", j) for j, name in enumerate(self.inputs)}
        position.update((name, ("step", i)) for i, (name, _, _) in enumerate(self.steps))
        parts = []
        for _, node, reads in self.steps:
            where = {k: position[v] for k, v in reads}
            parts.append(_shape(node, where))
        described = (parts, [position[o] for o in self.outputs])
        try:  # pickle is fast and names functions by module and name, partials by their arguments
            return hashlib.sha1(pickle.dumps(described, protocol=5)).hexdigest()
        except (pickle.PicklingError, AttributeError, TypeError):  # lambdas, local functions
            return tokenize(described)


def _shape(node: Any, where: Mapping[Key, Any]) -> Any:
    """A hashable description of ``node`` with the values it reads replaced by ``where``."""
    if isinstance(node, TaskRef):
        return where[node.key]
    if isinstance(node, DataNode):
        return _shape(node.value, where)
    if isinstance(node, Task):
        kwargs = tuple(sorted((k, _shape(v, where)) for k, v in node.kwargs.items())) if node.kwargs else ()
        return (node.func, tuple(_shape(a, where) for a in node.args), kwargs)
    if isinstance(node, Alias):
        return ("alias", where[node.target])
    if isinstance(node, GraphNode):  # another kind of node (a list or dict of tasks): by its token
        return tokenize(node.substitute({k: str(v) for k, v in where.items()}))
    if isinstance(node, (tuple, list)):
        return (type(node), tuple(_shape(a, where) for a in node))
    try:  # scalars, dtypes, functions: themselves (within this process)
        hash(node)
    except TypeError:  # arrays and other mutable constants: by their token
        return tokenize(node)
    return (type(node), node)
