"""Pure speed model: calibration priors refined by observed task timings.

No Dask here. Each worker has a prior speed per resource (``"compute"``: FLOP/s of a GEMM probe,
``"memory"``: bytes/s of a streaming probe). Finished tasks add observations per (worker, task prefix):
a rate (work units per second, units being the bytes it read and wrote) of one over the mean time per
unit of its timings since the rate last changed, at most :data:`WINDOW` of them, winsorized: the fastest
and the slowest tenth, rounded up (:data:`OUTER`; of three timings, one each: their median), count as
the nearest of the others. The mean time, since that is what a worker's share of the work takes, slow
tasks included (a co-tenant slowing one task in three); winsorized, so that a first task that also loads
a library or plans an FFT, or one fluke 100x faster or slower than the others, does not move it; since
the rate last changed, so that it gets more precise the longer a worker runs at one speed. A rate has
changed when the median of its last few timings (:data:`RECENT`) departs from the median of the earlier
ones by more than :data:`CHANGE` standard errors of their noise, and more of them lie past the midpoint
between the two medians than the earlier timings' share there makes likely (:data:`RARE`: a level the
earlier ones showed often is a mix of fast and slow tasks, not a change); the earlier timings are then
dropped, and kept aside while the timings since the change (those that showed it included) number
RECENT[-1] at most: when the newest timings are back at that earlier level
(:meth:`_Rate._back_before_change`), those timings count again, and the ones since the change are
dropped (a worker paused for a task or two has its rate back within three timings; the change test would
wait for as many timings at the new level as before it). For a prefix seen on several workers, each
worker's rate relative to the geometric mean of the others is its observed relative speed. Prefixes
count in proportion to the time their tasks take (a 300 ms GEMM says more about a worker than a 3 ms sum
of partial results, which latency dominates), and that weight halves with every :data:`HALF_LIFE`
timings taken since the prefix last ran: a finished computation's prefixes give way to the work running
now (a worker that slows down on new, shorter tasks loses weight even after long tasks of other prefixes
ran equally everywhere). A prefix counts only on workers that ran it ``confidence_samples`` times:
one-off tasks (a rechunk while data moves) say little about the steady work. The model keeps the timings
of the ``max_prefixes`` prefixes that ran last (tasks submitted under keys of their own, ``job_17``,
make a prefix each): a prefix dropped for a newer one had been unseen for that many timings at least, so
its weight had halved ``max_prefixes / HALF_LIFE`` times. The observed speed then replaces the prior, so
a worker that slows down mid-run loses weight within a few tasks of each prefix (two, after a long
steady run). Asked for one prefix, the model answers with that prefix's speeds alone once every worker
has them (``map`` plans a function by its own speeds). A worker that no longer runs a prefix the others
still run (a map of fewer items than the workers would take gives a slow worker none) does not keep, for
ever, the speed it had when it last ran it: once it missed more than :data:`STALE` of the prefix's
timings since its latest at the share of them it took from its first to its latest, its difference there
halves every :data:`STALE` more, toward what its prior and the workers that missed none predict, until
it gets work of that prefix again and is timed: a first timing that agrees with its rate (nearer to it
than to the others' mean) ends the fading, one that does not leaves it on until the third (to the change
test one timing is a fluke).
"""

from __future__ import annotations

import math
import operator
from collections import OrderedDict, defaultdict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

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
STALE = 8  # timings of a prefix a worker missed (at its share) after which its difference there halves, and again
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


def _missed(rate: _Rate, ran: int) -> float:
    """The timings of a prefix that a worker of ``rate`` would have taken of those since its latest
    (``ran``: the prefix's timings, all workers), at the share of them it took from its first to its
    latest (which its threads, its speed and how its tasks come, one by one or in batches, all set)."""
    return (ran - rate.at) * rate.count / max(1, rate.at - rate.first)


