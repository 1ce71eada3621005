"""Where a benchmark ran: hardware (GPUs through NVML) and library versions, for its JSON record."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from typing import Any

import dask_octopus


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
    """CPU and, through NVML, GPU names and memory."""
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0))}
    if gpu:
        import pynvml

        pynvml.nvmlInit()
        info["gpus"] = [{"name": pynvml.nvmlDeviceGetName(h), "memory": pynvml.nvmlDeviceGetMemoryInfo(h).total,
                         "driver": pynvml.nvmlSystemGetDriverVersion()}
                        for h in (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount()))]
    return info


def versions() -> dict[str, str]:
    import dask
    import distributed
    import numpy

    out = {"python": sys.version.split()[0], "dask": dask.__version__, "distributed": distributed.__version__,
           "numpy": numpy.__version__, "dask_octopus": dask_octopus.__version__}
    for mod in ("cupy", "dask_cuda"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            pass
    return out
