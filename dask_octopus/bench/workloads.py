"""Workloads shared by the demo, the benchmarks and the tests (NumPy or CuPy blocks)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import dask.array as da
import numpy as np
from dask.array.core import normalize_chunks
from dask.utils import key_split
from distributed import Client, get_task_stream, wait
from distributed.diagnostics.plugin import WorkerPlugin

from dask_octopus.groups.marks import annotate
from dask_octopus.groups.rewrite import FRAGMENT_PREFIX
from dask_octopus.profiling.probes import gpu_available


def array_module(gpu: bool) -> Any:
    """CuPy when ``gpu`` else NumPy."""
    if gpu:
        import cupy

        return cupy
    return np


_GOLDEN = 0x9E3779B97F4A7C15
_SLAB = 2**20  # elements of a block made at a time: bounds its uint64 temporaries (8 MiB each)


def _unit_floats(index: Any, seed: int, xp: Any) -> Any:
    """Splitmix64 of each ``index`` (uint64, updated in place) and ``seed``, as float32 in [0, 1) (24 bits)."""
    u = xp.uint64
    x = index
    x += u((seed + 1) * _GOLDEN % 2**64)
    for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x ^= x >> u(shift)
        x *= u(factor)
    x ^= x >> u(31)
    x >>= u(40)
    return x.astype(xp.float32) * xp.float32(2.0**-24)


def _positional_block(seed: int, gpu: bool, block_info: dict | None = None) -> Any:
    xp = array_module(gpu)
    (r0, r1), (c0, c1) = block_info[None]["array-location"]
    width = block_info[None]["shape"][1]
    out = xp.empty((r1 - r0, c1 - c0), dtype=xp.float32)
    columns = xp.arange(c0, c1, dtype=xp.uint64)[None, :]
    step = max(1, _SLAB // max(1, c1 - c0))
    for r in range(r0, r1, step):
        rows = xp.arange(r, min(r + step, r1), dtype=xp.uint64)[:, None]
        out[r - r0:r - r0 + rows.shape[0]] = _unit_floats(rows * xp.uint64(width) + columns, seed, xp)
    return out


def random_matrix(rows: int, cols: int, chunks: Any, gpu: bool = False, seed: int = 0) -> da.Array:
    """A float32 dask array of pseudo-random numbers in [0, 1), generated on the workers from each
    element's position and ``seed``: the same values whatever the ``chunks``, so that variants that
    cut the input differently compute on the same numbers (and their results can be compared)."""
    meta = array_module(gpu).empty((0, 0), dtype=np.float32)
    return da.map_blocks(_positional_block, seed, gpu,
                         chunks=normalize_chunks(chunks, (rows, cols), dtype=np.float32), dtype=np.float32, meta=meta)


def gemm_repeat(a: Any, reps: int, sync: bool = True) -> Any:
    """``reps`` products ``a.T @ a`` (compute-bound); with ``sync`` waits for the GPU before returning."""
    out = a
    for _ in range(reps):
        out = a.T @ a
    if sync:
        synchronize(out)
    return out


SCENARIOS: dict[str, list[tuple[int, int, int]]] = {  # (count, height, width)
    "web": [(1, 256, 256), (1, 1080, 1920), (1, 512, 512), (1, 2160, 4096)],
    "thumbnails-8k": [(3, 64, 64), (1, 4320, 7680)],
    "medical": [(5, 512, 512), (1, 4096, 4096)],
    "satellite": [(7, 256, 256), (1, 10000, 10000)],
    "video": [(29, 360, 640), (1, 2160, 3840)],
}


def specs(scenario: str, scale: float, repeat: int) -> list[tuple[int, int, int]]:
    """Image specs ``(height, width, seed)`` of a scenario, sizes scaled, the mix repeated."""
    sizes = [(max(8, int(h * scale)), max(8, int(w * scale)))
             for _ in range(repeat) for count, h, w in SCENARIOS[scenario] for _ in range(count)]
    return [(h, w, seed) for seed, (h, w) in enumerate(sizes)]


def image_pipeline(spec: tuple[int, int, int]) -> np.ndarray:
    """Generate one image on this worker's device (as a loader would), run :func:`frame_pipeline` on it
    and return its 64 counts on the host. (Returning them on the device would spare one host
    synchronisation per image, but sending 120 CuPy arrays to the client cost 60-180 ms on the GPU
    machine against 12-22 ms for NumPy ones: more than the pipelines' GPU work.)"""
    return to_host(frame_pipeline(make_frame(*spec, gpu=gpu_available())))


def to_host(a: Any) -> np.ndarray:
    """``a`` as a NumPy array (copied from the device when it is a CuPy array)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


@dataclass
class PassRecord:
    """One pass: wall time, and each worker's busy intervals (seconds from the pass start), for all
    tasks and for the per-block tasks alone (the ones balancing sizes)."""

    seconds: float
    intervals: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    blocks: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    value: tuple[float, float, float] | None = None  # the result's checksum (:func:`checksum`), on the last pass

    def finish(self) -> dict[str, float]:
        """Each worker's last per-block task end, from the pass start."""
        return {w: max(stop for _, stop in iv) for w, iv in self.blocks.items() if iv}

    def spread(self) -> float:
        """(latest - earliest worker finish) / pass time."""
        f = list(self.finish().values())
        return (max(f) - min(f)) / self.seconds if len(f) > 1 else 0.0


def checksum(client: Client, y: da.Array) -> tuple[float, float, float]:
    """The sum, the sum of squares and a sum weighted by position (each element times a number in
    [-1, 1) made from its place, as :func:`random_matrix` makes them) of the elements of ``y`` (a
    persisted result), in float64: what the results of variants that cut their input differently are
    compared by (taken after the timing). The weighted sum tells blocks put back in another order, or
    a row lost at a cut."""
    y64 = y.astype(np.float64)
    flat = y64.reshape(1, -1) if y64.ndim != 2 else y64
    # centred weights (in [-1, 1)): the weighted sum is not dominated by the mean, a moved block changes it
    weights = 2 * random_matrix(*flat.shape, chunks=flat.chunks, gpu=not isinstance(y._meta, np.ndarray), seed=7) - 1
    total, squares, weighted = client.compute([y64.sum(), (y64 * y64).sum(), (flat * weights).sum()], sync=True)
    return float(total), float(squares), float(weighted)


def same_checksums(a: tuple[float, ...], b: tuple[float, ...], rtol: float = 1e-4) -> bool:
    """Whether two :func:`checksum` values agree within ``rtol`` (float32 work summed in other orders)."""
    return bool(np.allclose(a, b, rtol=rtol, atol=0.0))


def _key_id(key: Hashable) -> str:
    """A task key as text, the same on a worker and in a task stream record (which may hold a tuple key as
    a list once it travelled)."""
    return repr(tuple(key)) if isinstance(key, (tuple, list)) else repr(key)


class TaskClockShifts(WorkerPlugin):
    """Records, as each task starts running, the shift its worker adds to its timings (``startstops``):
    its ``scheduler_delay`` then, an estimate of the scheduler's clock that each heartbeat replaces (read
    as the task's state turns to executing: a heartbeat that ends in the moment before the worker reads it
    for the task, while its inputs are unpacked, goes unseen)."""

    name = "octopus-bench-clock-shifts"
    idempotent = True

    def __init__(self) -> None:
        self.shifts: dict[str, float] = {}
        self.worker: Any = None

    def setup(self, worker: Any) -> None:
        self.worker = worker

    def transition(self, key: Hashable, start: str, finish: str, **kwargs: Any) -> None:
        if finish == "executing" and self.worker is not None:
            self.shifts[_key_id(key)] = self.worker.scheduler_delay


@contextlib.contextmanager
def watching_clock_shifts(client: Client) -> Iterator[None]:
    """Have the workers record each task's clock shift (:class:`TaskClockShifts`) within the block, and
    no longer: registered, the plugin keeps an entry per task until :func:`clock_shifts` reads it."""
    client.register_plugin(TaskClockShifts())
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # (a cluster closed meanwhile: nothing left to unregister)
            client.unregister_worker_plugin(TaskClockShifts.name)


def _take_shifts(dask_worker: Any) -> tuple[float, dict[str, float]]:
    plugin = dask_worker.plugins.get(TaskClockShifts.name)
    tasks: dict[str, float] = {}
    if plugin is not None:
        tasks, plugin.shifts = plugin.shifts, {}
    return dask_worker.scheduler_delay, tasks


@dataclass(frozen=True)
class ClockShifts:
    """What one worker added to its task timings: each task's shift as it started (those recorded by
    :class:`TaskClockShifts`), else the shift it adds now."""

    now: float
    tasks: dict[str, float] = field(default_factory=dict)

    def of(self, key: Hashable) -> float:
        """The shift of task ``key``'s timings."""
        return self.tasks.get(_key_id(key), self.now)


def clock_shifts(client: Client) -> dict[str, ClockShifts]:
    """Each worker's shifts of its task timings (``startstops``) onto the scheduler's clock, taken from
    what its :class:`TaskClockShifts` recorded since the last call (see :func:`watching_clock_shifts`) and
    the worker's ``scheduler_delay`` now: an estimate from its heartbeats, off by tens to hundreds of ms
    on a busy machine (two workers' finishes of one pass came apart by 0.04 s of a 0.07 s pass), which
    each heartbeat replaces. On one host every process reads the same clock: :func:`intervals` takes each
    task's shift back off. Read after a pass, the shift of the moment put tasks that ran before a
    heartbeat moved it up to 0.2 s after their pass ended: each task's own shift does not."""
    return {w: ClockShifts(now, tasks) for w, (now, tasks) in client.run(_take_shifts).items()}


def intervals(stream: list[dict], t0: float, names: tuple[str, ...] | None = None,
              shifts: dict[str, ClockShifts] | None = None) -> dict[str, list[tuple[float, float]]]:
    """Compute intervals per worker of the tasks whose key prefix is one of ``names`` (all by default),
    from ``t0`` (this process's ``time.time()``), each task's shift on its worker (:func:`clock_shifts`)
    taken off, and never before ``t0``: a shift's error (its heartbeats' round trips) can put a task of a
    short pass before the pass began (a finish of -0.012 s)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for rec in stream:
        if names is not None and key_split(rec["key"]) not in names:
            continue
        shift = shifts[rec["worker"]].of(rec["key"]) if shifts and rec["worker"] in shifts else 0.0
        origin = t0 + shift
        for ss in rec["startstops"]:
            if ss["action"] == "compute":
                out.setdefault(rec["worker"], []).append((max(0.0, ss["start"] - origin),
                                                          max(0.0, ss["stop"] - origin)))
    return out


@dataclass
class TimedPass:
    """What :func:`timed_pass` measured: the wall ``seconds`` of the block, its tasks' records (the task
    stream's), ``t0`` (this process's ``time.time()`` as it began) and each worker's clock shifts."""

    t0: float = 0.0
    seconds: float = 0.0
    stream: list[dict] = field(default_factory=list)
    shifts: dict[str, ClockShifts] = field(default_factory=dict)

    def intervals(self, names: tuple[str, ...] | None = None) -> dict[str, list[tuple[float, float]]]:
        """:func:`intervals` of the pass's tasks of ``names`` (all by default), from its start."""
        return intervals(self.stream, self.t0, names, self.shifts)


