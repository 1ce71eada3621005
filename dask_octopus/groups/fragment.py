"""A fragment's run, made once where the graph is rewritten: its steps in order, flattened.

The members of a fragment are tasks of Dask's graph, some of them made by Dask's low-level fusion
(``_execute_subgraph`` of a small graph, which runs ``dask.order`` on that graph each time it is
called: most of a small fused task's time). A :class:`Fragment` flattens fused members into their
inner tasks (renamed, since fusion reuses names across levels), orders all steps once
(depth first from the fragment's results: a chain or a branch of a reduction tree finishes before
the next one starts, so few intermediates are alive at once), and lists what each
step reads and which values can be dropped after it. Running it is then a walk over the steps.

Each step is kept as a *spec* made of plain tuples (:func:`evaluate` calls it as Dask's ``Task``
would be called): ``(Call, func, args, kwargs)``, its arguments ``(Ref, i)`` for the step's ``i``-th
read value, nested calls or constants. A spec names no key, so the steps of one block look alike
whatever the compute's keys (the fragment's :meth:`~Fragment.structure`). The specs are pickled once,
when the fragment is first sent to another process, into one bytes object: on the chain-and-sum
workload (3,070 steps) the fragment task pickles in 2 ms and unpickles in 3 ms, against 41 ms each way
with Dask's ``Task`` objects, and once sent the scheduler keeps no thousands of objects per fragment
for its garbage collector. In the process that made it, it runs the steps' objects as they are.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from dask.base import tokenize
from dask.typing import Key
from distributed.protocol.pickle import dumps

from dask_octopus._compat import Alias, DataNode, GraphNode, Task, TaskRef, execute_subgraph
from dask_octopus.groups.blocksizes import known_bytes
from dask_octopus.groups.planning import interleave, live_peak, topological


class Ref:
    """Head of the spec ``(Ref, i)``: the ``i``-th value the step reads."""


class Call:
    """Head of the spec ``(Call, func, args, kwargs)``: ``func`` called on its evaluated arguments
    (``kwargs``: pairs of a name and a spec), as ``Task.__call__`` calls it."""


class Node:
    """Head of the spec ``(Node, node, (i, ...))``: a graph node of another kind (a task with its own
    ``__call__``), called as Dask calls it, renamed ``"octopus-step"`` and its dependencies
    ``("octopus-read", i)``."""


class Const:
    """Head of the spec ``(Const, value)``: a constant tuple that begins with one of these heads."""


_HEADS = (Ref, Call, Node, Const)


_REFS: dict[int, tuple] = {}  # (Ref, i), one tuple per i: a pickle holds each once


def _ref(i: int) -> tuple:
    return _REFS.get(i) or _REFS.setdefault(i, (Ref, i))  # setdefault: one tuple also when threads race


_SPECIAL = (GraphNode, TaskRef, tuple)  # arguments that spec_of looks into (the rest are constants as they are)


def spec_of(node: Any, index: dict[Key, int]) -> Any:
    """The spec of ``node``, numbering in ``index`` (key -> position, in the order the arguments first
    name them) the keys it reads."""
    if isinstance(node, TaskRef):  # and distributed's Future
        return _ref(index.setdefault(node.key, len(index)))
    kind = type(node)
    if kind is Task or (isinstance(node, Task) and kind.__call__ is Task.__call__):  # and Dask's List, Dict...
        args = tuple([spec_of(a, index) if isinstance(a, _SPECIAL) else a for a in node.args])
        kwargs = tuple([(k, spec_of(v, index) if isinstance(v, _SPECIAL) else v)
                        for k, v in node.kwargs.items()]) if node.kwargs else ()
        return (Call, node.func, args, kwargs)
    if kind is DataNode:
        return spec_of(node.value, index) if type(node.value) is tuple else node.value
    if kind is Alias:
        return _ref(index.setdefault(node.target, len(index)))
    if isinstance(node, GraphNode):
        keys = sorted(node.dependencies, key=str)
        reads = tuple(index.setdefault(k, len(index)) for k in keys)
        return (Node, node.substitute({k: ("octopus-read", i) for k, i in zip(keys, reads)}, key="octopus-step"),
                reads)
    if kind is tuple and node and any(node[0] is head for head in _HEADS):  # not ==: arrays compare elementwise
        return (Const, node)
    return node  # a constant


def evaluate(spec: Any, values: Sequence[Any]) -> Any:
    """The value of ``spec`` (:func:`spec_of`) on ``values``, the values its step reads, in order."""
    if type(spec) is not tuple or not spec:
        return spec
    head = spec[0]
    if head is Ref:
        return values[spec[1]]
    if head is Call:
        _, func, args, kwargs = spec
        if kwargs:
            return func(*[evaluate(a, values) for a in args], **{k: evaluate(v, values) for k, v in kwargs})
        return func(*[evaluate(a, values) for a in args])
    if head is Node:
        return spec[1]({("octopus-read", i): values[i] for i in spec[2]})
    if head is Const:
        return spec[1]
    return spec  # a constant tuple


INNER = "octopus-inner"  # the step names of the tasks inside a fused member: (INNER, outer name, inner key)


def step_key(name: Any) -> Any:
    """The key of the task of Dask's graph whose work step ``name`` does: its name, or for a task fused
    into a member (whose inner names Dask made up) the member's."""
    while type(name) is tuple and name[:1] == (INNER,):
        name = name[1]
    return name


