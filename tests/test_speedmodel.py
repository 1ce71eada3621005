"""The speed model: priors, online refinement, and refused inputs."""

import math
import random
import statistics
from itertools import pairwise

import pytest

from dask_octopus.profiling.speedmodel import CHANGE, HALF_LIFE, RARE, STALE, SpeedModel


def test_priors_give_weights_per_resource():
    m = SpeedModel()
    m.set_prior("a", {"compute": 3e12, "memory": 1e9})
    m.set_prior("b", {"compute": 1e12, "memory": 1e9})
    assert m.weights(["a", "b"], "compute") == pytest.approx({"a": 0.75, "b": 0.25})
    assert m.weights(["a", "b"], "memory") == pytest.approx({"a": 0.5, "b": 0.5})


def test_uncalibrated_worker_gets_the_mean():
    m = SpeedModel()
    m.set_prior("a", {"compute": 4.0, "memory": 1.0})
    m.set_prior("b", {"compute": 1.0, "memory": 1.0})
    w = m.weights(["a", "b", "c"])
    assert w["c"] == pytest.approx(w["b"] * 2)  # geometric mean of 4 and 1 is 2


def test_a_worker_that_slows_down_loses_weight_within_a_few_tasks():
    m = SpeedModel(confidence_samples=3)
    m.set_prior("a", {"compute": 1.0, "memory": 1.0})
    m.set_prior("b", {"compute": 1.0, "memory": 1.0})
    for _ in range(3):
        m.observe("a", "mul", 100, 1.0)
        m.observe("b", "mul", 100, 1.0)
    assert m.weights(["a", "b"])["a"] == pytest.approx(0.5)
    weights = []
    for _ in range(4):  # a becomes twice as slow
        m.observe("a", "mul", 100, 2.0)
        m.observe("b", "mul", 100, 1.0)
        weights.append(m.weights(["a", "b"])["a"])
    # two slow timings after three: not yet a change (three timings against two); the third is
    assert weights == pytest.approx([0.5, 0.5, 1 / 3, 1 / 3])
    assert m.samples() == {"a": 7, "b": 7}


def test_a_finished_computation_s_prefixes_give_way_to_the_work_running_now():
    """Long tasks ran equally on both workers; then ``a`` is three times slower on new, shorter tasks.
    The old prefix's weight halves every HALF_LIFE timings since it last ran: the new prefix decides."""
    m = SpeedModel()
    for _ in range(20):
        m.observe("a", "matmul", 1e8, 0.3)
        m.observe("b", "matmul", 1e8, 0.3)
    for _ in range(3):  # the new prefix counts: its duration-weighted say is 0.04 s against 0.3 s
        m.observe("a", "add", 1e6, 0.06)
        m.observe("b", "add", 1e6, 0.02)
    young = m.weights(["a", "b"])["a"]
    # log speed of a on add: -ln(3)/2 against b; matmul says 0: weights 3 x 0.04 and 3 x 0.3 x 2^(-6/HALF_LIFE)
    old = 0.9 * 0.5 ** (6 / HALF_LIFE)
    assert young == pytest.approx(1 / (1 + 3 ** (0.12 / (0.12 + old))))
    for _ in range(5 * HALF_LIFE):
        m.observe("a", "add", 1e6, 0.06)
        m.observe("b", "add", 1e6, 0.02)
    assert m.weights(["a", "b"])["a"] == pytest.approx(0.25, abs=0.005)  # a third of b's speed
    assert m.weights(["a", "b"], prefix="matmul") == pytest.approx({"a": 0.5, "b": 0.5})  # its own speeds kept


def test_a_worker_that_no_longer_runs_a_prefix_fades_toward_the_others_and_runs_it_again():
    """``a`` was 3x slower on ``f`` (a co-tenant): a map of few items gives it none, and only ``b``
    runs ``f`` from then on. Once ``a`` missed more than STALE timings at the share it took (5 of the
    prefix's first 9), its difference on ``f`` halves every STALE more, so that it gets items again;
    back on ``f`` as slow as before, its first timing agrees with its rate and ends the fading."""
    m = SpeedModel()
    for _ in range(5):
        m.observe("a", "f", 100, 3.0)
        m.observe("b", "f", 100, 1.0)
    assert m.weights("ab", prefix="f")["a"] == pytest.approx(0.25)

    def faded(since):  # a's weight, ``since`` timings of f after a's latest
        fade = 0.5 ** (max(0.0, since * 5 / 9 - STALE) / STALE)
        return 1 / (1 + 3**fade)

    for _ in range(13):  # (b's fifth timing came after a's last)
        m.observe("b", "f", 100, 1.0)
    assert m.weights("ab", prefix="f")["a"] == pytest.approx(0.25) == pytest.approx(faded(14))  # not yet
    for _ in range(15):
        m.observe("b", "f", 100, 1.0)
    assert 0.3 < m.weights("ab", prefix="f")["a"] == pytest.approx(faded(29))
    assert m.weights("ab")["a"] == pytest.approx(faded(29))  # the weights over all prefixes alike
    for _ in range(40 * STALE):
        m.observe("b", "f", 100, 1.0)
    assert m.weights("ab", prefix="f")["a"] == pytest.approx(0.5, abs=1e-3)
    m.observe("a", "f", 100, 3.0)
    assert m.weights("ab", prefix="f")["a"] == pytest.approx(0.25)


def test_a_worker_back_on_a_prefix_as_fast_as_the_others_counts_as_fast_from_its_third_timing():
    """Back on ``f`` faster than its rate (nearer to the others' rates), ``a``'s difference fades on until
    its third timing, which shows the change (one timing is a fluke)."""
    m = SpeedModel()
    for _ in range(8):
        m.observe("a", "f", 100, 3.0)
        m.observe("b", "f", 100, 1.0)
    for _ in range(4 * STALE + 16):
        m.observe("b", "f", 100, 1.0)
    faded = m.weights("ab", prefix="f")["a"]
    assert 0.25 < faded < 0.5
    weights = []
    for _ in range(3):  # a's co-tenant left: a as fast as b again
        m.observe("a", "f", 100, 1.0)
        weights.append(m.weights("ab", prefix="f")["a"])
    assert faded <= weights[0] <= weights[1] < 0.5 and weights[2] == pytest.approx(0.5)


def test_a_worker_new_to_a_prefix_the_others_ran_long_is_not_stale():
    """A worker that joins late (or runs a prefix for the first time) never fell behind on it: its
    timings count as soon as there are ``confidence_samples`` of them."""
    m = SpeedModel(confidence_samples=1)
    for _ in range(4 * STALE):
        m.observe("a", "f", 100, 1.0)
    m.observe("c", "f", 100, 3.0)
    assert m.weights("ac", prefix="f")["c"] == pytest.approx(0.25)


