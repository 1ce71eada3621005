"""The scheduler plugin: worker profiles, online speed refinement, and block placement.

Modelled on distributed's ``ShuffleSchedulerPlugin`` and ``ActiveMemoryManagerExtension``: it
registers RPC handlers on the scheduler, pushes its worker plugin from :meth:`start`, and is
idempotent (registering it again is a no-op). Errors inside its hooks are logged once per hook
and never reach Dask: the computation then runs with Dask's own placement.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar

from dask.utils import format_bytes, key_split, parse_timedelta
from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps
from tornado.ioloop import PeriodicCallback

from dask_octopus import config
from dask_octopus._checks import is_finite
from dask_octopus._compat import SCHEDULER_LOGGER, add_worker_plugin, drop_unknown_duration, measured_bandwidths
from dask_octopus.dashboard.records import PlanRecord, PlanRecords, WeightHistory
from dask_octopus.groups import scheduler as scheduler_groups
from dask_octopus.groups.collector import collector_paused
from dask_octopus.groups.planning import ANNOTATION
from dask_octopus.groups.rewrite import fragment_of, timing_prefix
from dask_octopus.placement.kept_off import KeptOff
from dask_octopus.placement.pins import MAP_INFIX, Placement
from dask_octopus.placement.planning import reassign
from dask_octopus.placement.replicas import keep_homes, release_homes
from dask_octopus.plugins.messages import DONE_SHARE, NO_WORKERS, Profile, WorkerInfo, malformed, parallel_threads
from dask_octopus.plugins.worker import OctopusWorkerPlugin
from dask_octopus.profiling.gpu_timing import TOPIC as GPU_TIMINGS
from dask_octopus.profiling.itemcosts import ItemCostFit
from dask_octopus.profiling.recent import RecentlyUsed
from dask_octopus.profiling.short_tasks import ShortTasks
from dask_octopus.profiling.speedmodel import SpeedModel, check_resource
from dask_octopus.profiling.working_set import TOPIC as WORKING_SETS
from dask_octopus.profiling.working_set import WorkingSets

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler

logger = logging.getLogger(__name__)
SCHEDULER_LOG = logging.getLogger(SCHEDULER_LOGGER)
F = TypeVar("F", bound=Callable[..., Any])
HELD = (Status.paused, Status.closing_gracefully)  # worker states in which Dask sends a worker no task


def _guarded(func: F) -> F:
    """Run a hook; on error log it once per hook and carry on as if the plugin were absent."""

    @functools.wraps(func)
    def wrapper(self: OctopusSchedulerPlugin, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(self, *args, **kwargs)
        except Exception:
            if func.__name__ not in self.failed_hooks:
                self.failed_hooks.add(func.__name__)
                logger.exception("dask_octopus: %s failed; Dask's default placement applies", func.__name__)
            return None

    return wrapper  # type: ignore[return-value]


RESULT_SIZES = 8  #: map tasks per task prefix whose bytes of result per byte of items are kept
HISTORY_INTERVAL = 1.0  #: seconds between two samples of the weights for the dashboard's history
#: the share of the scheduler's time that working out the weights for the dashboard may take: where it takes
#: longer (64 workers that ran 1000 task prefixes each: 0.1 s), they are worked out less often than asked
HISTORY_SHARE = 0.02
HISTORY_CALLBACK = "octopus-weight-history"  #: the sampler's name in ``Scheduler.periodic_callbacks``
ERROR = "octopus-error"  #: key of a handler's reply that carries a ``ValueError``'s message
#: keys of a handler's reply that waited for calibrations and gave up on some workers: those workers and
#: ``octopus.calibration.wait``, and the reply itself
LATE, REPLY = "octopus-late", "octopus-reply"
#: attribute of a scheduler whose ``--preload dask_octopus`` failed (a bad setting): the error, for clients
PRELOAD_ERROR = "_dask_octopus_preload_error"
NOT_LOADED = "the worker plugin did not load there: "  #: the start of the profile error of such a worker


def remedy(error: str) -> str:
    """What to do about a worker where the worker plugin did not load with ``error``."""
    if error.startswith(("ModuleNotFoundError", "ImportError")):
        return "install dask_octopus in its environment"
    return "fix that worker's setup (its own octopus settings, for one)"


def not_loaded(profiles: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The workers of ``profiles`` where the worker plugin did not load, with the error."""
    return {w: p["error"][len(NOT_LOADED):] for w, p in profiles.items()
            if isinstance(p.get("error"), str) and p["error"].startswith(NOT_LOADED)}


