"""``dask_octopus.map``: run a function over indivisible items of different costs, packed onto
workers by cost and speed (:mod:`dask_octopus.placement.packing`; per-item seconds from
:mod:`dask_octopus.profiling.itemcosts` once fitted), pinned, with one future per item."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import cloudpickle
from dask.base import is_dask_collection, tokenize
from dask.sizeof import sizeof
from dask.utils import funcname, key_split
from distributed import Client, Future

from dask_octopus._compat import LLGExpr, Task, TaskRef, parse_input
from dask_octopus.groups import streams
from dask_octopus.groups.planning import check_group_spec
from dask_octopus.placement.packing import Packing, check_costs, pack
from dask_octopus.plugins.client import awaitable_on_async_clients, call_scheduler
from dask_octopus.plugins.messages import WorkerInfo
from dask_octopus.profiling.itemcosts import SPREAD
from dask_octopus.profiling.speedmodel import check_resource

ITEM_PREFIX = "octopus-item"  # the key prefix of the tasks that pick each item's result from its batch
SCATTER_BYTES = 2**20  # local items above this many bytes in all go to their planned worker by scatter


class ItemError:
    """The exception one item of a batch raised, in place of its result: the item's pick task raises it
    (with its traceback), and the other items of the batch keep their results."""

    __slots__ = ("exception",)

    def __init__(self, exception: BaseException):
        self.exception = exception


def _each_on_its_own(call: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``call``, returning an :class:`ItemError` instead of raising."""

    def run(item: Any) -> Any:
        try:
            return call(item)
        except Exception as e:
            return ItemError(e)

    return run


def run_batch(func: Callable, items: Sequence[Any], kwargs: dict[str, Any], resource: str, group: int) -> list[Any]:
    """Run ``func`` on each item in one task, ``group`` items at a time as a stream group; an item that
    raises gives an :class:`ItemError` in its place. The token of ``func`` and ``kwargs`` (which
    identifies the members' work on a GPU worker) is computed once for the whole batch, when a group
    first asks for it."""
    token = functools.cache(lambda: tokenize(func, kwargs))
    call = _each_on_its_own(partial(func, **kwargs))
    out: list[Any] = []
    for k in range(0, len(items), group):
        chunk = items[k:k + group]
        n = len(chunk)
        out += streams.run_group([call] * n, [[item] for item in chunk], [resource] * n, lambda n=n: [token()] * n)
    return out


async def _pick(batch: Sequence[Any], i: int) -> Any:
    """Item ``i`` of a batch's results, or its exception raised. A coroutine, so the worker runs it on
    its event loop instead of handing it to its thread (120 items in groups of 8 on 2 CPU workers:
    107 -> 64 ms)."""
    result = batch[i]
    if isinstance(result, ItemError):
        raise result.exception
    return result


def _cost_of(cost: Callable[[Any], float], item: Any) -> tuple[bool, Any]:
    """``(True, cost(item))``, or ``(False, the exception)``: run on the worker that holds the item."""
    try:
        return True, cost(item)
    except Exception as e:
        return False, e


def _costs(client: Client, items: list[Any], cost: Callable[[Any], float] | Sequence[float] | None) -> list[float]:
    """One cost per item. Futures (delayed items are futures by now) are equal by default, and a
    ``cost`` callable runs on the worker that holds them (one task each, gathered at once)."""
    if cost is None:
        return [1.0 if isinstance(it, Future) else float(getattr(it, "nbytes", 1)) for it in items]
    if callable(cost):
        remote = [i for i, it in enumerate(items) if isinstance(it, Future)]
        found = dict(zip(remote, client.gather(client.map(partial(_cost_of, cost), [items[i] for i in remote],
                                                          pure=False))))
        out = []
        for i, it in enumerate(items):
            ok, value = found[i] if i in found else _cost_of(cost, it)
            if not ok:
                raise ValueError(f"cost raised for item {i}: {value!r}") from value
            out.append(value)
    else:
        out = list(cost)
        if len(out) != len(items):
            raise ValueError(f"cost has {len(out)} entries for {len(items)} items")
    check_costs(out)
    return [float(c) for c in out]


def _transfer_seconds(client: Client, items: list[Any], workers: list[str]) -> list[list[float]] | None:
    """For items that are futures: the seconds to move each to a worker that does not hold it (bytes
    over the scheduler's bandwidth estimate); ``None`` when no item is a future."""
    at = [i for i, it in enumerate(items) if isinstance(it, Future)]
    if not at:
        return None
    who = client.who_has([items[i] for i in at])
    held = [i for i in at if who.get(items[i].key)]  # not computed yet: wherever it runs, it is not moved
    seconds = [[0.0] * len(workers) for _ in items]
    if not held:
        return seconds
    # keys in memory only: the scheduler may not know yet a future that was just computed
    nbytes = client.nbytes([items[i].key for i in held], summary=False)
    bandwidth = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.bandwidth)
    for i in held:
        holders = set(who[items[i].key])
        seconds[i] = [0.0 if w in holders else nbytes.get(items[i].key, 0) / bandwidth for w in workers]
    return seconds


