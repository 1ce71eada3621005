"""Pure transfer model: seconds to move bytes between workers, from measured bandwidths.

No Dask here. A :class:`Bandwidths` holds bytes per second per ``(sender, receiver)`` pair where the
cluster measured one, and one overall figure for every other pair. A worker fetches an item from
the holder with the fastest link to it. Many moves at once (a re-chunk, the inputs fragments fetch)
take as long as the busiest worker needs: each worker sends and receives over its own link, as fast
as its fastest measured pair shows, while different workers move data at the same time.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from dask_octopus._checks import check_finite, is_finite


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second between workers: ``pairs[(sender, receiver)]`` where measured, else
    ``default``. A pair whose figure is not finite and > 0 counts as not measured."""

    default: float
    pairs: Mapping[tuple[Hashable, Hashable], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_finite(self.default, "the default bandwidth")

    def __hash__(self) -> int:  # (equal figures hash alike: a plan priced with them is remembered by them)
        return hash((self.default, frozenset(self.pairs.items())))

    def between(self, sender: Hashable, receiver: Hashable) -> float:
        """Bytes per second from ``sender`` to ``receiver``."""
        measured = self.pairs.get((sender, receiver))
        return float(measured) if is_finite(measured, positive=True) else float(self.default)

    def fetch_seconds(self, nbytes: float, holders: Collection[Hashable], receiver: Hashable) -> float:
        """Seconds for ``receiver`` to get ``nbytes`` from the fastest of ``holders``; 0 when it holds
        them itself or nobody does yet (data still to be computed moves nowhere)."""
        check_finite(nbytes, "bytes to move", positive=False)
        if receiver in holders or not holders:
            return 0.0
        return nbytes / self.between(self.sender(holders, receiver), receiver)

    def sender(self, holders: Collection[Hashable], receiver: Hashable) -> Hashable:
        """The one of ``holders`` (not empty) with the fastest link to ``receiver``; of those as fast, the
        first by name."""
        return min(sorted(holders, key=str), key=lambda h: -self.between(h, receiver))

    def move_seconds(self, moves: Mapping[tuple[Hashable, Hashable], float]) -> float:
        """Seconds for all of ``moves`` (bytes per ``(sender, receiver)``), made at the same time: each
        pair's at its figure, and each worker's sending, and receiving, of its share at the figure of
        its fastest link among them at most (a worker moves data over one link, whose speed Dask's
        figures, made per transfer while others ran, show at their fastest): the longest of those (0
        with nothing to move)."""
        seconds = 0.0
        total: dict[tuple[str, Hashable], float] = {}
        fastest: dict[tuple[str, Hashable], float] = {}
        for (sender, receiver), nbytes in moves.items():
            nbytes, bandwidth = check_finite(nbytes, "bytes to move", positive=False), self.between(sender, receiver)
            seconds = max(seconds, nbytes / bandwidth)
            for end in (("out", sender), ("in", receiver)):
                total[end] = total.get(end, 0.0) + nbytes
                fastest[end] = max(fastest.get(end, 0.0), bandwidth)
        return max([seconds, *(total[end] / fastest[end] for end in total)])


def owner_changes(old: Sequence[int], new: Sequence[int]) -> dict[tuple[int, int], int]:
    """Rows that change worker when worker ``k``'s rows go from the ``k``-th consecutive range of
    sizes ``old`` to the ``k``-th of ``new``: ``{(from, to): rows}`` for ``from != to``, rows > 0."""
    if len(old) != len(new) or sum(old) != sum(new) or any(n < 0 for n in (*old, *new)):
        raise ValueError(f"old {list(old)} and new {list(new)} must be row counts >= 0, one per worker, "
                         "with the same sum")
    old_ends, new_ends = list(accumulate(old)), list(accumulate(new))
    out = {}
    for i, (a_end, a_size) in enumerate(zip(old_ends, old)):
        for j, (b_end, b_size) in enumerate(zip(new_ends, new)):
            shared = min(a_end, b_end) - max(a_end - a_size, b_end - b_size)
            if i != j and shared > 0:
                out[i, j] = shared
    return out
