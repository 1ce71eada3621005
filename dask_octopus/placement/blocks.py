"""``balance``: re-chunk a Dask array or dataframe into speed-weighted blocks pinned to workers.

The plan is made on the client before the graph is submitted: the scheduler plugin supplies the
workers' current weights and memory, :mod:`dask_octopus.placement.planning` turns them into block sizes,
and the plan (block ``i`` of the new collection -> worker) is sent to the plugin, which pins those
blocks and the tasks that consume only them when the graph arrives.
"""

from __future__ import annotations

import heapq
import math
import numbers
import sys
from collections import Counter
from collections.abc import Collection, Mapping
from typing import Any

import dask
import dask.array as da
import numpy as np
from dask.base import is_dask_collection, tokenize
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.utils import format_bytes, key_split
from distributed import Client, Future

from dask_octopus import config
from dask_octopus._checks import is_count
from dask_octopus._compat import Task, TaskRef
from dask_octopus.placement.planning import (
    PlanningError,
    at_once,
    axis_order,
    block_sizes,
    block_sizes_within,
    check_align,
    kept_groups,
    row_segments,
    snap_cuts,
    worth_moving,
)
from dask_octopus.placement.transfers import rechunk_seconds
from dask_octopus.placement.unfused import UnfusedTask
from dask_octopus.plugins.client import (
    awaitable_on_async_clients,
    call_scheduler,
    release,
    released_on_error,
    wait_for,
    warn_caller,
)
from dask_octopus.plugins.messages import parallel_threads, plannable_memory
from dask_octopus.profiling.speedmodel import check_resource
from dask_octopus.profiling.working_set import MIN_BASIS