def test_a_worker_whose_calibration_differs_fades_toward_its_calibrated_difference():
    """Stale evidence fades toward what the prior predicts (here ``a`` calibrated 2x ``b``), not toward equal."""
    m = SpeedModel()
    m.set_prior("a", {"compute": 2.0, "memory": 2.0})
    m.set_prior("b", {"compute": 1.0, "memory": 1.0})
    for _ in range(5):
        m.observe("a", "f", 100, 1.0)  # a 8x b on f: the calibration contradicted
        m.observe("b", "f", 100, 8.0)
    assert m.weights("ab", prefix="f")["a"] == pytest.approx(8 / 9)
    for _ in range(20 * STALE):
        m.observe("b", "f", 100, 8.0)
    assert m.weights("ab", prefix="f")["a"] == pytest.approx(2 / 3, abs=1e-3)


@pytest.mark.parametrize("workers", [8, 32])
def test_a_slow_worker_that_keeps_running_its_share_is_not_stale_among_many(workers):
    """Each worker takes the next task when free; ``w0`` is 4x slower throughout, so it runs one task of
    the prefix in every ``4 * workers - 3`` or so: its weight follows the truth (a gap counted in timings of
    the prefix, not scaled by its share, made it look up to 3x faster with 32 workers)."""
    m = SpeedModel()
    seconds = {f"w{i}": 4.0 if i == 0 else 1.0 for i in range(workers)}
    free = dict.fromkeys(seconds, 0.0)
    for _ in range(40 * workers):
        w = min(free, key=free.get)
        free[w] += seconds[w]
        m.observe(w, "f", 100, seconds[w])
    truth = 0.25 / (0.25 + workers - 1)
    assert m.weights(seconds, prefix="f")["w0"] == pytest.approx(truth, rel=0.01)


def test_a_worker_of_few_threads_running_its_share_is_not_stale():
    """``a`` (one thread, 2x slower per task) and ``b`` (32 threads) take the next task when a thread is
    free: ``a`` runs one task in 65 or so, its share; its weight stays at the truth, 1/3 (a share taken
    from the rates alone made it stale: up to 0.446)."""
    m = SpeedModel()
    seconds = {"a": 2.0, "b": 1.0}
    free = [(0.0, "a", 0)] + [(0.0, "b", t) for t in range(32)]
    weights = []
    for i in range(3000):
        at, w, t = min(free)
        free.remove((at, w, t))
        free.append((at + seconds[w], w, t))
        m.observe(w, "f", 100, seconds[w])
        if i > 300:
            weights.append(m.weights("ab", prefix="f")["a"])
    assert min(weights) == pytest.approx(1 / 3) == pytest.approx(max(weights))


def test_other_prefixes_and_pauses_do_not_make_a_worker_stale():
    """``a`` runs ``x`` 4x slower as often as ``b`` and ``c`` do, between many timings of other prefixes,
    and after a pause in which no one ran ``x``: its weight on ``x`` stays 1/9 (a gap counted in timings
    of every prefix made ``a`` and ``b`` stale next to ``c``, which ran ``x`` last)."""
    m = SpeedModel()
    for i in range(30):
        m.observe("a", "x", 100, 4.0)
        m.observe("b", "x", 100, 1.0)
        for _ in range(20 if i != 15 else 500):
            m.observe("a", "other", 100, 1.0)
            m.observe("b", "other", 100, 1.0)
        m.observe("c", "x", 100, 1.0)
        if i >= 2:  # (three timings each)
            assert m.weights("abc", prefix="x")["a"] == pytest.approx(1 / 9)


def test_stale_workers_fade_toward_the_workers_that_are_not():
    """``a`` (4x slower) and ``b`` (2x slower) stopped running ``f``; ``c`` runs it on: both fade toward
    ``c`` and never cross (each fading toward the other's unfaded rate made ``a`` faster than ``b``)."""
    m = SpeedModel()
    for _ in range(5):
        for w, t in (("a", 4.0), ("b", 2.0), ("c", 1.0)):
            m.observe(w, "f", 100, t)
    for _ in range(100 * STALE):
        m.observe("c", "f", 100, 1.0)
        weights = m.weights("abc", prefix="f")
        assert weights["a"] <= weights["b"] <= weights["c"]
    assert weights == pytest.approx(dict.fromkeys("abc", 1 / 3), abs=1e-3)


def test_a_prefix_whose_weight_underflows_counts_no_more_but_keeps_its_own_speeds(monkeypatch):
    from dask_octopus.profiling import speedmodel

    monkeypatch.setattr(speedmodel, "HALF_LIFE", 1e-3)  # 0.5 ** (timings / 1e-3): 0.0 after one timing
    m = SpeedModel()
    for _ in range(3):
        m.observe("a", "f", 200, 1.0)  # a twice as fast on f
        m.observe("b", "f", 100, 1.0)
    m.observe("a", "other", 100, 1.0)
    m.observe("b", "other", 100, 1.0)
    assert m.weights(["a", "b"]) == pytest.approx({"a": 0.5, "b": 0.5})  # f counts no more; other is too new
    assert m.samples() == {}
    assert m.weights(["a", "b"], prefix="f") == pytest.approx({"a": 2 / 3, "b": 1 / 3})  # its own, not aged
    for _ in range(3):  # b twice as fast on other: f, first among the prefixes, does not hide it
        m.observe("a", "other", 100, 1.0)
        m.observe("b", "other", 200, 1.0)
    weights = m.weights(["a", "b"])
    assert weights["b"] / weights["a"] == pytest.approx(2)  # 100, then three of 200: the first three's median


def test_a_weight_that_underflows_to_zero_counts_no_more(monkeypatch):
    from dask_octopus.profiling import speedmodel

    monkeypatch.setattr(speedmodel, "HALF_LIFE", 1 / 1074)  # one timing later: 0.5 ** 1074, the least float
    m = SpeedModel()
    for _ in range(3):  # a and b share "old", 3 ms tasks: 3 * 0.003 * 0.5 ** 1074 is 0.0
        m.observe("a", "old", 1e6, 0.003)
        m.observe("b", "old", 1e6, 0.003)
    m.observe("c", "new", 1e6, 0.003)  # (a paused, or running only tasks under min-duration)
    assert m.weights(["a", "b", "c"]) == pytest.approx(dict.fromkeys("abc", 1 / 3))  # was a ZeroDivisionError
    assert m.samples() == {}


@pytest.mark.parametrize("units, seconds", [(5e-324, 10.0), (1e308, 1e-10)])
def test_a_rate_that_is_not_finite_and_positive_is_refused_before_anything_changes(units, seconds):
    m = SpeedModel()
    with pytest.raises(ValueError, match=r"task rate .* must be finite and > 0"):
        m.observe("a", "p", units, seconds)
    assert (m.clock, m.table(), dict(m.last_seen)) == (0, {}, {})
    m.observe("a", "p", 1.0, 1.0)  # the next timing is taken as usual
    assert m.table() == {"p": {"a": (1.0, 1.0, 1)}}


