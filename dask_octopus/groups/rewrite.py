"""Rewrite of a low-level graph into fragments.

Each fragment of annotated tasks (chosen by :func:`~dask_octopus.groups.planning.plan_fragments`)
becomes one task that runs its members through :func:`~dask_octopus.groups.streams.run_fragment` and
returns, as a tuple, the results that tasks outside it read. Where each of those consumers reads all of
them (the top of a reduction reading each fragment's partial sums), the consumers read them from the
fragment task inline (:func:`~dask_octopus.groups.streams.pick`, which raises the error of a member
that failed); otherwise each result is a task of its own, under its member's key, that picks it from
the fragment task, so a consumer on another worker fetches the one result it reads and each result is
freed as its own consumers are done, as without fragments. Only tasks whose results are consumed
inside the graph join a fragment: an output of the computation keeps its own task (so
``client.gather`` and persisted collections see the same keys), and the graph has fewer tasks.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from dask.base import tokenize
from dask.core import reverse_dict
from dask.typing import Key
from dask.utils import key_split

from dask_octopus._compat import Alias, DataNode, GraphNode, Task, TaskRef, fused_graph_of
from dask_octopus.groups.fragment import Fragment
from dask_octopus.groups.memo import PlanInputs, Stale, named_by, plans
from dask_octopus.groups.planning import (
    follow_or_fetch,
    layer_of,
    layer_order,
    plan_fragments,
    pull_upstream,
    read_apart,
    topological,
)
from dask_octopus.groups.streams import pick, run_fragment, run_guarded
from dask_octopus.placement.bandwidth import Bandwidths
from dask_octopus.placement.unfused import UnfusedTask

FRAGMENT_PREFIX = "octopus-fragments"  # not "-fragment": key_split drops 8-letter words (hex-like names)
GUARD_PREFIX = "octopus-guarded"  # tasks that only fragments read, run so that their failure fails only what reads them


def _fragment_key(token: str, n: int) -> Key:
    """The key of fragment task ``n`` of a plan named ``token``."""
    return (f"{FRAGMENT_PREFIX}-{token}", n)


def _guard_key(key: Key, token: str) -> Key:
    """The key of a guard running the task ``key`` (named for what it runs: Dask's duration estimates and
    the task stream go by key prefix), of ``token``."""
    return (f"{key_split(key)}-{GUARD_PREFIX}", token)


def _is_guard_key(key: Key) -> bool:
    return type(key) is tuple and bool(key) and type(key[0]) is str and key[0].endswith(f"-{GUARD_PREFIX}")


def inner_keys(key: Key, node: Any) -> list[Key]:
    """The keys whose work the task ``key`` does: its own, and those fused into it by Dask's low-level
    fusion; for a fragment task, its members' keys and those fused into them."""
    if not isinstance(node, Task):
        return [key]
    inner = fused_graph_of(node)
    if inner is not None:  # fused graphs may nest
        return [key, *(k for i, child in inner.items() for k in inner_keys(i, child))]
    if node.func is run_fragment:
        return list(fragment_of(node).covers)
    if is_guard(node):
        return [key, *inner_keys(node.args[0].value, node.args[1].value)]
    return [key]


def picks_a_result(node: Any) -> bool:
    """Whether ``node`` (a task's run spec) is a task of :func:`fragment_graph` that picks one result
    of a fragment task: it does none of its member's work."""
    return isinstance(node, Task) and node.func is pick


def nested_tasks(node: GraphNode) -> Iterator[Task]:
    """``node``, where it is a task, and the tasks nested in its arguments (as Dask nests them in a run spec)."""
    stack: list[Any] = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, Task):
            yield item
            stack.extend(item.args)
            stack.extend(item.kwargs.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())


def _nested_picks(node: GraphNode) -> list[Task]:
    """The tasks nested in ``node`` that pick a result of a fragment task (:func:`picks_a_result`)."""
    return [t for t in nested_tasks(node) if t is not node and picks_a_result(t)]


