"""Loads the model under test (the repository's, run from its root) as ``new`` and that of 60af4e1
(``old_speedmodel.py`` here, the model before the mends) as ``old``."""
import heapq  # noqa: F401 (the probes import it from here)
import importlib.util
import os
import random  # noqa: F401
import sys

sys.path.insert(0, os.getcwd())
from dask_octopus.profiling import speedmodel as new  # noqa: E402

spec = importlib.util.spec_from_file_location("old_speedmodel", os.path.join(os.path.dirname(__file__), "old_speedmodel.py"))
old = importlib.util.module_from_spec(spec)
sys.modules["old_speedmodel"] = old
spec.loader.exec_module(old)
