"""Random CuPy array programs computed inside ``annotate`` on a one-GPU LocalCUDACluster, each over
several computes: new data each compute (new keys of one shape: plans reused renamed, graphs replayed
copying their inputs in), the same data under the same keys (plans remembered, graphs replayed in
place), or the same data under new names. Every compute's values against NumPy's (integers exactly,
means to 1e-12). Prints and writes a JSON summary: programs, computes, wrong values, errors, graphs
planned, the workers' capture counts. Asserts nothing; exits 1 where a value was wrong or a compute
raised.

    python3 gpu_fuzz.py SEED SECONDS OUT.json
"""
import json
import sys
import time
import traceback

import cupy
import dask.array as da
import numpy as np
from dask_cuda import LocalCUDACluster
from distributed import Client

import dask_octopus
from dask_octopus.groups import rewrite

sys.path.insert(0, "tests")
from test_fragment_properties import OPS, apply

planned = []
real = rewrite._fragment_graph
rewrite._fragment_graph = lambda *args: planned.append(1) or real(*args)


def stats(dask_worker):
    from dask_octopus.groups.streams import EXTENSION

    return dask_worker.extensions[EXTENSION].stats()


def program(x, ops):
    for op, c in ops:
        x = apply(x, op, c)
    return x


def main(seed: int, seconds: float, out: str) -> int:
    rng = np.random.default_rng(seed)
    summary = {"seed": seed, "programs": 0, "computes": 0, "wrong": [], "errors": [], "modes": {}}
    deadline = time.monotonic() + seconds
    with LocalCUDACluster(CUDA_VISIBLE_DEVICES="0", dashboard_address=":0") as cluster, Client(cluster) as client:
        dask_octopus.register(client, calibrate=False)
        while time.monotonic() < deadline:
            side, chunk = int(rng.integers(2, 13)), int(rng.integers(1, 6))
            ops = [(OPS[int(rng.integers(len(OPS)))], int(rng.integers(10))) for _ in range(int(rng.integers(1, 7)))]
            mode = ["new data", "same keys", "new names"][int(rng.integers(3))]
            summary["programs"] += 1
            summary["modes"][mode] = summary["modes"].get(mode, 0) + 1
            x = None
            for run in range(4):
                data = np.arange(side * side, dtype=np.int64).reshape(side, side)
                if mode == "new data":
                    data = data * (run + 1) + 1000 * run
                if x is None or mode == "new data":
                    x = client.persist(da.from_array(cupy.asarray(data), chunks=chunk))
                expected = program(da.from_array(data, chunks=chunk), ops).compute(scheduler="sync")
                y = program(x, ops)
                if mode == "new names":
                    y = y.map_blocks(lambda b: b, name=f"named-{summary['programs']}-{run}", dtype=y.dtype)
                case = {"side": side, "chunk": chunk, "ops": ops, "mode": mode, "run": run}
                summary["computes"] += 1
                try:
                    with dask_octopus.annotate():
                        got = cupy.asnumpy(client.compute(y).result())
                    if np.issubdtype(expected.dtype, np.integer):
                        ok = got.shape == expected.shape and np.array_equal(got, expected)
                    else:
                        ok = got.shape == expected.shape and np.allclose(got, expected, rtol=1e-12)
                    if not ok:
                        summary["wrong"].append(case)
                        print("WRONG", case, flush=True)
                except Exception:
                    summary["errors"].append({**case, "error": traceback.format_exc(limit=3)})
                    print("ERROR", case, traceback.format_exc(limit=3), flush=True)
        summary["planned"] = len(planned)
        summary["capture"] = list(client.run(stats).values())
    print(json.dumps({k: v for k, v in summary.items() if k not in ("wrong", "errors")}),
          "wrong", len(summary["wrong"]), "errors", len(summary["errors"]), flush=True)
    with open(out, "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return 1 if summary["wrong"] or summary["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]))
