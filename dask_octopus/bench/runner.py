"""The one loop every benchmark runs its variants in: interleaved, so drift hits all alike."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def interleave(variants: Mapping[str, Callable[[int], T]], runs: int, *, warmup: int = 0,
               progress: Callable[[str], None] | None = None) -> dict[str, list[T]]:
    """Call each variant once per run, in turn, with the run's index; return what each call returned,
    per variant, for the runs after the first ``warmup`` ones. Each run starts one variant later
    (A B C, B C A, C A B, ...): over a multiple of ``len(variants)`` runs every variant runs as often
    in each position, so what one variant leaves behind (memory still being freed, a warm cache)
    never favours the same one. ``progress`` is told each call as it starts.
    """
    names = list(variants)
    out: dict[str, list[T]] = {name: [] for name in names}
    for run in range(warmup + runs):
        k = run % len(names) if names else 0
        order = names[k:] + names[:k]
        for name in order:
            if progress is not None:
                progress(f"run {run + 1}/{warmup + runs}: {name}")
            value = variants[name](run)
            if run >= warmup:
                out[name].append(value)
    return out


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds ``fn`` took (wall clock), and what it returned."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out

