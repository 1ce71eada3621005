"""Pure speed model: calibration priors refined by observed task timings.

No Dask here. Each worker has a prior speed per resource (``"compute"``: FLOP/s of a GEMM probe,
``"memory"``: bytes/s of a streaming probe). Finished tasks add observations per (worker, task prefix):
a rate (work units per second, units being the bytes it read and wrote) of one over the mean time per
unit of its timings since the rate last changed, at most :data:`WINDOW` of them, winsorized: the
fastest and the slowest tenth, rounded up (:data:`OUTER`; of three timings, one each: their median),
count as the nearest of the others. The mean time, since that is what a worker's share of the work
takes, slow tasks included (a co-tenant slowing one task in three); winsorized, so that a first task
that also loads a library or plans an FFT, or one fluke 100x faster or slower than the others, does not
move it; since the rate last changed, so that it gets more precise the longer a worker runs at one
speed. A rate has changed when the median of its last few timings (:data:`RECENT`) departs from the
median of the earlier ones by more than :data:`CHANGE` standard errors of their noise, and more of them
lie past the midpoint between the two medians than the earlier timings' share there makes likely
(:data:`RARE`: a level the earlier ones showed often is a mix of fast and slow tasks, not a change);
the earlier timings are then dropped. For a prefix seen on several workers, each worker's rate relative
to the geometric mean of the others is its observed relative speed. Prefixes count in proportion to the
time their tasks take (a 300 ms GEMM says more about a worker than a 3 ms sum of partial results, which
latency dominates), and that weight halves with every :data:`HALF_LIFE` timings taken since the prefix
last ran: a finished computation's prefixes give way to the work running now (a worker that slows down
on new, shorter tasks loses weight even after long tasks of other prefixes ran equally everywhere). A
prefix counts only on workers that ran it ``confidence_samples`` times: one-off tasks (a rechunk while
data moves) say little about the steady work. The model keeps the timings of the ``max_prefixes``
prefixes that ran last (tasks submitted under keys of their own, ``job_17``, make a prefix each): a
prefix dropped for a newer one had been unseen for that many timings at least, so its weight had halved
``max_prefixes / HALF_LIFE`` times. The observed speed then replaces the prior, so a worker that slows
down mid-run loses weight within a few tasks of each prefix (two, after a long steady run). Asked
for one prefix, the model answers with that prefix's speeds alone once every worker has them (``map``
plans a function by its own speeds).
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from dask_octopus._checks import check_finite, is_finite

RESOURCES = ("compute", "memory")


def check_resource(resource: str) -> str:
    """Return ``resource`` if it is a known resource class, else raise ``ValueError``."""
    if not isinstance(resource, str) or resource not in RESOURCES:
        raise ValueError(f"unknown resource {resource!r}: expected one of {', '.join(RESOURCES)}")
    return resource


WINDOW = 64  # timings of a (prefix, worker) kept: those since its rate last changed, at most this many
OUTER = 0.1  # the fastest and the slowest tenth of those count as the nearest of the others (winsorized)
RECENT = (3, 8, 24)  # the last timings whose median is compared with the earlier ones' for a change of rate
CHANGE = 4.0  # standard errors between those medians that make a change
RARE = 0.005  # ... if the earlier timings' share past the midpoint makes that many of the last ones past it this rare
HALF_LIFE = 32  # timings (of any prefix, on any worker) after which a prefix not seen since counts half
MEDIAN_ERROR = math.sqrt(math.pi / 2)  # standard error of the median of n normal values, in sigma / sqrt(n)
CHANGE_SPREAD = 0.954  # median |x - y| of two values of N(0, sigma^2), in sigma


def _median(values: Iterable[float]) -> float:
    # (statistics.median, without its checks: this runs for every timing)
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _rare(earlier: list[float], recent: list[float], middle: float, above: bool) -> bool:
    """Whether as many of ``recent`` past ``middle`` (above it, else below) are less likely than
    :data:`RARE` for timings past it as often as ``earlier`` were (their share, a half counted in: a
    binomial tail). A level the earlier timings showed often is a mix of fast and slow tasks (a
    co-tenant's time slices), not a change; a fluke or two among them (a warm-up) does not hide one."""
    past = (lambda v: v > middle) if above else (lambda v: v < middle)
    p = (sum(map(past, earlier)) + 0.5) / (len(earlier) + 1)
    k, x = len(recent), sum(map(past, recent))
    return sum(math.comb(k, j) * p**j * (1 - p) ** (k - j) for j in range(x, k + 1)) < RARE


@dataclass
class _Rate:
    # units per second: one over the winsorized mean time per unit of the timings since the rate last changed
    value: float = 0.0
    seconds: float = 0.0  # one task's duration: the median of theirs
    count: int = 0  # timings ever taken
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # their log rates
    times: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # seconds per unit
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # and seconds
    changes: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW - 1))  # |successive log rates|
    # standard deviation of one timing's log rate, from the median change between successive timings:
    # a step (a worker that slows down) is one large change, not noise; 0 while fewer than three are known
    steps: float = 0.0
    # the noise the evidence counts: the larger of ``steps`` and the relative spread of the winsorized times,
    # which a lasting mix of fast and slow timings widens where most successive changes are within one kind
    noise: float = 0.0

    def add(self, log_rate: float, seconds: float, first: int) -> None:
        """Add one timing; once more than ``first`` are known, drop the earlier timings when the last
        ones show that the rate changed."""
        if self.recent:
            self.changes.append(abs(log_rate - self.recent[-1]))
        self.recent.append(log_rate)
        self.times.append(math.exp(-log_rate))
        self.durations.append(seconds)
        self.count += 1
        self.steps = self._steps()
        if self.count > first:
            self._drop_before_change()
        self._locate()
        self.seconds = _median(self.durations)

    def _steps(self) -> float:
        return _median(self.changes) / CHANGE_SPREAD if len(self.recent) >= 3 else 0.0

    def _locate(self) -> None:
        times = sorted(self.times)
        n = len(times)
        outer = math.ceil(OUTER * n) if n >= 3 else 0  # (of three: the median)
        middle, low, high = times[outer:n - outer], times[outer], times[n - outer - 1]
        mean = (sum(middle) + outer * (low + high)) / n
        spread = 0.0
        if outer:  # (the sum of squares: this runs for every timing)
            squares = sum(map(operator.mul, middle, middle)) + outer * (low * low + high * high)
            spread = math.sqrt(max(0.0, squares - n * mean * mean) / (n - 1)) / mean
        self.value, self.noise = 1 / mean, max(self.steps, spread)

    def _drop_before_change(self) -> None:
        values = list(self.recent)
        n = len(values)
        for k in RECENT:
            if n - k < k:  # (as many earlier timings as later ones at least)
                return
            earlier, recent = values[:-k], values[-k:]
            last = _median(recent)
            gap = last - _median(earlier)
            if abs(gap) > CHANGE * MEDIAN_ERROR * self.steps * math.sqrt(1 / k + 1 / (n - k)) and _rare(
                    earlier, recent, last - gap / 2, gap > 0):
                # the change began with the first of the last k timings nearer to their median than to the
                # earlier ones' (half of them at least are)
                kept = k
                while abs(values[n - kept] - last) > abs(values[n - kept] - last + gap):
                    kept -= 1
                for _ in range(n - kept):
                    self.recent.popleft()
                    self.times.popleft()
                    self.durations.popleft()
                while len(self.changes) > kept - 1:
                    self.changes.popleft()
                self.steps = self._steps()
                return

    def estimate(self) -> tuple[float, float]:
        """The log rate (of the winsorized mean time per unit since it last changed) and its standard
        error (taken as a median's: the winsorized mean's lies between a mean's and a median's)."""
        return math.log(self.value), MEDIAN_ERROR * self.noise / math.sqrt(len(self.recent))


@dataclass
class SpeedModel:
    """Per-worker speed estimates; see the module docstring for the model.

    A worker's observed speed replaces its prior once a prefix it shares with another worker has
    ``confidence_samples`` observations on both. A prefix shows the workers' differences only on
    evidence: when some worker's log rate (of its mean time since it last changed) is more than
    ``significance`` standard errors away from the mean over the workers (errors from the noise of each
    worker's timings and how many there are); otherwise its workers count as equal (identical workers
    keep equal weights, however noisy their short tasks). ``max_prefixes``: the prefixes kept, those
    that ran last.
    """

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
        current.add(math.log(rate), seconds, self.confidence_samples)

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
        """The workers' log speeds relative to their mean on one prefix, as its timings show them: the
        prior's (``expected``) while no worker's log rate departs from it by more than ``significance``
        standard errors, else equal (0) while none departs from equality that far, else ``None``: the
        observed rates count."""
        n = len(seen)
        recent = {w: r.estimate() for w, r in seen.items()}
        recent_mean = sum(m for m, _ in recent.values()) / n
        errors = sum(se**2 for _, se in recent.values())

        def departs(centre: dict[str, float]) -> bool:
            # the standard error of (a worker's log rate - the mean of all n): its own share and the others'
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
