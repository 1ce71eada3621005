"""Working sets of balanced blocks: the peak memory a task needs per byte of its block, learned from
the tasks that ran, so that the next ``balance`` of the same input makes blocks a worker can process.

A block that fits in memory may need several times its size while a task works on it (an FFT's work
areas, an expression's temporaries). The scheduler plugin marks the tasks it pins for a ``balance``
plan (the :data:`MEASURE` annotation): the blocks and the tasks that consume only them, with Dask's
fusion often one task that makes the block and uses it. On the worker, :class:`WorkingSetMeter`
measures the peak memory allocated while such a task runs: CuPy's allocations on GPU workers
(:class:`CupyPeak` wraps the current CuPy allocator and counts the bytes held), the process's peak
resident set on CPU workers (:class:`RssPeak`, Linux's ``VmHWM`` reset per task). It sends the
task's working set, its inputs plus that peak, to the scheduler as ``octopus-working-sets`` events
(from :data:`MIN_PEAK` bytes). A task that ran while another task ran in the same process is not
reported: their peaks cannot be told apart. On the scheduler, :class:`WorkingSets` keeps the recent
working sets per byte of the task's block for each balanced input, by the key prefix of its
collection (blocks of at least :data:`MIN_BASIS` bytes: smaller ones do not bound a plan and their
peaks are mostly page and allocator granularity).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from distributed import Worker

logger = logging.getLogger(__name__)

TOPIC = "octopus-working-sets"  #: worker -> scheduler events: ``{"worker": ..., "samples": [(key, peak)]}``
MEASURE = "octopus-measure"  #: annotation the scheduler plugin sets on the tasks to measure
MIN_PEAK = 2**20  #: smaller working sets are not reported
MIN_BASIS = 16 * 2**20  #: working sets of tasks of smaller blocks are not learned


class Peak(Protocol):
    """Peak memory allocated since :meth:`start`."""

    def start(self) -> None:
        """Begin a measurement: the peak is reset to what is held now."""

    def extra(self) -> int:
        """Bytes allocated at the peak since :meth:`start`, above what was held then."""


def _status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                name, value = line.split(":")
                out[name] = int(value.split()[0]) * 1024
    return out


class RssPeak:
    """The process's peak resident set: Linux resets ``VmHWM`` to the current RSS when ``5`` is written
    to ``/proc/self/clear_refs``."""

    def __init__(self) -> None:
        self.baseline = 0

    @staticmethod
    def available() -> bool:
        """Whether this process can reset and read its peak resident set (Linux)."""
        try:
            return os.access("/proc/self/clear_refs", os.W_OK) and "VmHWM" in _status()
        except OSError:
            return False

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.baseline = _status()["VmRSS"]

    def extra(self) -> int:
        return max(_status()["VmHWM"] - self.baseline, 0)


class _Held:
    """Keeps one allocation of the wrapped allocator and counts it down when CuPy lets it go."""

    __slots__ = ("inner", "meter", "nbytes")

    def __init__(self, meter: CupyPeak, inner: Any, nbytes: int):
        self.meter, self.inner, self.nbytes = meter, inner, nbytes

    def __del__(self) -> None:
        self.meter.release(self.nbytes)


class CupyPeak:
    """Bytes held through CuPy's allocator, and their peak, while measuring; one per process
    (:meth:`shared`), since wrapping a wrapper of the same kind would recurse.

    Wraps the allocator current when a measurement starts (CuPy's pool, or RMM's where dask-cuda set
    it up) with :meth:`malloc`. Outside a measurement the wrapper hands the inner allocation back
    unchanged (one Python call more per allocation); during one it returns it inside an
    ``UnownedMemory`` whose owner counts the bytes down when CuPy frees the array, from whichever
    thread. Allocations made under a thread's own allocator (CuPy's ``using_allocator``, as in CUDA
    graph capture) are not seen. :meth:`close` puts the inner allocator back when the last meter
    that shares it closes.
    """

    _process: CupyPeak | None = None

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.inner = None
        self.lock = threading.RLock()
        self.measuring = False
        self.held = self.peak = self.baseline = 0
        self.users = 0

    @classmethod
    def shared(cls) -> CupyPeak:
        """This process's instance, with one more user (each :meth:`close` removes one)."""
        if cls._process is None:
            cls._process = cls()
        cls._process.users += 1
        return cls._process

    def _wrap(self) -> None:
        current = self.cupy.cuda.get_allocator()
        if current != self.malloc:  # first use, or something (RMM's setup) replaced the wrapper
            self.inner = current
            self.cupy.cuda.set_allocator(self.malloc)

    def malloc(self, size: int) -> Any:
        """Allocate ``size`` bytes with the inner allocator, counted while measuring."""
        ptr = self.inner(size)
        if not self.measuring or size == 0:
            return ptr
        cuda = self.cupy.cuda
        owner = _Held(self, ptr, size)
        with self.lock:
            self.held += size
            self.peak = max(self.peak, self.held)
        return cuda.MemoryPointer(cuda.UnownedMemory(ptr.ptr, size, owner, ptr.device_id), 0)

    def release(self, nbytes: int) -> None:
        """An allocation counted by :meth:`malloc` was freed."""
        with self.lock:
            self.held -= nbytes

    def start(self) -> None:
        self._wrap()
        with self.lock:
            self.baseline = self.peak = self.held
        self.measuring = True

    def extra(self) -> int:
        self.measuring = False
        with self.lock:
            return max(self.peak - self.baseline, 0)

    def close(self) -> None:
        """One user less; the last puts the wrapped allocator back (allocations still held keep
        their owners)."""
        self.users = max(self.users - 1, 0)
        if self.users:
            return
        self.measuring = False
        if self.inner is not None and self.cupy.cuda.get_allocator() == self.malloc:
            self.cupy.cuda.set_allocator(self.inner)
        if type(self)._process is self:
            type(self)._process = None