def _workers_caps_and_speed(
    client: Client, resource: str, row_bytes: float, source: str,
) -> tuple[list[str], list[float], list[int | None], dict[str, float] | None, list[int], dict[str, int]]:
    """Sorted worker addresses, their weights, how many rows each may hold, the time scale of a pass,
    how many rows each may process at once and each one's threads.

    The time scale is, for ``resource="memory"``, each worker's speed in rows per second, each row
    read once at its calibrated streaming speed; ``None`` for ``"compute"`` (the work per row is not
    known before the graph that consumes the blocks is) or where a worker has no streaming figure.
    The rows a worker may process at once: its memory share divided among its threads and by the
    working set per byte of block learned from earlier runs on blocks of inputs named like this
    one (``source``, a key prefix), and never below :data:`~dask_octopus.profiling.working_set.MIN_BASIS`
    bytes; no limit (``sys.maxsize``) before any such run."""
    profiles = call_scheduler(client, "octopus_profiles", resource=resource, source=source, planning=True)
    workers = sorted(profiles)
    fraction = config.get("balance.memory-fraction")
    caps: list[int | None] = []
    limits: list[int] = []
    for w in workers:
        p = profiles[w]
        memory = plannable_memory(p)
        caps.append(int(memory * fraction // row_bytes) if memory is not None and row_bytes > 0 else None)  # 0: full
        ratio = p.get("working_set")
        # never below the smallest block whose working set is learned: tasks of smaller ones are not measured
        limits.append(max(math.ceil(MIN_BASIS / row_bytes), int(memory * fraction / (ratio * p.get("threads", 1)
                                                                                      * row_bytes)))
                      if memory and ratio and row_bytes > 0 else sys.maxsize)
    streams = [profiles[w].get("memory") for w in workers]
    rates = ({w: v / row_bytes for w, v in zip(workers, streams)}
             if resource == "memory" and row_bytes > 0 and all(streams) else None)
    threads = {w: parallel_threads(profiles[w], profiles[w].get("threads") or 1) for w in workers}
    return workers, [profiles[w]["weight"] for w in workers], caps, rates, limits, threads


def _plan(client: Client, total: int, nbytes: float, resource: str, per_worker: int | None, align: int,
          current: list[int], source: str, holders: list[str | None],
          axis: int = 0) -> tuple[list[int], list[str], float, dict[str, int | None]]:
    """Flat block sizes, the worker of each block, the bytes of a row and the rows each worker may hold
    (``None``: no cap known); the ``current`` sizes, each
    block on the worker that holds it (``holders``, None where not known; unless every block's holder
    is a profiled worker, the workers' sorted order is used instead), when moving data to the
    planned ones would not shorten the predicted makespan by ``octopus.balance.min-gain`` or, where a
    pass's time can be predicted (``resource="memory"``), by more seconds than moving the rows that
    change worker takes at the cluster's measured bandwidths. The workers take consecutive ranges in
    the order the rows they hold lie along the axis, so a re-chunk moves only the rows that change
    share. Without ``per_worker``, as few blocks per worker as keep every block within the largest
    current one and within what the worker can process at once (the working set learned for
    ``source``); with it, a warning where a block is not. ``axis`` names the rows in errors."""
    row_bytes = nbytes / total if total else 0.0
    workers, weights, caps, rates, limits, threads_of = _workers_caps_and_speed(client, resource, row_bytes, source)
    _check_fits(caps, total, nbytes, row_bytes, "")
    kept = _without_small(workers, weights, caps, limits, (per_worker or 1) * align, row_bytes)
    if len(kept[0]) < len(workers):  # what is left must fit too
        _check_fits(kept[2], total, nbytes, row_bytes, " (of those that can hold a block)")
    workers, weights, caps, limits = kept
    if per_worker is None and total < len(workers):  # fewer rows than workers: the fastest take one each
        fastest = sorted(heapq.nlargest(max(total, 1), range(len(workers)), key=weights.__getitem__))
        workers, weights, caps, limits = ([seq[i] for i in fastest] for seq in (workers, weights, caps, limits))
        if total == 0:  # nothing to cut: one empty block
            return [0], workers, row_bytes, dict(zip(workers, caps))
    if total < len(workers) * (per_worker or 1):
        one = total == 1
        rows = ("row" if one else "rows") if axis == 0 else f"entr{'y' if one else 'ies'} along axis {axis}"
        counted = f"{len(workers)} worker{'' if len(workers) == 1 else 's'}"
        raise PlanningError(f"{total} {rows} {'is' if one else 'are'} fewer than the {counted} x "
                            f"per_worker={per_worker or 1} blocks")
    index = {w: i for i, w in enumerate(workers)}
    held = [index.get(h) for h in holders]
    if None in held:  # a block not in memory, or on a worker without a profile: the workers' own order
        held = [None] * len(held)
    order = axis_order(held, current, len(workers))
    workers, weights, caps, limits = ([seq[i] for i in order] for seq in (workers, weights, caps, limits))
    rank = {w: r for r, w in enumerate(order)}
    held = [None if h is None else rank[h] for h in held]
    # a worker's weight is one thread's speed: it runs its blocks on as many threads at once as it has, or
    # as it has blocks where fewer
    threads = [threads_of[w] for w in workers]
    single = sum(weights)
    speed = None if rates is None else sum(rates[w] for w in workers)  # (of the workers planned on)
    if per_worker is None:
        plan = block_sizes_within(total, weights, [min(max(current), n) for n in limits], align=align, caps=caps,
                                  threads=threads)
        per_worker = len(current) // len(workers)  # the current blocks, if kept: this many per worker
        weights = at_once(weights, threads, [max(1, per_worker)] * len(workers))
        reference = _plan_or_none(total, weights, per_worker, align, caps) if len(current) % len(workers) == 0 else None
    else:
        weights = at_once(weights, threads, [per_worker] * len(workers))
        plan = reference = block_sizes(total, weights, per_worker=per_worker, align=align, caps=caps)
        _warn_over_working_set(workers, plan, limits, row_bytes, source)
    if speed is not None:  # (one thread each: the speed of the threads that run the kept blocks at once)
        speed *= sum(weights) / single
    groups = kept_groups(held, len(workers), per_worker)
    keepable = groups is not None and all(len(g) == per_worker for g in groups)
    keepable = keepable and all(n % align == 0 for n in current[:-1])  # kept blocks must also honour align
    if reference and keepable:
        kept = [[current[b] for b in g] for g in groups]
        fits = all(c is None or sum(k) <= c for k, c in zip(kept, caps))
        fits = fits and all(max(k, default=0) <= n for k, n in zip(kept, limits))
        move = 0.0
        if fits and speed is not None:  # the kept blocks' rows per worker against the plan's
            move = rechunk_seconds(client, workers, [sum(k) for k in kept], [sum(blocks) for blocks in plan], row_bytes)
        if fits and not worth_moving(kept, reference, weights, config.get("balance.min-gain"), speed=speed,
                                     move_seconds=move):
            owner = {b: workers[i] for i, g in enumerate(groups) for b in g}
            return list(current), [owner[b] for b in range(len(current))], row_bytes, dict(zip(workers, caps))
    return ([s for blocks in plan for s in blocks], [w for w, blocks in zip(workers, plan) for _ in blocks], row_bytes,
            dict(zip(workers, caps)))


class WorkingSetWarning(UserWarning):
    """``balance(..., per_worker=k)`` makes blocks larger than a worker can process at once, by the
    working set learned from earlier runs on blocks of the same input."""


def _check_fits(caps: list[int | None], total: int, nbytes: float, row_bytes: float, which: str) -> None:
    """Raise ``PlanningError`` where the workers' ``caps`` (rows; ``None``: unknown) hold fewer than ``total``
    rows (``which`` says which workers they are, after "the workers' memory")."""
    if all(c is not None for c in caps) and sum(caps) < total:
        fraction = config.get("balance.memory-fraction")
        raise PlanningError(
            f"the collection ({format_bytes(nbytes)}) does not fit in the workers' memory{which}: they can "
            f"hold {format_bytes(sum(caps) * row_bytes)} at octopus.balance.memory-fraction={fraction}; "
            "add workers or process it in pieces"
        )


def _without_small(workers: list[str], weights: list[float], caps: list[int | None], limits: list[int],
                   minimum: int, row_bytes: float) -> tuple[list[str], list[float], list[int | None], list[int]]:
    """The workers (with their weights, caps and limits) that can hold ``minimum`` rows (their blocks'
    fewest), with a warning naming those left out, which get no blocks; ``PlanningError`` where none can."""
    small = [i for i, c in enumerate(caps) if c is not None and c < minimum]
    if not small:
        return workers, weights, caps, limits
    fraction = config.get("balance.memory-fraction")
    largest = max(caps[i] for i in small)  # (every cap is known here: the others are small)
    if len(small) == len(workers):
        raise PlanningError(
            f"no worker can hold its fewest rows ({minimum}, {format_bytes(minimum * row_bytes)}): the largest "
            f"share is {format_bytes(largest * row_bytes)} at octopus.balance.memory-fraction={fraction}; "
            "lower per_worker or align, or add memory")
    for i in small:
        warn_caller(
            f"balance: {workers[i]} can hold {format_bytes(caps[i] * row_bytes)} of this collection at "
            f"octopus.balance.memory-fraction={fraction}, less than its fewest rows ({minimum}, "
            f"{format_bytes(minimum * row_bytes)}): it gets no blocks")
    keep = [i for i in range(len(workers)) if i not in small]
    return ([workers[i] for i in keep], [weights[i] for i in keep], [caps[i] for i in keep],
            [limits[i] for i in keep])


def _warn_over_working_set(workers: list[str], plan: list[list[int]], limits: list[int], row_bytes: float,
                           source: str) -> None:
    """Warn where ``per_worker`` gives a worker blocks larger than it can process at once."""
    over = [(w, max(blocks), n) for w, blocks, n in zip(workers, plan, limits) if max(blocks) > n]
    if over:
        w, rows, n = over[0]
        warn_caller(
            f"balance: blocks of {format_bytes(rows * row_bytes)} on {w} are larger than the "
            f"{format_bytes(n * row_bytes)} it can process at once: earlier tasks on blocks of "
            f"{source!r} needed more memory per byte of block; leave per_worker=None to size blocks by it",
            WorkingSetWarning)


def _plan_or_none(total: int, weights: list[float], per_worker: int, align: int,
                  caps: list[int | None]) -> list[list[int]] | None:
    """The plan with ``per_worker`` blocks each, or None where none can be made."""
    try:
        return block_sizes(total, weights, per_worker=per_worker, align=align, caps=caps)
    except PlanningError:
        return None


@awaitable_on_async_clients
def balance(collection: Any, *, client: Client | None = None, axis: int = 0, per_worker: int | None = None,
            resource: str = "compute", align: int = 1) -> Any:
    """Same collection and values, in blocks sized by the workers' speeds and pinned to them.

    Arrays are re-chunked along ``axis`` (task-based rechunk; other axes keep their chunks),
    dataframes and series by rows. When the existing blocks are already close to the plan
    (predicted makespan within ``octopus.balance.min-gain``), they are kept and only pinned: no
    data moves. The scheduler plugin pins each block, and the tasks that consume only it, to the
    planned worker. Needs :func:`dask_octopus.register` on the client's scheduler.

    Parameters
    ----------
    collection
        A dask array (NumPy or CuPy blocks), dataframe or series.
    client
        The client of the cluster (default: the default client).
    axis
        The array axis to split by speed (dataframes: 0, rows).
    per_worker
        Blocks per worker. ``None``: for each worker, the fewest that keep each of its blocks within
        the collection's largest block along ``axis``, so that no worker is asked to hold a block
        larger than the user's own; with fewer rows than workers, one row each on the fastest
        workers (with ``align`` above 1, an error: a row is not a multiple of it), and no rows
        make one empty block.
    resource
        Weights to plan by: ``"compute"`` or ``"memory"``.
    align
        Block sizes are multiples of it (the last block also takes the remainder).

    Returns
    -------
    collection
        The same type and values, re-chunked (or only renamed) and planned. Each worker's share
        respects its memory (``octopus.balance.memory-fraction`` of device memory on GPU workers,
        of the memory limit on CPU workers).

    Raises
    ------
    TypeError
        When ``collection`` is not a dask array, dataframe or series.
    ValueError
        For a bad ``axis``, ``per_worker``, ``resource``, or unknown chunk sizes.
    PlanningError
        When there are fewer rows than the blocks ``per_worker`` asks for, ``align`` is not an
        integer >= 1 or is larger than a share, or the collection does not fit in the workers' memory.
    NotRegisteredError
        When the scheduler has no dask_octopus plugin.

    Examples
    --------
    >>> x = dask_octopus.balance(x, axis=0)  # doctest: +SKIP
    >>> (x @ w).sum(axis=1).persist()  # doctest: +SKIP
    """
    check_resource(resource)
    if not is_dask_collection(collection):
        raise TypeError(f"balance expects a dask array or dataframe, got {type(collection).__name__}")
    if per_worker is not None and not is_count(per_worker):
        raise ValueError(f"per_worker must be an integer >= 1 or None, got {per_worker!r}")
    per_worker = None if per_worker is None else int(per_worker)
    check_align(align)
    align = int(align)  # (4.0 passes the check: block sizes must be integers)
    if isinstance(collection, da.Array):
        return _balance_array(collection, client, axis, per_worker, resource, align)
    import dask.dataframe as dd

    if isinstance(collection, dd.Index):  # (a dask Index is a Series too: refused before any work)
        raise TypeError("balance supports dask arrays, dataframes and series, not a dask Index: "
                        "balance the dataframe or series it indexes")
    if isinstance(collection, (dd.DataFrame, dd.Series)):
        if axis != 0:
            raise ValueError(f"dataframes are balanced by rows: axis must be 0, got {axis!r}")
        return _balance_frame(collection, client, per_worker, resource, align)
    raise TypeError(f"balance supports dask arrays, dataframes and series, not {type(collection).__name__}")


def _balance_array(x: da.Array, client: Client, axis: int, per_worker: int | None, resource: str,
                   align: int) -> da.Array:
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise ValueError(f"axis must be an integer, got {axis!r}")
    axis = int(axis)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis!r} is out of range for a {x.ndim}-d array")
    axis %= x.ndim
    if any(math.isnan(c) for chunks in x.chunks for c in chunks):
        raise ValueError("the array has unknown chunk sizes (NaN, e.g. after boolean indexing): "
                         "call x.compute_chunk_sizes() first")
    source = key_split(x.name)
    slabs: list[list[Any]] = [[] for _ in x.chunks[axis]]  # the persisted blocks of each slab along axis
    layer = x.__dask_graph__().layers.get(x.name) if isinstance(x.__dask_graph__(), HighLevelGraph) else None
    if isinstance(layer, MaterializedLayer):  # a persisted array: its own layer holds its futures (an
        for f in layer.values():  # array built on top of one is not looked through: that would materialize it)
            if isinstance(f, Future) and isinstance(f.key, tuple) and f.key[0] == x.name:
                slabs[f.key[1 + axis]].append(f)
    holders, held = _holders(client, slabs)
    sizes, workers, row_bytes, _ = _plan(client, x.shape[axis], x.nbytes, resource, per_worker, align,
                                         list(x.chunks[axis]), source, holders, axis)
    chunks = list(x.chunks)
    chunks[axis] = tuple(sizes)
    pieces = None
    if tuple(sizes) == x.chunks[axis]:
        y = _named_blocks(x, axis, workers)
    else:
        y, pieces = _pieces_cut_where_held(x.rechunk(tuple(chunks), method="tasks"), axis, held, workers,
                                           numpy=isinstance(x._meta, np.ndarray))
    call_scheduler(client, "octopus_add_plan", name=y.name, workers=workers, axis=axis, sizes=sizes,
                   resource=resource, source=source, nbytes=[n * row_bytes for n in sizes], pieces=pieces)
    return y


def aligned(block: Any) -> Any:
    """``block``, or a copy of it where its data does not start at a multiple of its item size: a
    piece of a re-chunk that arrived from another worker is a view into the received message at
    whatever offset it had there, and NumPy's matrix products then leave BLAS for a loop several
    times slower (``x.T @ x`` on a balanced block: 5x). Arrays without that flag (CuPy) are returned
    as they are."""
    return block if getattr(getattr(block, "flags", None), "aligned", True) else np.require(block, requirements="A")


def _pieces_cut_where_held(y: da.Array, axis: int, held: Mapping[Any, Collection[str]], workers: list[str],
                           numpy: bool) -> tuple[da.Array, str | None]:
    """The re-chunked ``y``, ready to run where its inputs are, and the key name of its slices of input
    blocks (``None`` if it has none), which the plan has the scheduler run where those blocks are held.

    Dask's rechunk makes a block that is one piece of an input block an alias of a slice (a view).
    Such blocks pass through :func:`aligned` (all of them for ``numpy`` blocks); where the block is
    planned (``workers``, per block along ``axis``) on a worker that does not hold its input block
    (``held``: the workers holding each input block now, by key), its slice becomes an
    :class:`~dask_octopus.placement.unfused.UnfusedTask`: low-level fusion would otherwise merge it into
    the block's task, pinned to the planned worker, and the whole input block would move there. Blocks
    joined from several pieces are new arrays already. Same keys, so the plan pins the same tasks."""
    from dask_octopus._compat import Alias, Task, TaskRef

    graph = y.__dask_graph__()
    layer = dict(graph.layers[y.name])
    for k in dask.core.flatten(y.__dask_keys__()):
        node = layer.get(k)
        if not isinstance(node, Alias):
            continue
        piece = layer.get(node.target)  # None: the alias names a whole input block
        inputs = list(piece.dependencies) if isinstance(piece, Task) else []
        away = len(inputs) == 1 and bool(held.get(inputs[0])) and workers[k[1 + axis]] not in held[inputs[0]]
        if away:
            layer[node.target] = UnfusedTask(piece.key, piece.func, *piece.args, **piece.kwargs)
        if numpy or away:  # a task, not an alias: Dask would collapse an alias and its slice into one task
            layer[k] = Task(k, aligned, TaskRef(node.target))
    old = graph.layers[y.name]
    layers = {**graph.layers, y.name: MaterializedLayer(layer, annotations=old.annotations,
                                                        collection_annotations=old.collection_annotations)}
    slices = {k[0] for k in layer if isinstance(k, tuple) and k[0] != y.name}
    pieces = slices.pop() if len(slices) == 1 else None
    return da.Array(HighLevelGraph(layers, graph.dependencies), y.name, y.chunks, meta=y._meta), pieces


def _holders(client: Client, slabs: list[list[Any]]) -> tuple[list[str | None], dict[Any, tuple[str, ...]]]:
    """For each slab of blocks (futures) along the axis, the worker holding most of them (None for a
    slab with none in memory), and the workers holding each block in memory, by key; blocks still
    being computed (``balance(x.persist())``) are waited for: where they will be held is not known before."""
    futures = [f for slab in slabs for f in slab]
    wait_for(client, futures)
    who = client.who_has(futures) if futures else {}
    out: list[str | None] = []
    for slab in slabs:
        counts = Counter(ws[0] for f in slab if (ws := who.get(f.key)))
        out.append(counts.most_common(1)[0][0] if counts else None)
    return out, {k: tuple(ws) for k, ws in who.items() if ws}


def _named_blocks(x: da.Array, axis: int, workers: list[str]) -> da.Array:
    """``x`` under a new name, one alias task per block: a layer that blockwise fusion cannot
    swallow, so the plan can find its blocks (inside low-level fused tasks too). The name is that of
    the plan (the blocks along ``axis`` on ``workers``): ``x`` balanced along another axis, or on other
    workers, is another collection with its own plan."""
    from dask.highlevelgraph import HighLevelGraph

    from dask_octopus._compat import Alias

    name = "octopus-blocks-" + tokenize(x, axis, workers)
    layer = {(name, *k[1:]): Alias((name, *k[1:]), k) for k in dask.core.flatten(x.__dask_keys__())}
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[x])
    return da.Array(graph, name, x.chunks, meta=x._meta)


