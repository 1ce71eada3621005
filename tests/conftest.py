import pytest
from distributed.utils_test import cleanup, loop, loop_in_thread  # noqa: F401  (fixtures)

import dask_octopus  # noqa: F401  (registers its dask.config defaults)
from dask_octopus.profiling.probes import gpu_available


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