def read_before_grouping(node: GraphNode) -> frozenset[Key] | None:
    """The keys that ``node``, a run spec in which :func:`fragment_graph` nested tasks picking results
    of fragments (under their members' keys), read before: those members, and its other dependencies;
    ``None`` for a node with no such task."""
    picks = _nested_picks(node)
    if not picks:
        return None
    groups = {d for p in picks for d in p.dependencies}
    return frozenset({p.key for p in picks} | (node.dependencies - groups))


def is_guard(node: Any) -> bool:
    """Whether ``node`` (a task's run spec) is a guard of :func:`fragment_graph`."""
    return isinstance(node, Task) and node.func is run_guarded


def of_fragments(node: Any) -> bool:
    """Whether ``node`` is a fragment task, picks a result of one or guards a task that only fragments
    read: it never joins a fragment."""
    return isinstance(node, Task) and node.func in (run_fragment, pick, run_guarded)


class Joins:
    """Whether a task may join a fragment: a plain task (not a P2P barrier's or another special kind),
    neither a coroutine function's (the worker awaits it, a fragment would not) nor one of this
    package's (:func:`of_fragments`). Whether a function is a coroutine function is asked once per
    function (0.1 ms for a curried one: its signature)."""

    def __init__(self) -> None:
        self._coroutines: dict[int, bool] = {}

    def __call__(self, node: GraphNode) -> bool:
        if type(node) is not Task or of_fragments(node):
            return False
        known = self._coroutines.get(id(node.func))
        if known is None:
            known = self._coroutines[id(node.func)] = node.is_coro
        return not known


def _read_before(dsk: Mapping[Key, GraphNode], outputs: Iterable[Key]) -> dict[Key, frozenset[Key]]:
    """What the tasks of ``outputs`` read before the grouping (members grouped before read other
    fragments' results inline): :attr:`Fragment.read_before`."""
    return {m: read_before_grouping(dsk[m]) or frozenset(dsk[m].dependencies) for m in outputs}


def dependents_of(graph: Mapping[Key, GraphNode]) -> dict[Key, set[Key]]:
    """The graph's reverse dependency map: the keys of the tasks that read each key."""
    return reverse_dict({k: node.dependencies for k, node in graph.items()})


def fragment_of(node: Any) -> Fragment | None:
    """The :class:`~dask_octopus.groups.fragment.Fragment` that ``node``, a fragment task's run spec, runs
    (``None`` for any other node)."""
    return node.args[0].value if isinstance(node, Task) and node.func is run_fragment else None


def timing_prefix(prefix: str, node: Any) -> str:
    """The task prefix under which the timings of a task of ``prefix`` with run spec ``node`` teach speeds:
    for a fragment task, the prefixes of its members (``octopus-fragments(chain+sum-partial)``): every
    fragment task's key has the prefix ``octopus-fragments``, whatever work it does, and a worker that ran
    a heavy workload's fragments would look slower than one that ran a light one's; else ``prefix``."""
    fragment = fragment_of(node) if prefix == FRAGMENT_PREFIX else None
    if fragment is None:
        return prefix
    names = dict.fromkeys(map(layer_of, fragment.members))
    prefixes = sorted({key_split(n) for n in names})
    more = f"+{len(prefixes) - 4} more" if len(prefixes) > 4 else ""  # (50 delayed functions: 400 letters)
    return f"{FRAGMENT_PREFIX}({'+'.join(prefixes[:4])}{more})"


def replaced_keys(node: GraphNode) -> list[Key]:
    """The keys of the graph whose work a task made by :func:`fragment_graph` does: a fragment task's
    members, or the one task a guard runs (empty for any other node)."""
    fragment = fragment_of(node)
    if fragment is not None:
        return list(fragment.members)
    if is_guard(node):
        return [node.args[0].value]
    return []


def _read_by_fragments_only(steps: Sequence[Key], dependents: Mapping[Key, Collection[Key]],
                            candidates: Collection[Key], members: Collection[Key]) -> list[Key]:
    """The keys of ``candidates`` that only ``members`` (of fragments) read, directly or through other such
    keys, in the order of ``steps`` (each key after its dependencies)."""
    found: set[Key] = set()
    for k in reversed(steps):
        readers = dependents.get(k, ())
        if k in candidates and readers and all(r in members or r in found for r in readers):
            found.add(k)
    return [k for k in steps if k in found]