@contextlib.contextmanager
def timed_pass(client: Client) -> Iterator[TimedPass]:
    """Time the block as one pass, recording its tasks, within :func:`watching_clock_shifts`: the shifts
    the workers recorded before it are dropped, those of its tasks read after it."""
    clock_shifts(client)
    timing = TimedPass()
    with get_task_stream(client) as ts:
        timing.t0 = time.time()
        start = time.perf_counter()
        yield timing
        timing.seconds = time.perf_counter() - start
    timing.stream = ts.data
    timing.shifts = clock_shifts(client)


def synchronize(a: Any) -> None:
    """Wait for the GPU work behind ``a`` (no-op for NumPy), so task timings are real."""
    if not isinstance(a, np.ndarray):
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def block_gram(xb: Any, w: Any) -> Any:
    """One row block's share ``X_i^T (X_i W)`` of the next subspace, shape ``(1, cols, width)``."""
    out = (xb.T @ (xb @ w))[None]
    synchronize(out)
    return out


def subspace_iteration(client: Client, x: da.Array, width: int, passes: int, gpu: bool = False,
                       grouped: bool = False) -> list[PassRecord]:
    """Passes of ``W <- normalise(X^T (X W))`` over a persisted ``x``; one record per pass.

    ``W`` stays on the cluster between passes (persisted); the per-block work (two GEMMs,
    ``4 * rows * cols * width`` FLOP per pass) dominates, and the cross-block sum of the
    ``cols x width`` partial products is small. Each pass is one graph (the per-block products, their
    sum and its normalisation) and one round trip, whatever the variant; with ``grouped`` the per-block
    stage runs in fragments (:func:`dask_octopus.annotate`).
    """
    xp = array_module(gpu)
    cols = x.shape[1]
    # made on a worker: a (cols x width) array in the graph is 16 MiB at 2048 x 2048
    w = client.persist((da.ones((cols, width), dtype=np.float32, chunks=(cols, width)) / np.float32(np.sqrt(cols)))
                       .map_blocks(xp.asarray, dtype=np.float32))
    records = []
    # the per-block tasks: Dask fuses each block's product with the sum's per-block step (named for the
    # sum); grouped, the fragments too
    block_tasks = (FRAGMENT_PREFIX, "block_gram", "sum") if grouped else ("block_gram", "sum")
    with watching_clock_shifts(client):
        for _ in range(passes):
            with timed_pass(client) as timing:
                with annotate(resource="compute") if grouped else contextlib.nullcontext():
                    parts = da.blockwise(block_gram, "ijk", x, "ij", w, "jk", adjust_chunks={"i": 1}, dtype=np.float32,
                                         meta=xp.empty((0, 0, 0), dtype=np.float32))
                g = parts.sum(axis=0)
                w = client.persist(g / da.linalg.norm(g))
                wait(w)
                # Broadcast W while every GPU is idle: on the legacy default stream a device-to-host copy
                # waits for the sender's running kernels, so a worker fetching W mid-pass would stall.
                client.replicate(w)
            records.append(PassRecord(timing.seconds, timing.intervals(), timing.intervals(block_tasks)))
    if records:
        records[-1].value = checksum(client, w)
    return records


