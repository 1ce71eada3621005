"""Typed payloads of the scheduler plugin's RPC handlers (msgpack sends tuples as lists: the
client side rebuilds :class:`WorkerInfo` with ``WorkerInfo.of``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypedDict

#: a task's metadata (``TaskState.metadata`` on the worker, sent with its result) where some of its work
#: failed: the share that did not (a ``map`` batch's items that gave results; 0.0 for a fragment or a task
#: run for fragments with a failed step). Its timing counts for that share of its work (none at 0.0): a
#: worker where the function fails at once would otherwise look fast
DONE_SHARE = "octopus-done-share"

#: the error of a handler that plans onto the workers where the cluster has none
NO_WORKERS = "the cluster has no workers"


class Profile(TypedDict, total=False):
    """A worker's calibration as the worker plugin reports it, and, from ``octopus_profiles``, its
    place in the cluster."""

    device: str  #: ``"gpu"`` or ``"cpu"``
    name: str  #: the GPU's name, or ``"CPU"``
    compute: float  #: GEMM FLOP/s
    memory: float  #: streaming bytes/s
    memory_total: int  #: bytes of device memory (GPU) or of the memory limit / RAM (CPU)
    memory_free: int  #: bytes free at calibration (GPU) or the memory limit (CPU)
    probe_seconds: float  #: how long the probes took
    error: str | None  #: why the calibration failed, if it did
    calibrated: bool  #: ``False`` when registered with ``calibrate=False``
    event_timing: bool  #: tasks timed with CUDA events on this worker
    #: a GPU worker without CUDA-event timings (of several threads): its tasks' durations end at kernel launch
    ends_at_launch: bool
    name_on_scheduler: str  #: the worker's name (``octopus_profiles``)
    weight: float  #: current weight for the asked resource (``octopus_profiles``)
    samples: int  #: task timings behind the weight (``octopus_profiles``)
    threads: int  #: worker threads (``octopus_profiles``)
    #: peak bytes per byte of block of the tasks of the asked input's blocks, once measured (``octopus_profiles``)
    working_set: float | None


#: the type of each field a worker reports (:class:`Profile`, as the worker plugin sends it)
REPORTED: dict[str, tuple[type, ...]] = {
    "device": (str,), "name": (str,), "compute": (int, float), "memory": (int, float), "memory_total": (int,),
    "memory_free": (int,), "probe_seconds": (int, float), "error": (str, type(None)), "calibrated": (bool,),
    "event_timing": (bool,), "ends_at_launch": (bool,),
}


def malformed(profile: Mapping[str, Any]) -> str | None:
    """Why a worker's calibration report ``profile`` cannot be read (a field of another type than
    :data:`REPORTED` says, as a worker running another version of the package might send), else ``None``.

    Parameters
    ----------
    profile
        The report (a mapping).

    Returns
    -------
    str or None
        The first field of the wrong type, with its value; ``None`` where all are as expected.
    """
    for name, value in profile.items():
        types = REPORTED.get(name)
        if types is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
            return f"{name} must be {' or '.join(t.__name__ for t in types)}, got {value!r}"
    return None


def plannable_memory(profile: Mapping[str, Any], memory_limit: int | None = None) -> float | None:
    """The memory of a worker that plans fill a fraction of (``octopus.balance.memory-fraction``).

    Parameters
    ----------
    profile
        The worker's calibration (:class:`Profile`).
    memory_limit
        Its memory limit as the scheduler knows it, if any (``octopus_profiles`` puts it in the profile
        of a CPU worker already).

    Returns
    -------
    float or None
        Free device memory at calibration on a GPU worker; on a CPU worker its memory limit, else its
        total memory; ``None`` where not known.
    """
    if profile.get("device") == "gpu":
        return profile.get("memory_free")
    return memory_limit or profile.get("memory_total")


def parallel_threads(profile: Mapping[str, Any], nthreads: int) -> int:
    """How many of a worker's blocks run at once at its weight's speed each.

    Parameters
    ----------
    profile
        The worker's calibration (:class:`Profile`).
    nthreads
        Its threads.

    Returns
    -------
    int
        1 on a GPU worker (its weight is its device's speed, which its threads share); else its threads
        (its weight is one thread's speed), at least 1.
    """
    return 1 if profile.get("device") == "gpu" else max(1, int(nthreads or 1))


class WorkerInfo(NamedTuple):
    """What ``map`` needs to know of one worker (``octopus_workers``)."""

    weight: float  #: relative weight, as ``speeds`` gives it
    threads: int  #: worker threads
    parallel: int  #: threads that run at ``weight``'s speed each (:func:`parallel_threads`: 1 on a GPU worker)
    fit: tuple[float, float] | None  #: ``(fixed, per_unit)`` seconds per item, once fitted
    rate: float | None  #: observed work units per second of the function there, once it ran there
    budget: float | None  #: bytes one task there may hold (``octopus.fragments.max-bytes``), if known
    result_size: float | None  #: bytes of result per byte of items of the function's recent batches, if any
    held: bool  #: paused or retiring: Dask sends it no task, and its scatter refuses it

    @classmethod
    def of(cls, values: Sequence[Any]) -> WorkerInfo:
        """Rebuild one from what came over the wire."""
        weight, threads, parallel, fit, rate, budget, result_size, held = values
        return cls(weight, threads, parallel, None if fit is None else (fit[0], fit[1]), rate, budget, result_size,
                   held)
