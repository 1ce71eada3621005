"""Rewrite of a low-level graph into stream groups.

Each group of annotated tasks (chosen by :func:`~dask_octopus.groups.planning.plan_groups`) becomes one
task that runs its members through :func:`~dask_octopus.groups.streams.run_group` and returns their
results as a tuple; consumers of a member read its result from the group task inline. Only tasks
whose results are consumed inside the graph are grouped: an output of the computation keeps its
own task (so ``client.gather`` and persisted collections see the same keys), and the graph has
fewer tasks.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

from dask.base import tokenize
from dask.typing import Key

from dask_octopus._compat import DataNode, GraphNode, Task, TaskRef, execute_subgraph
from dask_octopus.groups.planning import plan_groups
from dask_octopus.groups.streams import run_group

GROUP_PREFIX = "octopus-group"


def inner_keys(key: Key, node: Any) -> list[Key]:
    """The keys whose work the task ``key`` does: its own, those fused into it by Dask's low-level
    fusion, and those of its members if it is a group task (recursively)."""
    if not isinstance(node, Task):
        return [key]
    if node.func is execute_subgraph:
        return list(node.args[0])
    if node.func is run_members:
        return [k for m in node.args[0].value for k in inner_keys(m.key, m)]
    return [key]


def group_members(node: GraphNode) -> list[Key]:
    """The member keys of a group task made by :func:`group_graph` (empty for any other node)."""
    if isinstance(node, Task) and node.func is run_members:
        return [m.key for m in node.args[0].value]
    return []


class MemberCall:
    """A member task called with its inputs in the order of ``deps``."""

    def __init__(self, task: Task, deps: tuple[Key, ...]):
        self.task = task
        self.deps = deps

    def __call__(self, *values: Any) -> Any:
        return self.task(dict(zip(self.deps, values, strict=True)))


def member_token(task: Task, deps: tuple[Key, ...]) -> str:
    """What a member computes, whatever its keys: its function and constants, with dependency and
    fused inner keys replaced by their positions. Equal tokens on equal input shapes do equal work."""
    names: dict[Key, Key] = {d: f"octopus-in-{j}" for j, d in enumerate(deps)}
    nodes: list[Any] = [task]
    if task.func is execute_subgraph:
        inner = task.args[0]
        names.update({k: f"octopus-inner-{j}" for j, k in enumerate(inner)})
        nodes = [inner[k] for k in inner]
    parts = []
    for node in nodes:
        node = node.substitute(names)
        parts.append((node.func, node.args, node.kwargs) if isinstance(node, Task) else node)
    return tokenize(parts)


def run_members(members: tuple[Task, ...], declared: tuple[str, ...], dep_keys: tuple[Key, ...],
                *dep_values: Any) -> tuple[Any, ...]:
    """Body of a group task: evaluate each member task on the group's inputs."""
    values = dict(zip(dep_keys, dep_values, strict=True))
    deps = [tuple(sorted(m.dependencies, key=str)) for m in members]
    calls = [MemberCall(m, d) for m, d in zip(members, deps)]
    inputs = [[values[k] for k in d] for d in deps]
    return tuple(run_group(calls, inputs, declared, lambda: [member_token(m, d) for m, d in zip(members, deps)]))


def group_graph(dsk: Mapping[Key, GraphNode], specs: Mapping[Key, Mapping[str, Any]], keep: set[Key],
                dependents: Mapping[Key, set[Key]],
                places: Mapping[Key, Any] | None = None) -> dict[Key, GraphNode]:
    """The graph with annotated tasks grouped.

    ``specs[key]`` holds the annotation (``resource``, ``group``) of the tasks to group; ``keep``
    are the keys the caller asks for. Those, tasks read by something other than a plain task, and
    tasks next to a special one (a subclass of ``Task``, such as the barrier of a P2P shuffle, whose
    transfer and output tasks Dask's shuffle extension tracks by key) are not grouped.
    ``dependents`` is the graph's reverse dependency map (:func:`dask.core.reverse_dict`);
    ``places`` (optional) says where each task may run, and only tasks of one place are grouped
    together.
    """
    dependencies = {k: node.dependencies for k, node in dsk.items()}
    special = {k for k, node in dsk.items() if isinstance(node, Task) and type(node) is not Task}
    order = [k for k in dsk if k in specs and type(dsk[k]) is Task and k not in keep
             and not dependencies[k] & special
             and all(type(dsk[c]) is Task for c in dependents.get(k, ()))]
    groups = plan_groups(order, {k: specs[k]["group"] for k in order}, dependencies, places)
    if not groups:
        return dict(dsk)
    token = tokenize(sorted(map(str, order)), [len(g) for g in groups])
    picks: dict[Key, Task] = {}
    for n, members in enumerate(groups):
        for i, m in enumerate(members):
            picks[m] = Task(m, operator.getitem, TaskRef((f"{GROUP_PREFIX}-{token}", n)), i)

    def rewritten(k: Key) -> GraphNode:
        node = dsk[k]
        return node.substitute(picks) if picks.keys() & node.dependencies else node

    out: dict[Key, GraphNode] = {k: rewritten(k) for k in dsk if k not in picks}
    for n, members in enumerate(groups):
        gkey = (f"{GROUP_PREFIX}-{token}", n)
        tasks = tuple(rewritten(m) for m in members)
        dep_keys = tuple(sorted(set().union(*(t.dependencies for t in tasks)), key=str))
        out[gkey] = Task(gkey, run_members, DataNode(None, tasks),
                         DataNode(None, tuple(specs[m]["resource"] for m in members)),
                         DataNode(None, dep_keys), *(TaskRef(d) for d in dep_keys))
    return out