def _take_rows(bounds: tuple[tuple[int, int], ...], *parts: Any) -> Any:
    """Concatenate the rows ``bounds[i]`` (start, stop) of each partition ``parts[i]`` (pandas or cuDF,
    through Dask's concat dispatch)."""
    from dask.dataframe.methods import concat

    taken = [p.iloc[a:b] for p, (a, b) in zip(parts, bounds, strict=True)]
    return taken[0] if len(taken) == 1 else concat(taken)


def _rows_and_bytes(part: Any) -> tuple[int, int]:
    """Rows and bytes of a partition (pandas or cuDF, frame or series)."""
    usage = part.memory_usage(deep=True)
    return len(part), int(usage.sum() if hasattr(usage, "sum") else usage)


def _run_at(part: Any, row: int) -> tuple[int, int, Any, Any] | None:
    """The run of index values equal to the one at ``row`` of a partition: its ``(start, stop)`` rows,
    that value and the value after the run (None at the partition's end); None when the index is
    not sorted (pandas or cuDF)."""
    index = part.index
    if not index.is_monotonic_increasing:
        return None
    value = index[row]
    start, stop = int(index.searchsorted(value, side="left")), int(index.searchsorted(value, side="right"))
    return start, stop, value, index[stop] if stop < len(index) else None