def _unwrap(arg: Any) -> Any:
    return arg.value if isinstance(arg, DataNode) else arg


def _flatten(key: Key, node: GraphNode, names: Mapping[Key, Key], out: dict[Key, tuple[Any, tuple, Key]],
             covers: list[Key], member: Key, memo: dict[int, tuple[GraphNode, Any, tuple]]) -> None:
    """Add the spec of ``node`` under ``key`` to ``out`` with the names of the values it reads, looking
    into fused tasks (whose inner keys, as the graph named them, go to ``covers``). ``names`` renames the
    keys of the enclosing scope (the inputs of a fused task); ``member`` is the member task it belongs to.
    ``memo`` keeps each node's spec and the keys it reads by the node's identity: Dask's blockwise fusion
    gives every block of a layer the same inner graph, so their steps share one spec (made, and pickled,
    once)."""
    if isinstance(node, Task) and node.func is execute_subgraph:
        inner, outkey, inkeys = _unwrap(node.args[0]), _unwrap(node.args[1]), _unwrap(node.args[2])
        scope = {}
        for ik, arg in zip(inkeys, node.args[3:], strict=True):
            if isinstance(arg, TaskRef):
                scope[ik] = names.get(arg.key, arg.key)
            else:  # a constant or an inline task given to the fused graph: a step of its own
                scope[ik] = (INNER, key, ik)
                _flatten(scope[ik], arg, names, out, covers, member, memo)
        scope.update((k, key if k == outkey else (INNER, key, k)) for k in inner)
        covers.extend(inner)
        for k, child in inner.items():
            _flatten(scope[k], child, scope, out, covers, member, memo)
        return
    known = memo.get(id(node))
    if known is None or known[0] is not node:  # (the node is kept with its spec: its id is not reused meanwhile)
        index: dict[Key, int] = {}
        known = memo[id(node)] = (node, spec_of(node, index), tuple(index))
    out[key] = (known[1], tuple([names.get(d, d) for d in known[2]]), member)


def _pack(specs: tuple) -> bytes | tuple:
    """``specs`` pickled as distributed pickles a task (by value where pickle cannot, or where they name
    ``__main__``: functions of a script or notebook), or as they are where nothing can pickle them
    (constants such as locks, which only a scheduler in this process can run)."""
    try:
        return dumps(specs)
    except Exception:
        return specs


