"""Pure planning of fragments (no Dask): which annotated tasks run together as one task, on which CUDA
streams, and in what order independent members are launched.

A *fragment* is a connected part of an annotated graph that runs on one worker as one task: its
sources (the annotated tasks with no annotated task upstream) cut into a few runs per place, each
run with every annotated task that reads only that run's tasks (chains, the run's part of a
reduction tree). Tasks that combine several fragments stay tasks of their own.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from itertools import zip_longest

from dask_octopus._checks import is_count
from dask_octopus.placement.bandwidth import Bandwidths
from dask_octopus.profiling.speedmodel import RESOURCES

ANNOTATION = "octopus"  # the Dask annotation that carries a task's group spec


def check_group_spec(resource: str, group: int | None) -> int | None:
    """``group`` as a Python integer (or ``None``); raise ``ValueError`` naming the problem for an
    unknown resource class or a group that is neither ``None`` nor an integer >= 1. A group above
    ``sys.maxsize`` (no graph has as many tasks) is ``sys.maxsize``: Dask's messages carry 64-bit integers."""
    if not isinstance(resource, str) or (resource != "auto" and resource not in RESOURCES):
        raise ValueError(f"unknown resource {resource!r}: expected one of auto, {', '.join(RESOURCES)}")
    if group is not None and not is_count(group):
        raise ValueError(f"group must be None or an integer >= 1, got {group!r}")
    return None if group is None else min(int(group), sys.maxsize)


def topological(order: Sequence[Hashable], dependencies: Mapping[Hashable, Collection[Hashable]]) -> list[Hashable]:
    """The keys of ``order`` with every key after its dependencies, otherwise as close to ``order`` as a
    depth-first walk allows; dependencies outside ``order`` are ignored. Raises ``ValueError`` on a cycle."""
    index = {k: i for i, k in enumerate(order)}

    def inside(key: Hashable) -> list[Hashable]:  # its dependencies in order, last first (popped first)
        deps = [d for d in dependencies[key] if d in index]
        if len(deps) > 1:
            deps.sort(key=index.__getitem__, reverse=True)
        return deps

    done: set[Hashable] = set()
    out: list[Hashable] = []
    for root in order:
        if root in done:
            continue
        stack = [(root, inside(root))]
        on_path = {root}
        while stack:
            node, deps = stack[-1]
            while deps and deps[-1] in done:
                deps.pop()
            if deps:
                d = deps.pop()
                if d in on_path:
                    raise ValueError(f"the graph has a cycle through {d!r}")
                stack.append((d, inside(d)))
                on_path.add(d)
            else:
                stack.pop()
                on_path.discard(node)
                done.add(node)
                out.append(node)
    return out


def layer_of(key: Hashable) -> Hashable:
    """The layer of a key: the name of a block's key ``(name, *index)``, else the key itself."""
    return key[0] if type(key) is tuple and key else key


def layer_order(keys: Iterable[Hashable]) -> list[Hashable]:
    """``keys`` with the blocks of each layer (tuple keys ``(name, *index)`` of one ``name``) in index
    order, from the place of the layer's first key; layers and other keys keep their order. A
    collection's blocks then come in the same order however its graph listed them (some layers list
    them from a set, whose order changes from process to process), so fragments are cut alike each
    time. ``keys`` as they come where the indices of a layer do not compare."""
    keys = list(keys)
    rank: dict[Hashable, int] = {}
    places = [(rank.setdefault(("layer", k[0]), len(rank)), k[1:]) if type(k) is tuple and k
              else (rank.setdefault(("key", k), len(rank)), ()) for k in keys]
    try:
        ranked = sorted(range(len(keys)), key=places.__getitem__)
    except TypeError:
        return keys
    return [keys[i] for i in ranked]