def _fit_workers(entries: list[tuple[Hashable, str, float, float]], prior: dict[str, float]) -> dict[str, float]:
    """Each worker's log speed ``b[w]`` of the additive fit ``y = a[prefix] + b[worker]`` to the entries
    ``(prefix, worker, weight, y)`` (a prefix: any key), by weighted least squares: the prefixes' levels
    eliminated, the normal equations of each group of workers linked by the prefixes they share are
    solved at once, and each group keeps the mean of its workers' ``prior`` (log, missing: 0). Averaging
    each worker's own entries instead biased workers that ran other prefixes than the rest: ``b`` and
    ``c`` as fast, ``a`` half as fast, ``p1`` on ``a`` and ``b``, ``p2`` on ``b`` and ``c`` gave 0.241,
    0.418, 0.341 for 0.2, 0.4, 0.4."""
    if not entries:
        return {}
    by_prefix: dict[Hashable, list[tuple[str, float, float]]] = defaultdict(list)
    for prefix, worker, weight, y in entries:
        by_prefix[prefix].append((worker, weight, y))
    group = {worker: worker for _, worker, _, _ in entries}

    def root(w: str) -> str:
        while group[w] != w:
            group[w] = group[group[w]]
            w = group[w]
        return w

    for rows in by_prefix.values():
        first = root(rows[0][0])
        for w, _, _ in rows[1:]:
            group[root(w)] = first
    members: dict[str, list[int]] = defaultdict(list)
    workers = list(group)
    for i, w in enumerate(workers):
        members[root(w)].append(i)
    # the weighted normal equations of all the workers, each prefix's level eliminated: weights per worker
    # and prefix (a matrix), each prefix's weighted mean
    index = {w: i for i, w in enumerate(workers)}
    at = np.array([index[w] for rows in by_prefix.values() for w, _, _ in rows])
    of = np.array([j for j, rows in enumerate(by_prefix.values()) for _ in rows])
    wt = np.array([weight for rows in by_prefix.values() for _, weight, _ in rows])
    y = np.array([v for rows in by_prefix.values() for _, _, v in rows])
    weights = np.zeros((len(workers), len(by_prefix)))
    np.add.at(weights, (at, of), wt)
    totals = weights.sum(axis=0)
    means = np.bincount(of, wt * y, len(by_prefix)) / totals
    normal = np.diag(weights.sum(axis=1)) - (weights / totals) @ weights.T
    rhs = np.bincount(at, wt * (y - means[of]), len(workers))
    speed: dict[str, float] = {}
    for ids in members.values():
        fitted = np.zeros(len(ids))
        fitted[1:] = np.linalg.solve(normal[np.ix_(ids[1:], ids[1:])], rhs[ids[1:]])  # (the first one at 0)
        fitted += sum(prior.get(workers[i], 0.0) for i in ids) / len(ids) - fitted.mean()  # the group's prior mean
        speed.update(zip((workers[i] for i in ids), fitted.tolist()))
    return speed