def _balance_frame(df: Any, client: Client, per_worker: int | None, resource: str, align: int) -> Any:
    """Rows in the planned partitions, cut from the input's partitions computed once. With known
    divisions, each cut between new partitions moves to the nearer end of the run of equal index
    values it falls in, so that the divisions stay known: a partition then differs from the plan by
    less than the runs at its two cuts (the plan's balance is kept to within one run of equal
    values); where the nearer end would put the worker before the cut over its memory cap, the cut
    moves to the farther end. Divisions become unknown only when moving a cut would empty a partition,
    pass another cut or leave a worker over its cap."""
    # Planning needs each partition's rows, so the partitions are computed now, once: the balanced
    # collection is cut from these futures (which it keeps alive) instead of computing the input a
    # second time; an input already persisted is only read. But first, the plugin and a worker must be
    # there (NotRegisteredError, ValueError): the input is not computed for nothing, or waited for forever.
    call_scheduler(client, "octopus_speeds", resource=resource)
    parts: list[Future] = []
    with released_on_error(parts):  # the caller got none of them
        parts.extend(client.compute(df.to_delayed()))
        return _cut_frame(client, df, parts, per_worker, resource, align)


def _gather_once(client: Client, futures: list[Future]) -> list[Any]:
    """The results of ``futures``, which are released then, also where one of them failed."""
    try:
        return client.gather(futures)
    finally:
        release(futures)


