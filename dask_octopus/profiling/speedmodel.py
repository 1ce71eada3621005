"""Pure speed model: calibration priors refined by observed task timings.

No Dask here. Each worker has a prior speed per resource (``"compute"``: FLOP/s of a GEMM probe,
``"memory"``: bytes/s of a streaming probe). Finished tasks add observations per (worker, task
prefix): the median of the first ``confidence_samples`` timings' rates (work units per second, units
being the bytes it read and wrote), so that a first task that also loads a library or plans an FFT
does not set the start, then an exponentially weighted average of the log of the rate, each timing
counting at most 4x faster or slower than the average (:data:`MAX_STEP`): one fluke timing 100x
faster than its prefix's others moved the rates' own average 50x. For a prefix seen on several
workers, each worker's rate relative to the geometric mean of the others is its observed relative
speed. Prefixes count in proportion to the time their tasks take (a 300 ms GEMM says more about a
worker than a 3 ms sum of partial results, which latency dominates), and that weight halves with
every :data:`HALF_LIFE` timings taken since the prefix last ran: a finished computation's prefixes
give way to the work running now (a worker that slows down on new, shorter tasks loses weight even
after long tasks of other prefixes ran equally everywhere). A prefix counts only on workers that ran
it ``confidence_samples`` times: one-off tasks (a rechunk while data moves) say little about the
steady work. The model keeps the timings of the ``max_prefixes`` prefixes that ran last (tasks
submitted under keys of their own, ``job_17``, make a prefix each): a prefix dropped for a newer one
had been unseen for that many timings at least, so its weight had halved ``max_prefixes /
HALF_LIFE`` times. The observed speed then replaces the prior, so a worker that slows down mid-run
loses weight within a few tasks of each prefix. Asked for one prefix, the model answers with that
prefix's speeds alone once every worker has them (``map`` plans a function by its own speeds).
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise

from dask_octopus._checks import check_finite, is_finite

RESOURCES = ("compute", "memory")


def check_resource(resource: str) -> str:
    """Return ``resource`` if it is a known resource class, else raise ``ValueError``."""
    if not isinstance(resource, str) or resource not in RESOURCES:
        raise ValueError(f"unknown resource {resource!r}: expected one of {', '.join(RESOURCES)}")
    return resource


NOISE_WINDOW = 8  # recent timings of a (prefix, worker) from which the noise of its rate is estimated
MAX_STEP = math.log(4)  # one timing counts at most 4x faster or slower than the moving average
HALF_LIFE = 32  # timings (of any prefix, on any worker) after which a prefix not seen since counts half


@dataclass
class _Rate:
    # units per second: the median of the first timings (a warm-up timing, imports or a cuFFT plan, is
    # one of them, not the start), then their moving average (of logs, each step at most MAX_STEP)
    value: float = 0.0
    seconds: float = 0.0  # one task's duration: the median of the first timings, then their moving average
    count: int = 0
    # log rates, each within MAX_STEP of the average they joined (the first ones: of their median)
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=NOISE_WINDOW))
    durations: list[float] = field(default_factory=list)  # the first timings' seconds
    _recent_mean: tuple[float, float] | None = None  # recent_mean(), until the next timing

    def add(self, log_rate: float, seconds: float, alpha: float, first: int) -> None:
        """Add one timing: to the medians while fewer than ``first`` timings are known, then to the
        moving averages, of weight ``alpha``."""
        self._recent_mean = None
        if self.count < first:
            self.recent.append(log_rate)
            self.durations.append(seconds)
            centre = statistics.median(self.recent)
            self.value, self.seconds = math.exp(centre), statistics.median(self.durations)
            if self.count + 1 == first:  # the first timings count as far from the median as later ones may
                for i, x in enumerate(self.recent):
                    self.recent[i] = centre + max(-MAX_STEP, min(MAX_STEP, x - centre))
        else:
            change = max(-MAX_STEP, min(MAX_STEP, log_rate - math.log(self.value)))
            self.recent.append(math.log(self.value) + change)
            self.value *= math.exp(alpha * change)
            self.seconds = alpha * seconds + (1 - alpha) * self.seconds
        self.count += 1

    def noise(self) -> float:
        """Standard deviation of one timing's log rate, from the median change between successive
        timings (robust to a step change: a worker that slows down is one large change, not noise);
        0 while fewer than three timings are known."""
        if len(self.recent) < 3:
            return 0.0
        changes = [abs(b - a) for a, b in pairwise(self.recent)]
        return statistics.median(changes) / 0.954  # median |x - y| of two N(0, s^2) is 0.954 s

    def recent_mean(self) -> tuple[float, float]:
        """Mean log rate of the recent timings and its standard error."""
        if self._recent_mean is None:
            self._recent_mean = statistics.fmean(self.recent), self.noise() / math.sqrt(len(self.recent))
        return self._recent_mean


@dataclass
class SpeedModel:
    """Per-worker speed estimates; see the module docstring for the model.

    ``alpha`` is the weight of a new observation in the moving average; a worker's observed
    speed replaces its prior once a prefix it shares with another worker has ``confidence_samples``
    observations on both. A prefix shows the workers' differences only on evidence: when the mean of
    some worker's recent log rates is more than ``significance`` standard errors away from the mean
    over the workers (errors from the noise of each worker's timings); otherwise its workers count as
    equal (identical workers keep equal weights, however noisy their short tasks). ``max_prefixes``:
    the prefixes kept, those that ran last.
    """

    alpha: float = 0.5
    confidence_samples: int = 3
    significance: float = 2.5
    max_prefixes: int = 1000
    priors: dict[str, dict[str, float]] = field(default_factory=dict)
    rates: defaultdict[str, dict[str, _Rate]] = field(default_factory=lambda: defaultdict(dict))
    clock: int = 0  # timings observed
    # the clock at each prefix's latest timing, the least recent first
    last_seen: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def set_prior(self, worker: str, speeds: dict[str, float]) -> None:
        """Record the calibrated speeds of ``worker``; non-finite or non-positive ones are refused."""
        for resource, value in speeds.items():
            check_resource(resource)
            check_finite(value, f"{resource} speed of {worker}")
        self.priors[worker] = dict(speeds)

    def remove(self, worker: str) -> None:
        """Forget everything about ``worker``."""
        self.priors.pop(worker, None)
        for prefix, per_worker in list(self.rates.items()):
            per_worker.pop(worker, None)
            if not per_worker:
                del self.rates[prefix], self.last_seen[prefix]

    def observe(self, worker: str, prefix: str, units: float, seconds: float) -> None:
        """Add one finished task of ``prefix`` that processed ``units`` in ``seconds`` on ``worker``."""
        check_finite(seconds, "task duration")
        check_finite(units, "task work units")
        rate = units / seconds
        if not is_finite(rate, positive=True):  # (the message is made only then: this runs for every task)
            check_finite(rate, f"task rate ({units!r} units in {seconds!r} s)")
        self.clock += 1
        if prefix in self.last_seen:
            self.last_seen.move_to_end(prefix)
        elif len(self.last_seen) >= self.max_prefixes:
            del self.rates[self.last_seen.popitem(last=False)[0]]
        self.last_seen[prefix] = self.clock
        per_worker = self.rates[prefix]
        current = per_worker.get(worker) or per_worker.setdefault(worker, _Rate())
        current.add(math.log(rate), seconds, self.alpha, self.confidence_samples)

    def _observed(self, workers: list[str], prefixes: Iterable[str] | None = None,
                  prior: dict[str, float] | None = None) -> tuple[dict[str, float], dict[str, int]]:
        """Observed relative speed and sample count per worker, over
        ``prefixes`` (default: all, each weighing less by the timings taken since it last ran,
        :data:`HALF_LIFE`). ``prior``: each worker's log prior speed; a prefix whose recent timings
        agree with the prior's differences keeps them, and the workers that ran a prefix keep the geometric
        mean of their priors (without ``prior``: 1), so a prefix run on some of the workers moves them
        against each other only, not against the others."""
        logsum: dict[str, float] = defaultdict(float)
        wsum: dict[str, float] = defaultdict(float)
        samples: dict[str, int] = defaultdict(int)
        chosen = self.rates if prefixes is None else [p for p in prefixes if p in self.rates]
        asked = set(workers)
        for prefix in chosen:
            per_worker = self.rates[prefix]
            seen = {w: r for w, r in per_worker.items() if w in asked and r.count >= self.confidence_samples}
            if len(seen) < 2:
                continue
            n = len(seen)
            mean = sum(math.log(r.value) for r in seen.values()) / n
            duration = sum(r.seconds for r in seen.values()) / n
            expected = {w: (prior or {}).get(w, 0.0) for w in seen}
            expected_mean = sum(expected.values()) / n
            expected = {w: e - expected_mean for w, e in expected.items()}
            difference = self._difference(seen, expected)
            # (asked for chosen prefixes, each counts as it is: a lone prefix's age would only scale it)
            age = 1.0 if prefixes is not None else 0.5 ** ((self.clock - self.last_seen[prefix]) / HALF_LIFE)
            for w, r in seen.items():
                weight = min(r.count, self.confidence_samples) * duration * age
                if not weight > 0:  # (underflow: ~34,000 timings since the prefix ran) it counts no more
                    continue
                # on the prior's scale: the workers that ran the prefix keep their prior mean
                logsum[w] += weight * (expected_mean + (math.log(r.value) - mean if difference is None
                                                        else difference[w]))
                wsum[w] += weight
                samples[w] += r.count
        return {w: math.exp(logsum[w] / wsum[w]) for w in wsum}, dict(samples)

    def _difference(self, seen: dict[str, _Rate], expected: dict[str, float]) -> dict[str, float] | None:
        """The workers' log speeds relative to their mean on one prefix, as its recent timings show them:
        the prior's (``expected``) while no worker's recent mean departs from it by more than
        ``significance`` standard errors, else equal (0) while none departs from equality that far,
        else ``None``: the observed moving averages count."""
        n = len(seen)
        recent = {w: r.recent_mean() for w, r in seen.items()}
        recent_mean = sum(m for m, _ in recent.values()) / n
        errors = sum(se**2 for _, se in recent.values())

        def departs(centre: dict[str, float]) -> bool:
            # the standard error of (a worker's recent mean - the mean of all n): its own share and the others'
            return any(abs(m - recent_mean - centre[w])
                       > self.significance * math.sqrt(((n - 1) / n) ** 2 * se**2 + (errors - se**2) / n**2)
                       for w, (m, se) in recent.items())

        if not departs(expected):
            return expected
        equal = dict.fromkeys(seen, 0.0)
        return None if departs(equal) else equal

    def table(self) -> dict[str, dict[str, tuple[float, float, int]]]:
        """Observed ``(units per second, seconds per task, count)`` per prefix and worker."""
        return {p: {w: (r.value, r.seconds, r.count) for w, r in per.items()} for p, per in self.rates.items()}

    def samples(self) -> dict[str, int]:
        """Number of task timings of each worker that count (prefixes seen often enough on two workers or
        more); workers with none left out."""
        return self._observed(list({w for r in self.rates.values() for w in r}))[1]

    def weights(self, workers: Iterable[str], resource: str = "compute", prefix: str | None = None) -> dict[str, float]:
        """Relative weights of ``workers`` for ``resource``, summing to 1. With ``prefix``, and when
        every one of ``workers`` ran that prefix ``confidence_samples`` times, that prefix's own
        observed speeds alone (the speeds of that kind of work)."""
        check_resource(resource)
        workers = sorted(workers)
        if not workers:
            raise ValueError("no workers to weigh")
        prior = {w: self.priors.get(w, {}).get(resource) for w in workers}
        known = [math.log(v) for v in prior.values() if v]
        mean = sum(known) / len(known) if known else 0.0
        logs = {w: math.log(prior[w]) - mean if prior[w] else 0.0 for w in workers}  # uncalibrated: the mean
        if prefix is not None:
            own = self._observed(workers, [prefix], prior=logs)[0]
            if len(own) == len(workers):
                total = sum(own.values())
                return {w: own[w] / total for w in workers}
        observed = self._observed(workers, prior=logs)[0]
        speed = {w: observed.get(w) or math.exp(logs[w]) for w in workers}
        total = sum(speed.values())
        return {w: s / total for w, s in speed.items()}
