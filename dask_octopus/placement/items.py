"""``dask_octopus.map`` and ``imap``: run a function over indivisible items of different costs, packed
onto workers by cost and speed (:mod:`dask_octopus.placement.packing`; per-item seconds from
:mod:`dask_octopus.profiling.itemcosts` once fitted), pinned but for a stealable tail per worker, with
one future per item, or the results gathered per batch (``gather=True``, ``imap``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import inspect
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Collection, Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import CancelledError
from functools import partial
from typing import Any

import cloudpickle
import dask
from dask.base import is_dask_collection, tokenize
from dask.utils import funcname, key_split, parse_timedelta
from distributed import Client, Future, KilledWorker, as_completed
from distributed.client import FutureCancelledError
from distributed.sizeof import safe_sizeof

from dask_octopus import config
from dask_octopus._checks import check_flag
from dask_octopus._compat import (
    AnnotatedLLGExpr,
    Task,
    TaskRef,
    next_completed,
    parse_input,
    result_unless_lost,
    scheduler_id,
)
from dask_octopus.groups import streams
from dask_octopus.groups.planning import check_group_spec
from dask_octopus.placement import tohost
from dask_octopus.placement.packing import Packing, check_costs, pack, split_by_bytes, split_tail
from dask_octopus.placement.pins import ALONE_INFIX, MAP_INFIX
from dask_octopus.placement.transfers import item_seconds
from dask_octopus.plugins.client import (
    Caller,
    awaitable_on_async_clients,
    call_scheduler,
    called_from,
    check_open,
    client_of,
    closed,
    outside_caller,
    release,
    released_on_error,
    wait_for,
)
from dask_octopus.plugins.messages import NO_WORKERS, WorkerInfo
from dask_octopus.profiling.itemcosts import SPREAD
from dask_octopus.profiling.speedmodel import check_resource

ITEM_PREFIX = "octopus-item"  # the key prefix of the tasks that pick each item's result from its batch
SCATTER_BYTES = 2**20  # local items above this many bytes in all go to their planned worker by scatter (gathered runs)
ERRORS = ("raise", "skip")  # what map(gather=True) and imap do with an item that raised
TAIL_TASKS = 2  # the stealable tail of a worker's list of items is split into this many tasks
TAIL_PRIORITY = 1e-9  # how far below the user's priority the stealable tail runs (:func:`_just_below`)
Cost = Callable[[Any], float] | Iterable[float] | None  # map's cost: a callable of an item, numbers, or None
LOST_ROUNDS = 3  # map(gather=True) and imap send an item lost with a worker again this many times at most
RESULT_SIZE = 1.0  # bytes of result per byte of items, until a function's batches have shown theirs
PROBES = 3  # items of a function run alone first, one after the other, until one does not raise (_probed)


class ItemError(streams.HeldError):
    """The exception one item of a batch raised, in place of its result: the item's pick task raises it
    (with its traceback), and the other items of the batch keep their results."""

    __slots__ = ()


def _each_on_its_own(call: Callable[[Any], Any], retries: int, name: str) -> Callable[[Any], Any]:
    """``call``, run again up to ``retries`` times when it raises, then returning an :class:`ItemError`
    instead of raising (:func:`~dask_octopus.groups.streams.attempt`, as a Dask worker runs a task)."""

    def run(item: Any) -> Any:
        if isinstance(item, ItemError):  # an input that failed before the map (:func:`_failed_inputs`)
            return item
        ok, value = streams.attempt(call, (item,), retries, name)
        return value if ok else ItemError(value)

    return run


def run_batch(func: Callable, items: Sequence[Any], kwargs: dict[str, Any], resource: str, group: int | None,
              to_host: bool = False) -> list[Any]:
    """Run ``func`` on each item in one task: one after the other without ``group``, else ``group`` items
    at a time as a stream group; an item that raises runs again as often as the task's ``retries``
    allow (Dask would re-run the item's task), then gives an :class:`ItemError` in its place (the task's
    timing then counts for the share of its items that gave results, and it teaches no result size:
    :data:`~dask_octopus.plugins.messages.DONE_SHARE`). The
    token of ``func`` and ``kwargs`` (which identifies the members' work on a GPU worker) is computed
    once for the whole batch, when a group first asks for it. ``to_host``: CuPy results are copied to
    host memory at the end, all at once (:func:`~dask_octopus.placement.tohost.to_host`)."""
    task = streams.RunningTask()
    call = _each_on_its_own(partial(func, **kwargs), task.retries, funcname(func))
    if group is None:
        out = [call(item) for item in items]
    else:
        token = functools.cache(lambda: tokenize(func, kwargs))
        out = []
        for k in range(0, len(items), group):
            chunk = items[k:k + group]
            n = len(chunk)
            out += streams.run_group([call] * n, [[item] for item in chunk], [resource] * n,
                                     lambda n=n: [token()] * n)
    task.done_share(out, ItemError, partial=True)  # (a worker where func fails at once would look fast)
    return tohost.to_host(out) if to_host else out


def run_one(func: Callable, item: Any, kwargs: dict[str, Any]) -> Any:
    """``func(item, **kwargs)`` with CuPy results copied to host memory (``map(..., to_host=True)``
    with one task per item)."""
    return tohost.to_host([func(item, **kwargs)])[0]


async def pick_item(batch: Sequence[Any], i: int) -> Any:
    """Item ``i`` of a batch's results, or its exception raised. A coroutine, so the worker runs it on
    its event loop instead of handing it to its thread (120 items in groups of 8 on 2 CPU workers:
    107 -> 64 ms)."""
    result = batch[i]
    if isinstance(result, ItemError):
        raise result.exception()
    return result


def _label(func: Callable) -> str:
    """The first words of the keys of ``map``'s tasks of ``func``: its name, as in Dask's own keys (the
    scheduler's task prefix, ``key_split``, under which its speeds, seconds per item and result sizes
    are learned, stops at the first word with a character that is not a letter), and for a lambda or
    a function defined inside another, whose names tell them apart no more, a tag of letters for where
    its code is (every ``lambda`` learned one result size: a lambda returning 1 MiB arrays was cut
    into batches as if its results were the last lambda's integers)."""
    inner = func
    while isinstance(inner, partial):
        inner = inner.func
    qualname = getattr(inner, "__qualname__", "")
    if "<" not in qualname:
        return funcname(func)
    code = getattr(inner, "__code__", None)
    where = (getattr(inner, "__module__", None), qualname, getattr(code, "co_filename", None),
             getattr(code, "co_firstlineno", None))
    tag = "".join(chr(ord("g") + int(d, 16)) for d in hashlib.sha1(repr(where).encode()).hexdigest()[:6])
    return f"{funcname(func)}-{tag}"  # (letters g to v: never taken for a hex token)


def _cost_of(cost: Callable[[Any], float], item: Any) -> tuple[bool, Any]:
    """``(True, cost(item))``, or ``(False, the exception)``: run on the worker that holds the item."""
    try:
        return True, cost(item)
    except Exception as e:
        return False, e


def _error_of(future: Future) -> BaseException:
    """What gathering ``future``, which failed or was cancelled, raises (for a cancelled one, Dask's
    ``FutureCancelledError`` with its reason)."""
    if future.status == "error":
        return future.exception()
    try:
        future.result()  # (at once: a cancelled future's error is known)
    except CancelledError as e:
        # the future's own exception, raised: the traceback it took here held the frames of this call (the
        # run, its batches' futures: their results on the workers) for as long as the caller holds the future
        return e.with_traceback(None)
    return FutureCancelledError(future.key, reason=None)  # (submitted again since: cancelled when read)


def _failed_inputs(items: list[Any]) -> dict[int, ItemError]:
    """The items that are futures which failed or were cancelled already, as the :class:`ItemError` a
    batch gives in their place (what gathering them raises): a batch task that read them would fail
    every item of the batch with their error, or be cancelled with them."""
    return {i: ItemError(_error_of(it)) for i, it in enumerate(items)
            if isinstance(it, Future) and it.status in ("error", "cancelled")}


def _given_costs(cost: Iterable[float], n: int) -> list[float]:
    """The costs given as numbers, one per item of ``n``; raise ``ValueError`` for any other count, or
    a cost that is not a finite number >= 0, ``TypeError`` for a mapping (its keys would be read as the
    costs) or a cost that is not a number."""
    def wrong() -> TypeError:
        return TypeError(f"cost must be a callable, one number per item or None, got {type(cost).__name__} {cost!r}")

    if isinstance(cost, str | bytes | Mapping) or not isinstance(cost, Iterable):
        raise wrong()
    try:
        out = list(cost)
    except TypeError:  # iterable by its type only (a NumPy 0-d array)
        raise wrong() from None
    if len(out) != n:
        raise ValueError(f"cost has {len(out)} entries for {n} items")
    check_costs(out)
    return out


def _listed(client: Client, items: Iterable[Any], cost: Cost) -> tuple[list[Any], Cost]:
    """``items`` as a list, and ``cost``, where given as numbers, as a list of one per item (checked:
    before anything is computed or submitted, whatever the mode); ``TypeError`` where ``items`` is not
    iterable, ``ValueError`` for an item that is a future of another scheduler (the scheduler knows no
    such key)."""
    try:
        iterator = iter(items)  # (a sequence by __getitem__ alone, such as a map-style dataset, is)
    except TypeError:
        raise TypeError(f"items must be an iterable, got {type(items).__name__} {items!r}") from None
    items = list(iterator)
    here = scheduler_id(client)
    for i, it in enumerate(items):
        there = scheduler_id(it.client) if isinstance(it, Future) and it.client is not client else None
        if None not in (here, there) and there != here:
            raise ValueError(f"item {i} is a future of another scheduler ({it.client.scheduler.address}) than "
                             f"this client's ({client.scheduler.address})")
    return items, (cost if cost is None or callable(cost) else _given_costs(cost, len(items)))


def _default_cost(i: int, item: Any) -> float:
    """The cost of item ``i`` when none is given: 1 for a future, else its ``nbytes`` (1 without one)."""
    if isinstance(item, Future):
        return 1.0
    nbytes = getattr(item, "nbytes", 1)
    try:
        return float(nbytes)
    except (TypeError, ValueError):
        raise ValueError(f"item {i} has nbytes {nbytes!r}, not a number, and nbytes is the default cost: "
                         "pass cost=") from None


def _costs(client: Client, items: list[Any], cost: Cost) -> list[float]:
    """One cost per item. Futures (delayed items are futures by now) are equal by default, and a
    ``cost`` callable runs on the worker that holds them (one task each, gathered at once); costs given
    as numbers are one per item, checked already (:func:`_listed`)."""
    if cost is not None and not callable(cost):
        return [float(c) for c in cost]
    if cost is None:
        out = [_default_cost(i, it) for i, it in enumerate(items)]
    else:
        remote = [i for i, it in enumerate(items) if isinstance(it, Future)]
        if remote:  # (it runs where they are)
            _check_pickles("cost", cost)
        costed = client.map(partial(_cost_of, cost), [items[i] for i in remote], pure=False)
        try:
            wait_for(client, costed)
            # an item that failed upstream fails on its own when it runs: costed as one, meanwhile
            found = {i: f.result() if f.status == "finished" else (True, 1.0) for i, f in zip(remote, costed)}
        finally:
            release(costed)
        out = []
        for i, it in enumerate(items):
            ok, value = found[i] if i in found else _cost_of(cost, it)
            if not ok:
                raise ValueError(f"cost raised for item {i}: {value!r}") from value
            out.append(value)
    check_costs(out)
    return [float(c) for c in out]


def _plan_items(client: Client, costs: list[float], resource: str, items: list[Any], nbytes: list[float],
                prefix: str, started: bool) -> tuple[list[str], list[WorkerInfo], list[bool], Packing, float | None]:
    """Live workers (sorted), what the scheduler knows of each, which of them have no per-item seconds
    of the function fitted yet, the packing of ``costs`` onto them, counting the transfer of items that
    are futures already on some worker (of ``nbytes`` each), and the seconds of one unit of the packing's finish times
    (``None`` while unknown). Once every worker has a fitted per-item cost of the function
    (:mod:`dask_octopus.profiling.itemcosts`), items are packed by their predicted seconds there, fixed part
    included; until then by the workers' weights (the function's own observed speeds once every
    worker has them), in units of cost over weight. Both are one thread's: a worker runs its items on
    all its threads at once, so its speed counts once per thread, and so do its items' fixed parts
    (not the transfers of its items); but a GPU worker's weight is its device's, which its threads share:
    it counts once (:func:`~dask_octopus.plugins.messages.parallel_threads`). Fitted seconds, timed while
    the threads ran side by side, count the sharing already. Where the cluster has no workers, raises
    ``ValueError``; or, once the map ``started`` (submitted some of its work: workers left since), waits
    for one, as its tasks submitted already wait."""
    while True:
        try:
            found = call_scheduler(client, "octopus_workers", resource=resource, prefix=prefix)
            break
        except ValueError as e:
            if not started or str(e) != NO_WORKERS:
                raise
        client.wait_for_workers(1)
    info = {w: WorkerInfo.of(v) for w, v in found.items()}
    workers = sorted(info)
    threads = [max(1, info[w].threads) for w in workers]
    moves = item_seconds(client, items, nbytes, workers)  # moving items that are futures, at measured bandwidths
    fits = [info[w].fit for w in workers]
    if all(fit is not None for fit in fits):
        speeds = [n / per_unit for n, (_, per_unit) in zip(threads, fits)]
        penalty = [[fixed / threads[j] + (moves[i][j] if moves else 0.0) for j, (fixed, _) in enumerate(fits)]
                   for i in range(len(costs))]
        scale = 1.0
    else:
        speeds = [info[w].weight * info[w].parallel for w in workers]
        rates = [info[w].rate for w in workers]
        rate = sum(rates) if None not in rates else None  # the function's units per second, all workers
        scale = 1 / rate if rate else None  # a worker of weight w runs w * rate units per second
        # moves in the packing's unit: seconds times the total rate (not counted until it is known)
        penalty = [[m * rate for m in row] for row in moves] if moves is not None and scale else None
    packing = pack(costs, speeds, penalty=penalty)
    return workers, [info[w] for w in workers], [fit is None for fit in fits], packing, scale


def _batches(costs: list[float], packing: Packing, threads: list[int], batched: bool, explore: list[bool],
             steal: float, scale: float | None, held: list[float],
             budgets: Sequence[float | None]) -> list[tuple[int, list[int], bool]]:
    """``(worker index, item indices, stealable)`` of each task, the tasks each worker runs first before the
    stealable ones. Not ``batched``: one task per item. ``batched``: one per thread of the worker, its items
    split between its threads by cost; largest items first. A worker with ``explore`` set (no per-item seconds
    fitted yet) runs its larger and its smaller items apart, each split between half its threads, when their
    mean costs differ enough, so that its timings tell the fixed part of an item from the part proportional to
    its cost. The last items of each list, a ``steal`` fraction of its cost at most, are split off as
    :data:`TAIL_TASKS` stealable tasks (:func:`split_tail`), unless each would be predicted (``scale``: seconds
    per unit of the packing's finish times) to take less than ``octopus.map.steal-min-seconds``: too short to
    pay for its own task. Not ``batched``, the tail's items are stealable whatever their length (they are tasks
    anyway). ``batched``, each part is cut further so that one task holds at most its worker's ``budgets`` bytes
    (:func:`split_by_bytes`), ``held`` per item (its bytes and its result's): the task holds them all until it
    ends."""
    out = []
    floor = parse_timedelta(config.get("map.steal-min-seconds"))
    for j, n in enumerate(threads):
        mine = sorted((i for i, w in enumerate(packing.assignment) if w == j), key=lambda i: -costs[i])
        large, small = mine[:len(mine) // 2], mine[len(mine) // 2:]
        if not batched or not mine:
            lists = [mine]
        elif explore[j] and large and _mean(costs, small) > 0 and _mean(costs, large) >= SPREAD * _mean(costs, small):
            # (half the threads each, all of them busy)
            lists = [*_spread(large, costs, max(1, n // 2)), *_spread(small, costs, max(1, n - n // 2))]
        else:
            lists = _spread(mine, costs, n)
        # one task per item: stealable tasks cost nothing more. Batches: the lists run side by side on the
        # worker's threads, each for about the worker's finish time, and the tail adds TAIL_TASKS tasks
        worth = not batched or scale is None or steal * packing.finish[j] * scale / TAIL_TASKS >= floor
        for idx in lists:
            parts = split_tail([costs[i] for i in idx], steal if worth else 0.0, TAIL_TASKS)
            for start, stop, stealable in parts:
                if batched:
                    part = idx[start:stop]
                    out += [(j, part[a:b], stealable) for a, b in split_by_bytes([held[i] for i in part], budgets[j])]
                else:
                    out += [(j, [i], stealable) for i in idx[start:stop]]
    return sorted(out, key=lambda batch: batch[2])  # stable: every worker's own tasks first


def _spread(idx: list[int], costs: list[float], threads: int) -> list[list[int]]:
    """The items ``idx`` split between ``threads`` (at least one) by cost, the empty lists left out."""
    split = pack([costs[i] for i in idx], [1.0] * max(1, threads)).assignment
    return [part for t in range(max(1, threads)) if (part := [i for i, x in zip(idx, split) if x == t])]


def _item_bytes(client: Client, items: list[Any], wait: bool) -> list[float]:
    """The bytes of each item: Dask's ``sizeof`` of a local item (as distributed's ``safe_sizeof``: 1 MB,
    with a warning, where it raises), the scheduler's figure for a future,
    the futures waited for first where ``wait`` (a batch task cannot start before all its items are
    computed anyway); 0 for a future that failed, was cancelled or, not waited for, is not computed yet."""
    futures = [it for it in items if isinstance(it, Future)]
    if wait:
        wait_for(client, futures)
    held = [f.key for f in futures if f.status == "finished"]  # (the scheduler knows no cancelled key)
    nbytes = client.nbytes(held, summary=False) if held else {}
    return [max(0.0, nbytes.get(it.key, 0)) if isinstance(it, Future) else float(safe_sizeof(it)) for it in items]


def _scatter_to_plan(client: Client, items: list[Any], nbytes: list[float], batches: list[tuple[str, list[int]]],
                     held: Collection[str]) -> None:
    """Replace the local items by futures of their data on the worker planned for them (one scatter per
    worker), when they hold :data:`SCATTER_BYTES` or more in all (``nbytes`` each): the graph then
    carries keys, not data. Not to the ``held`` workers (paused or retiring: planned on only when all
    are): Dask's scatter refuses them and fails after its connect timeout, where the graph carrying the
    items waits for a worker, as Dask's ``client.map`` does. Where the planned worker left since the plan
    was made, its items stay in the graph (the plan's blocks there go to the other workers as it is
    registered)."""
    local = [i for i, it in enumerate(items) if not isinstance(it, Future)]
    if sum(nbytes[i] for i in local) < SCATTER_BYTES:
        return
    planned: dict[str, list[int]] = {}
    for worker, idx in batches:
        if worker not in held and (mine := [i for i in idx if not isinstance(items[i], Future)]):
            planned.setdefault(worker, []).extend(mine)  # (a worker planned only futures: nothing to scatter)
    for worker, idx in planned.items():
        try:
            futures = client.scatter([items[i] for i in idx], workers=[worker], hash=False)
        except (KeyError, OSError) as e:  # the scheduler has it no more, or it is closing (or gone: connect timeout)
            # its traceback and distributed's sync() hold each other: until Python collects that cycle, the
            # frames of this call and of its callers, their items and the futures made, stayed held
            e.__traceback__ = None
            continue
        for i, fut in zip(idx, futures):
            items[i] = fut


def _just_below(priority: float) -> float:
    """A priority just below ``priority``: :data:`TAIL_PRIORITY` below, or the next float down where
    floats are coarser (below infinity: the largest float)."""
    below = priority - TAIL_PRIORITY
    return below if below < priority else math.nextafter(priority, -math.inf)


def _mean(costs: list[float], idx: list[int]) -> float:
    return sum(costs[i] for i in idx) / len(idx)


def _check_kwargs(func: Callable, kwargs: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` where ``func``'s signature cannot take ``func(item, **kwargs)`` (nothing is
    checked for a callable without one, as some builtins): else each item would fail on its worker."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(None, **kwargs)
    except TypeError as e:
        raise TypeError(f"func {funcname(func)!r} cannot be called as func(item, **kwargs) with the keyword "
                        f"arguments {sorted(kwargs)}: {e} (map passes its other keyword arguments to func; for "
                        "Dask's retries, priority or resources, use dask.annotate(...) around the call)") from None


def _check_call(func: Callable, group: int | None, resource: str, errors: str, kwargs: Mapping[str, Any],
                **flags: Any) -> int | None:
    """``group`` as a Python integer, once the arguments of :func:`map` or :func:`imap` are checked
    (``kwargs``: those for ``func``; ``flags``: those that are true or false, by name)."""
    if not callable(func):
        raise TypeError(f"func must be callable, got {type(func).__name__} {func!r}")
    if inspect.iscoroutinefunction(func):  # a batch calls it in the worker's thread: nothing would await it
        raise TypeError(f"func {getattr(func, '__name__', func)!r} is a coroutine function: map runs items in "
                        "batches, which do not await; use client.map, or a function that runs the coroutine")
    _check_kwargs(func, kwargs)
    for name, value in flags.items():
        check_flag(value, name)
    check_resource(resource)
    checked = check_group_spec(resource, group)
    if errors not in ERRORS:
        raise ValueError(f"errors must be one of {', '.join(ERRORS)}, got {errors!r}")
    _check_pickles("func", func)  # distributed's dumps would log its own tracebacks first
    return checked


def _unpicklable(what: str, value: Any) -> TypeError | None:
    """The ``TypeError`` saying that ``what`` cannot be sent to workers, where ``value`` does not pickle
    (its buffers are passed over, not copied), else ``None``."""
    try:
        cloudpickle.dumps(value, protocol=5, buffer_callback=lambda buffer: None)
    except Exception as e:
        error = TypeError(f"{what} cannot be pickled, so it cannot be sent to workers: {e!r}")
        error.__cause__ = e
        return error
    return None


def _check_pickles(what: str, value: Any) -> None:
    """Raise :func:`_unpicklable`'s error where ``value`` does not pickle."""
    error = _unpicklable(what, value)
    if error is not None:
        raise error


def _named_unpicklable(items: list[Any], kwargs: Mapping[str, Any], numbers: Sequence[int] | None
                       ) -> TypeError | None:
    """For a graph that distributed could not serialize: the error naming the first keyword argument or
    local item that does not pickle, by its index in the map's items (``numbers``: those of ``items``,
    where they are some of them); ``None`` where each pickles."""
    named = [*((f"kwargs[{k!r}]", v) for k, v in kwargs.items()),
             *((f"item {i if numbers is None else numbers[i]}", it) for i, it in enumerate(items)
               if not isinstance(it, Future))]
    return next((e for e in (_unpicklable(what, value) for what, value in named) if e is not None), None)


def _compute_delayed(client: Client, items: list[Any]) -> list[int]:
    """Replace the delayed objects (and other collections) among ``items`` by futures of their values;
    returns their indices."""
    delayed_at = [i for i, it in enumerate(items) if is_dask_collection(it)]
    if delayed_at:
        for i, fut in zip(delayed_at, client.compute([items[i] for i in delayed_at])):
            items[i] = fut
    return delayed_at


def _submit(client: Client, func: Callable, items: list[Any], cost: Cost,
            group: int | None, resource: str, to_host: bool, kwargs: dict[str, Any],
            per_item: bool, probe: bool = True, pure: bool = True, started: bool = False,
            numbers: Sequence[int] | None = None) -> tuple[list[Future], list[list[int]], set[int]]:
    """Plan ``items``, register the plan and submit it as one graph (``started``: some of the map's work was
    submitted already, :func:`_plan_items`; ``numbers``: the items' indices in the map's, where they are
    some of them, for errors). ``per_item``: one future per item
    (and no batches), named by their work unless ``pure`` is false; else one future per batch task,
    with the indices of its items. Also returns the indices of the items that were futures failed
    already (:func:`_failed_inputs`). Batches of a
    function whose results' size the scheduler does not know yet: :func:`_probed` (with ``probe``).
    The tasks take the Dask annotations in effect (``dask.annotate``; a ``priority`` comes before the
    map's own order of its tasks). The futures it makes in place of ``items`` (delayed ones computed,
    local ones scattered) are released where it fails."""
    with released_on_error(items):
        _compute_delayed(client, items)
        return _plan_and_submit(client, func, items, cost, group, resource, to_host, kwargs, per_item, probe, pure,
                                started, numbers)


def _plan_and_submit(client: Client, func: Callable, items: list[Any], cost: Cost, group: int | None,
                     resource: str, to_host: bool, kwargs: dict[str, Any], per_item: bool, probe: bool, pure: bool,
                     started: bool, numbers: Sequence[int] | None) -> tuple[list[Future], list[list[int]], set[int]]:
    """:func:`_submit`, once the delayed items are futures."""
    costs = _costs(client, items, cost)
    batched = group is not None or not per_item
    nbytes = _item_bytes(client, items, wait=batched)  # (one task per item: it waits for its item itself)
    failed = _failed_inputs(items)
    label = _label(func)
    prefix = key_split(f"{label}-{MAP_INFIX}-{'0' * 32}")
    workers, info, unfitted, packing, scale = _plan_items(client, costs, resource, items, nbytes, prefix, started)
    # an item and its result, as large as the function's recent batches made them (else RESULT_SIZE)
    result_size = next((w.result_size for w in info if w.result_size is not None), None)
    if result_size is None and probe and batched and len(items) > 1 and config.get("map.learn-result-size"):
        usable = {i for i, b in enumerate(nbytes) if i not in failed and b > 0}
        return _probed(client, func, items, costs, usable, group, resource, to_host, kwargs, per_item, pure, started,
                       numbers)
    result_size = RESULT_SIZE if result_size is None else result_size
    batches = _batches(costs, packing, [w.threads for w in info], batched, unfitted, config.get("map.steal-fraction"),
                       scale, [b * (1 + result_size) for b in nbytes], [w.budget for w in info])
    # the futures per item are the user's, named by their work as Dask names them (unless the function is
    # impure: then, as client.map(pure=False) makes them, unique); the batch tasks of a run that gathers its
    # results are its own (it cancels those it does not read): no other run shares their keys
    run = None if per_item and pure else uuid.uuid4().hex
    token = tokenize(func, items, costs, kwargs, group, workers, batches, to_host, per_item, run)
    if not per_item:  # (only gathered results can be computed again from the items kept here: _Batches)
        _scatter_to_plan(client, items, nbytes, [(workers[j], idx) for j, idx, _ in batches],
                         {w for w, i in zip(workers, info) if i.held})
    name = f"{label}-{MAP_INFIX}-{token}"
    call_scheduler(client, "octopus_add_plan", name=name, workers=[workers[j] for j, _, _ in batches],
                   costs=[sum(costs[i] for i in idx) for _, idx, _ in batches],
                   counts=[len(idx) for _, idx, _ in batches], stealable=[st for _, _, st in batches],
                   resource=resource, nbytes=[sum(nbytes[i] for i in idx) for _, idx, _ in batches])
    item_name = f"{ITEM_PREFIX}-{token}"
    user = dask.get_annotations().get("priority", 0)  # a number or a function of the key (dask.annotate checks)
    dsk: dict[Any, Task] = {}
    priority: dict[Any, float] = {}
    keys: list[Any] = [None] * len(items)
    for b, (_, idx, stealable) in enumerate(batches):
        # a worker runs its own tasks first, the stealable ones last: just after, at the user's priority
        # (a whole step lower, they tied with the user's work of the next priority, which then ran first)
        level = user((name, b)) if callable(user) else user
        priority[(name, b)] = _just_below(level) if stealable else level
        if not batched:
            (i,) = idx
            keys[i] = (name, b)
            if i in failed:  # (reading it, the task would be refused with every other of the graph)
                dsk[keys[i]] = Task(keys[i], pick_item, [failed[i]], 0)
            elif to_host:
                dsk[keys[i]] = Task(keys[i], run_one, func, parse_input(items[i]), parse_input(kwargs))
            else:  # futures, in the item or in kwargs, become dependencies
                resolved = {k: parse_input(v) for k, v in kwargs.items()}
                dsk[keys[i]] = Task(keys[i], func, parse_input(items[i]), **resolved)
            continue
        dsk[(name, b)] = Task((name, b), run_batch, func, parse_input([failed.get(i, items[i]) for i in idx]),
                              parse_input(kwargs), resource, group, to_host)
        if per_item:
            for k, i in enumerate(idx):
                keys[i] = (item_name, i)
                dsk[keys[i]] = Task(keys[i], pick_item, TaskRef((name, b)), k)
    if not per_item:
        keys = [(name, b) for b in range(len(batches))]
    # One graph: one update_graph on the scheduler. Its keys already carry the map's token, so the
    # expression takes it too instead of tokenizing every task again (as Client.submit does).
    graph = AnnotatedLLGExpr(dsk, {"priority": priority}, _determ_token=token)
    try:
        futures = client.get(graph, keys, sync=False)
    except TypeError:  # (distributed's: "Could not serialize object of type AnnotatedLLGExpr", naming nothing)
        named = _named_unpicklable(items, kwargs, numbers)
        if named is None:
            raise
        raise named from named.__cause__
    return futures, [idx for _, idx, _ in batches] if not per_item else [], set(failed)


def _probed(client: Client, func: Callable, items: list[Any], costs: list[float], usable: Collection[int],
            group: int | None, resource: str, to_host: bool, kwargs: dict[str, Any],
            per_item: bool, pure: bool = True, started: bool = False,
            numbers: Sequence[int] | None = None) -> tuple[list[Future], list[list[int]], set[int]]:
    """:func:`_submit` of batches of a function none of whose tasks has finished yet: its cheapest item of
    ``usable`` (not failed already, of known bytes) first, alone, and once that finished (the scheduler
    then knows the bytes of result per byte of item) the others, in batches that count their results
    that large. Results much larger than their items (paths in, images out) would otherwise be counted
    as large as the items, and a batch cut to the worker's budget by that count would hold many times
    more, until the worker dies running it. An item that raises teaches nothing (its error is no
    result): the next cheapest runs alone then, up to :data:`PROBES` items, and after as many errors the
    others count :data:`RESULT_SIZE`; so they do where the items alone have not ended within
    ``octopus.map.learn-result-wait``, all of them (behind other work, or waiting for resources no worker has yet:
    ``map`` would not return its futures meanwhile, where ``client.map`` returns at once). Items
    scattered to their workers on the way replace those of ``items``, as :func:`_submit` does."""
    parts: list[tuple[list[int], tuple[list[Future], list[list[int]], set[int]]]] = []
    made: list[Future] = []  # their futures

    def submit(indices: list[int], probe: bool) -> list[Future]:
        some = [items[i] for i in indices]
        part = _submit(client, func, some, [costs[i] for i in indices], group, resource, to_host, kwargs,
                       per_item, probe=probe, pure=pure, started=started or bool(parts),
                       numbers=[numbers[i] for i in indices] if numbers is not None else indices)
        for i, item in zip(indices, some):
            items[i] = item
        parts.append((indices, part))
        made.extend(part[0])
        return part[0]

    left = list(range(len(items)))
    deadline = time.monotonic() + parse_timedelta(config.get("map.learn-result-wait"))  # (for all the items)
    with released_on_error(made):  # (the caller got none of them)
        for _ in range(PROBES):
            candidates = [i for i in left if i in usable]
            if not candidates or len(left) < 2:
                break
            first = min(candidates, key=costs.__getitem__)
            left.remove(first)
            (future,) = submit([first], probe=False)
            ended = wait_for(client, [future], timeout=max(0.0, deadline - time.monotonic()))
            if not ended or not _failed_alone(future, per_item):
                break  # (not done in time: the others count RESULT_SIZE, as they would without it)
        if left:  # (after PROBES failed items, counted RESULT_SIZE)
            submit(left, probe=False)
    failed = {indices[j] for indices, (_, _, bad) in parts for j in bad}
    if per_item:
        futures: list[Future] = [None] * len(items)  # type: ignore[list-item]
        for indices, (futs, _, _) in parts:
            for i, f in zip(indices, futs, strict=True):
                futures[i] = f
        return futures, [], failed
    return ([f for _, (futs, _, _) in parts for f in futs],
            [[indices[j] for j in idx] for indices, (_, batches, _) in parts for idx in batches], failed)


def _failed_alone(future: Future, per_item: bool) -> bool:
    """Whether the one-item task ``future`` (a finished item's future, or its batch task's) failed, or was
    cancelled (its worker left with its item: :meth:`_Batches.again` sends it again)."""
    return future.status != "finished" or (not per_item and isinstance(future.result()[0], ItemError))


def _checked(results: Iterable[tuple[int, Any]], errors: str) -> Iterator[tuple[int, Any]]:
    """``(index, result)`` pairs; an item's :class:`ItemError` raises its exception (``"raise"``) or
    leaves the item out (``"skip"``)."""
    for i, result in results:
        if isinstance(result, ItemError):
            if errors == "raise":
                raise result.exception()
            continue
        yield i, result


@awaitable_on_async_clients
def map(func: Callable, items: Iterable[Any], *, cost: Callable[[Any], float] | Iterable[float] | None = None,
        client: Client | None = None, group: int | None = None, resource: str = "compute", gather: bool = False,
        errors: str = "raise", to_host: bool = False, pure: bool = True, **kwargs: Any) -> list[Future] | list[Any]:
    """Run ``func`` over indivisible items of different costs, packed onto the workers so that all
    are predicted to finish together.

    Items are packed by cost and speed (largest first, then moves and swaps off the last worker)
    and pinned, but for the last items of each worker's list (``octopus.map.steal-fraction`` of
    its work), which Dask's work stealing may hand to a worker that ran out of work when the plan
    goes wrong. Observed task times refine the speeds, and once every worker has run the function
    often enough its own speeds plan it, so a second ``map`` of the same function is better
    planned. Once batches of different mean item costs have run on every worker, each item is
    planned by its predicted seconds there, a fixed part per item plus a part proportional to its
    cost (:mod:`dask_octopus.profiling.itemcosts`); until then a worker runs its larger and its
    smaller items as two tasks, to tell the two parts apart.

    A future per item costs a Dask key per item (about a millisecond each on a GPU worker). When
    the results are all you need, ``gather=True`` returns them without one: each worker's batch
    comes back as one object and is split here. To handle results as they come, use
    :func:`imap`.

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
        ``None``: one task per item (with ``gather=True``: one per worker thread, its items one
        after the other). ``g``: each worker runs its items in one task per worker thread (a Dask
        task costs milliseconds on a GPU worker), ``g`` at a time as a stream group; each item's
        result is then picked by a small coroutine task unless ``gather=True``. Batches are cut
        where one would hold more than ``octopus.fragments.max-bytes`` (the scheduler's setting) of
        items and results, these as large per byte of item as the function's recent batches made
        them (for a function none of whose tasks has finished on the scheduler, its cheapest item
        runs alone first, to show them: ``octopus.map.learn-result-size``, read here); items that
        are futures or delayed are waited for first, to know their sizes.
    resource
        Weights to plan by until the function's own speeds are known: ``"compute"`` or ``"memory"``.
    gather
        Return the results, in the order of ``items``, instead of futures.
    errors
        With ``gather=True``, as in ``Client.gather``: ``"raise"`` raises the exception of the first
        item that failed (with its traceback), ``"skip"`` leaves failed items out of the results.
    to_host
        Copy CuPy results to host memory on the worker, all of a task's items at once after its
        work (no ``.get()`` per item inside ``func``, which would stop the items overlapping).
    pure
        As in ``Client.map``: whether ``func`` returns the same result for the same item, so that the
        futures of another call of the same work (still held) may be reused. ``False`` (a function
        that draws random numbers, reads a clock or a changing file): this call's futures are its own.
        With ``gather=True`` (and :func:`imap`) every call runs its items anew either way.
    **kwargs
        Passed to ``func``.

    Returns
    -------
    list of Future or list
        One future per item, in the order of ``items``; with ``gather=True``, the results.

    Raises
    ------
    TypeError
        When ``func`` is not callable, is a coroutine function, cannot be pickled or cannot take
        ``kwargs`` (by its signature, where it has one), ``items`` is not iterable, a keyword
        argument, a local item or a ``cost`` callable sent to workers cannot be pickled (naming it),
        ``cost`` is neither a callable nor numbers, ``gather``, ``to_host`` or ``pure`` is not True or
        False, or ``client`` is not a Client.
    RuntimeError
        When ``client`` is closed (also by another thread while ``gather=True`` waits for results).
    ValueError
        For costs of the wrong length, negative or NaN (without ``cost``: an item's ``nbytes`` that
        is not a number), a ``cost`` callable that raises (the original error chained), an item that
        is a future of another scheduler, an unknown ``resource`` or ``errors``, ``errors`` without
        ``gather=True``, or a ``group`` below 1.
    NotRegisteredError
        When the scheduler has no dask_octopus plugin.

    Examples
    --------
    >>> futures = dask_octopus.map(pipeline, images, cost=[im.size for im in images], group=8)  # doctest: +SKIP
    >>> results = client.gather(futures)  # doctest: +SKIP
    >>> results = dask_octopus.map(pipeline, images, group=8, gather=True, to_host=True)  # doctest: +SKIP
    """
    group = _check_call(func, group, resource, errors, kwargs, to_host=to_host, gather=gather, pure=pure)
    if errors != "raise" and not gather:
        raise ValueError("errors applies to gathered results: pass gather=True, or give errors to client.gather")
    items, cost = _listed(client, items, cost)
    if not items:
        return []
    if not gather:
        return _submit(client, func, items, cost, group, resource, to_host, kwargs, per_item=True, pure=pure)[0]
    run = _Batches(client, func, items, cost, group, resource, to_host, kwargs, dask.get_annotations())
    return [result for _, result in _checked(sorted(_as_finished(run)), errors)]


def imap(func: Callable, items: Iterable[Any], *, cost: Callable[[Any], float] | Iterable[float] | None = None,
         client: Client | None = None, group: int | None = None, resource: str = "compute", errors: str = "raise",
         to_host: bool = False, pure: bool = True,
         **kwargs: Any) -> Iterator[tuple[int, Any]] | AsyncIterator[tuple[int, Any]]:
    """:func:`map` planned and run the same way, yielding ``(index, result)`` as each task of items
    finishes, for results streamed onward (no Dask key per item; a worker's items come together).

    Parameters are those of :func:`map` (``pure`` is only checked: each call runs its items anew);
    ``errors="raise"`` raises an item's exception when its
    task's results arrive, ``"skip"`` leaves failed items out. The plan is made and submitted at
    once, when the items that are futures or delayed are computed (as :func:`map` with batches;
    after the first item of a function new to the scheduler ran alone, as there);
    with an asynchronous client, iterate with ``async for`` (the plan is then made at the first
    step). Stopping early releases the tasks not yet finished.

    Returns
    -------
    iterator of (int, object)
        Index in ``items`` and result, in the order the tasks finish.

    Raises
    ------
    TypeError, ValueError, NotRegisteredError
        As :func:`map`.

    Examples
    --------
    >>> for i, frame in dask_octopus.imap(decode, videos, group=8, to_host=True):  # doctest: +SKIP
    ...     writer.write(i, frame)
    """
    client = client_of(client)
    group = _check_call(func, group, resource, errors, kwargs, to_host=to_host, pure=pure)
    items, cost = _listed(client, items, cost)
    annotations = dask.get_annotations()  # also of the tasks sent while the results are read
    if client.asynchronous:  # (its warnings name this call's line, as the others' do)
        return _imap_async(client, func, items, cost, group, resource, to_host, kwargs, errors, annotations,
                           outside_caller())
    if not items:
        return iter(())
    return _closing(_as_finished(_Batches(client, func, items, cost, group, resource, to_host, kwargs, annotations)),
                    errors)


def _closing(run: Generator[tuple[int, Any], None, None], errors: str) -> Iterator[tuple[int, Any]]:
    """:func:`_checked` over ``run``, closed as this ends, so that its tasks not finished are released also
    when an item's error is raised (its traceback, which a caller may keep, would keep ``run`` open)."""
    try:
        yield from _checked(run, errors)
    finally:
        run.close()


class _Batches:
    """The batch tasks of one :func:`map` with ``gather=True`` or :func:`imap`: the items of each, by its
    key, and their submission again where a batch ended for want of one of its items.

    Local items of :data:`SCATTER_BYTES` or more in all live on the worker planned for them only (as
    ``client.scatter``'s data); when that worker leaves, Dask forgets them and cancels the tasks that
    read them. An item given as a future (or a delayed object) that fails while the map runs fails
    the batch task that reads it. The results of this run are only gathered, so such batches can be
    submitted again: :meth:`again` plans and submits their items anew, from the items kept here (an
    item lost with workers at most :data:`LOST_ROUNDS` times, then it fails alone,
    :meth:`lost_for_good`; a failed item then fails alone, as one that failed before the map,
    :func:`_failed_inputs`). Computes the delayed items and submits ``items``
    (a list it keeps; a first item alone first, :func:`_probed`): :meth:`take` hands over the batch
    tasks' futures; call :meth:`finish` with each that finished. Every task it submits, also later
    (from wherever the results are read), takes ``annotations`` (those of ``dask.annotate`` where the
    call was made).
    """

    def __init__(self, client: Client, func: Callable, items: list[Any], cost: Any, group: int | None,
                 resource: str, to_host: bool, kwargs: dict[str, Any], annotations: Mapping[str, Any]):
        self.client = client
        self._annotations = dict(annotations)
        self._submit_args = (client, func, group, resource, to_host, kwargs)
        self._cost = cost  # one per item, where a list (:func:`_listed`)
        self._items = items
        self.where: dict[Any, list[int]] = {}
        self._sent: dict[int, Future] = {}  # items given as futures (or computed), of batches not finished
        self._scattered: set[int] = set()
        self._failed: set[int] = set()  # futures failed when submitted: ItemErrors in their batches
        self._resent: Counter[int] = Counter()  # times each item was sent again after workers left with it
        self._alone: set[Any] = set()  # the keys of the tasks of one item each, not pinned (_each_alone)
        with released_on_error(items):
            # once: a future kept here keeps its error (computed again, it might not)
            self._computed = _compute_delayed(client, items)
            self._futures = self._submit(list(range(len(items))), started=False)

    def take(self) -> list[Future]:
        """The futures of the batch tasks first submitted, held here no more (a stream holds no result
        it has read)."""
        futures, self._futures = self._futures, []
        return futures

    def _submit(self, indices: list[int], started: bool = True) -> list[Future]:
        client, func, group, resource, to_host, kwargs = self._submit_args
        items = [self._items[i] for i in indices]
        cost = self._cost if self._cost is None or callable(self._cost) else [self._cost[i] for i in indices]
        with dask.annotate(**self._annotations):
            futures, batches, failed = _submit(client, func, items, cost, group, resource, to_host, kwargs,
                                               per_item=False, started=started, numbers=indices)
        for i, sent in zip(indices, items):
            if isinstance(sent, Future) and isinstance(self._items[i], Future):
                self._sent[i] = sent  # (given or computed: it may fail)
            elif isinstance(sent, Future):
                self._scattered.add(i)  # not held here: released as its batch finishes, kept here as it was given
        self._failed.update(indices[j] for j in failed)
        self.where.update((f.key, [indices[i] for i in idx]) for f, idx in zip(futures, batches))
        return futures

    def again(self, future: Future, result: Any) -> list[Future] | None:
        """The batch tasks that now run the items of the batch task ``future`` (with ``result``, its
        result or exception), where the scheduler cancelled it because a worker left with items scattered
        to it (once it ran, or before: the scheduler then refused the whole submission, every batch of it
        cancelled for "lost dependencies"; or as the client read its result from the worker that left), or
        where it failed because an item given as a future failed, or because it killed the workers that
        ran it (``KilledWorker``: an item that ends its worker's process, out of memory, and the tasks
        pinned beside it; then each item runs alone, and only that one fails: :meth:`_each_alone`);
        ``None`` for any other outcome."""
        idx = self.where[future.key]
        if future.status == "error" and isinstance(result, KilledWorker) and future.key not in self._alone:
            return self._each_alone(self._forget(future))
        if future.status == "error":  # again where an item failed since it was submitted (then it fails alone)
            if not self._failed_since(idx, "error"):
                return None
        elif isinstance(result, FutureCancelledError) and self._failed_since(idx, "cancelled"):
            pass  # an item given as a future was cancelled, or lost with the worker holding it: it fails alone
        elif self._lost_with_workers(idx, result) and all(self._resent[i] < LOST_ROUNDS for i in idx):
            self._resent.update(idx)
        else:
            return None
        return self._submit(self._forget(future))

    def _lost_with_workers(self, indices: list[int], result: Any) -> bool:
        """Whether ``result`` says the batch task of the items ``indices`` was cancelled because a worker left
        with the items scattered to it (or its batch submitted with them)."""
        return isinstance(result, FutureCancelledError) and (
            result.reason == "lost dependencies"
            # (the scheduler forgot it with its scattered item; a batch whose holder died as the client read
            # it is reported cancelled for no reason, "unknown", as the client asks)
            or (result.reason in ("already forgotten", "unknown") and bool(self._scattered & set(indices))))

    def lost_for_good(self, future: Future, result: Any) -> list[tuple[int, ItemError]] | None:
        """``(index, ItemError)`` for each item of the batch task ``future``, where it was lost with workers
        (``result``) once more than :data:`LOST_ROUNDS` sendings again allow, so that its items fail alone,
        the others' results kept; else ``None``. (Dask's own ``allowed-failures`` counts only workers that
        die while running a task: data lost afterwards is computed again without end.)"""
        idx = self.where[future.key]
        if not (self._lost_with_workers(idx, result) and any(self._resent[i] >= LOST_ROUNDS for i in idx)):
            return None
        return [(i, ItemError(FutureCancelledError(
            future.key, result.reason,
            f"item {i} of the map was lost with the worker holding it (its batch's result, or the item scattered "
            f"there) after it was sent again {self._resent[i]} times, the most allowed ({LOST_ROUNDS}): workers that "
            f"leave (a nanny restarts a worker that outgrows its memory) lose the items on them")))
            for i in self.finish(future)]

    def _failed_since(self, indices: list[int], status: str) -> bool:
        """Whether an item of ``indices`` given as a future (or computed) took ``status`` since it was submitted."""
        return any(i not in self._failed and i in self._sent and self._sent[i].status == status for i in indices)

    def _each_alone(self, indices: list[int]) -> list[Future]:
        """Each item of ``indices`` in a task of its own, not pinned: Dask places them, and queues them
        on its workers, as ``client.map``'s, so that an item that kills the workers running it fails
        alone (``KilledWorker``), not the items of the tasks pinned beside it."""
        client, func, group, resource, to_host, kwargs = self._submit_args
        label = _label(func)
        futures: list[Future] = []
        with released_on_error(futures):  # (the caller got none of them)
            for i in indices:
                item = self._items[i]
                with dask.annotate(**self._annotations):  # (an item failed already: its ItemError, as in its batch)
                    future = client.submit(run_batch, func, [_failed_inputs([item]).get(0, item)], kwargs, resource,
                                           group, to_host,
                                           key=f"{label}-{ALONE_INFIX}-{uuid.uuid4().hex}")
                if isinstance(item, Future):
                    self._sent[i] = item
                self.where[future.key] = [i]
                self._alone.add(future.key)
                futures.append(future)
        return futures

    def _forget(self, future: Future) -> list[int]:
        """The indices of the items of the batch task ``future``, read or replaced: it is released, its
        items' bookkeeping dropped."""
        release([future])  # (whatever else still holds it, an error's traceback say, Dask need not keep it)
        self._alone.discard(future.key)
        idx = self.where.pop(future.key)
        for i in idx:
            self._sent.pop(i, None)
        return idx

    def finish(self, future: Future) -> list[int]:
        """The indices of the items of the batch task ``future``, which finished and is read now: its items
        (and the futures of those computed or given) are held here no more."""
        idx = self._forget(future)
        for i in idx:
            self._items[i] = None
        return idx

    def close(self) -> None:
        """The run is over (its results read, or stopped early, or by an error): release the futures of the
        items it computed that it still holds, now rather than when the last reference to it goes (an
        error's traceback, which the caller may keep, holds it)."""
        release(self._items[i] for i in self._computed if isinstance(self._items[i], Future))


def _as_finished(run: _Batches) -> Iterator[tuple[int, Any]]:
    """``(index, result or ItemError)`` of ``run``'s items as its batch tasks finish, those that ended for
    want of an item submitted again (:meth:`_Batches.again`); a batch task that failed raises its error,
    but for the one of an item alone that killed the workers that ran it: its ``KilledWorker`` is its ItemError.
    Each batch's results are read when the caller gets to them, one batch at a time, as a loop over
    ``as_completed`` reading ``future.result()`` does: read as soon as they finish (``with_results``),
    several batches' results were sent at once, and a worker holding them spilled (96 results of 32
    MiB in batches of 6, two 1 GiB CPU workers) read them all back to send them and died. A batch read
    is released at once (:func:`_read`). A batch whose worker left after it finished (its result lost,
    computed again) is read after those that finish meanwhile: waiting for it, the reader left them
    unread on workers that paused, full, and so never computed it again (items of 40 MB on two 500 MB
    nanny workers, as ``client.map``'s loop over ``as_completed`` does); so is one lost as its result is
    read (:func:`~dask_octopus._compat.result_unless_lost`). Raises ``RuntimeError`` where the
    client closes meanwhile (another thread closed it)."""
    client = run.client
    done = as_completed(run.take(), loop=client.loop)
    reads: dict[Any, asyncio.Task] = {}  # (result_unless_lost's)
    try:
        while True:
            try:
                future = next_completed(done, lambda: closed(client))
            except StopIteration:
                break
            check_open(client)  # (closed by another thread meanwhile: its futures were cancelled with it)
            try:
                read, result = client.sync(result_unless_lost, future, reads)
            except CancelledError as e:  # (the future's own exception: see _error_of)
                read, result = True, e.with_traceback(None)
            except Exception as e:  # as with_results=True, raise_errors=False
                read, result = True, e
            if not read:  # lost: read once computed again, after those finished meanwhile
                done.add(future)
                continue
            again = run.again(future, result)
            if again is not None:
                done.update(again)
                continue
            yield from _read(run, future, result)
    finally:  # stopped early, or by an error: the tasks not finished are not wanted any more
        pending = _pending(done)
        if pending and not closed(client):  # (a closed client released them all)
            with contextlib.suppress(RuntimeError):  # (closed since: its loop is gone, and so are they)
                cancelled = client.cancel(pending)
                if inspect.isawaitable(cancelled):  # closed on the client's event loop (collected there)
                    client.loop.add_callback(lambda: cancelled)
        _close(run, done)


def _close(run: _Batches, done: as_completed) -> None:
    """Release what ``run``, stopped, holds: the batch tasks that finished but were not read, the items it
    computed."""
    release(done.next_batch(block=False))
    run.close()


def _read(run: _Batches, future: Future, result: Any) -> Iterable[tuple[int, Any]]:
    """``(index, result)`` of the items of the batch task ``future`` of ``run``, read with ``result`` (its
    result, or the exception reading it raised) after :meth:`_Batches.again` passed it: the item of a task
    of one item that killed the workers that ran it (the item ran alone) with its ``KilledWorker`` as its
    :class:`ItemError`, the items of one lost with workers too often with theirs
    (:meth:`_Batches.lost_for_good`); else raises the exception of a batch that failed, or whose result could not be
    sent (not picklable), releasing the batch as one read (:meth:`_Batches._forget`: the error's traceback
    holds it, ``Future.result``'s frames)."""
    if isinstance(result, KilledWorker) and future.status != "finished":
        return list(zip(run.finish(future), [ItemError(result)]))
    if (lost := run.lost_for_good(future, result)) is not None:
        return lost
    if isinstance(result, Exception):
        run._forget(future)  # (released: the error's traceback holds the future)
        raise result
    return zip(run.finish(future), result)  # (finish releases the batch)


def _pending(done: as_completed) -> list[Future]:
    with done.lock:
        return list(done.futures)


async def _imap_async(client: Client, func: Callable, items: list[Any], cost: Any, group: int | None, resource: str,
                      to_host: bool, kwargs: dict[str, Any], errors: str, annotations: Mapping[str, Any],
                      caller: Caller | None) -> AsyncIterator[tuple[int, Any]]:
    if not items:
        return
    run = await asyncio.to_thread(called_from, caller, _Batches, client, func, items, cost, group, resource, to_host,
                                  kwargs, annotations)
    done = as_completed(run.take(), loop=client.loop)
    reads: dict[Any, asyncio.Task] = {}  # (result_unless_lost's)
    try:
        async for future in done:
            try:
                read, result = await result_unless_lost(future, reads)  # read as the caller gets to it (_as_finished)
            except Exception as e:
                read, result = True, e
            if not read:  # (as in _as_finished)
                done.add(future)
                continue
            again = await asyncio.to_thread(called_from, caller, run.again, future, result)
            if again is not None:
                done.update(again)
                continue
            for pair in _checked(_read(run, future, result), errors):
                yield pair
    finally:
        pending = _pending(done)
        if pending:
            await client.cancel(pending)
        _close(run, done)