def not_calibrated(profiles: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The workers of ``profiles`` whose calibration failed where the worker plugin loaded, with the error."""
    return {w: p["error"] for w, p in profiles.items()
            if isinstance(p.get("error"), str) and not p["error"].startswith(NOT_LOADED)}


_starts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scheduler -> the lock of its plugins' starts


#: the RPC handlers that the worker plugin calls; the others answer clients' calls
WORKER_CALLS = ("octopus_report", "octopus_not_loaded")


def _forwarding(plugin: OctopusSchedulerPlugin, name: str) -> Callable[..., Any]:
    """The RPC handler ``name`` of ``plugin`` (in its ``_answers``), called through a weak reference to
    ``plugin``: distributed keeps every handler it called for good (``core._expects_comm`` caches them),
    which would keep a plugin unregistered since alive, with its records (one more per unregistering).
    A client's call is answered ``None``, as distributed answers for a handler the scheduler lacks, while
    the plugin is not the one registered (unregistered, and its handlers not yet withdrawn by its
    sampler; or not yet registered, while it calibrates the workers): the client then asks the scheduler
    why (:func:`~dask_octopus.plugins.client.call_scheduler`)."""
    ref = weakref.ref(plugin)
    clients = name not in WORKER_CALLS

    def forward(*args: Any, **kwargs: Any) -> Any:
        plugin = ref()
        if plugin is None or (clients and registered_plugin(plugin.scheduler) is not plugin):
            return None
        return plugin._answers[name](*args, **kwargs)

    forward.__name__ = forward.__qualname__ = name
    return forward


def _to_run(scheduler: Scheduler, keys: Iterable[Any], skip: Collection[Any]) -> Iterator[Any]:
    """The keys of the tasks that Dask runs for the graph that asks for ``keys`` (called in
    ``update_graph``, before Dask's transitions): those released among them and, through released
    tasks, the released tasks they need; not those of ``skip``. A graph computed again while the first
    compute of it runs, or one whose tasks another graph has in memory, runs none of those again."""
    tasks = scheduler.tasks
    stack = [ts for k in keys if (ts := tasks.get(k)) is not None and ts.state == "released"]
    seen = {ts.key for ts in stack}
    while stack:
        ts = stack.pop()
        if ts.key not in skip:
            yield ts.key
        for dts in ts.dependencies:
            if dts.state == "released" and dts.key not in seen:
                seen.add(dts.key)
                stack.append(dts)


def _unheard(**message: Any) -> None:
    """``octopus_report`` and ``octopus_not_loaded`` once no plugin is registered: the worker plugin stays
    on the workers (Dask keeps it), and a worker that joins then sets it up and reports to no one."""


def _replying(handler: F) -> F:
    """The RPC handler ``handler``, replying ``{ERROR: message}`` for a ``ValueError`` (bad input, no
    workers) instead of raising it, which distributed would log on the scheduler as an error with its
    traceback; the client raises it again (:func:`dask_octopus.plugins.client.call_scheduler`)."""

    @functools.wraps(handler)
    def reply(*args: Any, **kwargs: Any) -> Any:
        try:
            return handler(*args, **kwargs)
        except ValueError as e:
            return {ERROR: str(e)}

    return reply  # type: ignore[return-value]


class _Sampler(PeriodicCallback):
    """The weight sampler of ``plugin`` (:meth:`OctopusSchedulerPlugin._sample_weights`, which also retires
    a plugin no longer registered). Its scheduler stops it as it closes, and calls ``close`` only on the
    plugins registered then: one unregistered since its last sample is retired as it stops (else its
    filter of the scheduler's log and its metrics would keep it, and its scheduler, for the process's life)."""

    def __init__(self, plugin: OctopusSchedulerPlugin):
        super().__init__(plugin._sample_weights, HISTORY_INTERVAL * 1000)
        self.plugin = plugin

    def stop(self) -> None:
        super().stop()
        plugin = self.plugin
        if plugin._sampler is self and not plugin._retired and not plugin.registered():
            plugin._sampler = None  # (not dropped from the periodic callbacks, which the scheduler is stopping)
            plugin._retire()


class OctopusSchedulerPlugin(SchedulerPlugin):
    """Profiles workers, refines their speeds from task timings and pins planned blocks.

    Configuration (``octopus.refine.*``, ``octopus.map.item-cost-alpha``, ``octopus.max-plans``,
    ``octopus.calibration.wait``) is read once, here, on the process that makes the plugin, unless given
    as arguments (``item_cost_alpha``, ``confidence_samples``, ``min_duration``, ``max_plans``, checked as
    the settings are); the worker plugin it sends reads ``octopus.calibration.*`` likewise
    (``calibration_seconds``, ``device``).
    """

    name = "octopus"
    idempotent = True

    #: sent to every worker from :meth:`start`
    worker_plugin: OctopusWorkerPlugin
    #: calibration priors refined by task timings
    model: SpeedModel
    #: shorter tasks are dominated by overhead: a prefix mostly that short on a worker does not refine its
    #: speed (seconds)
    min_duration: float
    #: per task prefix and worker, the share of its recent timings shorter than ``min_duration``
    short_tasks: ShortTasks
    #: balance and map plans, and the pins of their tasks
    placement: Placement
    #: per task prefix and worker: the per-item cost fit of ``map`` batches (the ``refine.max-prefixes``
    #: prefixes that ran last)
    item_costs: RecentlyUsed[defaultdict[str, ItemCostFit]]
    #: per task prefix: the bytes of result per byte of items of its recent ``map`` batches (as many prefixes)
    result_sizes: RecentlyUsed[deque[float]]
    #: each live worker's calibration, as its worker plugin reported it
    profiles: dict[str, Profile]
    #: how long planning waits for a worker's calibration report (seconds, ``octopus.calibration.wait``)
    calibration_wait: float
    #: live workers whose report did not come within ``calibration_wait``, or that joined once the worker
    #: plugin was unregistered (not waited for again)
    unreported: set[str]
    #: when each live worker joined (``time.monotonic``; those there when the plugin started: its start)
    joined: dict[str, float]
    #: per balanced input: peak memory of the tasks of its blocks per byte of block
    working_sets: WorkingSets
    #: hooks that raised once (logged once each)
    failed_hooks: set[str]
    #: workers that sent a bad timing (warned once each)
    bad_timings: set[str]
    #: the workers' weights over time, for the dashboard (sampled every second, kept when they change)
    history: WeightHistory
    #: the recent plans as made and the observed finish of their latest run, for the dashboard
    plan_records: PlanRecords
    #: sampling the weights raised once (the history stops; the watch for unregistering goes on)
    history_failed: bool
    scheduler: Scheduler | None

    def __init__(self, calibrate: bool = True, calibration_seconds: float | None = None,
                 device: str | None = None, *, item_cost_alpha: float | None = None,
                 confidence_samples: int | None = None,
                 min_duration: str | float | None = None, max_plans: int | None = None):
        config.check_all()  # (the settings read later too: a bad one fails here, naming its key)
        self.worker_plugin = OctopusWorkerPlugin(calibration_seconds, device, calibrate)
        item_cost_alpha = config.get("map.item-cost-alpha", item_cost_alpha, "item_cost_alpha")
        samples = config.get("refine.confidence-samples", confidence_samples, "confidence_samples")
        self.model = SpeedModel(confidence_samples=samples,
                                significance=config.get("refine.significance"),
                                max_prefixes=config.get("refine.max-prefixes"))
        self.min_duration = parse_timedelta(config.get("refine.min-duration", min_duration, "min_duration"))
        self.short_tasks = ShortTasks(self.model.max_prefixes)
        plans = config.get("max-plans", max_plans, "max_plans")
        self.working_sets = WorkingSets(max_sources=plans)
        self.placement = Placement(plans, measure=self.working_sets.wants)
        self.item_costs = RecentlyUsed(self.model.max_prefixes,
                                       lambda: defaultdict(lambda: ItemCostFit(alpha=item_cost_alpha)))
        self.result_sizes = RecentlyUsed(self.model.max_prefixes, lambda: deque(maxlen=RESULT_SIZES))
        self.profiles = {}
        self.calibration_wait = parse_timedelta(config.get("calibration.wait"))
        self.unreported = set()
        self.joined = {}
        self._started = time.monotonic()
        self._retired = False
        self.failed_hooks = set()
        self.bad_timings = set()
        # fragment tasks to split: the task, its restrictions and why (logged as it is split)
        self.held: dict[Any, tuple[Any, scheduler_groups.Restrictions, str]] = {}
        # map tasks unpinned after a lost worker (Dask places them): the plan whose run counts them
        self.unpinned: dict[Any, str] = {}
        self.sent_fragments = scheduler_groups.SentFragments()  # released as Dask forgets their tasks
        self.kept_off = KeptOff()  # tasks of this package's code kept off workers where the worker plugin did not load
        self.history = WeightHistory()
        self.plan_records = PlanRecords()
        self._sampler: _Sampler | None = None
        self._answers: dict[str, Callable[..., Any]] = {}  # its RPC handlers, by name
        self._handlers: dict[str, Callable[..., Any]] = {}  # those given to the scheduler (_forwarding)
        self.history_failed = False
        self._sampled_for: tuple | None = None  # the workers and calibrations of the last working-out
        self._sampled_clock = -1  # and the speed model's clock then
        self._sampled: tuple[dict[str, tuple[float, float]], dict[str, int]] = ({}, {})
        self._resample_at = 0.0  # (time.monotonic()) not before, to stay within HISTORY_SHARE
        self.scheduler = None
        self._log_filter: scheduler_groups.RegroupedRunSpecs | None = None
        self._adopted: asyncio.Future | None = None  # (held: the start of a plugin installed unstarted)

    async def start(self, scheduler: Scheduler) -> None:
        # Dask looks for a plugin of this name before awaiting start() and adds this one after it: two
        # registrations at once (two clients) both start. One start at a time; a later one that finds
        # the first registered installs nothing, and Dask drops it (the plugin is idempotent)
        async with _starts.setdefault(scheduler, asyncio.Lock()):
            current = registered_plugin(scheduler)
            if current is not None and current is not self:
                # registered with idempotent=False, or under another name, Dask installs it anyway,
                # unstarted, as this returns
                self._adopted = asyncio.ensure_future(self._start_if_installed(scheduler, current))
                return
            await self._start(scheduler)

    async def _start_if_installed(self, scheduler: Scheduler, current: OctopusSchedulerPlugin) -> None:
        """Start this plugin where Dask installed it in place of ``current`` without starting it (a
        registration with ``idempotent=False``): ``current`` retires at its next weight sample, as when
        unregistered. Installed beside ``current``, under another name (``client.register_plugin(plugin,
        name=...)``), it is removed: one scheduler runs one plugin (two would both pin and group tasks)."""
        names = [name for name, p in list(scheduler.plugins.items()) if p is self]
        if not names or self.scheduler is not None:
            return
        if any(p is current for p in list(scheduler.plugins.values())):
            logger.warning("dask_octopus: the scheduler plugin is registered already; the one registered as "
                           "%s is removed", " and ".join(map(repr, names)))
            for name in names:
                scheduler.remove_plugin(name=name)
            return
        await self.start(scheduler)

    async def _start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        if hasattr(scheduler, PRELOAD_ERROR):  # registered after all: what a client hears of it from now on
            delattr(scheduler, PRELOAD_ERROR)
        self._started = time.monotonic()
        self._answers = {
            "octopus_report": self.report,
            "octopus_not_loaded": self.report_not_loaded,
            "octopus_speeds": self._after_calibrations(_replying(self.speeds)),
            "octopus_workers": self._after_calibrations(_replying(self.workers)),
            "octopus_profiles": self._after_calibrations(_replying(self.get_profiles)),
            "octopus_add_plan": _replying(self.add_plan),
            "octopus_bandwidth": self.bandwidth,
        }
        self._handlers = {name: _forwarding(self, name) for name in self._answers}
        scheduler.handlers.update(self._handlers)
        try:
            await self.set_up_workers()
        except BaseException:  # (cancelled: the scheduler closes) no handler of a plugin never registered
            self._retire()
            raise
        # Dask adds this plugin to scheduler.plugins once start() returns, with no await in between (or
        # had, with --preload): from here on it is found there (a sample or a scrape would take it for
        # unregistered during the calibration above), the optimizer may leave it the grouping, and its
        # hooks see what changes
        for address in self.profiles.keys() - scheduler.workers.keys():  # reported, then left meanwhile
            self.remove_worker(scheduler, address, stimulus_id="octopus-start")
        for address, ws in scheduler.workers.items():  # (later changes come as worker-status-change events)
            if ws.status in HELD:
                self.placement.hold(scheduler, address, False, "octopus-start")
        scheduler_groups.hosts.add(self)
        keep_homes(scheduler, self.placement.home)
        self._filter_log(scheduler)
        self._serve()
        self._sampler = _Sampler(self)
        scheduler.periodic_callbacks[HISTORY_CALLBACK] = self._sampler  # the scheduler stops it as it closes
        self._sampler.start()

    async def close(self) -> None:
        self._retire()

    async def set_up_workers(self) -> None:
        """Set this plugin's worker plugin up on every worker (they calibrate, with this plugin's
        options) and on those that join later, replacing the one they have (Dask keeps a worker plugin
        when the scheduler plugin is unregistered: a plugin registered again calibrates them anew). A
        worker that leaves meanwhile is skipped: the others calibrate, and this returns once they did,
        or after :attr:`calibration_wait` seconds (a worker still calibrating then, hung or slow, is
        waited for no more, as :meth:`calibrations` has it). A worker where it does not load (its
        environment lacks dask_octopus, or its own settings are bad) has that error for profile, is
        logged, and is not waited for (:func:`not_loaded`), also where the error comes later."""
        setting_up = asyncio.ensure_future(
            add_worker_plugin(self.scheduler, dumps(self.worker_plugin), self.worker_plugin.name))
        try:
            await asyncio.wait({setting_up}, timeout=self.calibration_wait)
        except BaseException:  # (cancelled: the scheduler closes)
            setting_up.cancel()
            raise
        if setting_up.done():
            self._not_loaded(setting_up.result())  # (its error raised: the plugin does not start)
        else:
            setting_up.add_done_callback(self._set_up_late)

    def _set_up_late(self, setting_up: asyncio.Future) -> None:
        """:meth:`_not_loaded` once the setup that :meth:`set_up_workers` stopped waiting for ends."""
        if setting_up.cancelled() or self._retired:
            return
        if setting_up.exception() is not None:
            logger.error("dask_octopus: setting the worker plugin up failed: %r", setting_up.exception())
        else:
            self._not_loaded(setting_up.result())

    def report_not_loaded(self, worker: str, error: str) -> None:
        """Record that the worker plugin did not set up on ``worker``, with ``error``; called by
        :class:`OctopusWorkerPlugin` (also on a worker that joins after the plugin was registered)."""
        self._not_loaded({worker: error})

    def _not_loaded(self, failed: Mapping[str, str]) -> None:
        """Record the workers still here where the worker plugin failed to set up, with their errors (each
        logged once: the worker and the setup's broadcast may both tell it)."""
        now = set()
        for address, error in failed.items():
            if address in self.scheduler.workers and self.profiles.get(address) != {"error": NOT_LOADED + error}:
                self.profiles[address] = {"error": NOT_LOADED + error}
                logger.warning("dask_octopus: the worker plugin did not load on %s (%s): %s; it gets the mean weight",
                               address, error, remedy(error))
                now.add(address)
        if now:
            self._failed_now(now)

    @_guarded
    def _failed_now(self, workers: Collection[str]) -> None:
        """The tasks of this package's code, and the blocks pinned there, go to other workers than
        ``workers``, which told now that the worker plugin did not load there (the tasks held to be split
        split first, as where a worker left)."""
        stimulus_id = f"octopus-not-loaded-{time.time()}"
        self._split_held(stimulus_id)
        self._keep_off_again(stimulus_id, workers)
        self._rehome(stimulus_id)

    def _after_calibrations(self, handler: F) -> Callable[..., Any]:
        """The RPC handler ``handler``, answering once :meth:`calibrations` returned: a plan made
        while a worker that joined is still calibrating would give it the mean weight."""

        @functools.wraps(handler)
        async def answer(*args: Any, **kwargs: Any) -> Any:
            late = await self.calibrations()
            reply = handler(*args, **kwargs)
            return {LATE: [late, self.calibration_wait], REPLY: reply} if late else reply

        return answer

    async def calibrations(self) -> list[str]:
        """Return once every live worker has reported its calibration (:meth:`report`) or has not for
        :attr:`calibration_wait` seconds since it joined: those are logged and waited for no more (they
        keep the mean weight until they report). Returns at once when this plugin is retired, and waits
        for none where the worker plugin was unregistered (the workers that joined since never got it).
        Returns the workers this call stopped waiting for, as their wait ended."""
        given_up: list[str] = []
        while not self._retired:
            pending = self.scheduler.workers.keys() - self.profiles.keys() - self.unreported
            if pending and self.worker_plugin.name not in self.scheduler.worker_plugins:
                logger.warning("dask_octopus: %s will not report a calibration: the worker plugin %r was "
                               "unregistered (call register to set it up again); they get the mean weight",
                               sorted(pending), self.worker_plugin.name)
                self.unreported |= pending
                return given_up
            now = time.monotonic()
            late = {w for w in pending if now - self.joined.get(w, self._started) >= self.calibration_wait}
            if late:
                logger.warning("dask_octopus: no calibration report from %s within octopus.calibration.wait=%ss "
                               "of joining; they get the mean weight until they report", sorted(late),
                               self.calibration_wait)
                self.unreported |= late
                given_up += sorted(late)
            if pending <= late:
                return given_up
            await asyncio.sleep(0.02)
        return given_up

    def registered(self) -> bool:
        """Whether this plugin is the one registered on its scheduler (Dask closes a plugin when its
        scheduler closes, not when it is unregistered or replaced)."""
        return self.scheduler is not None and registered_plugin(self.scheduler) is self

    def _retire(self) -> None:
        """Stop everything this plugin runs beside Dask's hooks: grouping, its filter of the scheduler's
        log, sampling, its metrics, its policy of the active memory manager and the RPC handlers that are
        still its own (a plugin registered since has its own)."""
        self._retired = True  # (a handler waiting for calibrations answers now)
        scheduler_groups.hosts.discard(self)
        self._filter_log(None)
        self._stop_sampling()
        from dask_octopus.dashboard import serve

        serve.withdraw(self)
        if self.scheduler is not None:
            release_homes(self.scheduler, self.placement.home)
            for name, handler in self._handlers.items():
                if self.scheduler.handlers.get(name) is handler:
                    del self.scheduler.handlers[name]
            for name in WORKER_CALLS:
                self.scheduler.handlers.setdefault(name, _unheard)

    def _filter_log(self, scheduler: Scheduler | None) -> None:
        """Filter the scheduler's log with a :class:`~dask_octopus.groups.scheduler.RegroupedRunSpecs` of
        ``scheduler`` in place of this plugin's filter so far (``None``: none; one filter per plugin)."""
        if self._log_filter is not None:
            SCHEDULER_LOG.removeFilter(self._log_filter)
        self._log_filter = None if scheduler is None else scheduler_groups.RegroupedRunSpecs(scheduler)
        if self._log_filter is not None:
            SCHEDULER_LOG.addFilter(self._log_filter)

    def _serve(self) -> None:
        """Add the ``/octopus`` page and the ``dask_octopus_*`` metrics (optional dependencies: each
        is off, with one log line, when its library is missing); never stops the plugin from starting."""
        try:
            from dask_octopus.dashboard import serve

            serve.install(self)
        except Exception:
            logger.exception("dask_octopus: the /octopus page and the metrics are off")

    def _stop_sampling(self) -> None:
        """Stop this plugin's weight sampler, and drop it from the scheduler's periodic callbacks if it is
        still the one there (a plugin registered after this one has its own under the same name)."""
        if self._sampler is None:
            return
        self._sampler.stop()
        if self.scheduler is not None and self.scheduler.periodic_callbacks.get(HISTORY_CALLBACK) is self._sampler:
            del self.scheduler.periodic_callbacks[HISTORY_CALLBACK]
        self._sampler = None

    def _sample_weights(self) -> None:
        """Add the current weights to :attr:`history` (every :data:`HISTORY_INTERVAL` seconds, as
        :meth:`current_weights` has them), and once the plugin is no longer registered, retire it and
        let its pinned tasks run anywhere."""
        if not self.registered():
            self._retire()
            self.placement.loosen(self.scheduler, "octopus-unregistered")
            self.kept_off.loosen(self.scheduler, "octopus-unregistered")
            return
        if self.history_failed:
            return
        try:
            if self.scheduler.workers:
                self.history.add(time.time(), self.current_weights()[0])
        except Exception:
            self.history_failed = True
            logger.exception("dask_octopus: sampling the weights failed; the dashboard's weight history stops")

    def current_weights(self) -> tuple[dict[str, tuple[float, float]], dict[str, int]]:
        """The live workers' ``(compute, memory)`` weights and their task timings that count, for the
        dashboard (its history, page and Prometheus series): worked out again when the workers or their
        calibrations changed, and when new timings came in, these no more often than
        :data:`HISTORY_SHARE` of the scheduler's time allows (an idle cluster's are not worked out
        again)."""
        workers = sorted(self.scheduler.workers)
        if not workers:
            return {}, {}
        cluster = (workers, sorted((w, sorted(p.items())) for w, p in self.model.priors.items()))
        if cluster != self._sampled_for or (self.model.clock != self._sampled_clock
                                            and time.monotonic() >= self._resample_at):
            start = time.monotonic()
            compute, memory = self.speeds("compute"), self.speeds("memory")
            self._sampled = {w: (compute[w], memory[w]) for w in compute}, self.model.samples()
            self._sampled_for, self._sampled_clock = cluster, self.model.clock
            self._resample_at = start + (time.monotonic() - start) / HISTORY_SHARE
        return self._sampled

    # -- RPC handlers -------------------------------------------------------------------------

    def options(self) -> dict[str, Any]:
        """The options this plugin was registered with (``register`` compares them with its own)."""
        wp = self.worker_plugin
        return {"calibrate": wp.calibrate, "calibration_seconds": wp.seconds, "device": wp.device}

    def report(self, worker: str, profile: Profile) -> None:
        """Store a worker's calibration; called by :class:`OctopusWorkerPlugin` (the plugin loaded there: the
        tasks kept off workers where it did not may run there from now on, :meth:`_keep_off_again`)."""
        if worker not in self.scheduler.workers:
            return  # it left while calibrating
        self._store_profile(worker, profile)
        self._keep_off_again("octopus-report")

    def _store_profile(self, worker: str, profile: Profile) -> None:
        self.unreported.discard(worker)
        why = f"not a mapping: {profile!r}" if not isinstance(profile, Mapping) else malformed(profile)
        if why is not None:  # (the dashboard and the CLI show a profile's fields)
            logger.warning("dask_octopus: ignoring calibration report of %s: %s", worker, why)
            # (a worker without a calibration has reported all the same: it is not waited for)
            self.profiles[worker] = {"error": f"its calibration report was malformed: {why}"}
            self.model.forget_prior(worker)
            return
        self.profiles[worker] = profile
        if profile.get("calibrated") is False:
            return  # registered with calibrate=False: task timings alone set the weights
        if profile.get("error"):
            logger.warning("dask_octopus: worker %s has no calibration (%s); it gets the mean weight "
                           "until task timings refine it", worker, profile["error"])
            return
        try:
            self.model.set_prior(worker, {r: profile[r] for r in ("compute", "memory")})
        except (KeyError, ValueError) as e:
            profile["error"] = f"invalid calibration: {e}"
            logger.warning("dask_octopus: ignoring calibration of %s: %s", worker, e)
            self.model.forget_prior(worker)  # (an earlier calibration of this worker no longer stands)

    def bandwidth(self) -> dict[str, Any]:
        """The scheduler's bandwidth estimates in bytes/s (:mod:`dask_octopus.placement.transfers`):
        ``default``, its overall one, and ``pairs``, ``[sender, receiver, bytes/s]`` for each pair of
        live workers it measured (msgpack sends no tuple keys)."""
        default, pairs = measured_bandwidths(self.scheduler)
        return {"default": default, "pairs": [[sender, receiver, bw] for (sender, receiver), bw in pairs.items()]}

    def speeds(self, resource: str = "compute", prefix: str | None = None) -> dict[str, float]:
        """Relative weights of the live workers for ``resource`` (or for the tasks of ``prefix``
        once every worker ran enough of them), summing to 1."""
        check_resource(resource)
        if not self.scheduler.workers:
            raise ValueError(NO_WORKERS)
        return self.model.weights(self.scheduler.workers, resource, prefix)

    def workers(self, resource: str = "compute", prefix: str | None = None) -> dict[str, WorkerInfo]:
        """Per live worker that takes tasks (not paused nor retiring, unless all are) and has the worker
        plugin (one where it did not load, :func:`not_loaded`, would fail ``map``'s batches; unless it
        failed on all): its weight, as
        :meth:`speeds` gives it, its number of threads, the
        ``(fixed, per_unit)`` seconds per item of ``prefix``'s items there, once fitted
        (:mod:`dask_octopus.profiling.itemcosts`), the units per second observed of ``prefix``, the
        bytes one of its tasks may hold (:func:`~dask_octopus.groups.scheduler.thread_budget`), and the
        largest bytes of result per byte of items of ``prefix``'s recent batches."""
        weights = self.speeds(resource, prefix)
        fits = self.item_costs.get(prefix, {}) if prefix is not None else {}
        rates = self.model.rates.get(prefix, {}) if prefix is not None else {}
        sizes = self.result_sizes.get(prefix) if prefix is not None else None
        result_size = max(sizes) if sizes else None
        out = {}
        # (Dask sends a held worker no task, and its scatter refuses it: items planned there would wait)
        running = {a: ws for a, ws in self.scheduler.workers.items() if ws.status not in HELD}
        for addr, ws in self._loaded(running or self.scheduler.workers).items():
            fit = fits[addr].fit() if addr in fits else None
            rate = rates[addr].value if addr in rates else None
            profile = self.profiles.get(addr, {})
            out[addr] = WorkerInfo(weights[addr], ws.nthreads, parallel_threads(profile, ws.nthreads),
                                   None if fit is None else (fit.fixed, fit.per_unit), rate,
                                   scheduler_groups.thread_budget(ws, profile), result_size, ws.status in HELD)
        return out

    def _not_loaded_here(self) -> set[str]:
        """The live workers where the worker plugin did not load (:func:`not_loaded`)."""
        return not_loaded(self.profiles).keys() & self.scheduler.workers.keys()

    def _loaded(self, workers: Mapping[str, Any]) -> Mapping[str, Any]:
        """``workers`` but those where the worker plugin did not load (:func:`not_loaded`: a ``map`` batch or
        a fragment fails there), unless it loaded on none of them."""
        failed = not_loaded(self.profiles)
        return {a: ws for a, ws in workers.items() if a not in failed} or workers

    def get_profiles(self, resource: str = "compute", source: str | None = None,
                     planning: bool = False) -> dict[str, Profile]:
        """Per live worker: calibration figures, memory, threads, current weight and refining samples,
        and the working set per byte of block learned for the balanced input ``source`` (a key prefix);
        ``planning`` (``balance``): only the workers where the worker plugin loaded (:meth:`_loaded`)."""
        weights = self.speeds(resource)
        working_set = self.working_sets.ratio(source) if source is not None else None
        samples = self.model.samples()
        out = {}
        for addr, ws in (self._loaded(self.scheduler.workers) if planning else self.scheduler.workers).items():
            profile = Profile(**self.profiles.get(addr, {"error": "not calibrated"}))
            if profile.get("device") != "gpu" and ws.memory_limit:
                profile["memory_total"] = profile["memory_free"] = ws.memory_limit
            profile.update(name_on_scheduler=str(ws.name), weight=weights[addr],
                           samples=samples.get(addr, 0), threads=ws.nthreads, working_set=working_set)
            out[addr] = profile
        return out

    def add_plan(self, name: str, workers: list[str], axis: int = 0, costs: list[float] | None = None,
                 counts: list[int] | None = None, stealable: list[bool] | None = None,
                 sizes: list[float] | None = None, resource: str = "compute", source: str | None = None,
                 nbytes: list[float] | None = None, pieces: str | None = None) -> list[str]:
        """Remember a plan: block ``i`` of collection ``name`` goes to ``workers[i]`` (and costs
        ``costs[i]``, for ``counts[i]`` items; another worker may steal it if ``stealable[i]``, but none while a
        worker where the worker plugin did not load is there).
        ``sizes[i]`` (rows) and the weights of ``resource`` now give the dashboard the plan's
        predicted finish per worker (``costs`` when ``sizes`` is not given). A ``balance`` plan names
        its input's key prefix, ``source``, and its blocks' bytes, ``nbytes``: the working sets of
        its tasks are learned for that input; and the key name of its re-chunk's slices of input
        blocks, ``pieces``: each is pinned, loosely, to the workers holding the block it slices when
        that block is in memory as the graph arrives. A ``map`` plan gives the bytes of each task's
        items as ``nbytes`` (without ``source``): the bytes of result per byte of items are learned
        for its prefix. Returns the plan's worker per block, those that left replaced by others (where none
        is left, kept: :meth:`add_worker` moves them to the workers that join)."""
        check_resource(resource)
        if not isinstance(name, str) or not name:
            raise ValueError(f"plan name must be a collection's key name (a non-empty str), got {name!r}")
        if not isinstance(workers, list | tuple) or not workers or not all(isinstance(w, str) for w in workers):
            raise ValueError(f"plan {name} must name a worker address (str) per block, got {workers!r}")
        if isinstance(axis, bool) or not isinstance(axis, int) or axis < 0:
            raise ValueError(f"plan {name} axis must be a non-negative int (the block index's place), got {axis!r}")
        if not set(workers) <= self.scheduler.workers.keys():  # left while the client planned: to the others
            left = sorted(set(workers) - self.scheduler.workers.keys())
            if self.scheduler.workers:
                workers = reassign(workers, self.speeds(resource))
            logger.info("dask_octopus: plan %s names workers that left (%s): their blocks go to the %s",
                        name, ", ".join(left), "others" if self.scheduler.workers else "workers that join")
        for label, values in (("costs", costs), ("counts", counts), ("stealable flags", stealable),
                              ("sizes", sizes), ("block bytes", nbytes)):
            if values is not None and len(values) != len(workers):
                raise ValueError(f"plan has {len(values)} {label} for {len(workers)} blocks")
        if counts is not None and costs is None:
            raise ValueError("plan has item counts without costs")
        if source is not None and nbytes is None:
            raise ValueError("plan has a source without block bytes")
        if stealable is not None and self._not_loaded_here():
            stealable = None  # Dask's work stealing would move a loosely pinned tail there, where batches fail
        self.placement.add_plan(name, workers, axis, costs, counts, stealable, source, nbytes, pieces)
        loads = sizes if sizes is not None else costs if costs is not None else [1.0] * len(workers)
        blocks = Counter(workers)  # a worker runs as many of its blocks at once as its threads (parallel_threads)
        threads = {w: parallel_threads(self.profiles.get(w, {}), ws.nthreads)
                   for w, ws in self.scheduler.workers.items()}
        weights = self.speeds(resource) if self.scheduler.workers else {}
        speeds = {w: v * max(1, min(threads.get(w, 1), blocks[w])) for w, v in weights.items()}
        self.plan_records.add(PlanRecord(name, time.time(), list(workers), [float(x) for x in loads], speeds))
        return list(workers)

    # -- hooks --------------------------------------------------------------------------------

    @_guarded
    def update_graph(self, scheduler: Scheduler, *, tasks: list, keys: set | None = None,
                     annotations: dict | None = None, stimulus_id: str = "octopus-update-graph",
                     **kwargs: Any) -> None:
        if self.placement.reshare:
            self._reshare(stimulus_id)
        pinned = self.placement.update_graph(scheduler, tasks)
        made: dict = {}
        unread = scheduler_groups.unread_tasks(scheduler, tasks, keys or ())
        marks = (annotations or {}).get(ANNOTATION)
        if marks:  # marks that only the scheduler sees (dataframes, collections computed inside annotate)
            with collector_paused():
                made, grouped = scheduler_groups.group_new_tasks(scheduler, tasks, marks, keys or (), self.profiles,
                                                                 set(unread), self.placement.planned_block)
            unread += grouped
            for gkey, members in made.items():
                self.placement.inherit(gkey, members)
        self.sent_fragments.add(scheduler, chain(tasks, made))
        self._keep_off(chain(tasks, made))
        if unread:  # after update_graph: later plugins are still given these keys
            scheduler.loop.add_callback(scheduler_groups.forget_unread, scheduler, unread, stimulus_id)
        if pinned:  # a new run of these plans, for the dashboard: the pinned tasks that will run
            pins = self.placement.pins
            runs: defaultdict[str, list] = defaultdict(list)
            for k in _to_run(scheduler, keys or (), set(unread)):
                if k in pins:
                    runs[pins[k][0]].append(k)
            self.plan_records.restart(runs)

    @_guarded
    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if finish in ("erred", "forgotten"):
            self._record_loss(key)
        if finish == "forgotten":
            self.placement.forget(key)
            self.unpinned.pop(key, None)
            self.kept_off.forget(key)
            self.sent_fragments.forget(key)
        elif finish == "memory" and start == "processing" and "startstops" in kwargs:
            worker = kwargs["worker"]
            self.placement.done(key)
            scheduler_groups.place_readers(self.scheduler, key, worker)
            # each guarded on its own: a failure in one (logged once) leaves the others working
            share = (kwargs.get("metadata") or {}).get(DONE_SHARE, 1.0)  # of its work, where some failed
            if share > 0:
                self._refine(key, worker, kwargs, share)
            if share == 1.0:  # (errors in place of results: no result size)
                self._learn_result_size(key, kwargs.get("nbytes"))
            self._record_finish(key, worker, kwargs["startstops"])
            self._steal_for(worker)
        elif start == "processing" and finish == "released":
            self._hold_if_lost(key)
            self._unpin_if_lost(key)
        if start == "processing" and finish in ("erred", "released"):
            self._drop_unknown_duration(key)
        if finish == "memory":
            self._hold_if_too_large(key)

    @_guarded
    def _drop_unknown_duration(self, key: Any) -> None:
        """Let Dask's work stealing forget a task that stopped running without a result
        (:func:`~dask_octopus._compat.drop_unknown_duration`): a fragment's failed step fails the task that
        reads it as that task runs (Dask fails the dependents of a failed task without running them)."""
        ts = self.scheduler.tasks.get(key)
        if ts is not None:
            drop_unknown_duration(self.scheduler, ts)

    @_guarded
    def _hold_if_lost(self, key: Any) -> None:
        """Hold a fragment task whose worker left while running it, to split it once Dask's transitions of
        this stimulus end (in :meth:`remove_worker`, or soon after where no worker left)."""
        ts = self.scheduler.tasks.get(key)
        if (ts is not None and self.held.get(key, (None,))[0] is not ts
                and (held := scheduler_groups.hold_if_lost(ts)) is not None):
            self._split_later(ts, held, "whose worker left while running it")

    @_guarded
    def _unpin_if_lost(self, key: Any) -> None:
        """Let Dask place a ``map`` task whose worker left while running it, unless it is held to be split
        (:meth:`~dask_octopus.placement.pins.Placement.lost_map_task`)."""
        ts = self.scheduler.tasks.get(key)
        if ts is not None and self.held.get(key, (None,))[0] is not ts and self.placement.lost_map_task(ts):
            self._unpin(ts)

    def _unpin(self, ts: Any) -> None:
        """Let Dask place the pinned task ``ts`` from now on (kept off workers where the worker plugin did
        not load, where it runs this package's code); its plan's run still counts it."""
        block = self.placement.pins.get(ts.key)
        if block is not None and self.placement.unpin(ts):
            self.unpinned[ts.key] = block[0]
            self._keep_off([ts.key])

    def _keep_off(self, keys: Iterable[Any], parent: Any = None) -> None:
        """Keep the new tasks ``keys`` that run this package's code off the workers where the worker plugin
        did not load (:meth:`~dask_octopus.placement.kept_off.KeptOff.add`); those that run the work of
        the task ``parent`` (its parts, as it was split) as it was kept off
        (:meth:`~dask_octopus.placement.kept_off.KeptOff.inherit`)."""
        failed, allowed = self._kept_off_workers()
        if parent is not None:
            keys = list(keys)
            self.kept_off.inherit(self.scheduler, parent, keys, allowed)
        self.kept_off.add(self.scheduler, keys, failed, allowed)

    def _kept_off_workers(self) -> tuple[set[str], frozenset[str] | None]:
        """The live workers where the worker plugin did not load, and those that the tasks kept off them
        may run on: those that told that it loaded there, else (none did yet) any other; ``None`` where
        there is no other (or none is kept off: no worker failed)."""
        failed = self._not_loaded_here()
        if not failed:  # (the usual case, at every graph: no set of the workers made)
            return failed, None
        others = self.scheduler.workers.keys() - failed
        return failed, frozenset(others & self.profiles.keys() or others) or None

    @_guarded
    def _keep_off_again(self, stimulus_id: str, failed_now: Collection[str] = ()) -> None:
        """Keep the tasks kept off workers where the worker plugin did not load off those there are now, on
        the workers there are now (:meth:`~dask_octopus.placement.kept_off.KeptOff.update`), after workers
        joined or left or one told whether it loaded; where some told now that it did not (``failed_now``),
        also the tasks submitted before, and those sent there
        (:meth:`~dask_octopus.placement.kept_off.KeptOff.adopt`)."""
        failed, allowed = self._kept_off_workers()
        if failed_now:
            n = self.kept_off.adopt(self.scheduler, failed, allowed, failed_now, stimulus_id)
        else:
            n = self.kept_off.update(self.scheduler, failed, allowed, stimulus_id)
        if n:
            logger.debug("dask_octopus: %d tasks kept off workers without the worker plugin restricted anew", n)

    @_guarded
    def _hold_if_too_large(self, key: Any) -> None:
        """Hold the fragment tasks that the result ``key`` was the last input of, where their inputs and
        intermediates exceed the budget (:func:`~dask_octopus.groups.scheduler.hold_if_too_large`), to
        split them before they run."""
        ts = self.scheduler.tasks.get(key)
        for dts in ts.dependents if ts is not None else ():
            if dts.state != "waiting" or dts.waiting_on or self.held.get(dts.key, (None,))[0] is dts:
                continue  # not ready to run yet (or held already)
            if (found := scheduler_groups.hold_if_too_large(self.scheduler, dts, self.profiles)) is not None:
                held, estimate, budget = found
                self._split_later(dts, held, f"whose inputs and intermediates ({format_bytes(estimate)}) exceed "
                                             f"octopus.fragments.max-bytes ({format_bytes(budget)} here)")

    def _split_later(self, ts: Any, held: scheduler_groups.Restrictions, why: str) -> None:
        """Split the held fragment task ``ts`` once Dask's transitions of this stimulus end (one callback
        splits all that are held by then)."""
        if not self.held:
            self.scheduler.loop.add_callback(self._split_held, f"octopus-split-fragment-{time.time()}")
        self.held[ts.key] = (ts, held, why)

    def _split_held(self, stimulus_id: str) -> None:
        """Split the held tasks: fragment tasks (:func:`~dask_octopus.groups.scheduler.split_fragment`) and
        ``map`` batch tasks (:func:`~dask_octopus.groups.scheduler.split_batch`); one that cannot be split
        runs again whole, as Dask would run it."""
        while self.held:
            key, (ts, held, why) = self.held.popitem()
            batch = fragment_of(ts.run_spec) is None
            kind, each = ("map batch task", "item") if batch else ("fragment task", "member")
            try:
                if batch:
                    parts = scheduler_groups.split_batch(self.scheduler, ts, held, stimulus_id,
                                                         key in self.placement.pins,
                                                         functools.partial(self._batch_split, key))
                else:
                    parts = scheduler_groups.split_fragment(self.scheduler, ts, held, stimulus_id,
                                                            functools.partial(self._split_made, key))
            except Exception as e:  # raised before anything changed
                (logger.info if isinstance(e, ValueError) else logger.exception)(
                    "dask_octopus: %s %s runs whole: %s", kind, key, e)
                scheduler_groups.run_whole(self.scheduler, ts, held, stimulus_id)
                continue
            if parts:
                logger.info("dask_octopus: %s %s, %s, runs as %d tasks, one per %s", kind, key, why, len(parts), each)

    @_guarded
    def _batch_split(self, key: Any, parts: list) -> None:
        """The ``map`` batch task ``key`` is split into ``parts``, one per item: placed by Dask, they count
        in its plan's run in its place."""
        if (record := self._plan_record(key)) is not None:
            record.split(key, parts)
            self.unpinned.update((k, record.name) for k in parts)
        self._keep_off(parts, key)

    @_guarded
    def _split_made(self, key: Any, parts: list, gatherers: list) -> None:
        """The fragment task ``key`` is split into ``parts`` (and the ``gatherers`` of their results for its
        readers): pinned as it was, the parts count in its run in its place (not as a loss once it is
        forgotten), and their fragments are released as theirs are forgotten."""
        for k in chain(parts, gatherers):
            self.placement.inherit(k, (key,))
        self._keep_off(chain(parts, gatherers), key)  # (also held before a worker told that the plugin did not load)
        self.sent_fragments.add(self.scheduler, parts)
        if (record := self._plan_record(key)) is not None:
            record.split(key, parts)

    @_guarded
    def _refine(self, key: Any, worker: str, kwargs: dict[str, Any], share: float) -> None:
        """Feed a finished task's timing to the speed model, as the seconds that the ``share`` of its work
        done (where some failed) would take: not on workers that report CUDA-event timings, nor on those
        that have not reported yet (a GPU worker's tasks while it calibrates end at launch), nor on GPU
        workers without CUDA-event timings (of several threads: their tasks end at launch)."""
        profile = self.profiles.get(worker)
        if profile is None or profile.get("event_timing") or profile.get("ends_at_launch"):
            return  # CuPy tasks return at launch: this worker reports CUDA-event timings, or its calibration stands
        ts = self.scheduler.tasks.get(key)
        if ts is None:
            return
        computed = [s["stop"] - s["start"] for s in kwargs["startstops"] if s.get("action") == "compute"]
        if not computed:
            return  # it ran nothing here (no compute interval): no timing, not a bad one
        seconds = sum(computed)
        prefix = timing_prefix(ts.prefix.name, ts.run_spec)
        counted = is_finite(seconds, positive=True)  # (bad timings go on to _observe, which warns about them)
        if counted and not self.short_tasks.counts(prefix, worker, seconds < self.min_duration):
            return  # most short tasks: no bytes count
        block = self.placement.one_block_bytes(key)
        if block is not None:  # a task that does one balanced block's work: the block's bytes (what it reads
            units = block  # may be pieces of other blocks, or nothing where the block is made inside it, fused)
        else:
            nbytes = kwargs.get("nbytes")
            units = sum(d.nbytes for d in ts.dependencies if d.nbytes > 0)
            units += nbytes if isinstance(nbytes, int) and nbytes > 0 else 0
        self._observe(worker, key, prefix, units, seconds / share, counted=counted)

    @_guarded
    def _learn_result_size(self, key: Any, nbytes: Any) -> None:
        """Keep the bytes of result per byte of items of a finished ``map`` task ``key``."""
        items = self.placement.items_bytes_of(key)
        if items and isinstance(nbytes, int) and nbytes > 0:
            self.result_sizes.use(key_split(key)).append(nbytes / items)

    @_guarded
    def _steal_for(self, worker: str) -> None:
        """Let ``worker``, which just finished a task, take a stealable task from a busier worker."""
        self.placement.steal_for(self.scheduler, worker)

    def _plan_record(self, key: Any) -> PlanRecord | None:
        """The dashboard's record of the plan task ``key`` is pinned to (or was, :attr:`unpinned`), if kept."""
        block = self.placement.pins.get(key)
        name = block[0] if block is not None else self.unpinned.get(key)
        return self.plan_records.get(name) if name is not None else None

    @_guarded
    def _record_finish(self, key: Any, worker: str, startstops: list[dict]) -> None:
        """Add a finished task pinned to a plan to that plan's observed finish on ``worker``."""
        record = self._plan_record(key)
        computes = [s for s in startstops if s.get("action") == "compute"]
        if record is not None and computes:
            record.observe(worker, min(s["start"] for s in computes), max(s["stop"] for s in computes), key)

    @_guarded
    def _record_loss(self, key: Any) -> None:
        """A task pinned to a plan failed, or was forgotten (unfinished, as a cancelled one): its run
        counts it as lost, so that a run whose tasks all ended shows as ended, not in progress."""
        record = self._plan_record(key)
        if record is not None:
            record.lose(key)

    @_guarded
    def log_event(self, topic: str, msg: Any) -> None:
        if topic == GPU_TIMINGS and msg.get("worker") in self.scheduler.workers:
            for key, prefix, units, seconds in msg["timings"]:
                key = tuple(key) if isinstance(key, list) else key  # msgpack turned tuple keys into lists
                self._observe(msg["worker"], key, prefix, units, seconds)
        elif isinstance(msg, dict) and msg.get("action") == "worker-status-change" and topic in self.scheduler.workers:
            running = msg.get("status") == "running"
            n = self.placement.hold(self.scheduler, topic, running, msg.get("stimulus_id", "octopus-worker-status"))
            if n and running:
                logger.info("dask_octopus: worker %s runs again: %d tasks pinned to it again", topic, n)
            elif n:
                logger.info("dask_octopus: worker %s is %s: %d tasks pinned to it may run elsewhere meanwhile",
                            topic, msg.get("status"), n)
        elif topic == WORKING_SETS:
            for key, peak in msg["samples"]:
                key = tuple(key) if isinstance(key, list) else key
                block = self.placement.measured_block(key)
                if block is not None:
                    self.working_sets.add(block[0], key_split(key), block[1], peak)

    def _observe(self, worker: str, key: Any, prefix: str, units: float, seconds: float,
                 counted: bool = False) -> None:
        """Feed one task timing to the model, where it counts (:mod:`dask_octopus.profiling.short_tasks`;
        ``counted``: found to count already); a planned task's cost (in the user's units, whatever their
        scale) replaces its bytes as work units."""
        if not is_finite(seconds, positive=True):
            if worker not in self.bad_timings:
                self.bad_timings.add(worker)
                logger.warning("dask_octopus: ignoring task timings of %s that are not finite and > 0 "
                               "(got %r for %s)", worker, seconds, prefix)
            return
        if counted or self.short_tasks.counts(prefix, worker, seconds < self.min_duration):
            planned = self.placement.cost_of(key)
            cost, count = planned if planned is not None else (None, None)
            if cost is None and prefix.endswith(f"-{MAP_INFIX}"):
                return  # a map's task whose plan is gone: its bytes would join the rates of its costs
            if cost is None:  # bytes (at least one: a task reading and writing nothing)
                self.model.observe(worker, prefix, max(units, 1), seconds)
            elif cost > 0:  # the user's cost units, any scale (a batch of cost 0 has no rate)
                self.model.observe(worker, prefix, cost, seconds)
            if count is not None:
                self.item_costs.use(prefix)[worker].add(count, cost, seconds)

    @_guarded
    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        try:
            self._split_held(f"octopus-add-worker-{time.time()}")  # before the held tasks are placed again
            self.joined[worker] = time.monotonic()
            if scheduler.workers[worker].status in HELD:  # joined paused (a new worker is "init" until it runs)
                self.placement.hold(scheduler, worker, False, "add-worker")
        finally:
            self._keep_off_again("add-worker")
            self._rehome("add-worker")

    @_guarded
    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str, **kwargs: Any) -> None:
        try:
            self._split_held(stimulus_id)  # before the pins of the worker's blocks move
            self.profiles.pop(worker, None)
            self.unreported.discard(worker)
            self.joined.pop(worker, None)
            self.model.remove(worker)
            self.short_tasks.remove(worker)
            for prefix, fits in list(self.item_costs.items()):
                fits.pop(worker, None)
                if not fits:
                    del self.item_costs[prefix]
            self.bad_timings.discard(worker)
        finally:  # (also after an error above: a task pinned to the worker that left would wait forever)
            self._keep_off_again(stimulus_id)
            self._rehome(stimulus_id)

    @_guarded
    def _reshare(self, stimulus_id: str) -> None:
        """Share again the blocks moved off a worker that left which had started on a survivor as a worker
        joined, computed and forgotten since (:attr:`~dask_octopus.placement.pins.Placement.reshare`),
        before a new graph is pinned (on its own: where it fails, the graph is still pinned and grouped)."""
        self._rehome(stimulus_id)

    def _rehome(self, stimulus_id: str) -> None:
        """Pin the tasks of blocks whose worker left to the workers there are; where that fails, let
        every pinned task run anywhere (Dask's placement), as when the plugin is unregistered."""
        try:
            if self.scheduler.workers:
                n = self.placement.rehome(self.scheduler, dict(self._loaded(self.speeds())), stimulus_id)
                if n:
                    logger.info("dask_octopus: re-pinned %d tasks of blocks whose worker left (or cannot run "
                                "them: the worker plugin did not load there)", n)
        except Exception:
            self.placement.loosen(self.scheduler, stimulus_id)
            raise


def registered_plugin(scheduler: Scheduler) -> OctopusSchedulerPlugin | None:
    """The plugin registered on ``scheduler``: under its own name (``"octopus"``), else under the name it
    was given (``client.register_plugin(plugin, name=...)``); ``None`` where none is."""
    plugin = scheduler.plugins.get(OctopusSchedulerPlugin.name)
    if isinstance(plugin, OctopusSchedulerPlugin):
        return plugin
    return next((p for p in list(scheduler.plugins.values()) if isinstance(p, OctopusSchedulerPlugin)), None)