def _pull_downstream(steps: Sequence[Key], specs: Mapping[Key, Mapping[str, Any]],
                     dependencies: Mapping[Key, Any], pullable: Collection[Key] | None) -> dict[Key, Mapping[str, Any]]:
    """``specs`` with the unannotated tasks (among ``pullable``, ``None``: all) that read only annotated
    tasks of the graph (the partial sums of an annotated collection's reduction), which take the
    annotation of the first they read; ``steps`` are the graph's keys, each after its dependencies."""
    out = dict(specs)
    for k in steps:
        if k not in out and (pullable is None or k in pullable):
            inside = [d for d in dependencies[k] if d in dependencies]
            if inside and all(d in out for d in inside):
                out[k] = out[inside[0]]
    return out


def _targets(steps: Sequence[Key], dsk: Mapping[Key, GraphNode], read_through: Collection[Key],
             special: Collection[Key], skip: Collection[Key] = ()) -> dict[Key, Key]:
    """The task each alias of ``read_through`` (but ``skip``) names, through aliases of aliases, where
    that is not a ``special`` task; ``steps`` are the graph's keys, each after its dependencies."""
    through: dict[Key, Key] = {}
    for k in steps:
        if type(dsk[k]) is Alias and k in read_through and k not in skip:
            target = through.get(dsk[k].target, dsk[k].target)  # (never a member: an alias reads it)
            if target not in special:
                through[k] = target
    return through


def _build(dsk: Mapping[Key, GraphNode], specs: Mapping[Key, Mapping[str, Any]],
           dependents: Mapping[Key, set[Key]], members: list[Key], retries: Mapping[Key, int] | None,
           made_bytes: Mapping[Key, float] | None) -> Fragment:
    """The :class:`Fragment` of ``members``; its outputs are the members read from outside it."""
    inside = set(members)
    outputs = [m for m in members if not dependents.get(m, set()) <= inside]
    fragment = Fragment({m: dsk[m] for m in members}, outputs, {m: specs[m]["resource"] for m in members}, retries,
                        made_bytes)
    fragment.read_before = _read_before(dsk, outputs)
    return fragment


def needed_by(dependencies: Mapping[Key, Collection[Key]], roots: Iterable[Key]) -> set[Key]:
    """The keys of ``dependencies`` (a graph's, by key) that ``roots`` need: themselves and what they
    read, directly or not."""
    out: set[Key] = set()
    stack = [k for k in roots if k in dependencies]
    while stack:
        k = stack.pop()
        if k not in out:
            out.add(k)
            stack.extend(d for d in dependencies[k] if d in dependencies and d not in out)
    return out


