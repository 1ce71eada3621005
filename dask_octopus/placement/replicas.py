"""Dask's active memory manager, told where planned blocks live.

A task on another worker that reads a block leaves a copy there; Dask's ``ReduceReplicas`` policy
later drops one of the two, from the worker whose memory is fuller, which may be the block's planned
worker: the block then lives elsewhere, the next compute's pinned task fetches it back, and the
policy drops a copy again. :class:`ReduceReplicasOffHome` is that policy with one
change: it drops a pinned task's copies on other workers than the one its plan pinned it to, and the
copies of data the user scattered that pinned tasks read on other workers than the one that alone held
it as the first of them was pinned (:meth:`~dask_octopus.placement.pins.Placement.home`), while that
worker runs (paused or retiring, Dask drops the copy there first, as it would).
:func:`keep_homes` puts it in place of the scheduler's ``ReduceReplicas`` (the user's configuration of
the active memory manager stands otherwise: its interval, its measure, whether it runs, other
policies); :func:`release_homes` puts Dask's back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from distributed.active_memory_manager import ReduceReplicas, Suggestion
from distributed.core import Status

if TYPE_CHECKING:
    from dask.typing import Key
    from distributed.active_memory_manager import ActiveMemoryManagerPolicy, SuggestionGenerator
    from distributed.scheduler import Scheduler


class ReduceReplicasOffHome(ReduceReplicas):
    """``ReduceReplicas`` whose drops spare the copy on the worker ``home(key)`` names (``None``: any)."""

    def __init__(self, home: Callable[[Key], str | None]):
        self.home = home

    def run(self) -> SuggestionGenerator:
        suggestions = super().run()
        chosen = None
        while True:
            try:
                suggestion = suggestions.send(chosen)
            except StopIteration:
                return
            chosen = yield self._off_home(suggestion)

    def _off_home(self, suggestion: Suggestion) -> Suggestion:
        ts = suggestion.ts
        home = self.home(ts.key)
        if suggestion.op != "drop" or home is None or ts.who_has is None:
            return suggestion
        at_home = self.manager.scheduler.workers.get(home)
        if at_home not in ts.who_has or at_home.status != Status.running:
            # not at home (lost there, or moved), or home paused or retiring: Dask chooses, and drops the
            # copy there first (a retiring worker's RetireWorker counts the copy elsewhere as its move)
            return suggestion
        others = ts.who_has - {at_home}
        candidates = others if suggestion.candidates is None else others & suggestion.candidates
        return Suggestion("drop", ts, candidates)


def keep_homes(scheduler: Scheduler, home: Callable[[Key], str | None]) -> None:
    """Put a :class:`ReduceReplicasOffHome` asking ``home`` in place of the scheduler's ``ReduceReplicas``
    (or of an earlier one of these); nothing where the active memory manager is not on the scheduler or
    its configured policies leave ``ReduceReplicas`` out."""
    _replace(scheduler, lambda p: type(p) in (ReduceReplicas, ReduceReplicasOffHome),
             lambda: ReduceReplicasOffHome(home))


def release_homes(scheduler: Scheduler, home: Callable[[Key], str | None]) -> None:
    """Put Dask's ``ReduceReplicas`` back in place of the :class:`ReduceReplicasOffHome` asking ``home``
    (none where a later :func:`keep_homes` replaced it)."""
    _replace(scheduler, lambda p: isinstance(p, ReduceReplicasOffHome) and p.home == home, ReduceReplicas)


def _replace(scheduler: Scheduler, old: Callable[[ActiveMemoryManagerPolicy], bool],
             new: Callable[[], ActiveMemoryManagerPolicy]) -> None:
    """Put one policy ``new()`` in place of the active memory manager's policies that are ``old``, if any."""
    amm = scheduler.extensions.get("amm")
    found = [p for p in list(getattr(amm, "policies", ())) if old(p)]
    for policy in found:
        amm.policies.discard(policy)
    if found:
        amm.add_policy(new())
