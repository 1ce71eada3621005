"""Scheduler-side placement of planned blocks and of the tasks that consume only one block.

A *plan* maps the blocks of one collection (its key name, and the position of the block index
in its keys) to workers. When a graph arrives, :meth:`Placement.update_graph` finds each planned
block, also inside tasks that low-level fusion merged (their run spec keeps the inner keys), and
pins it with ``worker_restrictions``; a task whose planned dependencies all sit on one worker
follows them. A block planned as stealable (the tail of a worker's ``map`` items) is pinned loosely,
and :meth:`Placement.steal_for` hands it to a worker that ran out of work (through Dask's work-stealing
protocol, which takes a task only while its worker has not started it); its consumers are left to
Dask, which places them by their data. Tasks with user-set restrictions are never touched. Pins
are kept per key until the task is forgotten, so a lost worker's blocks can be moved to the
survivors.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dask.utils import key_split
from distributed.core import Status

from dask_octopus._compat import expected_duration
from dask_octopus.groups.planning import layer_of
from dask_octopus.groups.rewrite import inner_keys, picks_a_result
from dask_octopus.placement.planning import reassign
from dask_octopus.profiling.working_set import MEASURE

if TYPE_CHECKING:
    from dask.typing import Key
    from distributed.scheduler import Scheduler, TaskState

Block = tuple[str, int]
_DONE = frozenset({"memory", "processing", "erred", "forgotten"})


@dataclass
class Plan:
    """Worker of each block of the collection whose keys are ``(name, *index)``, and optionally the
    planned cost of each block (``map``), which then measures the work of its task, its number of
    items, and whether another worker may steal it."""

    workers: list[str]
    index: int  # position of the block index in the key tuple
    costs: list[float] | None = None
    counts: list[int] | None = None
    stealable: list[bool] | None = None
    source: str | None = None  # a balance plan: the key prefix of the collection it re-blocked
    nbytes: list[float] | None = None  # ... and the bytes of each block (of a map plan: of its items)
    pieces: str | None = None  # ... and the key name of its re-chunk's slices of input blocks
    moved: set[int] = field(default_factory=set)  # blocks moved off workers that left (Placement.rehome)


def _pinnable(ts: TaskState) -> bool:
    """Whether the plugin may pin ``ts``: not run yet, and without restrictions of its own (the user's
    are never touched)."""
    return not (ts.state in _DONE or ts.worker_restrictions or ts.host_restrictions or ts.resource_restrictions)


def _pin_where_held(ts: TaskState) -> bool:
    """Pin ``ts``, a slice of input blocks, loosely to the workers that hold all of them (Dask places a
    group of slices of an input with few blocks as root tasks, wherever a thread is free, and moves
    whole blocks there); if those workers leave, Dask runs it elsewhere, and with work stealing on an
    idle worker may still steal it. False where its inputs are not all held by one worker or where it
    has restrictions of its own."""
    if not _pinnable(ts):
        return False
    holders = [set(d.who_has or ()) for d in ts.dependencies]
    common = set.intersection(*holders) if holders else set()
    if not common:
        return False
    ts.worker_restrictions = {ws.address for ws in common}
    ts.loose_restrictions = True
    return True


def reschedule(scheduler: Scheduler, changed: list[TaskState], stimulus_id: str) -> int:
    """Schedule the tasks among ``changed`` (whose restrictions changed) that wait in ``no-worker``;
    returns how many changed."""
    recs = {ts.key: "processing" for ts in changed if ts in scheduler.unrunnable}
    if recs:
        scheduler.transitions(recs, stimulus_id)
    return len(changed)


RETIRED = 64  #: map plans kept after their tasks went, for the timings that arrive later
MAP_INFIX = "octopus-map"  #: a map's tasks are named ``<function>-octopus-map-<token>`` (their plan's name)
ALONE_INFIX = "octopus-alone"  #: and its items run alone after a lost worker, ``<function>-octopus-alone-...``
HELD = "octopus-held"  #: a worker restriction no worker has: a task kept from running until split


class Placement:
    """Plans, pins and their upkeep; owned by :class:`~dask_octopus.plugins.scheduler.OctopusSchedulerPlugin`."""

    def __init__(self, max_plans: int = 1000, measure: Callable[[str, str, float], bool] | None = None):
        self.max_plans = max_plans
        self.measure = measure  # (input prefix, task prefix, block bytes) -> mark the task for measuring
        self.plans: OrderedDict[str, Plan] = OrderedDict()
        self.pins: dict[Key, Block] = {}
        self._pins_of: Counter[str] = Counter()  # pins per plan name
        self._unpinned: set[str] = set()  # plans given since their last pin was set (their graph to come)
        # the tasks of map plans whose graph came without any pin (the user's restrictions), by key: such a
        # plan retires when Dask forgot them all, as a pinned one with its last pin
        self._unpinned_tasks: dict[Key, str] = {}
        self._unpinned_count: Counter[str] = Counter()
        # map plans gone with their tasks, the latest RETIRED: their costs for timings that come later
        # (a GPU worker sends its tasks' timings every 200 ms, after Dask forgot the tasks)
        self._retired: OrderedDict[str, Plan] = OrderedDict()
        self.stealable_keys: set[Key] = set()
        self.one_block: set[Key] = set()  # the pinned tasks that do the work of one balance block (or read it alone)
        self.held: set[str] = set()  # workers not running (paused, retiring): their pins are loose (hold)
        self._pinned: dict[str, set[Key]] = {}  # the pinned keys by the worker they are pinned to (for hold)
        self._pinned_on: dict[Key, str] = {}
        # data the user scattered (nothing can compute it again) that pinned tasks read: the worker that
        # alone held it as the first of them was pinned (a map's items given as futures)
        self._scattered_home: dict[Key, str] = {}
        # moved blocks that had started on the survivor that took them as a worker joined (rehome): once a
        # task of one is forgotten, ``reshare`` asks to share them again before the next graph is pinned
        self._stayed: set[Block] = set()
        self.reshare = False

    def add_plan(self, name: str, workers: list[str], axis: int = 0, costs: list[float] | None = None,
                 counts: list[int] | None = None, stealable: list[bool] | None = None,
                 source: str | None = None, nbytes: list[float] | None = None, pieces: str | None = None) -> None:
        """Remember that block ``i`` of collection ``name`` belongs on ``workers[i]``; with ``source``
        and the blocks' ``nbytes``, the tasks pinned for it are marked for measuring their working sets;
        the tasks named ``pieces`` (slices of input blocks) run where the blocks they slice are held. Past
        ``max_plans``, the oldest plan whose graph came is dropped (its pins stand), else the oldest."""
        self.plans[name] = Plan(list(workers), 1 + axis, costs, counts, stealable, source, nbytes, pieces)
        self.plans.move_to_end(name)
        self._unpinned.add(name)
        while len(self.plans) > self.max_plans:
            # the oldest whose graph came (its tasks' pins stand without it), before one whose graph is to
            # come (a persist that reached the scheduler after the next plans): its tasks would get no pin
            old = next((n for n in self.plans if n not in self._unpinned), next(iter(self.plans)))
            del self.plans[old]
            self._unpinned.discard(old)

    def cost_of(self, key: Key) -> tuple[float, int | None] | None:
        """The planned cost of the task ``key`` and its number of items (``None`` if not given), if it
        is a block of a plan with costs."""
        plan = self._costed(key)
        if plan is None or plan.costs is None or not isinstance(key, tuple):
            return None
        i = key[plan.index]
        return plan.costs[i], (plan.counts[i] if plan.counts is not None else None)

    def _costed(self, key: Key) -> Plan | None:
        """The plan of ``key``'s collection, also one gone with its tasks lately (their timings come later)."""
        name = layer_of(key)
        return self.plans.get(name) or self._retired.get(name)

    def items_bytes_of(self, key: Key) -> float | None:
        """The bytes of the items of the ``map`` task ``key``, if it is one of a plan of items (with
        counts) that gave its blocks' bytes."""
        plan = self._costed(key)
        if plan is None or plan.counts is None or plan.nbytes is None or not isinstance(key, tuple):
            return None
        return plan.nbytes[key[plan.index]]

    def measured_block(self, key: Key) -> tuple[str, float] | None:
        """The input's key prefix and the bytes of the block of the balance plan that pinned the task
        ``key``, if any."""
        block = self.pins.get(key)
        plan = self.plans.get(block[0]) if block is not None else None
        if plan is None or plan.source is None or plan.nbytes is None or block[1] >= len(plan.nbytes):
            return None
        return plan.source, plan.nbytes[block[1]]

    def one_block_bytes(self, key: Key) -> float | None:
        """The bytes of the block of the balance plan whose work the task ``key`` does, where it does one
        block's work (it is the block, or reads it alone; not a task reading several blocks, nor a
        fragment of several)."""
        found = self.measured_block(key) if key in self.one_block else None
        return None if found is None else found[1]

    def home(self, key: Key) -> str | None:
        """The worker a plan pinned the task ``key`` to, while Dask knows the task (``None`` for a
        stealable block, which may run elsewhere); for data the user scattered that pinned tasks read,
        the worker that alone held it as the first of them was pinned, while Dask knows the data."""
        block = self.pins.get(key)
        if block is None:
            return self._scattered_home.get(key)
        return None if self.stealable(block) else self._pinned_on.get(key)

    def worker_of(self, block: Block) -> str | None:
        plan = self.plans.get(block[0])
        return plan.workers[block[1]] if plan and block[1] < len(plan.workers) else None

    def _loose(self, block: Block, worker: str) -> bool:
        """Whether a task pinned to ``block`` on ``worker`` may run elsewhere too: its block is
        stealable, or the worker is held (:meth:`hold`)."""
        return self.stealable(block) or worker in self.held

    def stealable(self, block: Block) -> bool:
        """Whether ``block``'s plan lets another worker steal it."""
        plan = self.plans.get(block[0])
        return bool(plan and plan.stealable and block[1] < len(plan.stealable) and plan.stealable[block[1]])

    def _planned_blocks(self, key: Key, run_spec: Any) -> Iterator[Block]:
        """The planned blocks whose keys the task ``key`` is, or has fused or grouped into it."""
        if not self.plans:  # (no fused keys to walk then)
            return
        for k in inner_keys(key, run_spec):
            plan = self.plans.get(layer_of(k))
            if plan is not None and isinstance(k, tuple) and len(k) > plan.index:
                yield (layer_of(k), k[plan.index])

    def planned_block(self, key: Key, run_spec: Any) -> Block | None:
        """The first planned block whose key the task ``key`` (run spec ``run_spec``) is, or has fused or
        grouped into it; ``None`` for a task of no plan."""
        return next(self._planned_blocks(key, run_spec), None)

    def update_graph(self, scheduler: Scheduler, keys: Iterable[Key]) -> int:
        """Pin the planned blocks among ``keys`` and the tasks that consume only one worker's blocks,
        and the slices a balance plan cuts them from to the workers holding what they slice (loose
        pins, not kept in :attr:`pins`: a worker that leaves frees them, and :meth:`rehome` does not
        move them).

        Returns the number of tasks pinned.
        """
        if not self.plans:
            return 0
        todo = [scheduler.tasks[k] for k in keys if k in scheduler.tasks]
        pieces = {plan.pieces for plan in self.plans.values() if plan.pieces is not None}
        origin: dict[Key, Block | None] = {}
        owned: dict[Key, int] = {}  # how many planned blocks a task is (fused into it), once looked up
        pinned = 0
        for root in todo:
            stack = [root]
            while stack:  # post-order over the new tasks: dependencies first
                ts = stack[-1]
                if ts.key in origin:
                    stack.pop()
                    continue
                pending = [d for d in ts.dependencies if d.key not in origin and d.key not in self.pins
                           and d.state not in _DONE]
                if pending:
                    stack.extend(pending)
                    continue
                stack.pop()
                origin[ts.key] = block = self._origin(ts, origin, owned)
                if block is not None:
                    pinned += self._pin(ts, block, origin, owned)
                elif layer_of(ts.key) in pieces:
                    pinned += _pin_where_held(ts)
        self._retire_unpinned(todo)
        return pinned

    def _retire_unpinned(self, todo: list[TaskState]) -> None:
        """Follow the tasks (among ``todo``) of the ``map`` plans whose graph came and got no pin (the user's
        own restrictions or resources on every task): no pin would retire such a plan, and it would push
        older plans out (``octopus.max-plans``); it retires when Dask forgot its tasks (:meth:`forget`),
        keeping its costs for their timings until then."""
        waiting = {name for name in self._unpinned if (plan := self.plans.get(name)) and plan.counts is not None}
        if not waiting:  # (most graphs: no map plan waits for its graph)
            return
        came = {}
        for ts in todo:
            if (name := layer_of(ts.key)) in waiting:
                came.setdefault(name, []).append(ts.key)
        for name, keys in came.items():
            if not self._pins_of[name]:
                self._unpinned.discard(name)
                for key in keys:
                    self._unpinned_tasks[key] = name
                self._unpinned_count[name] += len(keys)

    def _origin(self, ts: TaskState, origin: dict[Key, Block | None], owned: dict[Key, int]) -> Block | None:
        if ts.key in self.pins:
            return self.pins[ts.key]
        if not _pinnable(ts):
            return None
        own = list(dict.fromkeys(self._planned_blocks(ts.key, ts.run_spec)))
        owned[ts.key] = len(own)
        if own:
            return own[0]
        found: dict[str | None, Block] = {}
        for dts in ts.dependencies:
            b = origin.get(dts.key) or self.pins.get(dts.key)
            if b is not None and not self.stealable(b):  # a stealable block may run elsewhere
                found.setdefault(self.worker_of(b), b)
        return next(iter(found.values())) if len(found) == 1 else None

    def _blocks_read(self, ts: TaskState, origin: dict[Key, Block | None], owned: dict[Key, int]) -> int:
        """How many planned blocks the task ``ts`` is (fused into it; ``owned`` has the count where
        :meth:`_origin` looked it up) or, failing that, reads."""
        own = owned.get(ts.key)
        if own is None:
            own = len(set(self._planned_blocks(ts.key, ts.run_spec)))
        if own:
            return own
        return len({b for d in ts.dependencies if (b := origin.get(d.key) or self.pins.get(d.key)) is not None})

    def _pin(self, ts: TaskState, block: Block, origin: dict[Key, Block | None], owned: dict[Key, int]) -> bool:
        """Pin ``ts`` to ``block``'s worker; a task that does the work of that one block of a balance
        plan (``origin``: the blocks of the graph's other tasks) is also marked for measuring its
        working set, where ``measure`` wants a sample of its kind."""
        worker = self.worker_of(block)
        if worker is None:
            return False
        self._set_pin(ts.key, block)
        ts.worker_restrictions = {worker}
        self._index(ts.key, worker)
        for dts in ts.dependencies:
            if dts.run_spec is None and dts.key not in self._scattered_home and dts.who_has and len(dts.who_has) == 1:
                self._scattered_home[dts.key] = next(iter(dts.who_has)).address
        plan = self.plans[block[0]]
        one = (plan.source is not None and plan.nbytes is not None  # balance plans only
               and block[1] < len(plan.nbytes) and not picks_a_result(ts.run_spec)
               and self._blocks_read(ts, origin, owned) == 1)
        if one:
            self.one_block.add(ts.key)
        else:
            self.one_block.discard(ts.key)
        if one and self.measure is not None and self.measure(plan.source, key_split(ts.key), plan.nbytes[block[1]]):
            # a new dict: a layer's tasks may share one
            ts.annotations = {**(ts.annotations or {}), MEASURE: True}
        ts.loose_restrictions = self._loose(block, worker)
        if self.stealable(block):
            self.stealable_keys.add(ts.key)
        return True

    def planned_worker(self, key: Key, run_spec: Any) -> str | None:
        """The worker that the task ``key`` (or a task fused into it) is pinned to by a plan, if any
        (``None`` also for a stealable block, which may run elsewhere)."""
        block = self.planned_block(key, run_spec)
        return self.worker_of(block) if block is not None and not self.stealable(block) else None

    def inherit(self, key: Key, members: Iterable[Key]) -> None:
        """Pin the new task ``key``, which does the work of ``members``, with the block of the first of them
        that is pinned (none where none is)."""
        if (member := next((m for m in members if m in self.pins), None)) is not None:
            self._set_pin(key, self.pins[member])
            self._index(key, self._pinned_on.get(member))

    def forget(self, key: Key) -> None:
        """Drop the pin of a task that the scheduler forgot (or the home of scattered data it forgot); a
        ``map`` plan goes with its last pin (its tasks run once: Dask forgot them all)."""
        block = self.pins.pop(key, None)
        self._index(key, None)
        self._scattered_home.pop(key, None)
        self.stealable_keys.discard(key)
        self.one_block.discard(key)
        if block is None:
            self._forget_unpinned(key)
            return
        name = block[0]
        if block in self._stayed:
            self._stayed.discard(block)
            self.reshare = True
        self._pins_of[name] -= 1
        if self._pins_of[name] <= 0:
            del self._pins_of[name]
            plan = self.plans.get(name)
            # (not one given again under this name since, whose graph is to come: a map of the same items)
            if plan is not None and plan.counts is not None and name not in self._unpinned:
                self._retire(name)

    def lost_map_task(self, ts: TaskState) -> bool:
        """Whether ``ts`` is a pinned task of a ``map`` plan that a worker left while running it (Dask counts
        it *suspicious*): :meth:`unpin` it, so that Dask places and queues it from then on, as
        ``client.map``'s tasks, and an item that takes the workers running it down counts its deaths
        against the tasks running beside it, not against every task pinned to its worker (Dask sends a
        worker all its pinned tasks at once: they failed with ``KilledWorker`` together); that first
        death is not counted against it either (most of them did not run)."""
        block = self.pins.get(ts.key)
        plan = self.plans.get(block[0]) if block is not None else None
        return bool(ts.suspicious) and plan is not None and plan.counts is not None

    def unpin(self, ts: TaskState) -> bool:
        """Let Dask place the task ``ts`` from now on, as a task of no plan (its pin forgotten) and count
        the deaths of the workers that run it from then on only (Dask's *suspicious*; a task sent to a
        pinned worker with all the others pinned there counted its death, whether it ran or not);
        ``False`` where it has no pin (restrictions the user gave are never touched)."""
        if ts.key not in self.pins:
            return False
        ts.worker_restrictions, ts.loose_restrictions, ts.suspicious = None, False, 0
        self.forget(ts.key)
        return True

    def _forget_unpinned(self, key: Key) -> None:
        """Retire the unpinned ``map`` plan of ``key`` once Dask forgot its last task."""
        name = self._unpinned_tasks.pop(key, None)
        if name is None:
            return
        self._unpinned_count[name] -= 1
        if self._unpinned_count[name] <= 0:
            del self._unpinned_count[name]
            # (not one given again under this name since: its graph is to come)
            if name in self.plans and name not in self._unpinned and not self._pins_of[name]:
                self._retire(name)

    def _retire(self, name: str) -> None:
        """Keep the ``map`` plan ``name`` among the retired ones only (for its timings that come later)."""
        self._retired[name] = self.plans.pop(name)
        while len(self._retired) > RETIRED:
            self._retired.popitem(last=False)

    def _set_pin(self, key: Key, block: Block) -> None:
        old = self.pins.get(key)
        if old is not None:
            self._pins_of[old[0]] -= 1
        self.pins[key] = block
        self._pins_of[block[0]] += 1
        self._unpinned.discard(block[0])

    def _index(self, key: Key, worker: str | None) -> None:
        """Note that ``key`` is pinned to ``worker`` (``None``: to none any more)."""
        old = self._pinned_on.pop(key, None)
        if old is not None:
            keys = self._pinned[old]
            keys.discard(key)
            if not keys:
                del self._pinned[old]
        if worker is not None:
            self._pinned_on[key] = worker
            self._pinned.setdefault(worker, set()).add(key)

    def done(self, key: Key) -> None:
        """A task finished: it can no longer be stolen."""
        self.stealable_keys.discard(key)

    def steal_for(self, scheduler: Scheduler, thief: str) -> None:
        """If worker ``thief`` has an idle thread, ask for a stealable task that waits on a busier
        worker (one with more tasks than threads) and whose inputs ``thief`` can fetch in less time
        than the task is expected to run: the last in run order of the worker with most waiting.
        Dask's work-stealing extension moves it if its worker has not started it yet; nothing
        happens when work stealing is off."""
        if not self.stealable_keys:
            return
        stealing = scheduler.extensions.get("stealing")
        ws = scheduler.workers.get(thief)
        if stealing is None or ws is None or ws.status != Status.running or len(ws.processing) >= ws.nthreads:
            return
        waiting = [ts for k in self.stealable_keys if (ts := scheduler.tasks.get(k)) is not None
                   and ts.state == "processing" and ts.processing_on not in (None, ws) and ts not in stealing.in_flight
                   and len(ts.processing_on.processing) > ts.processing_on.nthreads
                   and scheduler.get_comm_cost(ts, ws) < expected_duration(scheduler, ts)]
        if waiting:
            ts = max(waiting, key=lambda ts: (len(ts.processing_on.processing) - ts.processing_on.nthreads,
                                              ts.priority))
            stealing.move_task_request(ts, ts.processing_on, ws)

    def rehome(self, scheduler: Scheduler, weights: dict[str, float], stimulus_id: str) -> int:
        """Move blocks planned on workers that left to the live ones, ``weights``: each to the live worker
        that holds its data (a task pinned with it in memory there: Dask's retirement moved it), the
        others by :func:`reassign`.

        Blocks moved so before none of whose tasks has started (none is processing or done: their plan
        waits for its inputs, or has no task in the scheduler now, computed and released or forgotten
        by ``client.restart``) are shared again among the live workers: after a worker left, the
        survivors took its blocks, and a worker that joins before they ran (its nanny restarted it)
        takes its share back; a survivor that took them all would hold all the results, as Dask
        alone spreads the recomputed tasks over the workers that are there when they are ready. Those
        that had started stay, and are shared again once a task of theirs is forgotten, when the next
        graph comes (:attr:`reshare`). Updates the restrictions of the pinned tasks of moved blocks,
        and of those pinned to workers that left under an earlier plan of the same name (unpins those
        of plans dropped since, pinned to no live worker), and reschedules those stuck in
        ``no-worker``. Returns the number of tasks re-pinned or unpinned.
        """
        if not weights:
            return 0
        self.held &= weights.keys()
        self.reshare = False
        moved: set[Block] = set()
        started: set[Block] = set()  # also the other blocks a started task fused or grouped into it
        holder: dict[Block, tuple[float, str]] = {}  # a live worker holding a block's largest task in memory
        for key, block in self.pins.items():
            if (ts := scheduler.tasks.get(key)) is not None and ts.state in _DONE:
                started.add(block)
                started.update(self._planned_blocks(key, ts.run_spec))
                if ts.state == "memory" and ts.who_has and ts.nbytes > holder.get(block, (-1.0, ""))[0]:
                    live = sorted(ws.address for ws in ts.who_has if ws.address in weights)
                    if live:
                        holder[block] = (ts.nbytes, live[0])
        self._stayed = {(name, i) for name, plan in self.plans.items() for i in plan.moved if (name, i) in started}
        for name, plan in self.plans.items():
            again = {i for i in plan.moved if (name, i) not in started}
            if all(w in weights for w in plan.workers) and not again:
                continue
            owners: list[str | None] = []
            for i, w in enumerate(plan.workers):
                if i in again:
                    owners.append(None)
                else:
                    owners.append(w if w in weights else holder.get((name, i), (0.0, None))[1])
            new = reassign(owners, weights)
            changed = {i for i, (a, b) in enumerate(zip(plan.workers, new)) if a != b}
            moved.update((name, i) for i in changed)
            plan.moved |= changed
            plan.workers = new
        repinned: list[TaskState] = []
        for key, block in list(self.pins.items()):
            ts = scheduler.tasks.get(key)
            if ts is None:
                continue
            if block[0] not in self.plans:  # its plan was dropped (octopus.max-plans): no one to move it to
                if ts.worker_restrictions and not ts.worker_restrictions & weights.keys():
                    ts.worker_restrictions = None  # pinned to workers that left: Dask places it, as unplanned
                    self.forget(key)
                else:
                    continue
            elif block in moved or (ts.worker_restrictions and not ts.worker_restrictions & weights.keys()):
                # moved now, or pinned to a worker that left under an earlier plan of the same name (two
                # balance calls of one input that give the same chunks elsewhere share Dask's key names)
                worker = self.worker_of(block)
                ts.worker_restrictions = {worker}
                ts.loose_restrictions = self._loose(block, worker)
                self._index(key, worker)
            else:
                continue
            repinned.append(ts)
        return reschedule(scheduler, repinned, stimulus_id)

    def hold(self, scheduler: Scheduler, worker: str, running: bool, stimulus_id: str) -> int:
        """Follow the status of ``worker``: while it is not running (paused by its memory, retiring),
        the tasks pinned to it that have not run yet may run elsewhere too (loose restrictions; those
        waiting for it in ``no-worker`` are scheduled now), as Dask places unpinned tasks; once it runs
        again, they are pinned to it again (stealable blocks stay loose). Tasks pinned to it meanwhile
        are pinned loosely too. Returns the number of tasks changed."""
        if running:
            self.held.discard(worker)
        else:
            self.held.add(worker)
        changed: list[TaskState] = []
        for key in self._pinned.get(worker, ()):
            ts = scheduler.tasks.get(key)
            if (ts is None or ts.state in ("memory", "erred", "forgotten") or ts.worker_restrictions != {worker}
                    or self.stealable(self.pins[key]) or ts.loose_restrictions == (not running)):
                continue
            ts.loose_restrictions = not running
            changed.append(ts)
        return reschedule(scheduler, changed, stimulus_id)

    def loosen(self, scheduler: Scheduler, stimulus_id: str) -> int:
        """Let every pinned task run elsewhere too (loose restrictions) and forget the pins: the plugin
        that kept them up to date is gone (unregistered), so a pin to a worker that leaves would hold
        its task forever. Those waiting in ``no-worker`` (their worker left) are scheduled; returns
        the number of tasks loosened."""
        changed = []
        for key in self.pins:
            ts = scheduler.tasks.get(key)
            if ts is not None:
                ts.loose_restrictions = True
                changed.append(ts)
        self.pins.clear()
        self.one_block.clear()
        self._pins_of.clear()
        self._unpinned.clear()
        self._unpinned_tasks.clear()
        self._unpinned_count.clear()
        self._pinned.clear()
        self._pinned_on.clear()
        self._scattered_home.clear()
        self.stealable_keys.clear()
        return reschedule(scheduler, changed, stimulus_id)