def _in_rate_units(client: Client, seconds: list[list[float]] | None, workers: list[str],
                   prefix: str) -> list[list[float]] | None:
    """``seconds`` in the unit of a packing by weights: seconds times the function's observed total
    rate (units per second over the workers); ``None`` while the function was never observed."""
    if seconds is None:
        return None
    rates = call_scheduler(client, "octopus_rates").get(prefix, {})
    total = sum(rate for w, (rate, _, _) in rates.items() if w in workers)
    return [[s * total for s in row] for row in seconds] if total > 0 else None


def _plan_items(client: Client, costs: list[float], resource: str, items: list[Any],
                prefix: str) -> tuple[list[str], list[int], list[bool], Packing]:
    """Live workers (sorted), their threads, which of them have no per-item seconds of the function
    fitted yet, and the packing of ``costs`` onto them, counting the transfer of items that are
    futures already on some worker. Once every worker has a fitted per-item cost of the function
    (:mod:`dask_octopus.profiling.itemcosts`), items are packed by their predicted seconds there, fixed part
    included; until then by the workers' weights (the function's own observed speeds once every
    worker has them)."""
    info = {w: WorkerInfo.of(v) for w, v in call_scheduler(client, "octopus_workers", resource=resource,
                                                           prefix=prefix).items()}
    workers = sorted(info)
    moves = _transfer_seconds(client, items, workers)
    fits = [info[w].fit for w in workers]
    if all(fit is not None for fit in fits):
        speeds = [1 / per_unit for _, per_unit in fits]
        penalty = [[fixed + (moves[i][j] if moves else 0.0) for j, (fixed, _) in enumerate(fits)]
                   for i in range(len(costs))]
    else:
        speeds = [info[w].weight for w in workers]
        penalty = _in_rate_units(client, moves, workers, prefix)
    threads = [info[w].threads for w in workers]
    return workers, threads, [fit is None for fit in fits], pack(costs, speeds, penalty=penalty)


