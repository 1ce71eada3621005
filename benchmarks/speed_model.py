"""How well the speed model's online refinement weighs two workers, on simulated task timings.

Pure Python (the model has no Dask in it): two workers ``a`` and ``b`` each report ``--timings``
task timings of one prefix, in turns, under one scenario of noise and slowdown; after every
timing the model's weights are read, and the error is ``|log(weight ratio / true ratio)|``, the true
ratio being that of the workers' mean times (what a worker's share of the work takes), but in the
scenario of flukes: there a's rare 100x tasks (a mean of about 2) are what the model should leave out,
so its truth is the workers' typical times, equal (1.0). A scenario's
figure is its mean error over all timings and ``--seeds`` random seeds (0.1 is 10% off). Steps: ``b``
changes speed (a slowdown after steady timings or after a warm-up, a mix of slow tasks that ends), and
how many timings the weights take to stay within 15% of the truth for five timings in a row (median
and worst over the seeds). Asserts nothing.

    python benchmarks/speed_model.py --out benchmarks/results/cpu
"""

from __future__ import annotations

import math
import os
import random
import statistics
from collections.abc import Callable

import click
from rich.table import Table

from dask_octopus.bench.options import OutFolder
from dask_octopus.bench.record import header, write_json
from dask_octopus.cli import console as make_console
from dask_octopus.profiling.speedmodel import SpeedModel

Timings = Callable[[random.Random, int], tuple[list[float], list[float]]]  # rng, n -> a's and b's seconds


def _noisy(rng: random.Random, sigma: float) -> float:
    return math.exp(rng.gauss(0, sigma))


def _step(sigma: float, at: int, before: float = 1.0, after: float = 2.0, warm_up: float = 1.0) -> Timings:
    """``b`` ``before`` times slower than ``a`` until timing ``at``, then ``after`` times (its first timing
    ``warm_up`` times longer); lognormal noise of ``sigma`` (``at=0``: ``after`` times slower throughout)."""
    return lambda rng, n: ([_noisy(rng, sigma) for _ in range(n)],
                           [(warm_up if i == 0 else 1.0) * (after if i >= at else before) * _noisy(rng, sigma)
                            for i in range(n)])


def _pause(sigma: float, start: int, length: int, factor: float) -> Timings:
    """``b`` as fast as ``a`` but ``factor`` times slower for ``length`` timings from ``start`` (a pause, a
    co-tenant's burst); lognormal noise of ``sigma``."""
    return lambda rng, n: ([_noisy(rng, sigma) for _ in range(n)],
                           [(factor if start <= i < start + length else 1.0) * _noisy(rng, sigma) for i in range(n)])


def _mixed(p: float, until: int | None = None) -> Timings:
    """``b``'s tasks take three times longer at random with probability ``p`` (a co-tenant's slices), until
    timing ``until`` (then none) or throughout."""
    return lambda rng, n: ([_noisy(rng, 0.05) for _ in range(n)],
                           [(3.0 if (until is None or i < until) and rng.random() < p else 1.0) * _noisy(rng, 0.05)
                            for i in range(n)])


def _t2(rng: random.Random) -> float:
    return rng.gauss(0, 1) / math.sqrt((rng.gauss(0, 1) ** 2 + rng.gauss(0, 1) ** 2) / 2)


def _correlated(rng: random.Random, n: int, phi: float = 0.9, sigma: float = 0.25) -> list[float]:
    x, out = 0.0, []
    for _ in range(n):
        x = phi * x + math.sqrt(1 - phi * phi) * rng.gauss(0, sigma)
        out.append(math.exp(x))
    return out


def _coarse(rng: random.Random, n: int) -> list[float]:
    return [0.004 if rng.random() < 0.45 else 0.003 for _ in range(n)]


def _flukes(rng: random.Random, n: int) -> tuple[list[float], list[float]]:
    return ([_noisy(rng, 0.05) * (100 if rng.random() < 0.01 else 1) for _ in range(n)],
            [_noisy(rng, 0.05) for _ in range(n)])