@dataclass
class _Rate:
    # units per second: one over the winsorized mean time per unit of the timings since the rate last changed
    value: float = 0.0
    seconds: float = 0.0  # one task's duration: the median of theirs
    count: int = 0  # timings ever taken
    # the prefix's timings (all workers) at the latest of them, but for a worker back from missing STALE:
    # at the one before it came back, until its timings agree with its rate or RECENT[0] of them came
    at: int = 0
    returning: int = RECENT[0]  # timings since it came back, up to RECENT[0]
    first: int = 0  # the prefix's timings before this worker's first
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
    # after a change: the timings dropped (log rates and seconds), their noise (``steps``), their median
    # and the median of the timings that made the change, while RECENT[-1] timings at most are kept since
    before: tuple[list[float], list[float], float, float, float] | None = None

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
        if self.count > first and not self._back_before_change():
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
                self.before = (values[:n - kept], list(self.durations)[:n - kept], self.steps, last - gap, last)
                self._keep([], [], kept)
                return

    def _back_before_change(self) -> bool:
        """Whether the last timings are back at the level before the last change, and if so, keep that
        level's timings and theirs (the ones since the change dropped): the last ``RECENT[0]`` timings all
        lie nearer to that level than to the median of the timings since the change, more of them than
        those make likely (:func:`_rare`), and their median lies within :data:`CHANGE` standard errors of
        that level's noise and beyond as many of the noise since the change (as the change test has it).
        A worker slowed down for a task or two (a pause) is back within three timings, where the change
        test would wait for as many timings at the new level as before it."""
        if self.before is None:
            return False
        if len(self.recent) > RECENT[-1]:  # a level of its own, which the change test follows
            self.before = None
            return False
        log_rates, durations, steps, level, changed = self.before
        if abs(self.recent[-1] - level) >= abs(self.recent[-1] - changed):  # (this runs for every timing)
            return False
        k = RECENT[0]
        values = list(self.recent)
        if len(values) <= k:
            return False
        recent, since = values[-k:], values[:-k]
        changed = _median(since) if since else changed  # (the change's own timings: a median biased outward)
        if any(abs(v - level) >= abs(v - changed) for v in recent):
            return False
        last = _median(recent)
        if (abs(last - level) > CHANGE * MEDIAN_ERROR * steps * math.sqrt(1 / k + 1 / len(log_rates))
                or abs(last - changed) <= CHANGE * MEDIAN_ERROR * self.steps * math.sqrt(1 / k + 1 / len(since))
                or not _rare(since, recent, (level + changed) / 2, level > changed)):
            return False
        self._keep(log_rates, durations, k)
        return True

    def _keep(self, log_rates: list[float], durations: list[float], last: int) -> None:
        """Keep ``log_rates`` (with their ``durations``) and the ``last`` timings only."""
        values = [*log_rates, *list(self.recent)[-last:]][-WINDOW:]
        seconds = [*durations, *list(self.durations)[-last:]][-WINDOW:]
        self.recent = deque(values, maxlen=WINDOW)
        self.times = deque((math.exp(-v) for v in values), maxlen=WINDOW)
        self.durations = deque(seconds, maxlen=WINDOW)
        self.changes = deque((abs(y - x) for x, y in pairwise(values)), maxlen=WINDOW - 1)
        if log_rates:
            self.before = None
        self.steps = self._steps()

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
    ran: dict[str, int] = field(default_factory=dict)  # timings of each prefix kept, all workers

    def set_prior(self, worker: str, speeds: dict[str, float]) -> None:
        """Record the calibrated speeds of ``worker``; non-finite or non-positive ones are refused."""
        for resource, value in speeds.items():
            check_resource(resource)
            check_finite(value, f"{resource} speed of {worker}")
        self.priors[worker] = dict(speeds)

    def forget_prior(self, worker: str) -> None:
        """Forget the calibrated speeds of ``worker`` (its timings stand): it counts as uncalibrated."""
        self.priors.pop(worker, None)

    def remove(self, worker: str) -> None:
        """Forget everything about ``worker``."""
        self.forget_prior(worker)
        for prefix, per_worker in list(self.rates.items()):
            per_worker.pop(worker, None)
            if not per_worker:
                del self.rates[prefix], self.last_seen[prefix], self.ran[prefix]

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
            dropped = self.last_seen.popitem(last=False)[0]
            del self.rates[dropped], self.ran[dropped]
        self.last_seen[prefix] = self.clock
        ran = self.ran.get(prefix, 0)
        self.ran[prefix] = ran + 1
        per_worker = self.rates[prefix]
        current = per_worker.get(worker) or per_worker.setdefault(worker, _Rate(at=ran, first=ran))
        log_rate = math.log(rate)
        if current.returning == RECENT[0] and _missed(current, ran) > STALE:
            current.returning = 0  # back from missing its share: its difference fades on (see _faded) ...
        if current.returning < RECENT[0]:
            others = [math.log(r.value) for r in per_worker.values() if r is not current and r.value > 0]
            mean = sum(others) / len(others) if others else log_rate
            if abs(log_rate - math.log(current.value)) <= abs(log_rate - mean):
                current.returning = RECENT[0] - 1  # ... unless its timings agree with its rate
        current.add(log_rate, seconds, self.confidence_samples)
        current.returning = min(current.returning + 1, RECENT[0])
        if current.returning == RECENT[0]:  # ... or RECENT[0] came, which can show a change
            current.at = ran + 1

    def _observed(self, workers: list[str], prefixes: Iterable[str] | None = None,
                  prior: dict[str, float] | None = None) -> tuple[dict[str, float], dict[str, int]]:
        """Observed relative speed and sample count per worker, over
        ``prefixes`` (default: all, each weighing less by the timings taken since it last ran,
        :data:`HALF_LIFE`). ``prior``: each worker's log prior speed; a prefix whose recent timings
        agree with the prior's differences keeps them. The workers' log speeds are fitted over all the
        prefixes at once (:func:`_fit_workers`), and the workers linked by the prefixes they ran keep the
        geometric mean of their priors (without ``prior``: 1), so prefixes run on some of the workers
        move them against each other only, not against the others."""
        # per set of workers that ran a prefix: each worker's weight and weighted log speeds, summed over such
        # prefixes (a prefix weighs every worker alike, so these sums fit as the prefixes would one by one)
        sets: dict[frozenset[str], dict[str, list[float]]] = defaultdict(dict)
        samples: dict[str, int] = defaultdict(int)
        chosen = self.rates if prefixes is None else [p for p in prefixes if p in self.rates]
        asked = set(workers)
        for prefix in chosen:
            per_worker = self.rates[prefix]
            seen = {w: r for w, r in per_worker.items() if w in asked and r.count >= self.confidence_samples}
            if len(seen) < 2:
                continue
            n = len(seen)
            duration = sum(r.seconds for r in seen.values()) / n
            expected = {w: (prior or {}).get(w, 0.0) for w in seen}
            expected_mean = sum(expected.values()) / n
            expected = {w: e - expected_mean for w, e in expected.items()}
            difference = self._difference(seen, expected) or self._faded(seen, expected, self.ran[prefix])
            # (asked for chosen prefixes, each counts as it is: a lone prefix's age would only scale it)
            age = 1.0 if prefixes is not None else 0.5 ** ((self.clock - self.last_seen[prefix]) / HALF_LIFE)
            weight = self.confidence_samples * duration * age  # (every worker seen ran it that often at least)
            if not weight > 0:  # (underflow: ~34,000 timings since the prefix ran) it counts no more
                continue
            sums = sets[frozenset(seen)]
            for w, r in seen.items():
                total = sums.setdefault(w, [0.0, 0.0])
                total[0] += weight
                # on the prior's scale: the workers that ran the prefix keep their prior mean
                total[1] += weight * (expected_mean + difference[w])
                samples[w] += r.count
        fitted = _fit_workers([(key, w, wt, y / wt) for key, sums in sets.items() for w, (wt, y) in sums.items()],
                              prior or {})
        return {w: math.exp(v) for w, v in fitted.items()}, dict(samples)

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

    @staticmethod
    def _faded(seen: dict[str, _Rate], expected: dict[str, float], ran: int) -> dict[str, float]:
        """The workers' observed log speeds relative to their mean on one prefix, each worker's faded
        toward what the prior (``expected``) and the others that missed none predict for it once it missed
        more than :data:`STALE` of the prefix's timings (:func:`_missed`; ``ran``: the prefix's timings),
        halving every :data:`STALE` more: a
        worker given none of a function's items (a map of fewer items than it would take) gets some again,
        and is timed again, instead of keeping the speed it had when it last ran them."""
        logs = {w: math.log(r.value) for w, r in seen.items()}
        missed = {w: _missed(r, ran) - STALE for w, r in seen.items()}
        fresh = [logs[w] - expected[w] for w in seen if missed[w] <= 0]  # (their speeds on the prior's scale)
        faded = dict(logs)
        for w in seen:
            if missed[w] > 0 and fresh:
                predicted = sum(fresh) / len(fresh) + expected[w]
                faded[w] = predicted + 0.5 ** (missed[w] / STALE) * (logs[w] - predicted)
        mean = sum(faded.values()) / len(faded)
        return {w: v - mean for w, v in faded.items()}

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
