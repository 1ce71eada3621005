"""The tasks that run dask_octopus's code kept off the workers where the worker plugin did not load
(without the package, or with bad settings: such a task fails there), as workers come and go."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from dask_octopus.groups.rewrite import nested_tasks
from dask_octopus.placement.pins import reschedule

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, TaskState


def runs_octopus_code(node: Any) -> bool:
    """Whether the run spec ``node`` calls a function of dask_octopus (a fragment task, a guard, a task
    picking a fragment's result, also inline, a ``map`` batch): a worker without the package cannot
    unpickle it."""
    return any(getattr(t.func, "__module__", "").startswith("dask_octopus.") for t in nested_tasks(node))


class KeptOff:
    """Restrictions that keep tasks running dask_octopus's code (:func:`runs_octopus_code`) off the workers
    where the worker plugin did not load. A task restricted already (a plan's pin, the user's workers) keeps
    its other workers. One that was not is restricted strictly to every other live worker, and kept so as
    workers join and leave (:meth:`update`): loosely restricted, Dask's work stealing gave it to such a worker
    when that one alone was idle. Where only such workers are left, it is not restricted (Dask places it,
    rather than have it wait for workers that may never come); once none is left, no task is kept off."""

    def __init__(self) -> None:
        self._keys: set[Key] = set()  # the tasks restricted here, that were not restricted

    def add(self, scheduler: Scheduler, keys: Iterable[Key], failed: Collection[str]) -> None:
        """Keep the new tasks of ``keys`` (released, not restricted to hosts) that run dask_octopus's code
        off ``failed``, the live workers where the worker plugin did not load. A task restricted to
        ``failed`` alone is left as it is."""
        if not failed:
            return
        for key in keys:
            ts = scheduler.tasks.get(key)
            if ts is None or ts.state != "released" or ts.host_restrictions or not runs_octopus_code(ts.run_spec):
                continue
            if ts.worker_restrictions:
                if allowed := set(ts.worker_restrictions) - set(failed):
                    ts.worker_restrictions = allowed
                continue
            self._keys.add(key)
            _restrict(scheduler, ts, failed)

    def update(self, scheduler: Scheduler, failed: Collection[str], stimulus_id: str) -> int:
        """Restrict the tasks kept off to the live workers but ``failed`` (where the worker plugin did not
        load; a worker that joined and has not told is taken to have it), after workers joined or left or
        one told that it did not load; with ``failed`` empty, let them run anywhere and forget them. Those
        waiting in ``no-worker`` are scheduled; returns the number of tasks changed."""
        changed = []
        for key in list(self._keys):
            ts = scheduler.tasks.get(key)
            if ts is None:
                self._keys.discard(key)
                continue
            before = ts.worker_restrictions
            _restrict(scheduler, ts, failed)
            if ts.worker_restrictions != before:
                changed.append(ts)
        if not failed:
            self._keys.clear()
        return reschedule(scheduler, changed, stimulus_id)

    def inherit(self, scheduler: Scheduler, key: Key, keys: Iterable[Key], failed: Collection[str]) -> None:
        """The new tasks ``keys`` run the task ``key``'s work (its parts, as it was split), with its
        restrictions: kept off ``failed`` as it was, restricted to the live workers but those now."""
        if key not in self._keys:
            return
        for k in keys:
            if (ts := scheduler.tasks.get(k)) is not None:
                self._keys.add(k)
                _restrict(scheduler, ts, failed)

    def forget(self, key: Key) -> None:
        """The task ``key`` was forgotten."""
        self._keys.discard(key)


def _restrict(scheduler: Scheduler, ts: TaskState, failed: Collection[str]) -> None:
    """Restrict ``ts`` strictly to the live workers but ``failed``; where there are none, or ``failed`` is
    empty, not at all."""
    ts.worker_restrictions = (scheduler.workers.keys() - set(failed)) or None if failed else None
    ts.loose_restrictions = False