class _Measurement:
    __slots__ = ("inputs", "key", "tainted")

    def __init__(self, key: Any, inputs: int):
        self.key, self.inputs, self.tainted = key, inputs, False


_meters: weakref.WeakSet[WorkingSetMeter] = weakref.WeakSet()  # the meters of this process's workers


def _taint_all() -> None:
    """Leave the measurements running in this process unreported: their peaks mix with another's."""
    for meter in list(_meters):
        if meter.current is not None:
            meter.current.tainted = True


class WorkingSetMeter:
    """Measures the marked tasks of one worker and reports them to the scheduler plugin.

    Parameters
    ----------
    worker
        The worker whose task transitions :meth:`transition` is given.
    peak
        How to measure: :class:`CupyPeak` on GPU workers, :class:`RssPeak` on CPU workers.
    """

    def __init__(self, worker: Worker, peak: Peak):
        self.worker = worker
        self.peak = peak
        self.current: _Measurement | None = None
        _meters.add(self)

    def transition(self, key: Any, start: str, finish: str) -> None:
        """Start measuring a marked task that begins executing alone in this process (no other task
        running, seceded or not, nor data arriving); report it when it finishes in memory without
        another task having run beside it or data having arrived meanwhile."""
        if finish == "executing":
            self._started(key)
        elif finish == "flight":  # data arriving for a task to come: the peak would count it
            _taint_all()
        elif start == "executing" and self.current is not None and self.current.key == key:
            m, self.current = self.current, None
            peak = m.inputs + self.peak.extra()
            if finish == "memory" and not m.tainted and peak >= MIN_PEAK:
                self.worker.log_event(TOPIC, {"worker": self.worker.address, "samples": [(key, peak)]})

    def _started(self, key: Any) -> None:
        _taint_all()  # another task beside theirs: their peaks would mix
        ts = self.worker.state.tasks.get(key)
        if ts is None or not (ts.annotations or {}).get(MEASURE):
            return
        meters = list(_meters)
        alone = (all(t is ts for meter in meters for t in meter.worker.state.executing)
                 and not any(meter.worker.state.long_running or meter.worker.state.in_flight_tasks
                             for meter in meters))
        if not alone:
            return
        try:
            self.peak.start()
        except OSError as e:  # /proc not writable after all: this task goes unmeasured
            logger.debug("dask_octopus: cannot measure the working set of %r: %r", key, e)
            return
        self.current = _Measurement(key, sum(d.nbytes or 0 for d in ts.dependencies))

    def close(self) -> None:
        """Stop measuring (the worker plugin's teardown)."""
        if self.current is not None:  # (a shared CupyPeak that other workers keep would go on measuring)
            self.current = None
            self.peak.extra()
        _meters.discard(self)
        if isinstance(self.peak, CupyPeak):
            self.peak.close()


