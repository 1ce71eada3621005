# Defect 1: when cudaMalloc fails during a capture, the graph's private pool frees memory the graph still uses.
# Run from /work/main on a GPU: python /tmp/review-gpu/r1_capture_pool_oom.py
import cupy as cp
from dask_octopus.groups import replay

MB = 1 << 20
n = 32 * MB // 4                                   # 32 MiB of float32
x = cp.ones(n, dtype=cp.float32)
s = cp.cuda.Stream(non_blocking=True)
seen = {}

def member(a):
    t1 = a * 2                                     # 32 MiB from the graph's pool
    t2 = t1 + 1                                    # 32 MiB
    seen["t1"], seen["t2"] = t1.data.ptr, t2.data.ptr
    del t1
    r = t2 * 3                                     # 32 MiB; ~4 MiB left on the device
    del t2                                         # t1, t2: free blocks of the private pool
    big = cp.full(48 * MB // 4, 5, cp.float32)     # cudaMalloc fails -> _try_malloc: free_all_blocks() -> retry
    seen["big"] = big.data.ptr
    return r + big[:n]

member(x)                                          # warm-up: kernels compiled and loaded before the capture
cp.cuda.Device().synchronize()
cp.get_default_memory_pool().free_all_blocks()
s.wait_event(cp.cuda.get_current_stream().record())
free, _ = cp.cuda.runtime.memGetInfo()
blob = cp.cuda.Memory(free - 100 * MB)             # raw cudaMalloc: about 100 MiB stay free
try:
    g = replay.capture(cp, [member], [[x]], [0], [s], in_place=True)
except replay.CaptureRefused as e:
    print("refused:", e, "| free now:", cp.cuda.runtime.memGetInfo()[0] // MB, "MiB (a leak if well below ~100)")
    raise SystemExit
print({k: hex(v) for k, v in seen.items()}, "| graph pool MiB:", g.held_bytes() // MB)
victim = cp.zeros(16 * MB // 4, cp.float32)        # default pool -> cudaMalloc: lands in memory t2 had
print("victim at", hex(victim.data.ptr))
del blob                                           # room for the replay's output copy
cp.cuda.Device().synchronize()
out = g.replay(cp, [x], s, cp.cuda.get_current_stream())[0]
print("replay exact:", bool((out == 14).all()), "| victim still zero:", not bool(victim.any()))
# Expected with the defect: 'victim still zero: False' (the graph wrote t2's 3.0s into it), or an
# illegal-address error on replay; if CUDA refuses cudaFree during capture: a refusal plus leaked memory.