# name: (timings, true ratio of b's mean time to a's (of the timing's index and their number), a's and b's
# calibrated speeds)
SCENARIOS: dict[str, tuple[Timings, Callable[[int, int], float], tuple[float, float]]] = {
    "identical, 25% noise": (_step(0.25, 0, after=1.0), lambda i, n: 1.0, (1.0, 1.0)),
    "b 1.2x slower, 25% noise": (_step(0.25, 0, after=1.2), lambda i, n: 1.2, (1.0, 1.0)),
    "b 1.5x slower, 25% noise": (_step(0.25, 0, after=1.5), lambda i, n: 1.5, (1.0, 1.0)),
    "b 1.4x slower, calibrated 2x, 25% noise": (_step(0.25, 0, after=1.4), lambda i, n: 1.4, (2.0, 1.0)),
    "b 2x slower, 10% noise": (_step(0.10, 0, after=2.0), lambda i, n: 2.0, (1.0, 1.0)),
    "equal, calibrated 2x, 25% noise": (_step(0.25, 0, after=1.0), lambda i, n: 1.0, (2.0, 1.0)),
    **{f"b 3x slower on {p:.0%} of tasks": (_mixed(p), lambda i, n, p=p: 1 + 2 * p, (1.0, 1.0))
       for p in (0.05, 0.1, 0.2, 0.35)},
    "b 1x and 4x by turns": (lambda rng, n: ([_noisy(rng, 0.05) for _ in range(n)],
                                             [(4.0 if i % 2 else 1.0) * _noisy(rng, 0.05) for i in range(n)]),
                             lambda i, n: 2.5, (1.0, 1.0)),
    "heavy-tailed noise, b 1.5x slower": (lambda rng, n: ([math.exp(0.1 * _t2(rng)) for _ in range(n)],
                                                          [1.5 * math.exp(0.1 * _t2(rng)) for _ in range(n)]),
                                          lambda i, n: 1.5, (1.0, 1.0)),
    "b drifts 1x to 2x, 10% noise": (lambda rng, n: ([_noisy(rng, 0.1) for _ in range(n)],
                                                     [(1 + i / n) * _noisy(rng, 0.1) for i in range(n)]),
                                     lambda i, n: 1 + i / n, (1.0, 1.0)),
    "identical, correlated noise": (lambda rng, n: (_correlated(rng, n), _correlated(rng, n)), lambda i, n: 1.0,
                                    (1.0, 1.0)),
    "identical, 3 or 4 ms (a coarse clock)": (lambda rng, n: (_coarse(rng, n), _coarse(rng, n)), lambda i, n: 1.0,
                                              (1.0, 1.0)),
    "identical, 1% of a's tasks 100x slower (flukes: left out)": (_flukes, lambda i, n: 1.0, (1.0, 1.0)),
}


def ratios(a: list[float], b: list[float], prior: tuple[float, float]) -> list[float]:
    """The model's weight of ``a`` over ``b``'s after each pair of timings (seconds per unit of work)."""
    m = SpeedModel()
    m.set_prior("a", {"compute": prior[0]})
    m.set_prior("b", {"compute": prior[1]})
    out = []
    for ta, tb in zip(a, b):
        m.observe("a", "p", 1.0, ta)
        m.observe("b", "p", 1.0, tb)
        w = m.weights(["a", "b"])
        out.append(w["a"] / w["b"])
    return out


def mean_error(name: str, seeds: int, n: int) -> float:
    """A scenario's mean ``|log(ratio / truth)|`` over its timings and ``seeds`` seeds."""
    timings, truth, prior = SCENARIOS[name]
    errors = []
    for seed in range(seeds):
        a, b = timings(random.Random(seed), n)
        errors.append(statistics.fmean(abs(math.log(r / truth(i, n))) for i, r in enumerate(ratios(a, b, prior))))
    return statistics.fmean(errors)


# name: (timings, the timing at which b changes, b's true ratio before and after it)
STEPS: dict[str, tuple[Timings, int, float, float]] = {
    "b slows down 2x, 5% noise": (_step(0.05, 50), 50, 1.0, 2.0),
    "b slows down 2x, 25% noise": (_step(0.25, 50), 50, 1.0, 2.0),
    "b's first task 5x (a warm-up), then 2x slower from its 9th": (_step(0.05, 8, warm_up=5.0), 8, 1.0, 2.0),
    "b 3x slower on 30% of tasks, then on none": (_mixed(0.3, until=100), 100, 1.6, 1.0),
    "b's tasks 50 and 51 100x (a pause), 5% noise": (_pause(0.05, 50, 2, 100.0), 52, 1.0, 1.0),
    "b 4x slower for 10 tasks from its 50th, 10% noise": (_pause(0.10, 50, 10, 4.0), 60, 1.0, 1.0),
}


def lags(name: str, seeds: int, after: int = 60) -> list[int]:
    """Timings after a step's change until the weights stay within 15% of the truth for five in a row
    (``after`` where they never do within ``after``), per seed."""
    timings, at, before, later = STEPS[name]
    out = []
    for seed in range(seeds):
        a, b = timings(random.Random(seed), at + after)
        errors = [abs(math.log(r / (later if i >= at else before))) for i, r in enumerate(ratios(a, b, (1.0, 1.0)))]
        out.append(next((i - at for i in range(at, at + after - 4)
                         if all(e < math.log(1.15) for e in errors[i:i + 5])), after))
    return out


@click.command()
@click.option("--seeds", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--timings", type=click.IntRange(min=10), default=200, show_default=True, help="per worker and scenario")
@click.option("--out", type=OutFolder(), default=None, help="folder for the JSON")
def main(seeds: int, timings: int, out: str | None) -> None:
    """The speed model's weights against the truth over simulated timings: a table of each scenario's
    mean error, each step's timings to follow, and with --out a JSON record."""
    console = make_console()
    errors = {name: mean_error(name, seeds, timings) for name in SCENARIOS}
    steps = {name: lags(name, seeds) for name in STEPS}
    table = Table(title=f"Speed model: mean |log error| of the weight ratio ({timings} timings each, {seeds} seeds)")
    table.add_column("scenario")
    table.add_column("mean error", justify="right")
    for name, e in errors.items():
        table.add_row(name, f"{e:.3f}")
    console.print(table)
    for name, taken in steps.items():
        console.print(f"{name}: within 15% after {statistics.median(taken):g} timings (median), "
                      f"{max(taken)} at worst")
    if out:
        write_json(os.path.join(out, "speed-model.json"),
                   header(False, "none", seeds=seeds, timings=timings, mean_error=errors, step_timings=steps))


if __name__ == "__main__":
    main()
