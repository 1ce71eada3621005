"""The repository's scripts (``benchmarks/*.py``, ``examples/*.py``) imported by their paths, for tests."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).parents[1]


def load_script(relative: str):
    """Import one of the repository's scripts (``benchmarks/*.py``, ``examples/*.py``) by its path."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(f"octopus_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
