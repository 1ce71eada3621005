"""Rewrite of a low-level graph into stream groups.

Each group of annotated tasks (chosen by :func:`~dask_octopus.grouping.plan_groups`) becomes one
task that runs its members through :func:`~dask_octopus.streams.run_group` and returns their
results as a tuple. Consumers of a member read its result from the group task inline; a member
that is an output of the computation (or is read by something other than a task) keeps its key,
as a ``getitem`` of its group. So downstream tasks and ``client.gather`` see the same keys and
values, and the graph has fewer tasks.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Mapping
from functools import partial
from typing import Any

from dask._task_spec import DataNode, GraphNode, Task, TaskRef, _execute_subgraph
from dask.base import tokenize
from dask.typing import Key
from dask.utils import key_split

from dask_octopus.grouping import plan_groups
from dask_octopus.streams import run_group

GROUP_PREFIX = "octopus-group"


def inner_keys(key: Key, node: Any) -> list[Key]:
    """The keys whose work the task ``key`` does: its own, those fused into it by Dask's low-level
    fusion, and those of its members if it is a group task (recursively)."""
    if not isinstance(node, Task):
        return [key]
    if node.func is _execute_subgraph:
        return list(node.args[0])
    if node.func is run_members:
        return [k for m in node.args[0].value for k in inner_keys(m.key, m)]
    return [key]


def run_members(members: tuple[Task, ...], declared: tuple[str, ...], dep_keys: tuple[Key, ...],
                *dep_values: Any) -> tuple[Any, ...]:
    """Body of a group task: evaluate each member task on the group's inputs."""
    values = dict(zip(dep_keys, dep_values, strict=True))
    calls = [partial(m, {d: values[d] for d in m.dependencies}) for m in members]
    names = [key_split(m.key) for m in members]
    inputs = [[values[d] for d in sorted(m.dependencies, key=str)] for m in members]
    return tuple(run_group(calls, names, inputs, declared))


def group_graph(dsk: Mapping[Key, GraphNode], specs: Mapping[Key, Mapping[str, Any]],
                keep: set[Key]) -> tuple[dict[Key, GraphNode], dict[Key, list[Key]]]:
    """The graph with annotated tasks grouped, and each group task's member keys.

    ``specs[key]`` holds the annotation (``resource``, ``group``) of the tasks to group; ``keep``
    are the keys the caller asks for.
    """
    order = [k for k in dsk if k in specs and isinstance(dsk[k], Task)]
    dependencies = {k: node.dependencies for k, node in dsk.items()}
    groups = plan_groups(order, {k: specs[k]["group"] for k in order}, dependencies)
    if not groups:
        return dict(dsk), {}
    dependents: dict[Key, set[Key]] = defaultdict(set)
    for k, deps in dependencies.items():
        for d in deps:
            dependents[d].add(k)
    token = tokenize(sorted(map(str, order)), [len(g) for g in groups])
    picks: dict[Key, Task] = {}
    group_key: dict[Key, Key] = {}
    for n, members in enumerate(groups):
        gkey = (f"{GROUP_PREFIX}-{token}", n)
        for i, m in enumerate(members):
            picks[m] = Task(m, operator.getitem, TaskRef(gkey), i)
            group_key[m] = gkey
    kept = {m for m in picks if m in keep or any(not isinstance(dsk[c], Task) for c in dependents[m])}
    inline = {m: p for m, p in picks.items() if m not in kept}

    def rewritten(k: Key) -> GraphNode:
        node = dsk[k]
        return node.substitute(inline) if inline.keys() & node.dependencies else node

    out: dict[Key, GraphNode] = {k: rewritten(k) for k in dsk if k not in picks}
    members_of: dict[Key, list[Key]] = {}
    for n, members in enumerate(groups):
        gkey = group_key[members[0]]
        tasks = tuple(rewritten(m) for m in members)
        dep_keys = tuple(sorted(set().union(*(t.dependencies for t in tasks)), key=str))
        out[gkey] = Task(gkey, run_members, DataNode(None, tasks),
                         DataNode(None, tuple(specs[m]["resource"] for m in members)),
                         DataNode(None, dep_keys), *(TaskRef(d) for d in dep_keys))
        members_of[gkey] = list(members)
    for m in kept:
        out[m] = picks[m]
    return out, members_of
