"""How much a remembered entry holds: the identity form vs the Shape (layers + named form)."""
import sys, gc, types
sys.path.insert(0, "tests")  # run from the repository root
import numpy as np, dask, dask.array as da
import dask_octopus
from dask_octopus.groups.memo import plans
from test_plan_memo import chain

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
print(f"keys in plan {len(e.graph)}; plan graph+picks {g/1e6:.2f} MB, identity form {f/1e6:.2f} MB, shape (named form) {s/1e6:.2f} MB")
