"""One result record for every benchmark: when, how and where it ran, written as JSON into a folder
that the command line checked (:class:`~dask_octopus.bench.options.OutFolder`)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from typing import Any

from distributed.versions import get_versions

# beside distributed's own list; distribution names (the UCX wheels carry their CUDA version)
PACKAGES = ["cupy", "dask_cuda", "dask_octopus", "distributed-ucxx-cu13", "ucxx-cu13", "ucxx", "rmm"]


def write_json(path: str, record: dict[str, Any]) -> str:
    """Write a benchmark record (folders made as needed); returns ``path``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    return path


def now() -> str:
    """UTC time, to the second."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def hardware(gpu: bool) -> dict[str, Any]:
    """CPU and, through distributed's NVML module, GPU names and memory."""
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0))}
    if gpu:
        import pynvml
        from distributed.diagnostics import nvml

        nvml.init_once()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.device_get_count())]
        info["gpus"] = [{"name": pynvml.nvmlDeviceGetName(h), "memory": pynvml.nvmlDeviceGetMemoryInfo(h).total,
                         "driver": pynvml.nvmlSystemGetDriverVersion()} for h in handles]
    return info


def versions() -> dict[str, str | None]:
    """Python and package versions (distributed's ``get_versions``; ``None`` where not installed)."""
    return get_versions(PACKAGES)["packages"]


def ucx_environment() -> dict[str, str]:
    """The ``UCX_*`` and ``UCXPY_*`` variables of this process's environment as the record is made:
    the user's, which the local cluster's workers inherit, and those dask-cuda sets when it starts a
    UCX cluster. They say how UCX and distributed-ucxx were tuned (``UCXPY_PROGRESS_MODE`` and
    ``UCXPY_ENABLE_PYTHON_FUTURE`` change how fast Python-bound work runs beside the comms)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "UCXPY_"))}


def header(gpu: bool, protocol: str, **fields: Any) -> dict[str, Any]:
    """The start of every record: date, the exact command, hardware, versions and the protocol the
    cluster's workers talked over (``tcp``, ``ucx``, ``inproc``), with the UCX environment
    (:func:`ucx_environment`) over ``ucx``, then ``fields``."""
    ucx = {"ucx_environment": ucx_environment()} if protocol == "ucx" else {}
    return {"date": now(), "command": " ".join(sys.argv), "hardware": hardware(gpu), "versions": versions(),
            "protocol": protocol, **ucx, **fields}
