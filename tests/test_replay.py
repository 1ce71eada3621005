"""Capture refusals of ``groups/replay.py`` on a CPU machine (a fake of CuPy's streams and pools): what
a CUDA graph could not replay safely runs eagerly. The real captures run in ``tests/test_gpu.py``."""

import contextlib
import threading
import types

import numpy as np
import pytest

from dask_octopus import _compat
from dask_octopus.groups import replay


class Stream:
    def __init__(self):
        self.capturing = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def begin_capture(self):
        self.capturing = True

    def end_capture(self):
        self.capturing = False
        return "graph"

    def record(self):
        return object()

    def wait_event(self, event):
        pass


class Pool:
    def __init__(self, allocator=None):
        self.allocator = allocator

    def malloc(self, nbytes):
        raise AssertionError("not allocated from here")

    def total_bytes(self):
        return 0


def fake_cupy():
    cuda = types.SimpleNamespace(MemoryPool=Pool, using_allocator=lambda malloc: contextlib.nullcontext())
    return types.SimpleNamespace(cuda=cuda, ndarray=np.ndarray)


def fft_module():
    """A module with CuPy's FFT executors (``cupy.fft._fft``), made to count FFTs."""
    module = types.ModuleType("fake_fft")
    module._exec_fft = lambda a, *args: np.fft.fft(a)
    module._exec_fftn = lambda a, *args: np.fft.fftn(a)
    assert _compat.count_ffts_of(module)
    return module


def test_ffts_are_counted_on_the_thread_that_counts_them_only():
    module = fft_module()
    x = np.ones(8)
    assert _compat.count_ffts_of(module)  # counted once, however many times asked
    module._exec_fft(x)  # not counting: runs as before
    seen = []
    with _compat.counting_ffts() as ffts:
        np.testing.assert_array_equal(module._exec_fft(x), np.fft.fft(x))
        module._exec_fftn(x)
        other = threading.Thread(target=lambda: seen.append(module._exec_fft(x)))
        other.start()
        other.join()
    module._exec_fft(x)
    assert ffts == [2] and len(seen) == 1
    assert not _compat.count_ffts_of(types.ModuleType("no_executors"))


def test_a_capture_that_runs_an_fft_is_refused():
    """The graph would read the cuFFT plan, which CuPy's plan cache frees when it holds 16 others: on an
    H200 the next replay crashed the worker (an illegal memory access)."""
    module = fft_module()
    cp = fake_cupy()
    values = {0: np.ones(8)}
    with pytest.raises(replay.CaptureRefused, match="2 FFTs: a CUDA graph does not hold the cuFFT plans"):
        replay.capture_fragment(cp, lambda v, st: v.update({1: module._exec_fftn(module._exec_fft(v[0]))}),
                                values, [0], [1], [Stream(), Stream()], in_place=True)
    graph = replay.capture_fragment(cp, lambda v, st: v.update({1: v[0] * 2}), values, [0], [1], [Stream()],
                                    in_place=True)
    assert graph.graph == "graph" and graph.inputs is None


class Unfit(np.ndarray):
    """A device array whose copy finds no memory left."""

    def copy(self):
        raise MemoryError("Out of memory allocating 512 bytes")


@pytest.mark.parametrize("how", ["fragment", "group"])
def test_a_capture_whose_input_copies_do_not_fit_is_refused(how):
    cp = fake_cupy()
    x = np.ones(64).view(Unfit)
    with pytest.raises(replay.CaptureRefused, match="copying the inputs: MemoryError: Out of memory"):
        if how == "fragment":
            replay.capture_fragment(cp, lambda v, st: None, {0: x}, [0], [0], [Stream()], in_place=False)
        else:
            replay.capture(cp, [lambda a: a * 2], [[x]], [0], [Stream()])


class Invalidating(Stream):
    """A stream whose capture a refused call invalidated: ending it raises, as CUDA's does."""

    def end_capture(self):
        self.capturing = False
        raise RuntimeError("cudaErrorStreamCaptureInvalidated: operation failed due to a previous error")


def refused_while_captured(x):
    raise RuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing")


@pytest.mark.parametrize("stream", [Stream, Invalidating])
def test_a_step_that_raises_while_captured_is_the_capture_s_reason_to_refuse(stream):
    """The debug line and the dashboard's last refusal say why: the step's error, not that its output (a
    held error) is no CuPy array, nor CUDA's message on ending the capture it invalidated."""
    from dask_octopus._compat import Task, TaskRef
    from dask_octopus.groups import streams
    from dask_octopus.groups.fragment import Fragment

    frag = Fragment({"a": Task("a", refused_while_captured, TaskRef("x")), "b": Task("b", np.negative, TaskRef("a"))},
                    ["b"], {"a": "memory", "b": "memory"})
    layout = streams.FragmentLayout(frag, 1)
    specs = frag.specs()
    origin = stream()
    with pytest.raises(replay.CaptureRefused, match=r"^RuntimeError: cudaErrorStreamCaptureUnsupported"):
        replay.capture_fragment(fake_cupy(), lambda v, st: streams.launch(frag, specs, layout, v, st),
                                {0: np.ones(4)}, [0], frag.results, [origin], in_place=True)
    assert not origin.capturing  # the capture ended


class CUDARuntimeError(RuntimeError):
    pass


def test_a_graph_s_pool_refuses_the_capture_where_device_memory_runs_out():
    """The private pool's allocator turns CUDA's out-of-memory error into a refused capture: CuPy's pool,
    given that error, frees its free blocks (intermediates freed inside the capture, which recorded kernels
    still use) and tries again."""
    cp, made = fake_cupy(), []

    def memory(nbytes):
        if nbytes > 100:
            raise CUDARuntimeError("cudaErrorMemoryAllocation: out of memory")
        made.append(nbytes)
        return ("memory", nbytes)

    cp.cuda.Memory, cp.cuda.MemoryPointer = memory, lambda mem, offset: (mem, offset)
    cp.cuda.runtime = types.SimpleNamespace(CUDARuntimeError=CUDARuntimeError)
    malloc = replay._allocator(cp)
    assert malloc(64) == (("memory", 64), 0) and made == [64]
    with pytest.raises(replay.CaptureRefused, match=r"^device memory ran out while capturing \(cudaErrorMemory"):
        malloc(512)
    pools = []
    cp.cuda.MemoryPool = lambda allocator=None: pools.append(allocator) or Pool(allocator)
    stream = Stream()
    replay._capture(cp, [stream], lambda: None)
    assert len(pools) == 1 and pools[0] is not None
    with pytest.raises(replay.CaptureRefused, match="device memory ran out"):
        pools[0](512)
