"""The transfer model on a live cluster: the bandwidths the scheduler measured, and what moving an
item or a re-chunk's rows costs with them (the math is :mod:`dask_octopus.placement.bandwidth`).

Dask's workers time every fetch of more than 1 MB from a peer and report it with their heartbeats;
the scheduler keeps an average per pair of workers (``Scheduler.bandwidth_workers``, receiver
first) and one over all transfers (``Scheduler.bandwidth``, which starts at
``distributed.scheduler.bandwidth``). The scheduler plugin's ``octopus_bandwidth`` handler sends
them to :func:`bandwidths`; a pair that never moved that much data counts at the overall figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distributed import Client, Future

from dask_octopus.placement.bandwidth import Bandwidths, owner_changes
from dask_octopus.plugins.client import call_scheduler


def bandwidths(client: Client) -> Bandwidths:
    """The cluster's bandwidths now, from the scheduler plugin."""
    reply = call_scheduler(client, "octopus_bandwidth")
    return Bandwidths(reply["default"], {(sender, receiver): bw for sender, receiver, bw in reply["pairs"]})


def item_seconds(client: Client, items: Sequence[Any], nbytes: Sequence[float],
                 workers: Sequence[str]) -> list[list[float]] | None:
    """For each item and worker: the seconds to move the item's data (``nbytes`` of it) there from the
    fastest of the workers that hold it (0 where it is held, for local items, and for futures not
    computed yet or cancelled, which Dask's ``who_has`` refuses); ``None`` when no item is such a
    future, or there is one worker (nothing to choose, no round trip to the scheduler)."""
    at = [i for i, it in enumerate(items) if isinstance(it, Future) and it.status != "cancelled"]
    if not at or len(workers) < 2:
        return None
    who = client.who_has([items[i] for i in at])
    held = [i for i in at if who.get(items[i].key)]  # not computed yet: wherever it runs, it is not moved
    seconds = [[0.0] * len(workers) for _ in items]
    if not held:
        return seconds
    links = bandwidths(client)
    for i in held:
        holders = set(who[items[i].key])
        seconds[i] = [links.fetch_seconds(nbytes[i], holders, w) for w in workers]
    return seconds


def rechunk_seconds(client: Client, workers: Sequence[str], old: Sequence[int], new: Sequence[int],
                    row_bytes: float) -> float:
    """Seconds to move the rows that change worker when ``workers[k]``'s rows go from the ``k``-th
    consecutive range of sizes ``old`` to the ``k``-th of ``new`` (each ``row_bytes`` bytes)."""
    moves = {(workers[i], workers[j]): rows * row_bytes for (i, j), rows in owner_changes(old, new).items()}
    return bandwidths(client).move_seconds(moves) if moves else 0.0
