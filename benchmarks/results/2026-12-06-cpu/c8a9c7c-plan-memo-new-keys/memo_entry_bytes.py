"""How much a remembered plan holds: its tasks and picks, its form by keys and its shape (the form by
layer names, and the layers' names). Run from the repository root (imports ``tests/test_plan_memo.py``)."""
import gc
import sys
import types

import dask
import dask.array as da

sys.path.insert(0, "tests")
import dask_octopus  # noqa: E402
from dask_octopus.groups.memo import plans  # noqa: E402
from test_plan_memo import chain  # noqa: E402


def deep(obj, seen):
    total, stack = 0, [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)):
            continue
        seen.add(id(o))
        total += sys.getsizeof(o)
        stack.extend(gc.get_referents(o))
    return total


with dask.config.set(scheduler="sync"):
    for i in range(2):
        with dask_octopus.annotate():
            z = da.random.default_rng(i).random((4096, 6), chunks=(4, 6)).map_blocks(chain).sum(axis=1)
        z.compute()
e = next(iter(plans._plans.values()))
seen = set()
g = deep(e.graph, seen) + deep(e.picks, seen)
f = deep(e.form, seen)
s = deep(e.shape, seen)
print(f"keys in plan {len(e.graph)}; plan graph+picks {g/1e6:.2f} MB, identity form {f/1e6:.2f} MB, "
      f"shape (named form) {s/1e6:.2f} MB")
