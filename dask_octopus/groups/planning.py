"""Pure planning of stream groups (no Dask): which annotated tasks run together, and in what order
a group's members are launched.

Tasks are grouped only with tasks at the same *depth* of the whole graph (longest dependency path
from a source): two tasks at the same depth never depend on each other, directly or through other
tasks, so a group can run its members in any order and only its members' own inputs are needed.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from itertools import zip_longest

from dask_octopus.profiling.speedmodel import RESOURCES

ANNOTATION = "octopus"  # the Dask annotation that carries a task's group spec


def check_group_spec(resource: str, group: int) -> None:
    """Raise ``ValueError`` naming the problem for an unknown resource class or a group below 1."""
    if resource != "auto" and resource not in RESOURCES:
        raise ValueError(f"unknown resource {resource!r}: expected one of auto, {', '.join(RESOURCES)}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be an integer >= 1, got {group!r}")


def depths(dependencies: Mapping[Hashable, Sequence[Hashable]]) -> dict[Hashable, int]:
    """Longest path from a source to each task; dependencies outside the mapping count as sources."""
    out: dict[Hashable, int] = {}
    for root in dependencies:
        if root in out:
            continue
        stack = [(root, iter(dependencies[root]))]
        on_path = {root}
        while stack:
            node, deps = stack[-1]
            for d in deps:
                if d in dependencies and d not in out:
                    if d in on_path:
                        raise ValueError(f"the graph has a cycle through {d!r}")
                    stack.append((d, iter(dependencies[d])))
                    on_path.add(d)
                    break
            else:
                stack.pop()
                on_path.discard(node)
                out[node] = 1 + max((out[d] for d in dependencies[node] if d in dependencies), default=-1)
    return out


def plan_groups(order: Sequence[Hashable], sizes: Mapping[Hashable, int],
                dependencies: Mapping[Hashable, Sequence[Hashable]],
                places: Mapping[Hashable, Hashable] | None = None) -> list[list[Hashable]]:
    """Groups of the tasks in ``order`` (the annotated ones, in graph order): consecutive tasks of the
    same depth, the same group size ``sizes[task]`` and the same place ``places[task]`` (where the
    task may run, e.g. its worker restrictions), at most that many to a group. Tasks whose group
    would have one member are left out (they run as plain tasks)."""
    depth = depths(dependencies)
    open_groups: dict[tuple[int, int, Hashable], list[Hashable]] = {}
    groups: list[list[Hashable]] = []
    for key in order:
        bucket = (depth[key], sizes[key], places.get(key) if places else None)
        members = open_groups.setdefault(bucket, [])
        members.append(key)
        if len(members) == sizes[key]:
            groups.append(open_groups.pop(bucket))
    groups.extend(open_groups.values())
    return [g for g in groups if len(g) > 1]


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