def workers_info(client: Client) -> dict[str, dict]:
    """Each worker's entry of the scheduler's identity, fetched now (``client.scheduler_info()`` returns
    the client's cached identity, which its periodic refresh may just have replaced with one that
    lists no workers)."""
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def persist_on_workers(client: Client, x: da.Array) -> da.Array:
    """Persist ``x`` and wait until every block is in memory."""
    x = client.persist(x)
    wait(x)
    return x


FRAMES: list[tuple[int, int, int]] = [  # (count, height, width): 216 frames, 256x256 to 4K
    (96, 256, 256), (64, 512, 512), (40, 720, 1280), (12, 1080, 1920), (4, 2160, 3840)]
_GAUSS = np.exp(-0.5 * (np.arange(-8, 9) / 2.0) ** 2).astype(np.float32)
_GAUSS /= _GAUSS.sum()
_DERIV, _SMOOTH = np.array([-1, 0, 1], np.float32), np.array([1, 2, 1], np.float32)
_weights: dict[int, tuple] = {}  # device -> the filter weights on it (made once: no copies inside a capture)


def frame_specs(scale: float = 1.0) -> list[tuple[int, int, int]]:
    """``(height, width, seed)`` of the 216 frames of :data:`FRAMES`, sides scaled."""
    sizes = [(max(8, int(h * scale)), max(8, int(w * scale))) for count, h, w in FRAMES for _ in range(count)]
    return [(h, w, seed) for seed, (h, w) in enumerate(sizes)]