def test_a_warm_up_timing_does_not_move_a_worker_off_its_speed():
    m = SpeedModel()  # two identical workers; b's first task of f also loads its library (1 s)
    m.set_prior("a", {"compute": 1.0, "memory": 1.0})
    m.set_prior("b", {"compute": 1.0, "memory": 1.0})
    for i in range(10):
        m.observe("a", "f", 1e6, 0.010 + 0.0002 * (i % 3))
        m.observe("b", "f", 1e6, 0.010 + 0.0002 * ((i + 1) % 3) + (1.0 if i == 0 else 0.0))
        assert m.weights(["a", "b"])["b"] == pytest.approx(0.5, abs=0.02), i  # was 0.07 after the third


def test_units_normalise_block_size():
    m = SpeedModel(confidence_samples=1)
    m.observe("a", "mul", 300, 3.0)  # three times the rows in three times the time: same speed
    m.observe("b", "mul", 100, 1.0)
    assert m.weights(["a", "b"]) == pytest.approx({"a": 0.5, "b": 0.5})


def test_prefix_seen_on_one_worker_does_not_count():
    m = SpeedModel(confidence_samples=1)
    m.set_prior("a", {"compute": 1.0, "memory": 1.0})
    m.set_prior("b", {"compute": 1.0, "memory": 1.0})
    m.observe("a", "only-a", 1, 100.0)
    assert m.weights(["a", "b"]) == pytest.approx({"a": 0.5, "b": 0.5})
    assert m.samples() == {}


def test_a_prefix_is_weighed_by_its_own_speeds_once_every_worker_ran_it():
    m = SpeedModel(confidence_samples=2)
    for _ in range(2):  # a is 3x faster on gemm, b 2x faster on small launches, which take longer
        m.observe("a", "gemm", 300, 1.0)
        m.observe("b", "gemm", 100, 1.0)
        m.observe("a", "launch", 100, 4.0)
        m.observe("b", "launch", 200, 4.0)
    assert m.weights(["a", "b"], prefix="gemm") == pytest.approx({"a": 0.75, "b": 0.25})
    assert m.weights(["a", "b"], prefix="launch") == pytest.approx({"a": 1 / 3, "b": 2 / 3})
    mixed = m.weights(["a", "b"])
    assert mixed["b"] > 0.5 and mixed != m.weights(["a", "b"], prefix="launch")  # all prefixes, by time
    assert m.weights(["a", "b"], prefix="unseen") == mixed
    m.observe("c", "gemm", 100, 1.0)
    m.observe("c", "gemm", 100, 1.0)
    m.observe("c", "launch", 100, 1.0)  # c ran "launch" once: not enough, all prefixes decide
    assert m.weights(["a", "b", "c"], prefix="launch") == m.weights(["a", "b", "c"])


@pytest.mark.parametrize("b_seconds, expected", [
    (1.0, [0.4, 0.4, 0.1, 0.1]),  # a and b 4x c and d, as calibrated; a and b equal, as calibrated
    (4.0, [4 / 7, 1 / 7, 1 / 7, 1 / 7]),  # a 4x the others; b, c and d equal: b's timings confirm it
])
def test_a_prefix_run_on_some_workers_moves_them_against_each_other_only(b_seconds, expected):
    """Timings that agree with the calibration leave the weights as calibrated, although only two of the
    four workers ran the prefix (it moved them to the others' scale: a and b 0.33 each, then b below c)."""
    m = SpeedModel()
    priors = dict(zip("abcd", [4.0, 4.0, 1.0, 1.0] if b_seconds == 1.0 else [4.0, 1.0, 1.0, 1.0]))
    for w, speed in priors.items():
        m.set_prior(w, {"compute": speed, "memory": speed})
    for _ in range(5):
        m.observe("a", "p", 100, 1.0)
        m.observe("b", "p", 100, b_seconds)
    assert m.weights("abcd") == pytest.approx(dict(zip("abcd", expected)))


def test_workers_that_ran_different_prefixes_are_fitted_together():
    """``b`` and ``c`` as fast, ``a`` half as fast; ``p1`` ran on ``a`` and ``b``, ``p2`` on ``b`` and ``c``:
    ``b`` links them (each worker's own prefixes averaged gave 0.241, 0.418, 0.341)."""
    m = SpeedModel()
    for w in "abc":
        m.set_prior(w, {"compute": 1.0, "memory": 1.0})
    for _ in range(20):
        m.observe("a", "p1", 1.0, 0.2)
        m.observe("b", "p1", 1.0, 0.1)
        m.observe("b", "p2", 1.0, 0.1)
        m.observe("c", "p2", 1.0, 0.1)
    assert m.weights("abc") == pytest.approx({"a": 0.2, "b": 0.4, "c": 0.4})


def test_workers_fitted_together_keep_the_mean_of_their_calibrations_against_the_others():
    """``a``, ``b``, ``c`` linked by ``p1`` (long tasks, ``b`` 2x ``a``) and ``p2`` (short ones, ``b`` 2x
    ``c``), ``d`` ran nothing: all calibrated alike, the three keep ``d``'s speed as their geometric mean."""
    m = SpeedModel()
    for w in "abcd":
        m.set_prior(w, {"compute": 1.0, "memory": 1.0})
    for _ in range(3):
        m.observe("a", "p1", 1.0, 2.0)
        m.observe("b", "p1", 1.0, 1.0)
    for _ in range(5):
        m.observe("b", "p2", 1.0, 0.01)
        m.observe("c", "p2", 1.0, 0.02)
    speeds = {"a": 2 ** (-1 / 3), "b": 2 ** (2 / 3), "c": 2 ** (-1 / 3), "d": 1.0}
    total = sum(speeds.values())
    assert m.weights("abcd") == pytest.approx({w: v / total for w, v in speeds.items()})


def test_workers_linked_by_no_prefix_keep_their_groups_calibrated_means():
    """``p1`` on ``a`` (2x slower) and ``b``, ``p2`` on ``c`` and ``d`` (as fast), ``p3`` on ``c`` and ``d``
    (``c`` 4x faster, longer tasks): each pair keeps the mean of its calibrations, 1 and 2."""
    m = SpeedModel()
    for w, speed in zip("abcd", [1.0, 1.0, 2.0, 2.0]):
        m.set_prior(w, {"compute": speed, "memory": speed})
    for _ in range(5):
        m.observe("a", "p1", 1.0, 0.2)
        m.observe("b", "p1", 1.0, 0.1)
        m.observe("c", "p2", 1.0, 0.1)
        m.observe("d", "p2", 1.0, 0.1)
        m.observe("c", "p3", 1.0, 0.1)
        m.observe("d", "p3", 1.0, 0.4)
    # c and d: p2 says equal, p3 4x; p3 weighs its tasks' 0.25 s, p2 its 0.1 s, aged by the 2 timings since
    p2 = 0.1 * 0.5 ** (2 / HALF_LIFE)
    ratio = 4 ** (0.25 / (0.25 + p2))
    speeds = {"a": 1 / math.sqrt(2), "b": math.sqrt(2), "c": 2 * math.sqrt(ratio), "d": 2 / math.sqrt(ratio)}
    total = sum(speeds.values())
    assert m.weights("abcd") == pytest.approx({w: v / total for w, v in speeds.items()})


