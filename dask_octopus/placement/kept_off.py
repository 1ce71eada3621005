"""The tasks that run dask_octopus's code kept off the workers where the worker plugin did not load
(without the package, or with bad settings: such a task fails there), as workers come and go."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from dask_octopus.groups.rewrite import nested_tasks
from dask_octopus.placement.pins import HELD, reschedule

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler, TaskState

_DONE = ("memory", "erred", "forgotten")


def runs_octopus_code(node: Any) -> bool:
    """Whether the run spec ``node`` calls a function of dask_octopus (a fragment task, a guard, a task
    picking a fragment's result, also inline, a ``map`` batch): a worker without the package cannot
    unpickle it."""
    return any(getattr(t.func, "__module__", "").startswith("dask_octopus.") for t in nested_tasks(node))


class KeptOff:
    """Restrictions that keep tasks running dask_octopus's code (:func:`runs_octopus_code`) off the workers
    where the worker plugin did not load (``failed``). A task restricted already (a plan's pin, the user's
    workers) keeps its other workers. One that was not is restricted strictly to ``allowed``, the workers it
    may run on (chosen by the caller), and kept so as they change (:meth:`update`): loosely restricted, Dask's
    work stealing gave it to a failed worker where that one alone was idle. With ``allowed`` ``None`` (no
    other worker), it is not restricted: Dask places it, rather than have it wait for workers that may never
    come. Once no worker has failed, no task is kept off."""

    def __init__(self) -> None:
        self._keys: set[Key] = set()  # the tasks restricted here, that were not restricted
        self._allowed: frozenset[str] | None = None  # their restrictions (one object: compared by identity)

    def add(self, scheduler: Scheduler, keys: Iterable[Key], failed: Collection[str],
            allowed: frozenset[str] | None) -> None:
        """Keep the new tasks of ``keys`` (released, not restricted to hosts, not kept off already) that run
        dask_octopus's code off ``failed``. A task restricted to ``failed`` alone is left as it is."""
        if not failed:
            return
        for key in keys:
            ts = scheduler.tasks.get(key)
            if (key in self._keys or ts is None or ts.state != "released" or ts.host_restrictions
                    or not runs_octopus_code(ts.run_spec)):
                continue
            if ts.worker_restrictions:
                if others := set(ts.worker_restrictions) - set(failed):
                    ts.worker_restrictions = others
                continue
            self._keys.add(key)
            _restrict(ts, self._shared(allowed))

    def adopt(self, scheduler: Scheduler, failed: Collection[str], allowed: frozenset[str] | None,
              now: Collection[str], stimulus_id: str) -> int:
        """:meth:`update`, after the workers ``now`` told that the worker plugin did not load there, keeping
        off also the tasks not restricted and not done that run dask_octopus's code, submitted while no
        worker had failed, and placing again those kept off that were sent to ``now`` (a worker runs no
        task before it set its plugins up). Returns the number of tasks changed."""
        for ts in scheduler.tasks.values():
            if (ts.key not in self._keys and ts.state not in _DONE and not ts.worker_restrictions
                    and not ts.host_restrictions and runs_octopus_code(ts.run_spec)):
                self._keys.add(ts.key)
        return self.update(scheduler, failed, allowed, stimulus_id, now)

    def update(self, scheduler: Scheduler, failed: Collection[str], allowed: frozenset[str] | None,
               stimulus_id: str, sent_to: Collection[str] = ()) -> int:
        """Restrict the tasks kept off to ``allowed`` now, after workers joined or left or told whether the
        worker plugin loaded there; with ``failed`` empty, let them run anywhere and forget them. Those
        waiting in ``no-worker`` are scheduled; those queued (where Dask takes no restriction into account)
        or sent to a worker of ``sent_to`` are released, to be placed again. Tasks held to be split are left
        as they are, and so are tasks done while some are kept off. Returns the number of tasks changed."""
        restrictions = self._shared(allowed) if failed else None
        changed: list[TaskState] = []
        again: dict[Key, str] = {}
        for key in list(self._keys):
            ts = scheduler.tasks.get(key)
            if ts is None:
                self._keys.discard(key)
                continue
            if ts.worker_restrictions == {HELD} or (failed and ts.state in _DONE):
                continue  # (a task done is restricted anew when computed again: released before this runs)
            if ts.worker_restrictions is not restrictions:
                _restrict(ts, restrictions)
                changed.append(ts)
            if restrictions and (ts in scheduler.queued
                                 or (ts.processing_on is not None and ts.processing_on.address in sent_to)):
                again[key] = "released"
        if not failed:
            self._keys.clear()
        if again:
            scheduler.transitions(again, stimulus_id)
        return reschedule(scheduler, changed, stimulus_id)

    def inherit(self, scheduler: Scheduler, key: Key, keys: Iterable[Key], allowed: frozenset[str] | None) -> None:
        """The new tasks ``keys`` run the task ``key``'s work (its parts, as it was split), with its
        restrictions: kept off as it was, restricted to ``allowed`` now."""
        if key not in self._keys:
            return
        for k in keys:
            if (ts := scheduler.tasks.get(k)) is not None:
                self._keys.add(k)
                _restrict(ts, self._shared(allowed))

    def loosen(self, scheduler: Scheduler, stimulus_id: str) -> int:
        """Let the tasks kept off run elsewhere too (loose restrictions) and forget them: the plugin that
        kept them up to date is gone (unregistered). Those waiting in ``no-worker`` are scheduled; returns
        the number of tasks loosened."""
        changed = [ts for key in self._keys if (ts := scheduler.tasks.get(key)) is not None]
        for ts in changed:
            ts.loose_restrictions = True
        self._keys.clear()
        return reschedule(scheduler, changed, stimulus_id)

    def _shared(self, allowed: frozenset[str] | None) -> frozenset[str] | None:
        """``allowed``, as the object the tasks hold where it is equal (a cluster's thousand workers compared
        for each of its hundred thousand tasks at each worker event would hold up the scheduler)."""
        if allowed != self._allowed:
            self._allowed = allowed
        return self._allowed

    def forget(self, key: Key) -> None:
        """The task ``key`` was forgotten."""
        self._keys.discard(key)


def _restrict(ts: TaskState, allowed: frozenset[str] | None) -> None:
    """Restrict ``ts`` strictly to ``allowed`` (one set shared by the tasks: Dask replaces a task's
    restrictions, never changes them in place); ``None``: not at all."""
    ts.worker_restrictions = allowed  # type: ignore[assignment]
    ts.loose_restrictions = False