def make_frame(height: int, width: int, seed: int, gpu: bool = False) -> Any:
    """One frame, float32 in [0, 1), on the device (CuPy when ``gpu``): a counter-based integer hash
    of each pixel's index and ``seed``, the same bits on CPU and GPU, in one kernel (a random
    generator's set-up would cost more than the pipeline on small frames)."""
    offset = np.uint32((seed * 0x9E3779B9) & 0xFFFFFFFF)
    if not gpu:
        x = np.arange(height * width, dtype=np.uint32) + offset
        x ^= x >> 16
        x *= np.uint32(0x7FEB352D)
        x ^= x >> 15
        x *= np.uint32(0x846CA68B)
        x ^= x >> 16
        return ((x >> 8).astype(np.float32) * np.float32(2.0**-24)).reshape(height, width)
    xp = array_module(True)
    out = xp.empty((height, width), dtype=np.float32)
    return _kernel(xp, "frame")(offset, out)


_CORRELATE_SOURCE = """
int r = i / width, c = i % width;
float acc = 0;
for (int k = -radius; k <= radius; ++k) {
    int rr = r, cc = c;
    if (axis == 0) { rr = r + k; rr = rr < 0 ? -rr - 1 : (rr >= height ? 2 * height - rr - 1 : rr); }
    else { cc = c + k; cc = cc < 0 ? -cc - 1 : (cc >= width ? 2 * width - cc - 1 : cc); }
    acc += img[rr * width + cc] * w[k + radius];
}
out = acc;
"""
_FRAME_SOURCE = """
unsigned int x = (unsigned int)i + offset;
x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
out = (float)(x >> 8) * (1.0f / 16777216.0f);
"""
_KERNEL_SPECS = {  # name: (inputs, outputs, body)
    "correlate": ("raw float32 img, raw float32 w, int32 radius, int32 height, int32 width, int32 axis",
                  "float32 out", _CORRELATE_SOURCE),
    "histogram": ("float32 x, int32 bins", "raw int32 out",
                  "int b = (int)(x * bins); b = b < 0 ? 0 : (b >= bins ? bins - 1 : b); atomicAdd(&out[b], 1);"),
    "frame": ("uint32 offset", "float32 out", _FRAME_SOURCE),
}
_kernels: dict[str, Any] = {}