def _chunks(n: int, parts: int) -> list[int]:
    """Part of each of ``n`` consecutive items cut into ``parts`` runs of sizes differing by one at most."""
    return [i * parts // n for i in range(n)] if n else []


def plan_fragments(steps: Sequence[Hashable], dependencies: Mapping[Hashable, Collection[Hashable]],
                   candidates: Collection[Hashable], places: Mapping[Hashable, Hashable],
                   parts: Mapping[Hashable, int], cap: int | None = None,
                   labels: Mapping[Hashable, Hashable] | None = None) -> list[list[Hashable]]:
    """Fragments of a graph: sets of ``candidates`` that each run as one task, members in dependency order.

    ``steps`` is every key of the graph, each after its dependencies (:func:`topological`, neighbouring
    blocks together: :func:`layer_order`); ``dependencies`` maps each to its dependencies (keys outside ``steps``
    are inputs that exist already). A *source* is a candidate with
    no candidate upstream of it; the sources of each place (``places[k]``, ``None``: anywhere) are cut
    into ``parts[place]`` runs of consecutive sources (more where ``cap`` sources per part would be
    exceeded), one fragment each. A candidate that reads candidates of exactly one fragment, and reads
    nothing downstream of a fragment through other tasks, joins it when its place is ``None`` or the
    fragment's; any other candidate (one that combines several fragments, such as the top of a
    reduction tree) and everything downstream of it stays out. So no fragment reads another fragment's
    member through a task outside it, and the fragments never form a cycle. Fragments of one member
    are left out (those tasks run as they are). ``labels[k]`` (missing: ``None``) must be equal among a
    fragment's members: sources of one place with other labels form other fragments, and a candidate
    joins a fragment of its own label only.
    """
    if cap is not None and cap < 1:
        raise ValueError(f"cap must be >= 1 or None, got {cap!r}")
    candidates = set(candidates)
    labels = labels or {}
    upstream: dict[Hashable, bool] = {}  # a candidate is upstream (or the key itself is one)
    for k in steps:
        upstream[k] = k in candidates or any(upstream.get(d, False) for d in dependencies[k])
    sources: dict[tuple[Hashable, Hashable], list[Hashable]] = {}
    for k in steps:
        if k in candidates and not any(upstream.get(d, False) for d in dependencies[k]):
            sources.setdefault((places[k], labels.get(k)), []).append(k)
    part: dict[Hashable, tuple[Hashable, Hashable, int]] = {}
    for (place, label), keys in sources.items():
        n = max(1, parts[place], -(-len(keys) // cap) if cap else 1)
        part.update((k, (place, label, p)) for k, p in zip(keys, _chunks(len(keys), min(n, len(keys)))))
    tainted: set[Hashable] = set()  # keys downstream of a fragment, not in one
    for k in steps:
        if k in part:
            continue
        deps = [d for d in dependencies[k] if d in upstream]
        owners = {part[d] for d in deps if d in part}
        owner = next(iter(owners)) if len(owners) == 1 else None
        if (k in candidates and owner is not None and not any(d in tainted for d in deps)
                and places[k] in (None, owner[0]) and labels.get(k) == owner[1]):
            part[k] = owner
        elif owners or any(d in tainted for d in deps):
            tainted.add(k)
    members: dict[tuple[Hashable, Hashable, int], list[Hashable]] = {}
    for k in steps:
        if k in part:
            members.setdefault(part[k], []).append(k)
    return [m for m in members.values() if len(m) > 1]


def read_apart(outputs: Collection[Hashable], members: Sequence[Hashable], n: int,
               fragment_of: Mapping[Hashable, int], dependencies: Mapping[Hashable, Collection[Hashable]],
               dependents: Mapping[Hashable, Collection[Hashable]], labels: Mapping[Hashable, Hashable]) -> bool:
    """Whether a task outside the fragment ``n`` (``members``, the first one's label its own; ``outputs``:
    its results read outside it) reads some of its results but not all, and results of another fragment
    too (``fragment_of``: each result's fragment), or has another label (``labels``, Dask annotations:
    restrictions to other workers, say): such a task may run elsewhere, and would fetch all of this
    one's results. Those results are then tasks of their own, each picking its value from the fragment."""
    outputs, inside = set(outputs), set(members)
    label = labels.get(members[0])
    for m in outputs:
        for c in dependents.get(m, ()):
            reads = dependencies.get(c, ())
            if c not in inside and not outputs.issubset(reads) and (
                    labels.get(c) != label or any(fragment_of.get(d, n) != n for d in reads)):
                return True
    return False


def follow_or_fetch(steps: Sequence[Hashable], dependencies: Mapping[Hashable, Collection[Hashable]],
                    candidates: Collection[Hashable], follow: Mapping[Hashable, Hashable],
                    fetch: Mapping[Hashable, Hashable], parts: Mapping[Hashable, int], cap: int | None,
                    labels: Mapping[Hashable, Hashable] | None, sizes: Mapping[Hashable, float],
                    holders: Mapping[Hashable, Collection[Hashable]], task_seconds: float,
                    bandwidths: Bandwidths) -> Mapping[Hashable, Hashable]:
    """``follow`` or ``fetch``, the places of ``candidates`` by which :func:`plan_fragments` (same
    arguments) cuts the fragments that cost less.

    ``follow`` places each candidate with the worker holding most of its inputs, ``fetch`` where it may
    run (its restrictions) wherever its inputs are. Where the inputs of neighbouring tasks are held by
    different workers, following them leaves the tasks that combine them (a reduction's tree) and
    everything downstream as tasks; fetching moves a fragment's inputs to one worker. A cut costs
    ``task_seconds`` for each task it leaves (the candidates outside fragments, the fragments, and the
    results of a fragment that a task reads apart, :func:`read_apart`) plus the time its moves take
    (:meth:`~dask_octopus.placement.bandwidth.Bandwidths.move_seconds` at ``bandwidths``: workers move
    data at the same time): each fragment runs on the worker holding most
    bytes of its inputs (``sizes``, missing: 0; ``holders``: the workers holding each input, missing:
    none; of those holding as many, the one receiving least so far, then the first by name) and fetches
    each other input from the holder with the fastest link to it. ``follow`` where the costs are equal.
    """
    if not task_seconds >= 0:
        raise ValueError(f"task_seconds must be >= 0, got {task_seconds!r}")
    labels = labels or {}
    readers: dict[Hashable, list[Hashable]] = {}
    for k in steps:
        for d in dependencies[k]:
            readers.setdefault(d, []).append(k)

    def cost(places: Mapping[Hashable, Hashable]) -> float:
        fragments = plan_fragments(steps, dependencies, candidates, places, parts, cap, labels)
        owner = {m: i for i, members in enumerate(fragments) for m in members}
        outputs = [[m for m in members if any(owner.get(r) != i for r in readers.get(m, ()))]
                   for i, members in enumerate(fragments)]
        fragment_of = {m: i for i, results in enumerate(outputs) for m in results}
        picks = sum(len(results) for i, (results, members) in enumerate(zip(outputs, fragments))
                    if read_apart(results, members, i, fragment_of, dependencies, readers, labels))
        moves: dict[tuple[Hashable, Hashable], float] = {}
        received: dict[Hashable, float] = {}
        for members in fragments:
            inputs = {d for m in members for d in dependencies[m] if owner.get(d) is None and sizes.get(d)}
            held: dict[Hashable, float] = {}
            for d in inputs:
                for worker in holders.get(d, ()):
                    held[worker] = held.get(worker, 0.0) + sizes[d]
            if not held:
                continue
            most = max(held.values())
            receiver = min(sorted((w for w, n in held.items() if n == most), key=str),
                           key=lambda w: received.get(w, 0.0))
            for d in inputs:
                if holders.get(d) and receiver not in holders[d]:
                    pair = (bandwidths.sender(holders[d], receiver), receiver)
                    moves[pair] = moves.get(pair, 0.0) + sizes[d]
                    received[receiver] = received.get(receiver, 0.0) + sizes[d]
        tasks = len(candidates) - len(owner) + len(fragments) + picks
        return tasks * task_seconds + bandwidths.move_seconds(moves)

    return fetch if cost(fetch) < cost(follow) else follow


def pull_upstream(fragments: Sequence[Sequence[Hashable]], steps: Sequence[Hashable],
                  dependents: Mapping[Hashable, Collection[Hashable]], pullable: Collection[Hashable],
                  places: Mapping[Hashable, Hashable], labels: Mapping[Hashable, Hashable] | None = None,
                  ) -> list[list[Hashable]]:
    """``fragments`` (of :func:`plan_fragments`) with the tasks upstream of them that only they read.

    A key of ``pullable`` outside the fragments whose readers (``dependents``) are all members of one
    fragment joins it where its place (``places``, missing: ``None``) is ``None`` or the fragment's
    (its first member's), and its label (``labels``, missing: ``None``) the fragment's; its own inputs
    may then join too. A fragment task runs once all its inputs are in memory, so a task outside it
    that fails fails all of it; inside, a step that fails fails only the steps that read it. Each
    fragment keeps its members first (its first member stays one of its sources, whose place and
    annotations the fragment task takes), then those that joined, in the order of ``steps``."""
    labels = labels or {}
    owner = {m: i for i, members in enumerate(fragments) for m in members}
    pulled = []
    for k in reversed(steps):  # readers first: a chain upstream joins in one pass
        if k in owner or k not in pullable:
            continue
        found = {owner.get(r) for r in dependents.get(k, ())}
        if len(found) != 1 or None in found:
            continue
        (i,) = found
        first = fragments[i][0]
        if labels.get(k) == labels.get(first) and places.get(k) in (None, places.get(first)):
            owner[k] = i
            pulled.append(k)
    out = [list(members) for members in fragments]
    for k in reversed(pulled):
        out[owner[k]].append(k)
    return out


def live_peak(sizes: Sequence[float], frees: Sequence[Collection[int]]) -> float:
    """The peak of the summed sizes of the results alive while steps ``0..n-1`` run in order: step ``i``'s
    result (``sizes[i]`` bytes) is alive from step ``i`` until it is freed after step ``j`` (``i`` in
    ``frees[j]``, ``i <= j``); a result never freed is held to the end. (:func:`arena_peak` on one stream.)"""
    if len(sizes) != len(frees):
        raise ValueError(f"{len(frees)} free lists for {len(sizes)} steps")
    return arena_peak(sizes, frees, [0] * len(sizes))


def arena_peak(sizes: Sequence[float], frees: Sequence[Collection[int]], streams: Sequence[int],
               scratch: Sequence[float] | None = None) -> float:
    """The bytes a CUDA memory pool with one arena per stream (CuPy's) holds after steps ``0..n-1`` ran
    in order, step ``i`` allocating its result (``sizes[i]`` bytes) and, while it runs, ``scratch[i]``
    bytes of temporaries on stream ``streams[i]``, results freed as in :func:`live_peak`: memory freed
    on a stream is reused only by later allocations on that stream, so the pool holds the sum over
    streams of each stream's own peak."""
    scratch = [0.0] * len(sizes) if scratch is None else scratch
    if not len(sizes) == len(frees) == len(streams) == len(scratch):
        raise ValueError(f"{len(sizes)} sizes, {len(frees)} free lists, {len(streams)} streams and "
                         f"{len(scratch)} scratch sizes")
    live: dict[int, float] = {}
    peak: dict[int, float] = {}
    for j, (size, stream) in enumerate(zip(sizes, streams)):
        live[stream] = live.get(stream, 0.0) + size
        peak[stream] = max(peak.get(stream, 0.0), live[stream] + scratch[j])
        for i in frees[j]:
            if i > j:
                raise ValueError(f"step {i}'s result freed after step {j}, before it exists")
            live[streams[i]] -= sizes[i]
    return sum(peak.values())


def interleave(dependencies: Sequence[Collection[int]], classes: Sequence[str]) -> list[int]:
    """A run order of steps ``0..n-1`` (given in a dependency order, ``dependencies[i]`` the earlier
    steps that step ``i`` reads) in which, whenever a step of each class is ready, compute-bound and
    memory-bound steps alternate (Opara's order: one kind's kernels overlap the other's); among the
    ready steps of a class the earliest goes first, so with one class the order is unchanged."""
    if len(dependencies) != len(classes):
        raise ValueError(f"{len(classes)} classes for {len(dependencies)} steps")
    readers: list[list[int]] = [[] for _ in classes]
    waiting = [len(set(deps)) for deps in dependencies]
    for i, deps in enumerate(dependencies):
        for d in set(deps):
            if d >= i:
                raise ValueError(f"step {i} reads a later step: {sorted(deps)}")
            readers[d].append(i)
    ready: dict[str, list[int]] = {"compute": [], "memory": []}
    unknown = set(classes) - set(ready)
    if unknown:
        raise ValueError(f"classes must be 'compute' or 'memory', got {sorted(unknown)}")
    for i, n in enumerate(waiting):
        if not n:
            heapq.heappush(ready[classes[i]], i)
    out: list[int] = []
    last = None
    while ready["compute"] or ready["memory"]:
        other = "memory" if last == "compute" else "compute"
        cls = other if ready[other] else ("memory" if other == "compute" else "compute")
        if last is None and ready["memory"] and (not ready["compute"] or ready["memory"][0] < ready["compute"][0]):
            cls = "memory"
        i = heapq.heappop(ready[cls])
        out.append(i)
        last = cls
        for r in readers[i]:
            waiting[r] -= 1
            if not waiting[r]:
                heapq.heappush(ready[classes[r]], r)
    return out


def assign_streams(dependencies: Sequence[Collection[int]], streams: int) -> list[int]:
    """The stream of each step of a fragment (steps in run order, ``dependencies[i]`` the earlier steps
    that step ``i`` reads): a chain stays on its stream (a step continues the stream of the first step
    it reads that no other step continued yet), a step that starts a branch takes the next stream of
    the ``streams`` round-robin. Steps on different streams run concurrently unless one reads the
    other."""
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams!r}")
    out: list[int] = []
    continued: set[int] = set()
    turn = 0
    for i, deps in enumerate(dependencies):
        if any(d >= i for d in deps):
            raise ValueError(f"step {i} reads a later step: {sorted(deps)}")
        head = next((d for d in sorted(deps) if d not in continued), None)
        if head is None:
            out.append(turn % streams)
            turn += 1
        else:
            continued.add(head)
            out.append(out[head])
    return out


def launch_order(classes: Sequence[str], sizes: Sequence[float]) -> list[int]:
    """Member positions in launch order: compute-bound and memory-bound members alternate (the
    Opara order, so that one kind's kernels overlap the other's), largest first within a class;
    the longer class's remainder comes last."""
    if len(classes) != len(sizes):
        raise ValueError(f"{len(classes)} classes for {len(sizes)} sizes")
    by_class = {c: sorted((i for i, k in enumerate(classes) if k == c), key=lambda i: -sizes[i])
                for c in ("compute", "memory")}
    unknown = set(classes) - set(by_class)
    if unknown:
        raise ValueError(f"classes must be 'compute' or 'memory', got {sorted(unknown)}")
    first, second = sorted(by_class.values(), key=lambda members: -sum(sizes[i] for i in members))
    return [i for pair in zip_longest(first, second) for i in pair if i is not None]