def fragment_graph(dsk: Mapping[Key, GraphNode], specs: Mapping[Key, Mapping[str, Any]], keep: Collection[Key],
                   dependents: Mapping[Key, set[Key]], places: Mapping[Key, Any],
                   parts: Mapping[Any, int], pullable: Collection[Key] | None = None,
                   sizes: Mapping[Key, float] | None = None,
                   budgets: Mapping[Any, float | None] | None = None, retries: Mapping[Key, int] | None = None,
                   labels: Mapping[Key, Any] | None = None, made_bytes: Mapping[Key, float] | None = None,
                   read_through: Collection[Key] = (), roots: Iterable[Key] | None = None,
                   loose: Mapping[Key, Any] | None = None, holders: Mapping[Key, Collection[str]] | None = None,
                   fetch_costs: tuple[float, Bandwidths] | None = None) -> dict[Key, GraphNode]:
    """The graph with annotated tasks run as fragments.

    ``specs[key]`` holds the annotation (``resource``, ``group``) of the tasks to run as fragments;
    ``keep`` are the keys the caller asks for. Those, tasks read by something other than a plain
    task, and tasks next to a special one (a subclass of ``Task``, such as the barrier of a P2P
    shuffle, whose transfer and output tasks Dask's shuffle extension tracks by key; not
    :class:`~dask_octopus.placement.unfused.UnfusedTask`) stay tasks. The graph is planned from the
    keys of ``keep`` in their order (a list: the order they were asked for), then from its other keys
    with each layer's blocks in order (:func:`~dask_octopus.groups.planning.layer_order`), so the same
    computation is cut alike in whatever order its graph lists each layer's blocks.
    ``dependents`` is the graph's reverse dependency map (:func:`dask.core.reverse_dict`);
    ``places[key]`` says where each annotated task may run (``None``: anywhere) and ``parts[place]``
    how many fragments to cut the sources of a place into (its worker threads). The smallest
    ``group`` of the annotations caps the sources per fragment. Unannotated tasks that read only
    annotated ones join them, and so do those upstream that one fragment alone reads
    (:func:`~dask_octopus.groups.planning.pull_upstream`: their failures then fail only what reads
    them), all among ``pullable`` (``None``: any). ``budgets[place]`` caps the
    estimated peak bytes of a fragment's inputs and intermediates (:meth:`Fragment.peak_bytes`, from
    ``sizes``, the bytes of inputs that exist already, and ``made_bytes``, the bytes of tasks' results as
    estimated before they exist: blocks of dask arrays): a place whose fragments exceed it is cut into twice as many
    parts, until they fit or hold one source each. ``retries`` are the tasks' own retries (those missing
    take the fragment task's); tasks of different ``labels`` (their Dask annotations) never share a
    fragment (:func:`~dask_octopus.groups.planning.plan_fragments`). The results of a fragment that a
    task reads apart (:func:`~dask_octopus.groups.planning.read_apart`) are tasks of their own that
    pick them from the fragment task; the consumers of the others read them inline. The other tasks
    among ``pullable`` that only fragments (or such tasks) read, and the aliases of those, run as guards
    (:func:`~dask_octopus.groups.streams.run_guarded`, under a key of their own that the fragment tasks
    read): where one raises, only the steps that read it fail. Fragments and guards read what the
    aliases among ``read_through`` name (through aliases of aliases) where that is not a special task,
    and those aliases that only they, or other such aliases, read are left out (any alias is sized as
    what it names, from ``sizes``). Give only aliases whose targets hold the same value
    without running anything more: not those the scheduler holds (Dask reuses them: their targets may
    have been released since), nor those a plan pins. Only tasks that ``roots`` need join fragments
    (:func:`needed_by`): the others stay tasks, which Dask does not run (``da.linalg.qr(x)[1]`` leaves
    each block's Q factor in the graph, read by nothing; a fragment computed it and held it to its end).
    ``None``: all are needed (a graph culled already, as ``annotate``'s optimizer culls it).
    ``loose[key]`` is where an annotated task may run wherever its inputs are (``places`` may say where
    they are held): the fragments are cut by those places instead where that costs less
    (:func:`~dask_octopus.groups.planning.follow_or_fetch`, at ``fetch_costs``: the seconds of a task
    and the bandwidths between workers; ``holders``: the workers holding each input that exists already, an
    alias's those of what it names).

    The plan made before from the same arguments (the same keys, places, sizes and budgets:
    :class:`~dask_octopus.groups.memo.PlanMemo`), or from a graph of the same shape under other keys, is
    reused, with fresh fragment tasks (``octopus.fragments.plan-memo``).
    """
    inputs = PlanInputs(dsk, specs, keep, dependents, places, parts, pullable, sizes, budgets, retries, labels,
                        made_bytes, read_through, None if roots is None else list(roots), loose, holders,
                        fetch_costs)
    return plans.plan(inputs, lambda: _fragment_graph(*inputs), _fresh, _renamed)