def _kernel(xp: Any, name: str) -> Any:
    """The workloads' own CuPy kernels (plain launches, so a CUDA graph can capture them)."""
    if name not in _kernels:
        inputs, outputs, body = _KERNEL_SPECS[name]
        _kernels[name] = xp.ElementwiseKernel(inputs, outputs, body, f"octopus_{name}")
    return _kernels[name]


def _device_weights(xp: Any) -> tuple:
    if xp is np:
        return _GAUSS, _DERIV, _SMOOTH
    device = xp.cuda.runtime.getDevice()
    if device not in _weights:
        _weights[device] = tuple(xp.asarray(w) for w in (_GAUSS, _DERIV, _SMOOTH))
    return _weights[device]


def _correlate1d(xp: Any, img: Any, w: Any, axis: int) -> Any:
    """``scipy.ndimage.correlate1d(img, w, axis, mode="reflect")``; on GPU one kernel of ours."""
    if xp is np:
        import scipy.ndimage as ndimage

        return ndimage.correlate1d(img, w, axis, mode="reflect")
    h, wd = img.shape
    out = xp.empty_like(img)
    return _kernel(xp, "correlate")(img, w, np.int32(w.size // 2), np.int32(h), np.int32(wd), np.int32(axis), out)


def _histogram(xp: Any, unit: Any, bins: int) -> Any:
    """Counts of ``unit`` (values in [0, 1]) in ``bins`` equal bins; on GPU one atomic kernel (CuPy's
    histogram synchronises with the host, which a CUDA graph capture refuses)."""
    if xp is np:
        return np.histogram(unit, bins=bins, range=(0.0, 1.0))[0].astype(np.int32)
    out = xp.zeros(bins, dtype=np.int32)
    _kernel(xp, "histogram")(unit, np.int32(bins), out)
    return out


def frame_pipeline(img: Any) -> Any:
    """Gaussian blur, Sobel edge magnitude, normalisation and a 64-bin histogram of one frame, all on
    the frame's device and without host synchronisation (so a CUDA graph can capture it)."""
    xp = np if isinstance(img, np.ndarray) else array_module(True)
    gauss, deriv, smooth = _device_weights(xp)
    g = _correlate1d(xp, _correlate1d(xp, img, gauss, 0), gauss, 1)
    gx = _correlate1d(xp, _correlate1d(xp, g, deriv, 1), smooth, 0)
    gy = _correlate1d(xp, _correlate1d(xp, g, deriv, 0), smooth, 1)
    mag = xp.hypot(gx, gy)
    lo, hi = mag.min(), mag.max()
    return _histogram(xp, (mag - lo) / (hi - lo + np.float32(1e-6)), 64)


def scale_shift(block: Any) -> Any:
    """A tiny elementwise step (``2 b + 1``): Dask's per-task cost dwarfs it."""
    return block * 2 + 1


def elementwise_chain(block: Any) -> Any:
    """Eight elementwise kernels on one block (NumPy or CuPy): ``sqrt(|(1.5 b + 0.5)^2 - 0.25|)
    * 0.9 + 0.1``. Each is a memory pass; on a small block Dask's per-task cost dwarfs them all."""
    y = block * 1.5 + 0.5
    y = y * y - 0.25
    y = abs(y) ** 0.5
    return y * 0.9 + 0.1


def square(block: Any) -> Any:
    """``b @ b`` of a square block: one GEMM that fills the GPU on large blocks."""
    return block @ block


def stack_to_host(parts: list[Any]) -> np.ndarray:
    """The parts stacked into one host array (one output key for a whole set of results)."""
    xp = np if isinstance(parts[0], np.ndarray) else array_module(True)
    out = xp.stack(parts)
    return out if xp is np else out.get()


def stencil_mean(block: Any, radius: int = 4) -> Any:
    """Mean of each row with its ``radius`` neighbours above and below (wrapping at the block's
    edges, which ``map_overlap`` trims): a memory-bound stencil for NumPy or CuPy blocks."""
    xp = np if isinstance(block, np.ndarray) else array_module(True)
    out = block.copy()
    for k in range(1, radius + 1):
        out += xp.roll(block, k, 0) + xp.roll(block, -k, 0)
    return out / (2 * radius + 1)