def _cut_frame(client: Client, df: Any, parts: list[Future], per_worker: int | None, resource: str,
               align: int) -> Any:
    """:func:`_balance_frame` once the partitions ``parts`` of ``df`` are computing: a frame of tasks
    (``dd.from_graph``, as Dask's ``persist`` makes; Dask's ``from_delayed`` frames fail its array
    conversions: ``to_dask_array``, ``.values``) reading the futures ``parts``, which its graph holds
    under their keys: the tasks read them by key (a future in a task's arguments is one in the scheduler's
    log of the messages it sent, for 1,000 messages more, in the client's process where ``LocalCluster``
    runs the scheduler: the partitions stayed in memory that long)."""
    import dask.dataframe as dd

    shapes = _gather_once(client, client.map(_rows_and_bytes, parts, pure=False))
    lengths = [n for n, _ in shapes]
    source = key_split(df._name)
    holders, held = _holders(client, [[p] for p in parts])
    sizes, workers, row_bytes, caps = _plan(client, sum(lengths), float(sum(b for _, b in shapes)), resource,
                                            per_worker, align, lengths, source, holders)
    divisions = None
    if df.known_divisions:
        snapped, divisions = _snapped(client, df, parts, lengths, sizes, workers, caps)
        if all(n % align == 0 for n in snapped[:-1]):
            sizes = snapped
        else:  # a cut on an index boundary would break align: the planned sizes, divisions unknown
            divisions = None
    segments = row_segments(lengths, sizes)
    token = tokenize(df, sizes, workers, held)  # where the partitions are decides which blocks read slices
    name, pieces = "octopus-rows-" + token, "octopus-slice-" + token
    wanted = Counter()  # rows of each partition that each worker's blocks take
    for j, seg in enumerate(segments):
        for i, a, b in seg:
            wanted[i, workers[j]] += b - a
    layer: dict[Any, Task | Future] = {}
    for j, seg in enumerate(segments):
        bounds, reads = [], []
        for i, a, b in seg:
            # the rows another worker takes of a partition, when not all of it, are cut where it is held
            where = held.get(parts[i].key, ())
            layer[parts[i].key] = parts[i]
            if where and workers[j] not in where and wanted[i, workers[j]] < lengths[i]:
                layer[pieces, j, i] = Task((pieces, j, i), _take_rows, ((a, b),), TaskRef(parts[i].key))
                bounds.append((0, b - a))
                reads.append(TaskRef((pieces, j, i)))
            else:
                bounds.append((a, b))
                reads.append(TaskRef(parts[i].key))
        if not reads:  # a kept empty partition: no rows, its columns
            part = parts[min(j, len(parts) - 1)]
            layer[part.key] = part
            bounds, reads = [(0, 0)], [TaskRef(part.key)]
        layer[name, j] = Task((name, j), _take_rows, tuple(bounds), *reads)
    call_scheduler(client, "octopus_add_plan", name=name, workers=workers, axis=0, sizes=sizes, resource=resource,
                   source=source, nbytes=[n * row_bytes for n in sizes], pieces=pieces)
    keys = [(name, j) for j in range(len(segments))]
    return dd.from_graph(layer, df._meta, divisions or (None,) * (len(keys) + 1), keys, "octopus-balance")