def _renamed(graph: Mapping[Hashable, GraphNode | None], picks: Mapping[Key, GraphNode],
             layers: Mapping[Hashable, Hashable]) -> tuple[dict[Hashable, GraphNode | None], dict[Key, GraphNode]]:
    """A plan (``graph`` as the memo keeps it, :func:`_fresh`, and its ``picks``) with the keys of each layer of
    ``layers`` in the layer it names: for a graph of the same shape under other keys. Its fragment tasks and
    guards get keys of their own (tokens of the plan's and of ``layers``): computes of other keys in flight
    at once share none (those of the same keys renamed from one plan share them, as Dask shares their
    tasks)."""
    name = named_by(layers)
    salt = tokenize(sorted(map(repr, layers.items())))
    made: dict[Hashable, Key] = {}
    for k, node in graph.items():
        if fragment_of(node) is not None:
            made[k] = _fragment_key(tokenize(k[0], salt), k[1])
        elif is_guard(node):
            made[k] = _guard_key(name(node.args[0].value), tokenize(k[1], salt))

    def key(k: Hashable) -> Key:
        new = made.get(k)
        return name(k) if new is None else new

    def pick_task(node: Task) -> Task:
        return Task(key(node.key), pick, TaskRef(key(node.args[0].key)), *node.args[1:])

    out: dict[Hashable, GraphNode | None] = {}
    for k, node in graph.items():
        fragment = fragment_of(node)
        if node is None:
            out[key(k)] = None
        elif fragment is not None:
            out[key(k)] = Task(key(k), run_fragment, DataNode(None, fragment.renamed(key)),
                               *(TaskRef(key(ref.key)) for ref in node.args[1:]))
        elif is_guard(node):  # what it reads, by the new keys' order, and the tasks that give them alike
            reads = sorted(zip(map(key, node.args[2].value), (key(ref.key) for ref in node.args[4:])),
                           key=lambda read: str(read[0]))
            out[key(k)] = Task(key(k), run_guarded, DataNode(None, key(node.args[0].value)), node.args[1],
                               DataNode(None, tuple(r for r, _ in reads)), node.args[3],
                               *(TaskRef(ref) for _, ref in reads))
        elif picks_a_result(node):
            out[key(k)] = pick_task(node)
        else:
            raise Stale(f"{k!r} is a task this plan cannot rename")
    return out, {key(m): pick_task(node) for m, node in picks.items()}


def _fresh(node: GraphNode, dsk: Mapping[Key, GraphNode] | None = None,
           picks: Mapping[Key, GraphNode] | None = None) -> GraphNode:
    """``node``, a task of a plan, for a compute of the graph ``dsk``: a fragment task holds a copy of its
    fragment whose steps are ``dsk``'s tasks (:meth:`Fragment.respec`), a guard runs ``dsk``'s task
    (reading the results it reads from a fragment through ``picks``, as the plan's did); raises
    :class:`~dask_octopus.groups.memo.Stale` where those are other tasks than the plan's (other keys, or
    reading other values) or tasks that planning would not group now (:class:`Joins`). Without ``dsk``,
    as a plan keeps it: a fragment task's fragment without its steps (:meth:`Fragment.layout`), a guard
    without its task (the plan holds none of a compute's functions and constants)."""
    fragment = fragment_of(node)
    if fragment is not None:
        copy = fragment.layout() if dsk is None else fragment.respec(dsk, Joins())
        if copy is None:
            raise Stale(f"the tasks of {node.key!r} changed")
        if dsk is not None:
            copy.read_before = _read_before(dsk, copy.outputs)
            _check_given(dsk, copy.inputs, node.args[1:])
        return Task(node.key, run_fragment, DataNode(None, copy), *node.args[1:])
    if not is_guard(node):
        return node
    if dsk is None:
        return Task(node.key, run_guarded, node.args[0], DataNode(None, None), *node.args[2:])
    key, reads = node.args[0].value, node.args[2].value
    task = dsk.get(key)
    if task is not None and picks and picks.keys() & task.dependencies:
        task = task.substitute(picks)
    if (task is None or tuple(sorted(task.dependencies, key=str)) != reads
            or not (type(task) is Alias or Joins()(task))):  # (planning guards those, and aliases)
        raise Stale(f"the task of {key!r} changed")
    _check_given(dsk, reads, node.args[4:])
    return Task(node.key, run_guarded, node.args[0], DataNode(None, task), *node.args[2:])