class WorkingSets:
    """Recent working sets per byte of block, per balanced input (the key prefix of its collection) and
    per task prefix of the tasks measured on its blocks: many light tasks of one kind (aliases,
    replayed CUDA graphs, whose allocations go to the graph's own pool) do not push the heavy kind's
    samples out.

    Parameters
    ----------
    window
        Samples kept per input and task prefix; :meth:`ratio` is the largest of them all.
    max_sources
        Inputs remembered (the least recently measured dropped first).
    max_prefixes
        Task prefixes remembered per input (likewise).
    """

    def __init__(self, window: int = 16, max_sources: int = 1000, max_prefixes: int = 32):
        self.window = window
        self.max_sources = max_sources
        self.max_prefixes = max_prefixes
        self.ratios: OrderedDict[str, OrderedDict[str, deque[float]]] = OrderedDict()
        # how many tasks of each input and prefix were offered to wants() (least recently asked dropped)
        self.asked: OrderedDict[tuple[str, str], int] = OrderedDict()

    def wants(self, source: str, prefix: str, block: float) -> bool:
        """Whether to measure a task of prefix ``prefix`` on a block of ``block`` bytes of ``source``:
        never below :data:`MIN_BASIS` bytes (not learned); the first ``window`` tasks of that input and
        prefix while its window of samples is not full; then one in ``window``. Each measurement costs
        the worker a few tenths of a millisecond, and a full window changes slowly: an input processed
        over and over (or the first graph of one with many blocks) would otherwise pay it on every task."""
        if block < MIN_BASIS:
            return False
        n = self.asked[source, prefix] = self.asked.get((source, prefix), 0) + 1
        self.asked.move_to_end((source, prefix))
        while len(self.asked) > self.max_sources * self.max_prefixes:
            self.asked.popitem(last=False)
        if n <= self.window and len(self.ratios.get(source, {}).get(prefix, ())) < self.window:
            return True
        return n % self.window == 0

    def add(self, source: str, prefix: str, block: float, peak: float) -> None:
        """A task of prefix ``prefix`` on a block of ``block`` bytes of ``source`` held ``peak`` bytes
        at most; ignored for blocks under :data:`MIN_BASIS`."""
        if not (block >= MIN_BASIS and peak >= 0):
            return
        prefixes = self.ratios.setdefault(source, OrderedDict())
        prefixes.setdefault(prefix, deque(maxlen=self.window)).append(peak / block)
        prefixes.move_to_end(prefix)
        self.ratios.move_to_end(source)
        while len(prefixes) > self.max_prefixes:
            prefixes.popitem(last=False)
        while len(self.ratios) > self.max_sources:
            self.ratios.popitem(last=False)

    def ratio(self, source: str) -> float | None:
        """Peak bytes per byte of block of ``source``'s recent tasks (the largest), or ``None``."""
        prefixes = self.ratios.get(source)
        return max((max(r) for r in prefixes.values()), default=None) if prefixes else None
