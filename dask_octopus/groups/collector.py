"""Planning and small runs with Python's cyclic garbage collector paused.

Making fragments allocates tens of thousands of short-lived containers (the optimized graph's
copies, each step's spec, order and slots). With the collector running, its young-generation
passes promote the ones alive at that moment, and the scheduler then pays for a full collection of
its whole heap at about every compute: 190-240 ms per compute of the 1024-block chain-and-sum on the
2-core machine, a third of the compute. Paused while the optimizer of an annotated graph runs, the
temporaries are freed by reference counting and are never promoted: 13-15 ms of collection per
compute, one full collection every five computes instead of every one
(`benchmarks/results/2026-12-01-cpu-fragment-specs/`). A fragment's run on a worker is the same
case (its steps' specs, unpickled as it starts, live until it ends):
:meth:`~dask_octopus.groups.streams.RunningTask.collector_paused`.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # blocks inside the pause, in any thread
_resume = False  # whether the collector ran when the first of them paused it


@contextmanager
def collector_paused() -> Iterator[Callable[[], None]]:
    """Pause the cyclic garbage collector for the duration of the block (nested and concurrent blocks
    resume it when the last one ends, and only if it ran before the first began). The block may end
    its share of the pause early by calling the function it is given (once or more)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    held = True

    def resume() -> None:
        global _depth
        nonlocal held
        with _lock:
            if not held:
                return
            held = False
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()

    try:
        yield resume
    finally:
        resume()