def _batches(costs: list[float], packing: Packing, threads: list[int], group: int | None,
             explore: list[bool]) -> list[tuple[int, list[int]]]:
    """``(worker index, item indices)`` of each task: one per item without ``group``, else one per
    thread of the worker, its items split between its threads by cost; largest items first. A
    worker with ``explore`` set (no per-item seconds fitted yet) runs its larger and its smaller
    items as two tasks when their mean costs differ enough, so that its timings tell the fixed
    part of an item from the part proportional to its cost."""
    out = []
    for j, n in enumerate(threads):
        mine = sorted((i for i, w in enumerate(packing.assignment) if w == j), key=lambda i: -costs[i])
        if group is None:
            out += [(j, [i]) for i in mine]
            continue
        large, small = mine[:len(mine) // 2], mine[len(mine) // 2:]
        if explore[j] and large and _mean(costs, small) > 0 and _mean(costs, large) >= SPREAD * _mean(costs, small):
            out += [(j, large), (j, small)]
            continue
        split = pack([costs[i] for i in mine], [1.0] * max(1, n)).assignment
        out += [(j, idx) for t in range(max(1, n)) if (idx := [i for i, x in zip(mine, split) if x == t])]
    return out


def _scatter_to_plan(client: Client, items: list[Any], batches: list[tuple[str, list[int]]]) -> None:
    """Replace the local items by futures of their data on the worker planned for them (one scatter per
    worker), when they hold :data:`SCATTER_BYTES` or more in all: the graph then carries keys, not data."""
    local = [i for i, it in enumerate(items) if not isinstance(it, Future)]
    if sum(sizeof(items[i]) for i in local) < SCATTER_BYTES:
        return
    planned: dict[str, list[int]] = {}
    for worker, idx in batches:
        planned.setdefault(worker, []).extend(i for i in idx if not isinstance(items[i], Future))
    for worker, idx in planned.items():
        for i, fut in zip(idx, client.scatter([items[i] for i in idx], workers=[worker], hash=False)):
            items[i] = fut


def _mean(costs: list[float], idx: list[int]) -> float:
    return sum(costs[i] for i in idx) / len(idx)


@awaitable_on_async_clients
def map(func: Callable, items: Iterable[Any], *, cost: Callable[[Any], float] | Sequence[float] | None = None,
        client: Client | None = None, group: int | None = None, resource: str = "compute",
        **kwargs: Any) -> list[Future]:
    """Run ``func`` over indivisible items of different costs, packed onto the workers so that all
    are predicted to finish together.

    Items are packed by cost and speed (largest first, then moves and swaps off the last worker)
    and pinned. Observed task times refine the speeds, and once every worker has run the function
    often enough its own speeds plan it, so a second ``map`` of the same function is better
    planned. Once batches of different mean item costs have run on every worker, each item is
    planned by its predicted seconds there, a fixed part per item plus a part proportional to its
    cost (:mod:`dask_octopus.profiling.itemcosts`); until then a worker runs its larger and its
    smaller items as two tasks, to tell the two parts apart.

    Parameters
    ----------
    func
        The function, called as ``func(item, **kwargs)``; it must pickle.
    items
        Local objects, futures or delayed objects. Items that are futures count the time to move
        them to a worker that does not hold them, once the function's speed has been observed.
    cost
        A callable of an item, or one number per item (default: ``nbytes`` when items have it,
        else equal), in any unit.
    client
        The client of the cluster (default: the default client).
    group
        ``None``: one task per item. ``g``: each worker runs its items in one task per worker thread
        (a Dask task costs milliseconds on a GPU worker), ``g`` at a time as a stream group; each
        item's result is then picked by a small coroutine task.
    resource
        Weights to plan by until the function's own speeds are known: ``"compute"`` or ``"memory"``.
    **kwargs
        Passed to ``func``.

    Returns
    -------
    list of Future
        One future per item, in the order of ``items``.

    Raises
    ------
    TypeError
        When ``func`` cannot be pickled.
    ValueError
        For costs of the wrong length, negative or NaN, a ``cost`` callable that raises (the
        original error chained), an unknown ``resource`` or a ``group`` below 1.
    NotRegisteredError
        When the scheduler has no dask_octopus plugin.

    Examples
    --------
    >>> futures = dask_octopus.map(pipeline, images, cost=[im.size for im in images], group=8)  # doctest: +SKIP
    >>> results = client.gather(futures)  # doctest: +SKIP
    """
    check_resource(resource)
    if group is not None:
        check_group_spec(resource, group)
    try:
        cloudpickle.dumps(func)  # distributed's dumps would log its own tracebacks first
    except Exception as e:
        raise TypeError(f"func cannot be pickled, so it cannot be sent to workers: {e!r}") from e
    items = list(items)
    if not items:
        return []
    delayed_at = [i for i, it in enumerate(items) if is_dask_collection(it)]
    if delayed_at:
        for i, fut in zip(delayed_at, client.compute([items[i] for i in delayed_at])):
            items[i] = fut
    costs = _costs(client, items, cost)
    # the function's name first, as in Dask's own keys: key_split (hence the scheduler's task prefix,
    # under which its speeds are kept) stops at the first word with a character that is not a letter
    prefix = key_split(f"{funcname(func)}-octopus-map-{'0' * 32}")
    workers, threads, unfitted, packing = _plan_items(client, costs, resource, items, prefix)
    batches = _batches(costs, packing, threads, group, unfitted)
    token = tokenize(func, items, costs, kwargs, group, workers, batches)
    _scatter_to_plan(client, items, [(workers[j], idx) for j, idx in batches])
    name = f"{funcname(func)}-octopus-map-{token}"
    call_scheduler(client, "octopus_add_plan", name=name, workers=[workers[j] for j, _ in batches],
                   costs=[sum(costs[i] for i in idx) for _, idx in batches], counts=[len(idx) for _, idx in batches])
    item_name = f"{ITEM_PREFIX}-{token}"
    dsk: dict[Any, Task] = {}
    keys: list[Any] = [None] * len(items)
    for b, (_, idx) in enumerate(batches):
        if group is None:
            (i,) = idx
            # futures, in the item or in kwargs, become dependencies
            resolved = {k: parse_input(v) for k, v in kwargs.items()}
            dsk[(name, b)] = Task((name, b), func, parse_input(items[i]), **resolved)
            keys[i] = (name, b)
            continue
        dsk[(name, b)] = Task((name, b), run_batch, func, parse_input([items[i] for i in idx]), parse_input(kwargs),
                              resource, group)
        for k, i in enumerate(idx):
            keys[i] = (item_name, i)
            dsk[keys[i]] = Task(keys[i], _pick, TaskRef((name, b)), k)
    # One graph: one update_graph on the scheduler. Its keys already carry the map's token, so the
    # expression takes it too instead of tokenizing every task again (as Client.submit does).
    return client.get(LLGExpr(dsk, _determ_token=token), keys, sync=False)