class Fragment:
    """The steps of one fragment, ready to run.

    Values live in *slots*: slot ``j < len(inputs)`` holds input ``j``, slot ``len(inputs) + i`` the
    result of step ``i``. ``inputs`` are the names of the values the fragment receives (results of
    tasks outside it) and ``outputs`` those it returns, in that order, at the slots ``results``;
    ``names[i]`` is step ``i``'s key, ``reads[i]`` the slots it reads, in the order of its ``(Ref, j)``,
    ``deps[i]`` the earlier steps it reads and ``drop[i]`` the slots no later step reads (freed after
    it); :meth:`specs` gives the steps' specs (:func:`evaluate`). ``covers`` are the keys whose work the
    fragment does (members and the keys fused into them). ``resources`` maps each member to its
    declared class (``"compute"``, ``"memory"`` or ``"auto"``, run as memory-bound): where steps of
    both classes are ready they alternate. ``retries`` maps members to the times a raising step of
    theirs may run again (:meth:`step_retries`; members missing: the fragment task's ``retries``).
    ``read_before`` maps each output to the keys its task read before the grouping (set where the
    fragment was made, :func:`~dask_octopus.groups.rewrite.fragment_graph`; not sent with it): a scheduler
    holding the output's task, rewritten to pick it from the fragment, tells the same task brought again
    from other work brought under its key. ``made`` maps inputs and steps to the bytes of their values
    as estimated before they exist (blocks of dask arrays: their chunks and dtype; given where the
    fragment is made, not sent with it), for :meth:`estimate`.

    The specs stay as they are until the fragment is pickled (sent to another process): a worker or
    local scheduler of this process runs the members' very functions and constants, as without
    fragments (a function of ``__main__`` sees its module's globals, ``da.store`` writes into the
    target array). Pickled, they travel as one bytes object, which the fragment then keeps: the
    scheduler that sends it copies it, Dask's logs of sent messages hold it without thousands of
    objects for the garbage collector to walk, and the worker unpickles it once, when the fragment runs.
    Once the task is forgotten where it was sent from, :meth:`release` drops the rest too.
    """

    def __init__(self, members: Mapping[Key, GraphNode], outputs: Iterable[Key], resources: Mapping[Key, str],
                 retries: Mapping[Key, int] | None = None, made: Mapping[Key, float] | None = None):
        flat: dict[Key, tuple[Any, tuple, Key]] = {}
        covers: list[Key] = []
        memo: dict[int, tuple[GraphNode, Any, tuple]] = {}
        for key, node in members.items():
            covers.append(key)
            _flatten(key, node, {}, flat, covers, key, memo)
        reads = {name: [d for d in names if d in flat] for name, (_, names, _) in flat.items()}
        read = {d for deps in reads.values() for d in deps}
        # depth first from the results (each one's inputs just before it): a chain or a branch of a
        # reduction tree finishes before the next starts, so few intermediates are alive at a time
        names = topological([n for n in flat if n not in read] + [n for n in flat if n in read], reads)
        # then compute- and memory-bound steps alternate where both are ready ("auto": memory, as on CPU)
        classes = [resources[flat[name][2]] if resources[flat[name][2]] != "auto" else "memory" for name in names]
        if len(set(classes)) > 1:  # (with one class, interleave keeps the order)
            position = {name: i for i, name in enumerate(names)}
            names = [names[i] for i in interleave([[position[d] for d in reads[n]] for n in names], classes)]
        known = retries or {}
        self._lay_out(names, {name: flat[name][1] for name in names}, outputs, tuple(flat[name][0] for name in names),
                      tuple(members), tuple(dict.fromkeys(covers)),
                      tuple(known.get(flat[name][2]) for name in names) if known.keys() & members.keys() else None,
                      made if made is not None else {})

    def _lay_out(self, names: Sequence[Key], reads: Mapping[Key, Sequence[Key]], outputs: Iterable[Key],
                 specs: tuple, members: tuple[Key, ...], covers: tuple[Key, ...],
                 retries: tuple[int | None, ...] | None, made: Mapping[Key, float]) -> None:
        """Set the slots of steps ``names`` (in run order), each reading the values ``reads[name]`` (by
        name, in the order of its ``(Ref, j)``), with ``specs`` (in the same order) and the known bytes of
        the values ``made`` (by name; others may be left in)."""
        self.inputs: tuple[Key, ...] = tuple(sorted({d for name in names for d in reads[name]} - set(names), key=str))
        self.outputs: tuple[Key, ...] = tuple(outputs)
        first = len(self.inputs)
        slot = {name: j for j, name in enumerate(self.inputs)}
        slot.update((name, first + i) for i, name in enumerate(names))
        self.names: tuple[Key, ...] = tuple(names)
        self.reads: tuple[tuple[int, ...], ...] = tuple(tuple(slot[v] for v in reads[name]) for name in names)
        self.deps: tuple[tuple[int, ...], ...] = tuple(
            ((r[0] - first,) if r[0] >= first else ()) if len(r) == 1  # (most steps read one value)
            else tuple(sorted({s - first for s in r if s >= first})) for r in self.reads)
        self.results: tuple[int, ...] = tuple(slot[o] for o in self.outputs)
        last: dict[int, int] = {}
        for i, r in enumerate(self.reads):
            for s in r:
                last[s] = i
        drop: list[list[int]] = [[] for _ in names]
        keep = set(self.results)
        for s, i in last.items():
            if s not in keep:
                drop[i].append(s)
        self.drop: tuple[tuple[int, ...], ...] = tuple(map(tuple, drop))
        self.covers = covers
        self.members = members
        self.retries = retries
        self._specs: bytes | tuple = specs
        self._structure: str | None = None
        self.read_before: dict[Key, frozenset[Key]] = {}
        self.made: dict[Key, float] = known_bytes(made, (*self.inputs, *names))

    def split(self) -> list[Fragment]:
        """The fragment as one fragment per member, in the order of the members' first steps: each holds
        its member's steps (those fused into it too) and returns the values that the fragment returns
        or that another member's steps read; it receives the fragment's inputs it reads and the other
        members' values it reads, under their names."""
        specs = self.specs()
        first = len(self.inputs)
        named = self.inputs + self.names  # the name of each slot
        steps_of: dict[Key, list[int]] = {}
        for i, name in enumerate(self.names):
            steps_of.setdefault(step_key(name), []).append(i)
        apart = set(self.outputs) | {named[s] for i, r in enumerate(self.reads) for s in r
                                     if s >= first and step_key(named[s]) != step_key(self.names[i])}
        parts = []
        for member, steps in steps_of.items():
            part = object.__new__(Fragment)
            names = [self.names[i] for i in steps]
            part._lay_out(names, {self.names[i]: [named[s] for s in self.reads[i]] for i in steps},
                          [name for name in names if name in apart], tuple(specs[i] for i in steps), (member,),
                          (member,), None if self.retries is None else tuple(self.retries[i] for i in steps),
                          self.made)
            part.read_before = {k: self.read_before[k] for k in part.outputs if k in self.read_before}
            parts.append(part)
        return parts

    def copy(self) -> Fragment:
        """A copy holding the same steps (as first made, where this one is not pickled yet) and copies of
        the scheduler's records (:attr:`read_before`, :attr:`made`)."""
        copy = object.__new__(Fragment)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.pop("_sent", None)
        copy.read_before = dict(self.read_before)
        copy.made = dict(self.made)
        return copy

    def layout(self) -> Fragment:
        """A copy (:meth:`copy`) without the steps' specs: where each step's value lives, what it reads and
        frees; :meth:`respec` gives it steps."""
        copy = self.copy()
        copy._specs, copy._structure = (), None
        return copy

    def respec(self, tasks: Mapping[Key, GraphNode], joins: Callable[[GraphNode], bool]) -> Fragment | None:
        """A copy (:meth:`copy`) whose steps are those of ``tasks``, the graph's tasks under this fragment's
        members' keys (a plan remembered runs the compute at hand's functions and constants, as Dask
        runs the tasks it is given under keys it saw before); ``None`` where they are other steps than
        this fragment's (other keys, fused otherwise, reading other values) or one may not join a
        fragment now (``joins``, planning's rule: a coroutine function's, which a fragment does not
        await, say)."""
        flat: dict[Key, tuple[Any, tuple, Key]] = {}
        covers: list[Key] = []
        memo: dict[int, tuple[GraphNode, Any, tuple]] = {}
        for key in self.members:
            node = tasks.get(key)
            if node is None or not joins(node):
                return None
            covers.append(key)
            _flatten(key, node, {}, flat, covers, key, memo)
        named = self.inputs + self.names
        if len(flat) != len(self.names) or tuple(dict.fromkeys(covers)) != self.covers:
            return None
        specs = []
        for name, reads in zip(self.names, self.reads):
            step = flat.get(name)
            if step is None or step[1] != tuple([named[s] for s in reads]):
                return None
            specs.append(step[0])
        copy = self.copy()
        copy._specs, copy._structure = tuple(specs), None
        return copy

    def renamed(self, rename: Callable[[Key], Key]) -> Fragment:
        """A copy (:meth:`copy`) with ``rename``'s keys for this one's (a step fused into a member: named by
        its member's new key and its own): the same plan for a graph of other keys of the same shape."""
        def step(name: Any) -> Any:
            if type(name) is tuple and name[:1] == (INNER,):
                return (INNER, step(name[1]), rename(name[2]))
            return rename(name)

        copy = self.copy()
        copy.inputs, copy.outputs = tuple(map(rename, self.inputs)), tuple(map(rename, self.outputs))
        copy.names, copy.members, copy.covers = tuple(map(step, self.names)), tuple(map(rename, self.members)), \
            tuple(map(rename, self.covers))
        copy.read_before = {rename(k): frozenset(map(rename, v)) for k, v in self.read_before.items()}
        copy.made = {step(k): v for k, v in self.made.items()}
        copy._structure = None
        return copy

    def step_retries(self, default: int) -> list[int]:
        """How many times each step may run again after raising: its member's own ``retries``, else
        ``default`` (the task's)."""
        if self.retries is None:
            return [default] * len(self.names)
        return [default if r is None else r for r in self.retries]

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "read_before": {}, "made": {}}  # (the scheduler's alone)
        state.pop("_sent", None)  # (a copy unpickled elsewhere was not sent from there)
        specs = self._specs
        if not isinstance(specs, bytes):
            # sent elsewhere: from now on packed here too (a scheduler keeps no steps' objects alive)
            self._specs = state["_specs"] = _pack(specs)
        self._sent = True
        return state

    def release(self) -> None:
        """Drop what this fragment holds (its steps, their layout, the scheduler's records), where it was
        sent from, once its task is forgotten there: Dask's log of the messages sent to the workers keeps
        the last thousand, this fragment's among them, whose layout grows with its steps (216 kB for a
        fragment of 128 blocks; 490 MiB held after 280 computes). Only a fragment that was pickled (sent
        to another process) is released: a worker in this process may be running this very object."""
        if self.__dict__.get("_sent"):
            self.__dict__ = {"_specs": b"", "_sent": True}

    def __dask_tokenize__(self) -> Any:
        # what the fragment is (the same keys are the same tasks), without pickling its steps for a token
        return type(self).__name__, repr(self.members), repr(self.outputs)

    def specs(self) -> tuple:
        """The steps' specs, in step order (unpickled at each call: a run asks once, or twice where it
        tries a capture that CUDA refuses and then runs eagerly)."""
        specs = self._specs  # read once: pickling the fragment in another thread swaps it for its bytes
        return pickle.loads(specs) if isinstance(specs, bytes) else specs

    def _input_bytes(self, sizes: Mapping[Key, float]) -> list[float]:
        """The bytes of each input: ``sizes[name]``, else as known before it existed (``made``), else 0."""
        made = self.made
        return [float(sizes[name]) if name in sizes else made.get(name, 0.0) for name in self.inputs]

    def estimate(self, sizes: Mapping[Key, float]) -> tuple[list[float], list[list[int]]]:
        """Each step's estimated result bytes: as large as the largest value it reads (elementwise work),
        or as ``made`` says where that is more (0 for a step reading none that it does not size), from
        ``sizes``, the bytes of the inputs by name (those missing: as ``made`` says, else 0); and the
        steps whose results are freed after each step."""
        first = len(self.inputs)
        held = self._input_bytes(sizes)
        made = self.made
        for name, r in zip(self.names, self.reads, strict=True):
            held.append(max(made.get(name, 0.0), max((held[s] for s in r), default=0)))
        return held[first:], [[s - first for s in d if s >= first] for d in self.drop]

    def _received_bytes(self, inputs: Sequence[float], same: Mapping[Key, Key]) -> float:
        """The bytes of the values the fragment task receives (``inputs``: :meth:`_input_bytes`), each
        once: ``same`` maps inputs to the key of the value they are (an alias read through, its target),
        where two inputs may be one value."""
        return sum({same.get(name, name): b for name, b in zip(self.inputs, inputs)}.values())

    def peak_bytes(self, sizes: Mapping[Key, float], same: Mapping[Key, Key] | None = None) -> float:
        """The estimated peak of the bytes the fragment task holds while its steps run in their order on
        one stream: its inputs (``sizes``; each value once, ``same``: see :meth:`_received_bytes`; it
        receives them all before it starts and holds them to its end, where Dask's tasks would hold only
        those of the running task, the others may spill) and the intermediate results alive at once,
        outputs held to the end (:meth:`estimate`, :func:`live_peak`)."""
        return self._received_bytes(self._input_bytes(sizes), same or {}) + live_peak(*self.estimate(sizes))

    def exceeds(self, sizes: Mapping[Key, float], budget: float | None, same: Mapping[Key, Key] | None = None) -> bool:
        """Whether :meth:`peak_bytes` exceeds ``budget`` (``None``: no budget); not estimated where the
        inputs and every step holding a result as large as the largest input or known result fit."""
        if budget is None:
            return False
        inputs = self._input_bytes(sizes)
        largest = max(max(inputs, default=0), max(self.made.values(), default=0))
        if self._received_bytes(inputs, same or {}) + len(self.names) * largest <= budget:
            return False
        return self.peak_bytes(sizes, same) > budget

    def structure(self) -> str:
        """What the fragment computes, whatever its keys: a hash of its steps' specs (functions and
        constants, pickled) and of the slots they read and return (a token where they do not pickle).
        Equal structures on equal input shapes do equal work. Computed once."""
        if self._structure is None:
            specs = self._specs
            packed = specs if isinstance(specs, bytes) else _pack(specs)
            if isinstance(packed, bytes):
                extra = pickle.dumps((self.reads, self.results), protocol=5)
                self._structure = hashlib.sha1(packed + extra).hexdigest()
            else:
                self._structure = tokenize(packed, self.reads, self.results)
        return self._structure
