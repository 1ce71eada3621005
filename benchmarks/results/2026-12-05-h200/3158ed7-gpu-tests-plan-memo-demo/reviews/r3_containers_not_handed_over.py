# Defect 3: handed_over() copies top-level CuPy arrays only; a dict/tuple of arrays made on a pool stream
# keeps its memory in that stream's arena, reused by the thread's next run while a reader still reads it.
from unittest import mock
import cupy as cp, numpy as np
from dask_octopus.groups import streams

P = cp.cuda.Stream(non_blocking=True)              # a pool stream of thread T1
with P:
    arr = cp.full(1 << 20, 1.0, cp.float32)
    d = {"total": cp.full(1 << 20, 1.0, cp.float32)}   # as dask's mean_chunk returns
P.synchronize()
with mock.patch.object(streams, "_several_threads", lambda: True):   # a worker of 2 threads
    out = streams.handed_over(cp, [arr, d])
print("array handed over:", out[0] is not arr, "| dict's array handed over:", out[1]["total"] is not d["total"])
spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long n){long long t=clock64(); while(clock64()-t<n){}}''', "spin")
null = cp.cuda.Stream.null                         # the reader task on thread T2 (dask-cuda: legacy stream)
with null:
    spin((1,), (1,), (np.int64(2_000_000_000),))   # a busy GPU queue, ~1 s
    read_dict = out[1]["total"] * 1                # queued behind it
    read_arr = out[0] * 1
del out, d, arr                                    # reader returns; Dask releases the fragment's results
with P:                                            # T1's next fragment (its ready event recorded earlier)
    junk = cp.full(1 << 20, 7.0, cp.float32)
    junk2 = cp.full(1 << 20, 7.0, cp.float32)
null.synchronize()
print("reader of the dict saw", float(read_dict.max()), "| reader of the array saw", float(read_arr.max()))
# Expected with the defect: 7.0 for the dict, 1.0 for the handed-over array.
