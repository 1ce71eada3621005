import pytest

import dask_octopus  # noqa: F401  (its dask.config defaults must be in place before utils_test snapshots the config)
from dask_octopus.probes import gpu_available
from distributed.utils_test import cleanup, loop, loop_in_thread  # noqa: F401, E402  (fixtures)


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs CuPy and a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
