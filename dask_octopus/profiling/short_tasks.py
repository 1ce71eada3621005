"""Which task timings teach speeds, given ``octopus.refine.min-duration`` (no Dask here).

Tasks shorter than the minimum are dominated by overhead (scheduling, Python) and say little about a
worker's speed. Dropping each such timing alone cut a fast worker's fastest timings only, where a
prefix's tasks straddle the minimum: of two workers, one twice as fast with tasks of 1-3 ms, the fast
one kept its slow half and weighed 0.607 for 0.667. So a prefix counts on a worker whole, or not at
all: a timing counts when most of the prefix's recent timings there before it (an average weighing each
:data:`SHORT_WEIGHT` against the ones before) were not short, and a worker's first timing of a prefix
when it is not short itself. The decision never looks at the timing it decides (for timings that come
alike, the ones counted are a fair sample of them all).
"""

from __future__ import annotations

from dask_octopus.profiling.recent import RecentlyUsed

SHORT_WEIGHT = 0.5  # weight of the latest timing in a prefix's share of short timings on a worker


class ShortTasks:
    """The share of short timings per task prefix and worker, for the ``max_prefixes`` prefixes used last."""

    def __init__(self, max_prefixes: int):
        self.shares: RecentlyUsed[dict[str, float]] = RecentlyUsed(max_prefixes, dict)

    def counts(self, prefix: str, worker: str, short: bool) -> bool:
        """Whether a timing of ``prefix`` on ``worker``, ``short`` or not, teaches speeds (see the module
        docstring); it joins the share of short timings either way."""
        per_worker = self.shares.use(prefix)
        share = per_worker.get(worker)
        per_worker[worker] = float(short) if share is None else share + SHORT_WEIGHT * (short - share)
        return not short if share is None else share < 0.5

    def remove(self, worker: str) -> None:
        """Forget ``worker``'s shares."""
        for per_worker in self.shares.values():
            per_worker.pop(worker, None)