def test_noisy_timings_that_agree_with_the_calibration_on_some_workers_leave_it_in_place():
    """Two of four workers ran a prefix, a about 4x b as calibrated (within the noise): the calibrated
    weights stand, the differences as the calibration has them, centred on the two workers' own."""
    m = SpeedModel()
    for w, speed in zip("abcd", [4.0, 1.0, 1.0, 1.0]):
        m.set_prior(w, {"compute": speed, "memory": speed})
    for noise, other in zip([1.0, 1.2, 0.85, 1.1, 0.9], [1.1, 0.9, 1.2, 0.85, 1.05]):
        m.observe("a", "p", 100, noise)
        m.observe("b", "p", 100, 4.0 * other)  # medians: a 100, b 100 / 4.2 units/s
    assert m.weights("abcd") == pytest.approx(dict(zip("abcd", [4 / 7, 1 / 7, 1 / 7, 1 / 7])))


def test_remove_forgets_a_worker():
    m = SpeedModel(confidence_samples=1)
    m.set_prior("a", {"compute": 1.0, "memory": 1.0})
    m.observe("a", "p", 1, 1.0)
    m.observe("b", "p", 1, 1.0)
    m.remove("a")
    assert "a" not in m.priors and "a" not in m.rates["p"]


def test_the_prefixes_that_ran_last_are_kept_and_the_least_recent_dropped():
    """Tasks under keys of their own make a prefix each: the model keeps ``max_prefixes`` of them, those
    that ran last (a prefix running again moves to the front), with their speeds."""
    m = SpeedModel(confidence_samples=1, max_prefixes=2)
    m.observe("a", "gemm", 300, 1.0)
    m.observe("b", "gemm", 100, 1.0)
    m.observe("a", "job_1", 1, 1.0)
    m.observe("a", "gemm", 300, 1.0)  # gemm ran after job_1
    m.observe("b", "job_2", 1, 1.0)  # job_1 dropped
    assert set(m.table()) == {"gemm", "job_2"} and set(m.last_seen) == {"gemm", "job_2"}
    assert m.weights(["a", "b"], prefix="gemm") == pytest.approx({"a": 0.75, "b": 0.25})
    for i in range(10_000):
        m.observe("a", f"job_{i}", 1, 1.0)
    assert len(m.rates) == len(m.last_seen) == 2
    assert m.weights(["a", "b"]) == {"a": 0.5, "b": 0.5}  # gemm's timings dropped too


def test_a_prefix_no_worker_ran_any_more_is_forgotten():
    m = SpeedModel(confidence_samples=1, max_prefixes=2)
    m.observe("a", "only-a", 1, 1.0)
    m.observe("b", "both", 1, 1.0)
    m.observe("a", "both", 1, 1.0)
    m.remove("a")
    assert set(m.rates) == set(m.last_seen) == {"both"}
    m.observe("b", "new", 1, 1.0)
    m.observe("b", "newer", 1, 1.0)  # the room the forgotten prefix left is taken: both dropped
    assert set(m.rates) == {"new", "newer"}


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan, math.inf])
def test_bad_durations_are_refused(seconds):
    with pytest.raises(ValueError, match="duration"):
        SpeedModel().observe("a", "p", 1, seconds)


@pytest.mark.parametrize("units", [0, -5, math.nan])
def test_bad_units_are_refused(units):
    with pytest.raises(ValueError, match="units"):
        SpeedModel().observe("a", "p", units, 1.0)


@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, "fast"])
def test_bad_priors_are_refused(value):
    with pytest.raises(ValueError, match="compute speed"):
        SpeedModel().set_prior("a", {"compute": value})


def test_unknown_resource_and_no_workers():
    with pytest.raises(ValueError, match="unknown resource 'disk'"):
        SpeedModel().weights(["a"], "disk")
    with pytest.raises(ValueError, match="no workers"):
        SpeedModel().weights([])


def test_long_tasks_outweigh_short_ones():
    m = SpeedModel(confidence_samples=1)
    m.observe("a", "gemm", 100, 0.6)  # a is half as fast on the long GEMMs
    m.observe("b", "gemm", 100, 0.3)
    m.observe("a", "sum", 100, 0.003)  # and looks as fast on a short, latency-bound sum
    m.observe("b", "sum", 100, 0.003)
    w = m.weights(["a", "b"])
    assert w["a"] / w["b"] == pytest.approx(0.5, rel=0.02)


# +-20% noise, out of phase: after 12 timings the rates end equal; after 3 (the fewest that count,
# confidence_samples: their medians), 1.5x apart
@pytest.mark.parametrize("timings", [12, 3])
def test_identical_workers_keep_equal_weights_whatever_the_noise_of_their_timings(timings):
    m = SpeedModel(confidence_samples=3)
    for i in range(timings):
        m.observe("a", "sum", 100, 0.004 * (1.2 if i % 2 else 0.8))
        m.observe("b", "sum", 100, 0.004 * (0.8 if i % 2 else 1.2))
    assert m.weights(["a", "b"]) == {"a": 0.5, "b": 0.5}


def test_a_steady_difference_counts_in_full_however_noisy():
    rng = random.Random(0)
    m = SpeedModel(confidence_samples=3)
    for _ in range(10):  # b is twice as slow, +-5% noise on both
        m.observe("a", "mul", 100, math.exp(rng.gauss(0, 0.05)))
        m.observe("b", "mul", 100, 2 * math.exp(rng.gauss(0, 0.05)))
    w = m.weights(["a", "b"])
    assert w["a"] / w["b"] > 1.5  # (the rates end 1.94x apart)
    m.significance = 0.0  # no evidence asked for: the same, the difference is far beyond the noise
    assert m.weights(["a", "b"]) == w


# Added for mutation testing (tools/mutation.sh, docs/testing.md): behaviours the tests above left open.


def test_errors_name_the_problem_in_full():
    with pytest.raises(ValueError, match=r"^unknown resource 'disk': expected one of compute, memory$"):
        SpeedModel().weights(["a"], "disk")
    with pytest.raises(ValueError, match=r"^no workers to weigh$"):
        SpeedModel().weights([])
    with pytest.raises(ValueError, match=r"^task duration must be finite and > 0, got 0\.0$"):
        SpeedModel().observe("a", "p", 1, 0.0)
    with pytest.raises(ValueError, match=r"^task work units must be finite and > 0, got 0$"):
        SpeedModel().observe("a", "p", 0, 1.0)


def test_removing_a_worker_the_model_does_not_know_is_harmless():
    m = SpeedModel(confidence_samples=1)
    m.set_prior("a", {"compute": 1.0})
    m.observe("b", "p", 1, 1.0)  # a never ran "p"
    m.remove("a")
    m.remove("ghost")
    assert m.priors == {} and m.table() == {"p": {"b": (1.0, 1.0, 1)}}


