"""The one loop every benchmark runs its variants in: interleaved, so drift hits all alike."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from distributed import Client

T = TypeVar("T")


def run_orders(n: int) -> list[list[int]]:
    """The orders, by position, in which runs call ``n`` variants: a Williams design (a balanced Latin
    square, mirrored when ``n`` is odd), so that over ``len(run_orders(n))`` runs every variant runs
    as often in each position and right after each other variant (A B D C, B C A D, C D B A, D A C B
    for four): neither what runs first nor what one variant leaves behind (memory still being freed,
    a warm cache) favours one of them."""
    first = [(k + 1) // 2 if k % 2 else (n - k // 2) % n for k in range(n)]  # 0, 1, n-1, 2, n-2, ...
    rows = [[(x + i) % n for x in first] for i in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 and n > 1 else rows


def interleave(variants: Mapping[str, Callable[[int], T]], runs: int, *, warmup: int = 0, start: int = 0,
               progress: Callable[[str], None] | None = None,
               between: Callable[[], None] | None = None) -> dict[str, list[T]]:
    """Call each variant once per run, in turn, with the run's number (from ``start``: a series of runs
    split over several calls continues where the last one stopped), in the orders of
    :func:`run_orders`; return what each call returned, per variant, for the runs after the first
    ``warmup`` ones. ``progress`` is told each call as it starts; ``between()`` is called before each
    call (such as :func:`settle`: outside the variants' own timing)."""
    names = list(variants)
    orders = run_orders(len(names))
    out: dict[str, list[T]] = {name: [] for name in names}
    for run in range(start, start + warmup + runs):
        for name in (names[i] for i in orders[run % len(orders)]) if orders else ():
            if progress is not None:
                progress(f"run {run + 1}/{start + warmup + runs}: {name}")
            if between is not None:
                between()
            value = variants[name](run)
            if run >= start + warmup:
                out[name].append(value)
    return out


def settle(client: Client, timeout: float = 10.0) -> None:
    """Wait until the cluster of ``client`` has let go of the tasks of what ran before (the scheduler
    holds only tasks a client wants, each worker only tasks in memory) or ``timeout`` seconds
    passed, then collect the garbage of every process: the next variant then starts on a
    quiet cluster instead of paying for the previous one's release (a compute of 2,048 small tasks
    leaves the scheduler and its worker busy forgetting them for a while after its result came)."""
    deadline = time.monotonic() + timeout
    while (client.run_on_scheduler(_unwanted_tasks) or any(client.run(_tasks_without_data).values())) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    client.run_on_scheduler(gc.collect)
    client.run(gc.collect)
    gc.collect()


def _unwanted_tasks(dask_scheduler: Any) -> int:
    return sum(not ts.who_wants for ts in dask_scheduler.tasks.values())


def _tasks_without_data(dask_worker: Any) -> int:
    return sum(ts.state != "memory" for ts in dask_worker.state.tasks.values())


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds ``fn`` took (wall clock), and what it returned."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out