def _snapped(client: Client, df: Any, parts: list, lengths: list[int], sizes: list[int], workers: list[str],
             caps: dict[str, int | None]) -> tuple[list[int], list | None]:
    """Sizes whose cuts sit on index value boundaries and the divisions they give; the planned sizes
    and None when a cut cannot move (see :func:`snap_cuts`: nor put a worker of ``workers``, one per
    block, over its ``caps``) or a partition's index is not sorted.

    Old partition edges are boundaries already (a value never spans two partitions of known
    divisions); where empty partitions sit at one, each cut there takes the next of their divisions
    (the input's own, which are unique, as Dask requires). For the other cuts, one small task per cut
    on the partition holding it, all computed in one round trip."""
    from bisect import bisect_left, bisect_right
    from itertools import accumulate

    from dask import delayed

    ends = list(accumulate(lengths))
    starts = [*(e - n for e, n in zip(ends, lengths)), ends[-1]]  # and the end, as a partition to come
    where = []  # (old partition, row in it) of the first row after each cut
    taken = 0  # the last old partition edge (by the partition it starts) that a cut took
    for cut in accumulate(sizes[:-1]):
        i = bisect_right(ends, cut)  # the first partition ending after the cut (not empty), or the end
        if cut == starts[i]:  # on an edge: the first one there that no cut took (none left: the last one)
            i = min(i, bisect_left(starts, cut, lo=taken + 1))
        taken = i
        where.append((i, cut - starts[i]))
    inner = [(i, r) for i, r in where if r > 0]
    found = _gather_once(client, client.compute([delayed(_run_at)(parts[i], r) for i, r in inner])) if inner else []
    if any(f is None for f in found):
        return sizes, None
    runs, firsts, found = [], [], iter(found)
    for i, r in where:
        if r == 0:
            runs.append((starts[i], starts[i]))
            firsts.append({starts[i]: df.divisions[i]})
            continue
        start, stop, value, after = next(found)
        runs.append((starts[i] + start, starts[i] + stop))
        firsts.append({starts[i] + start: value, starts[i] + stop: df.divisions[i + 1] if after is None else after})
    new = snap_cuts(sizes, runs, workers, caps)
    if new is None:
        return sizes, None
    cuts = accumulate(new[:-1])
    return new, [df.divisions[0], *(first[cut] for first, cut in zip(firsts, cuts)), df.divisions[-1]]