def test_one_fluke_timing_does_not_move_the_rate_and_steady_ones_change_it():
    """One task 100x faster, or 10,000x slower, than its prefix's others leaves the rate; a steady change
    shows once it is rare enough against the earlier timings' share past the midpoint: with a fluke among 19 of them
    (a share of 1.5 in 20), the last three timings all (0.0004), not two of them (0.016)."""
    m = SpeedModel()
    for _ in range(10):
        m.observe("a", "p", 100, 1.0)
        m.observe("b", "p", 100, 1.0)
    m.observe("a", "p", 100, 0.01)
    assert m.table()["p"]["a"][0] == pytest.approx(100) and m.weights(["a", "b"]) == pytest.approx({"a": 0.5, "b": 0.5})
    for _ in range(5):
        m.observe("a", "p", 100, 1.0)
    m.observe("a", "p", 100, 1e4)
    assert m.table()["p"]["a"][0] == pytest.approx(100) and m.weights(["a", "b"]) == pytest.approx({"a": 0.5, "b": 0.5})
    for _ in range(3):
        m.observe("a", "p", 100, 1.0)
    for _ in range(2):  # a slows to a third: one timing, then two of the last three
        m.observe("a", "p", 100, 3.0)
        assert m.table()["p"]["a"][0] == pytest.approx(100)
    m.observe("a", "p", 100, 3.0)  # three: a change; the earlier timings are dropped
    assert m.table()["p"]["a"] == (pytest.approx(100 / 3), 3.0, 23)
    m.observe("b", "p", 100, 1.0)  # (b missed its share of a's 13 timings: back, as fast, it counts again)
    assert m.weights(["a", "b"]) == pytest.approx({"a": 0.25, "b": 0.75})


def test_a_worker_back_at_its_level_after_a_pause_has_its_earlier_timings_again():
    """Two tasks 100x slower (a pause) are a change (the documented rule); three timings back at the
    earlier level restore it with its timings, the pause dropped: 0.5 again from the third (the change
    test would wait for as many timings as the pause's and more)."""
    m = SpeedModel()
    for _ in range(30):
        m.observe("a", "p", 100, 1.0)
        m.observe("b", "p", 100, 1.0)
    weights = []
    for i in range(6):
        m.observe("a", "p", 100, 100.0 if i < 2 else 1.0)
        m.observe("b", "p", 100, 1.0)
        weights.append(m.weights("ab")["a"])
    assert weights[1] < 0.02 and weights[3] < 0.05  # the pause counted, then two timings back: not yet
    assert weights[4:] == pytest.approx([0.5, 0.5])
    assert m.table()["p"]["a"] == (pytest.approx(100), 1.0, 36)
    assert len(m.rates["p"]["a"].recent) == 34  # the 30 before the pause and the four after it


def test_noise_toward_the_earlier_level_after_a_lasting_change_does_not_bring_it_back():
    """``a`` slowed down 2x for good, its timings 15% apart; three timings nearer to the earlier level than
    to the slow one, but within the noise of the slow ones, leave the slow level (restoring the earlier one
    took ``a`` back to 0.5)."""
    m = SpeedModel()
    for i in range(30):
        m.observe("a", "p", 100, 0.9 if i % 2 else 1.1)
        m.observe("b", "p", 100, 1.0)
    for i in range(14):
        m.observe("a", "p", 100, 1.7 if i % 2 else 2.3)
        m.observe("b", "p", 100, 1.0)
    for _ in range(3):
        m.observe("a", "p", 100, 1.38)
        m.observe("b", "p", 100, 1.0)
    assert m.weights("ab")["a"] < 0.4
    assert len(m.rates["p"]["a"].recent) > 3


def test_a_return_after_more_timings_at_the_new_level_than_the_change_test_compares_is_a_change_of_its_own():
    """The timings dropped at a change are kept aside for RECENT[-1] (24) timings since: back at the earlier
    level after 30, the worker's rate is that of the returning timings alone."""
    m = SpeedModel()
    for slow in (1.0, 4.0):
        for _ in range(30):
            m.observe("a", "p", 100, slow)
            m.observe("b", "p", 100, 1.0)
    for _ in range(3):
        m.observe("a", "p", 100, 1.0)
        m.observe("b", "p", 100, 1.0)
    assert m.weights("ab")["a"] == pytest.approx(0.5)
    assert len(m.rates["p"]["a"].recent) == 3


def test_a_lasting_change_stays_and_a_return_to_a_third_level_is_a_change_of_its_own():
    m = SpeedModel()
    for _ in range(30):
        m.observe("a", "p", 100, 1.0)
        m.observe("b", "p", 100, 1.0)
    for _ in range(40):  # a slows down 4x, for good
        m.observe("a", "p", 100, 4.0)
        m.observe("b", "p", 100, 1.0)
    assert m.weights("ab")["a"] == pytest.approx(0.2)
    for _ in range(2):  # then 1.5x: nearer to the level before, but a level of its own (two of three)
        m.observe("a", "p", 100, 1.5)
        m.observe("b", "p", 100, 1.0)
    assert m.weights("ab")["a"] == pytest.approx(0.4)
    assert len(m.rates["p"]["a"].recent) == 2


@pytest.mark.parametrize("factor, changes", [(0.99, False), (1.01, True)])
def test_a_change_counts_beyond_four_standard_errors_of_the_timings_noise(factor, changes):
    """Twenty timings alternate between two log rates 0.1 apart; then two at a higher rate make the
    median of the last three depart from the median of the nineteen before them by ``factor`` times 4
    standard errors (of the difference of two medians, from the timings' noise): a change only beyond
    (none of the nineteen was past the midpoint: two of three are rare, 0.002)."""
    m = SpeedModel()
    rates = [math.exp(0.1 * (i % 2 == 0)) for i in range(20)]  # log rates 0.1, 0, 0.1, ... 0
    noise = 0.1 / 0.954  # every change between successive timings is 0.1
    standard_error = math.sqrt(math.pi / 2) * noise * math.sqrt(1 / 3 + 1 / 19)
    assert CHANGE == 4.0
    high = math.exp(0.1 + factor * 4.0 * standard_error)  # the nineteen's median is 0.1
    for rate in [*rates, high, high]:
        m.observe("a", "p", rate, 1.0)
    r = m.rates["p"]["a"]
    if changes:  # the earlier timings dropped, the last before the change too: the rate is the last two's
        assert list(r.recent) == pytest.approx([math.log(high)] * 2) and r.value == pytest.approx(high)
        assert r.steps == 0  # (two timings: no noise known)
    else:
        assert len(r.recent) == 22 and r.steps == pytest.approx(noise)


def test_a_level_the_earlier_timings_showed_often_is_no_change():
    """Tasks that take three times longer one time in five (a co-tenant's time slices) make most successive
    timings equal (no noise between them), so three slow tasks in a row look like a change against the
    earlier timings' median; but the earlier timings showed that level a fifth of the time: a mix, not
    a change. The rate stays the mean time per unit, slow tasks included."""
    m = SpeedModel()
    for i in range(20):
        m.observe("a", "p", 1, 3.0 if i % 5 == 4 else 1.0)
    for _ in range(3):
        m.observe("a", "p", 1, 3.0)
    r = m.rates["p"]["a"]
    assert len(r.recent) == 23 and r.steps == 0
    # 16 tasks of 1 s and 7 of 3 s (the slowest three counted as the next slowest, the fastest three as
    # the next fastest: as they are): one over their mean
    mean = (16 * 1.0 + 7 * 3.0) / 23
    assert r.value == pytest.approx(1 / mean)
    # the evidence counts their spread (standard deviation over the mean), as the successive changes miss it
    assert r.noise == pytest.approx(statistics.stdev([1.0] * 16 + [3.0] * 7) / mean)