def _check_given(dsk: Mapping[Key, GraphNode], reads: Sequence[Key], given: Sequence[TaskRef]) -> None:
    """Raise :class:`~dask_octopus.groups.memo.Stale` where a plan's task is given, for a key it reads, the
    value of another key than the key itself, what the key aliases in ``dsk`` (through aliases of
    aliases) or a guard's: the keys a plan's tasks read in place of aliases are the plan's, not the graph's."""
    for read, ref in zip(reads, given, strict=True):
        key = ref.key
        if key == read or _is_guard_key(key):
            continue
        target, seen = read, set()
        while type(dsk.get(target)) is Alias and target not in seen:  # (a cycle of aliases ends)
            seen.add(target)
            target = dsk[target].target
        if target != key:
            raise Stale(f"{read!r} is read as {key!r}, which it no longer names")


def _fragment_graph(dsk: Mapping[Key, GraphNode], specs: Mapping[Key, Mapping[str, Any]], keep: Collection[Key],
                    dependents: Mapping[Key, set[Key]], places: Mapping[Key, Any], parts: Mapping[Any, int],
                    pullable: Collection[Key] | None, sizes: Mapping[Key, float] | None,
                    budgets: Mapping[Any, float | None] | None, retries: Mapping[Key, int] | None,
                    labels: Mapping[Key, Any] | None, made_bytes: Mapping[Key, float] | None,
                    read_through: Collection[Key], roots: list[Key] | None, loose: Mapping[Key, Any] | None,
                    holders: Mapping[Key, Collection[str]] | None, fetch_costs: tuple[float, Bandwidths] | None,
                    ) -> tuple[dict[Key, GraphNode], dict[Key, GraphNode], frozenset[Key]]:
    """:func:`fragment_graph`, planned; the tasks that pick the fragments' results read inline; the keys
    whose tasks are those of ``dsk``, or read those picks in place of what they read."""
    retries = retries or {}
    dependencies = {k: node.dependencies for k, node in dsk.items()}
    wanted = set(keep)
    needed = None if roots is None else needed_by(dependencies, roots)
    steps = topological([*(k for k in keep if k in dsk), *layer_order(dsk)], dependencies)  # dependencies first
    specs = _pull_downstream(steps, specs, dependencies, pullable)
    sizes, holders = dict(sizes or {}), dict(holders or {})
    for k in steps:  # an alias is as large as its target (the same value), held where it is
        if type(dsk[k]) is Alias:
            for known in (sizes, holders):
                if k not in known and dsk[k].target in known:
                    known[k] = known[dsk[k].target]
    special = {k for k, node in dsk.items() if isinstance(node, Task) and type(node) not in (Task, UnfusedTask)}
    movable = {k for k in dsk if k not in wanted and (needed is None or k in needed)
               and (pullable is None or k in pullable)
               and not dependencies[k] & special}
    joins = Joins()
    plain = {k for k in movable if joins(dsk[k])}
    eligible = {k for k in plain if all(type(dsk[c]) is Task for c in dependents.get(k, ()))}
    candidates = {k for k in eligible if k in specs}
    caps = [specs[k].get("group") for k in candidates if specs[k].get("group") is not None]
    parts = dict(parts)
    same = _targets(steps, dsk, read_through, special)  # inputs that are one value, counted once
    cap = min(caps) if caps else None
    placed = {k: places.get(k) for k in candidates}
    if loose is not None and fetch_costs is not None:
        placed = follow_or_fetch(steps, dependencies, candidates, placed, {k: loose.get(k) for k in candidates},
                                 parts, cap, labels, sizes, holders, *fetch_costs)
        places = {**places, **placed}
    while True:
        planned = plan_fragments(steps, dependencies, candidates, placed, parts, cap, labels)
        fragments = pull_upstream(planned, steps, dependents, eligible - candidates, places, labels)
        for members, marked in zip(fragments, planned):  # pulled upstream: the class of the first source
            for k in members:
                specs.setdefault(k, specs[marked[0]])
        built = [_build(dsk, specs, dependents, members, retries, made_bytes) for members in fragments]
        made: dict[Any, int] = {}
        over = set()  # places with a fragment over its budget that can still be cut (two sources or more)
        for marked, fragment in zip(planned, built):
            place = places.get(marked[0])  # a fragment's first marked member is one of its sources
            made[place] = made.get(place, 0) + 1
            inside = set(marked)
            sources = sum(not dependencies[m] & inside for m in marked)
            if sources > 1 and fragment.exceeds(sizes, (budgets or {}).get(place), same):
                over.add(place)
        if not over:
            break
        parts.update((p, 2 * max(1, parts[p], made[p])) for p in over)
    if not fragments:
        return dict(dsk), {}, frozenset(dsk)
    inside = {m for fragment in built for m in fragment.members}
    aliases = {k for k in movable if type(dsk[k]) is Alias}
    guards: dict[Key, Key] = {}
    unread: set[Key] = set()  # aliases that only fragments and guards read (directly or through such aliases)
    for d in _read_by_fragments_only(steps, dependents, (plain | aliases) - inside, inside):  # dependencies first
        if type(dsk[d]) is Alias and dsk[d].target not in guards:  # it fails only where its target does
            unread.add(d)
            continue
        # named by what it reads (repr: keys that print alike, such as ('a', 0) and "('a', 0)", differ):
        # computes in flight at once that guard one task alike share its guard, as Dask shares the task
        reads = sorted(repr(guards.get(r, r)) for r in dependencies[d])
        guards[d] = _guard_key(d, tokenize(repr(d), reads, retries.get(d)))
    # the same members with other outputs (other keys asked for), or other inputs, are another fragment task
    token = tokenize(repr([(f.members, f.outputs) for f in built]), sorted(map(repr, guards.values())))
    picks: dict[Key, Task] = {}  # read inline by the consumers
    kept: dict[Key, Task] = {}  # tasks of their own
    made: dict[Key, Fragment] = {}
    fragment_of = {m: n for n, fragment in enumerate(built) for m in fragment.outputs}
    for n, fragment in enumerate(built):
        fkey = _fragment_key(token, n)
        made[fkey] = fragment
        apart = read_apart(fragment.outputs, fragment.members, n, fragment_of, dependencies, dependents,
                           labels or {})
        for i, m in enumerate(fragment.outputs):
            (kept if apart else picks)[m] = Task(m, pick, TaskRef(fkey), i)

    def rewritten(k: Key) -> GraphNode:
        node = dsk[k]
        return node.substitute(picks) if picks.keys() & node.dependencies else node

    # fragments and guards read an alias's target (a task of their own: a persisted partition of a dask-expr
    # dataframe, which Dask reads through one alias task per partition), and the aliases only they read go
    through = _targets(steps, dsk, read_through, special, guards)
    gone: set[Key] = set()  # aliases read through by all that read them: fragments, guards and other such aliases
    for k in reversed(steps):
        if k in unread and k in through and all(r in inside or r in guards or r in gone for r in dependents[k]):
            gone.add(k)
    members_of = (inside - kept.keys()) | guards.keys() | gone
    given = {**through, **guards}  # what the fragments and guards read in place of each such task
    out: dict[Key, GraphNode] = {k: rewritten(k) for k in dsk if k not in members_of}
    out.update(kept)
    for d, gkey in guards.items():
        node = rewritten(d)
        reads = tuple(sorted(node.dependencies, key=str))
        out[gkey] = Task(gkey, run_guarded, DataNode(None, d), DataNode(None, node), DataNode(None, reads),
                         retries.get(d), *(TaskRef(given.get(r, r)) for r in reads))
    for fkey, fragment in made.items():
        out[fkey] = Task(fkey, run_fragment, DataNode(None, fragment),
                         *(TaskRef(given.get(d, d)) for d in fragment.inputs))
    return out, picks, frozenset(k for k in dsk if k not in members_of and k not in kept)