@pytest.mark.parametrize("fast, changes", [(3, True), (4, False)])
def test_a_faster_level_the_earlier_timings_showed_rarely_is_a_change_and_often_is_not(fast, changes):
    """Of 20 earlier timings, ``fast`` were three times faster; then three in a row are. Three of 20
    (a share of 3.5 in 21: three in a row 0.0046, under RARE) were flukes: a change; four (0.0098) are a
    level the worker showed before: not one."""
    assert RARE == 0.005
    m = SpeedModel()
    for i in range(20):
        m.observe("a", "p", 1, 1 / 3 if i in range(2, 20, 20 // fast)[:fast] else 1.0)
    for _ in range(3):
        m.observe("a", "p", 1, 1 / 3)
    assert len(m.rates["p"]["a"].recent) == (3 if changes else 23)


@pytest.mark.parametrize("factor, changes", [(0.98, False), (1.02, True)])
def test_a_change_counts_where_the_share_past_the_midpoint_makes_the_last_timings_rarer_than_rare(
        monkeypatch, factor, changes):
    """A fluke among 19 earlier timings (a share of 1.5 in 20 past the midpoint, a half counted in), then
    two of the last three past it: a change where that binomial tail is under RARE, not at it."""
    from dask_octopus.profiling import speedmodel

    p = 1.5 / 20
    tail = 3 * p**2 * (1 - p) + p**3  # two or three of three
    monkeypatch.setattr(speedmodel, "RARE", tail * factor)
    m = SpeedModel()
    for i in range(19):
        m.observe("a", "p", 1, 3.0 if i == 5 else 1.0)
    for seconds in (1.0, 3.0, 3.0):
        m.observe("a", "p", 1, seconds)
    assert len(m.rates["p"]["a"].recent) == (2 if changes else 22)


@pytest.mark.parametrize("way, changes", [(0.4, True), (0.6, False)])
def test_the_midpoint_between_the_two_medians_splits_the_levels(way, changes):
    """Four of 20 earlier timings lie ``way`` of the way from the old level to the new one: nearer the
    old one, they are not past the midpoint, and three timings at the new level are a change; nearer
    the new one, they are (a share of 4.5 in 21: three in a row 0.0098), and they are not."""
    m = SpeedModel()
    for i in range(20):
        m.observe("a", "p", 1, 2.0**-way if i % 5 == 2 else 1.0)  # (log rates 0 and way x ln 2)
    for _ in range(3):
        m.observe("a", "p", 1, 0.5)  # twice as fast
    assert len(m.rates["p"]["a"].recent) == (3 if changes else 23)


def test_a_change_shows_over_the_last_eight_timings_where_the_last_three_are_too_noisy():
    """A 1.25x slowdown in timings 0.1 apart (log rates): the last three's median never departs by 4
    standard errors; the last eight's does once five of them are slower (the earlier timings dropped)."""
    m = SpeedModel()
    for i in range(32):
        m.observe("a", "p", 1, math.exp(-0.1 if i % 2 == 0 else 0.0))  # log rates 0.1 and 0
    slower = [math.exp(0.223 if i % 2 == 0 else 0.123) for i in range(5)]  # log rates -0.223 and -0.123
    for i, seconds in enumerate(slower):
        assert len(m.rates["p"]["a"].recent) == 32 + i
        m.observe("a", "p", 1, seconds)
    r = m.rates["p"]["a"]
    assert list(r.times) == pytest.approx(slower)


def test_the_standard_error_counts_the_timings_since_the_rate_last_changed():
    m = SpeedModel()
    for _ in range(30):
        m.observe("a", "p", 1, 1.0)
    for seconds in (3.0, 3.3, 2.9, 3.1):
        m.observe("a", "p", 1, seconds)
    r = m.rates["p"]["a"]
    assert len(r.recent) == 4 and r.count == 34
    assert r.estimate() == (pytest.approx(math.log(r.value)), pytest.approx(math.sqrt(math.pi / 2) * r.noise / 2))


def test_after_a_change_the_noise_is_that_of_the_timings_kept():
    m = SpeedModel()
    for _ in range(10):
        m.observe("a", "p", 1, 1.0)
    for seconds in (3.0, 3.3):  # the second: a change; the timings before the first are dropped
        m.observe("a", "p", 1, seconds)
    m.observe("a", "p", 1, 2.9)
    r = m.rates["p"]["a"]
    assert list(r.times) == pytest.approx([3.0, 3.3, 2.9])
    # the median of the two changes between them (the step from 1 s is not one of them)
    assert list(r.changes) == pytest.approx([math.log(3.3 / 3.0), math.log(3.3 / 2.9)])
    assert r.steps == pytest.approx((math.log(3.3 / 3.0) + math.log(3.3 / 2.9)) / 2 / 0.954)


def test_a_mix_of_fast_and_slow_tasks_weighs_a_worker_by_its_mean_time():
    """b's tasks take three times longer at random 35% of the time (5% noise otherwise): balanced by the
    time it needs for its work, it is 1.7x slower than a, not as fast (the median of its timings), nor 3x
    slower whenever two of its last three tasks were slow."""
    rng = random.Random(1)
    m = SpeedModel()
    ratios = []
    for _ in range(200):
        m.observe("a", "p", 1, math.exp(rng.gauss(0, 0.05)))
        m.observe("b", "p", 1, (3.0 if rng.random() < 0.35 else 1.0) * math.exp(rng.gauss(0, 0.05)))
        w = m.weights(["a", "b"])
        ratios.append(w["a"] / w["b"])
    assert all(1.7 / 1.25 < r < 1.7 * 1.25 for r in ratios[64:])  # from a full window on


def test_a_worker_alternating_fast_and_slow_keeps_its_weight_from_one_timing_to_the_next():
    """b takes 1x and 4x by turns (a time-sliced co-tenant): its weight must not depend on whether it ran
    an odd or an even number of tasks (as the median of its timings would: 2x, then 1x)."""
    m = SpeedModel()
    ratios = []
    for i in range(60):
        m.observe("a", "p", 1, 1.0)
        m.observe("b", "p", 1, 4.0 if i % 2 else 1.0)
        w = m.weights(["a", "b"])
        ratios.append(w["a"] / w["b"])
    assert ratios[:10] == [1.0] * 10  # (the noise of b's timings: no evidence of a difference yet)
    assert all(abs(math.log(x / y)) < math.log(1.05) for x, y in pairwise(ratios[30:]))
    assert ratios[-1] == pytest.approx(2.5, rel=0.05)  # the mean time, 2.5 s per task


def test_identical_workers_timed_by_a_coarse_clock_keep_about_equal_weights():
    """Timings that repeat exactly (a clock that counts whole milliseconds) leave most successive changes
    zero; the workers' 3 or 4 ms tasks are no evidence of a difference, but for the rare run of the
    rarer level long enough to look like a change (eight in a row: 0.45 ** 8)."""
    rng = random.Random(0)
    m = SpeedModel()
    weights = []
    for _ in range(200):
        for w in "ab":
            m.observe(w, "p", 1, 0.004 if rng.random() < 0.45 else 0.003)
        weights.append(m.weights(["a", "b"])["a"])
    assert sum(w == 0.5 for w in weights) >= 190 and all(abs(w - 0.5) < 0.05 for w in weights)


def test_the_first_confidence_samples_timings_show_no_change():
    m = SpeedModel(confidence_samples=10)  # they start the rate together, however they differ
    for seconds in [1.0] * 7 + [5.0] * 3:  # (three at a new level after seven: a change, later)
        m.observe("a", "p", 100, seconds)
    assert m.table()["p"]["a"][0] == pytest.approx(100 / 2.2)  # (seven of 1 s, three of 5 s: mean 2.2 s)
    m.observe("a", "p", 100, 5.0)  # then the last three against the eight before them: a change
    assert m.table()["p"]["a"][0] == pytest.approx(20)


def test_three_timings_after_three_others_can_show_a_change():
    m = SpeedModel()  # the fewest: as many later timings as earlier ones
    for seconds in (1.0, 1.0, 1.0, 2.0, 2.0):
        m.observe("a", "p", 100, seconds)
    assert m.table()["p"]["a"][0] == pytest.approx(100 / 1.4)  # five timings: not yet (three against two)
    m.observe("a", "p", 100, 2.0)
    assert m.table()["p"]["a"][0] == pytest.approx(50) and len(m.rates["p"]["a"].recent) == 3


def test_the_table_holds_the_winsorized_mean_time_of_the_timings_since_the_rate_last_changed():
    m = SpeedModel(confidence_samples=3)
    for seconds in (10.0, 2.0, 4.0):  # 10 (a warm-up: imports, a cuFFT plan), 50 and 25 units/s
        m.observe("a", "p", 100, seconds)
    assert m.table()["p"]["a"] == pytest.approx((25.0, 4.0, 3))  # of three: the median; not the warm-up
    m.observe("a", "p", 100, 2.0)  # 50 units/s
    rate, seconds, count = m.table()["p"]["a"]
    # seconds per unit 0.1, 0.02, 0.04, 0.02: the slowest counts as the next slowest, the fastest as the
    # next fastest (a tenth of four, rounded up: one each), mean 0.03 s per unit
    assert rate == pytest.approx(1 / 0.03)
    assert (seconds, count) == (3.0, 4)  # the median duration


def test_the_estimate_gets_more_precise_the_longer_a_worker_runs_at_one_speed():
    """b is 1.5x slower than a, with 25% noise on every timing, and calibrated as equal: the weights
    leave the calibration once the timings since the rates last changed are evidence enough (here after
    ten timings each), and from the 50th timing on err by 3.4% on average, at most 10% from the 100th
    (a moving average of weight 0.5 over the last timings, never more precise than they are: 26% on
    average, up to 74%)."""
    rng = random.Random(2)
    m = SpeedModel()
    m.set_prior("a", {"compute": 1.0, "memory": 1.0})
    m.set_prior("b", {"compute": 1.0, "memory": 1.0})
    errors = []
    for _ in range(200):
        m.observe("a", "mul", 100, 0.01 * math.exp(rng.gauss(0, 0.25)))
        m.observe("b", "mul", 100, 0.015 * math.exp(rng.gauss(0, 0.25)))
        w = m.weights(["a", "b"])
        errors.append(abs(math.log(w["a"] / w["b"] / 1.5)))
    assert statistics.fmean(errors[50:]) < 0.06 and max(errors[100:]) < math.log(1.15)
    assert len(m.rates["mul"]["a"].recent) == 64  # (the window: the last 64 timings at most)


def test_a_prefix_seen_on_one_worker_does_not_hide_the_prefixes_after_it():
    m = SpeedModel(confidence_samples=1)
    m.observe("a", "only-a", 1, 100.0)  # the first prefix the model saw
    m.observe("a", "mul", 200, 1.0)  # a twice as fast as b
    m.observe("b", "mul", 100, 1.0)
    assert m.weights(["a", "b"]) == pytest.approx({"a": 2 / 3, "b": 1 / 3})


def test_samples_add_up_over_prefixes():
    m = SpeedModel(confidence_samples=2)
    for prefix, n in (("p", 2), ("q", 3)):
        for _ in range(n):
            m.observe("a", prefix, 100, 1.0)
            m.observe("b", prefix, 100, 1.0)
    assert m.samples() == {"a": 5, "b": 5}


def test_a_prefix_counts_by_the_duration_of_its_tasks_not_by_how_many_workers_ran_it():
    m = SpeedModel(confidence_samples=1)
    m.observe("a", "gemm", 200, 1.0)  # on gemm a is twice as fast as b: log speeds +-ln(2)/2
    m.observe("b", "gemm", 100, 1.0)
    for w in "abc":  # on sum, as long per task, the three are equal
        m.observe(w, "sum", 100, 1.0)
    gemm = 0.5 ** (3 / HALF_LIFE)  # three timings ago: its weight against sum's
    share = 0.5 * gemm / (1 + gemm)  # a and b: the weighted mean of their two prefixes (equal: 0.25)
    raw = {"a": 2 ** share, "b": 2 ** -share, "c": 1.0}
    assert m.weights(["a", "b", "c"]) == pytest.approx({w: s / sum(raw.values()) for w, s in raw.items()})


@pytest.mark.parametrize("factor, counts", [(1.02, False), (0.98, True)])
def test_a_difference_counts_beyond_significance_standard_errors_of_the_recent_timings(factor, counts):
    m = SpeedModel(confidence_samples=3)
    for seconds in (1.0, 2.0, 1.0):  # a: 100, 50, 100 units/s, median 100
        m.observe("a", "mul", 100, seconds)
    for _ in range(3):  # b: a steady 40 units/s, no noise
        m.observe("b", "mul", 100, 2.5)
    gap = math.log(100) - math.log(40)  # between the median log rates of a and b
    noise = math.log(2) / 0.954  # of one timing of a, whose log rate changes by ln 2 each time
    standard_error = math.sqrt(math.pi / 2) * noise / math.sqrt(3)  # of the gap: a's median of three (b: no noise)
    m.significance = factor * gap / standard_error  # just above, or just below, the gap
    w = m.weights(["a", "b"])
    if counts:  # the observed rates decide
        assert w["a"] / w["b"] == pytest.approx(100 / 40.0)
    else:  # within the noise: no evidence of a difference
        assert w == pytest.approx({"a": 0.5, "b": 0.5})


def test_the_same_recent_timings_in_another_order_are_no_evidence_of_a_difference():
    m = SpeedModel(confidence_samples=2)
    for seconds in (1.0, 2.0):  # a: 100 then 50 units/s, median (of their logs) 100**0.5 * 50**0.5
        m.observe("a", "mul", 100, seconds)
    for seconds in (2.0, 1.0):  # b: 50 then 100 units/s, the same median
        m.observe("b", "mul", 100, seconds)
    assert m.weights(["a", "b"]) == {"a": 0.5, "b": 0.5}


def test_with_three_workers_one_significant_difference_keeps_the_others_differences_unbiased():
    rng = random.Random(1)
    m = SpeedModel(confidence_samples=3)
    for _ in range(8):  # a twice as fast as b and c, which are equal; 3% noise
        m.observe("a", "mul", 200, math.exp(rng.gauss(0, 0.03)))
        m.observe("b", "mul", 100, math.exp(rng.gauss(0, 0.03)))
        m.observe("c", "mul", 100, math.exp(rng.gauss(0, 0.03)))
    w = m.weights(["a", "b", "c"])
    assert w["a"] / w["b"] == pytest.approx(2.0, rel=0.1) and w["b"] / w["c"] == pytest.approx(1.0, rel=0.1)


@pytest.mark.parametrize("factor, counts", [(1.02, False), (0.98, True)])
def test_the_gap_between_two_noisy_workers_counts_beyond_significance_standard_errors_of_the_gap(factor, counts):
    m = SpeedModel(confidence_samples=3)
    for seconds in (1.0, 2.0, 1.0):  # a: 100, 50, 100 units/s, median 100
        m.observe("a", "mul", 100, seconds)
    for seconds in (2.5, 3.75, 2.5):  # b: 40, 26.7, 40 units/s, median 40
        m.observe("b", "mul", 100, seconds)
    gap = math.log(100) - math.log(40)  # between their medians
    # each: the standard error of the median of three timings, sqrt(pi / 2) times their noise over root three
    se_a = math.sqrt(math.pi / 2) * math.log(2) / 0.954 / math.sqrt(3)
    se_b = math.sqrt(math.pi / 2) * math.log(1.5) / 0.954 / math.sqrt(3)
    m.significance = factor * gap / math.sqrt(se_a**2 + se_b**2)  # just above, or just below, the gap
    w = m.weights(["a", "b"])
    if counts:
        assert w["a"] / w["b"] == pytest.approx(100 / 40)
    else:
        assert w == pytest.approx({"a": 0.5, "b": 0.5})


def test_timings_too_noisy_to_show_a_difference_leave_the_calibrated_one_in_place():
    m = SpeedModel(confidence_samples=3)
    m.set_prior("a", {"compute": 2.0, "memory": 2.0})  # calibration: b half as fast (a co-tenant on it)
    m.set_prior("b", {"compute": 1.0, "memory": 1.0})
    for i in range(8):  # b takes 10 or 40 ms by turns (time-sliced): 2.5 times a's 10 ms on average
        m.observe("a", "mul", 100, 0.01)
        m.observe("b", "mul", 100, 0.04 if i % 2 else 0.01)
    # the gap is within the noise of b's timings: no evidence against equal weights, nor against the
    # calibration, which therefore stands
    assert m._difference(m.rates["mul"], {"a": 0.0, "b": 0.0}) == {"a": 0.0, "b": 0.0}
    assert m.weights(["a", "b"]) == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    assert m.weights(["a", "b"], prefix="mul") == pytest.approx({"a": 2 / 3, "b": 1 / 3})


def test_steady_timings_that_contradict_the_calibration_replace_it():
    m = SpeedModel(confidence_samples=3)
    m.set_prior("a", {"compute": 2.0, "memory": 2.0})  # the co-tenant on b left after calibration
    m.set_prior("b", {"compute": 1.0, "memory": 1.0})
    rng = random.Random(4)
    for _ in range(8):  # both equally fast now, 5% noise
        m.observe("a", "mul", 100, 0.01 * math.exp(rng.gauss(0, 0.05)))
        m.observe("b", "mul", 100, 0.01 * math.exp(rng.gauss(0, 0.05)))
    assert m.weights(["a", "b"]) == {"a": 0.5, "b": 0.5}  # no difference beyond the noise: equal
    for _ in range(8):  # then b slows to a third, steadily: beyond calibration and equality
        m.observe("b", "mul", 100, 0.03 * math.exp(rng.gauss(0, 0.05)))
    w = m.weights(["a", "b"])
    assert 2.5 < w["a"] / w["b"] < 3.5  # the observed rates decide


def test_two_timings_each_show_no_noise_so_any_difference_counts():
    # noise is 0 while fewer than three timings are known: with confidence_samples=2 the workers'
    # differences count as they are, however far apart each worker's two timings were
    m = SpeedModel(confidence_samples=2)
    for units in (1, 2):
        m.observe("a", "p", units, 1.0)
        m.observe("b", "p", 4 * units, 1.0)
    assert m.weights(["a", "b"]) == pytest.approx({"a": 0.2, "b": 0.8})


def test_a_prefix_straddling_the_minimum_duration_weighs_its_workers_without_bias():
    """``a`` twice as fast as ``b``, ``a``'s tasks 1-3 ms, the minimum 2 ms: dropping each short timing kept
    ``a``'s slow half only; counting a prefix on a worker while most of its timings before were long keeps
    a fair sample of them: the weights of all the timings (those of the model's window: 0.647 for 0.667)."""
    from dask_octopus.profiling.short_tasks import ShortTasks

    def weights(keep):
        rng = random.Random(0)
        m = SpeedModel()
        for _ in range(400):
            ta = rng.uniform(1.0, 3.0) / 1e3
            for w, t in (("a", ta), ("b", 2 * rng.uniform(1.0, 3.0) / 1e3)):
                if keep(w, t):
                    m.observe(w, "p", 1e6, t)
        return m.weights("ab")["a"]

    everything = weights(lambda w, t: True)
    short = ShortTasks(10)
    assert weights(lambda w, t: short.counts("p", w, t < 0.002)) == pytest.approx(everything, abs=0.01)
    assert weights(lambda w, t: t >= 0.002) < everything - 0.04  # each timing alone: biased (0.598)


def test_short_tasks_decide_per_prefix_and_worker_from_the_timings_before():
    from dask_octopus.profiling.short_tasks import SHORT_WEIGHT, ShortTasks

    short = ShortTasks(2)
    assert short.counts("p", "a", False) and not short.counts("q", "a", True)  # first timings: themselves
    assert short.counts("p", "a", True)  # mostly long before: a short one counts
    assert short.shares["p"]["a"] == pytest.approx(SHORT_WEIGHT)
    assert [short.counts("q", "a", False) for _ in range(4)] == [False, False, True, True]  # 1, .5, .25, .125
    assert short.counts("p", "b", False)  # b's own share
    short.remove("a")
    assert "a" not in short.shares["p"] and not short.counts("q", "a", True)  # forgotten: first again
    short.counts("r", "a", False)  # a third prefix: the least recently used one is dropped
    assert set(short.shares) == {"q", "r"}
