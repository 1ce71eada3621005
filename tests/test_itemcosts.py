"""The per-item cost model of map batches: exact fits, when it abstains, its window, bad input."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_octopus.profiling.itemcosts import ItemCost, ItemCostFit


def batches(fit: ItemCostFit, truth: ItemCost, shapes: list[tuple[int, float]]) -> None:
    for n, cost in shapes:
        fit.add(n, cost, n * truth.fixed + cost * truth.per_unit)


@settings(max_examples=200, deadline=None)
@given(fixed=st.floats(0, 1e-2), per_unit=st.floats(1e-9, 1e-3),
       shapes=st.lists(st.tuples(st.integers(1, 200), st.floats(1, 1e7)), min_size=3, max_size=8))
def test_exact_batches_give_back_the_terms(fixed, per_unit, shapes):
    fit = ItemCostFit()
    means = [c / n for n, c in shapes][1 if len(shapes) > 3 else 0:]  # (the first, a warm-up, left out)
    batches(fit, ItemCost(fixed, per_unit), shapes)
    got = fit.fit()
    if max(means) < fit.spread * min(means):
        assert got is None  # the batches cannot tell the fixed part from the proportional one
        return
    assert got is not None
    scale = fixed + per_unit * max(means)  # the seconds per item the terms must reproduce
    assert got.fixed == pytest.approx(fixed, abs=1e-6 * scale)
    assert got.per_unit * max(means) == pytest.approx(per_unit * max(means), abs=1e-6 * scale)


def test_abstains_until_three_batches_of_different_mean_costs():
    fit = ItemCostFit()
    truth = ItemCost(0.002, 1e-6)
    batches(fit, truth, [(10, 1000.0), (20, 2000.0)])
    assert fit.fit() is None  # two batches
    batches(fit, truth, [(5, 500.0)])
    assert fit.fit() is None  # three, all 100 units per item
    batches(fit, truth, [(4, 4000.0)])
    got = fit.fit()
    assert got.fixed == pytest.approx(truth.fixed) and got.per_unit == pytest.approx(truth.per_unit)


def test_no_fixed_part_fits_through_the_origin_and_no_proportional_part_abstains():
    fit = ItemCostFit()
    fit.add(1, 100.0, 0.0)  # noise: a batch measured as faster than its work
    batches(fit, ItemCost(0.0, 1e-3), [(1, 1000.0), (1, 3000.0)])
    got = fit.fit()
    assert got.fixed == 0.0 and got.per_unit > 0
    flat = ItemCostFit()
    batches(flat, ItemCost(0.01, 0.0), [(1, 10.0), (1, 100.0), (1, 1000.0)])
    assert flat.fit() is None  # costs do not predict time: packing by them would be wrong


def test_old_batches_leave_the_window_so_a_slowdown_shows():
    fit = ItemCostFit(window=4)
    shapes = [(1, 100.0), (1, 400.0), (2, 200.0), (1, 1000.0)]
    batches(fit, ItemCost(0.001, 1e-5), shapes)
    batches(fit, ItemCost(0.001, 4e-5), shapes)  # the work part became four times slower
    assert fit.fit().per_unit == pytest.approx(4e-5)


def test_a_slowdown_shows_within_a_few_batches_while_older_sizes_keep_the_slope():
    fit = ItemCostFit(window=8, alpha=0.5)
    before = ItemCost(0.002, 1e-6)
    batches(fit, before, [(10, 1000.0), (10, 100_000.0), (4, 4000.0), (10, 50_000.0), (8, 800.0)])
    after = ItemCost(2 * before.fixed, 2 * before.per_unit)  # a co-tenant arrives: twice as slow
    batches(fit, after, [(10, 1000.0)] * 3)  # the same small items again and again
    got = fit.fit()
    assert got.seconds(100.0) > 1.75 * before.seconds(100.0)  # 87.5% of the weight is on the slow batches
    assert got.seconds(100.0) < after.seconds(100.0) * 1.001


@pytest.mark.parametrize("items, cost, seconds, match", [
    (0, 1.0, 1.0, "at least one item"),
    (1.5, 1.0, 1.0, "at least one item"),
    (1, -1.0, 1.0, "cost must be"),
    (1, math.inf, 1.0, "cost must be"),
    (1, 1.0, math.nan, "seconds must be"),
])
def test_bad_batches_are_refused(items, cost, seconds, match):
    with pytest.raises(ValueError, match=match):
        ItemCostFit().add(items, cost, seconds)


# Added for mutation testing (tools/mutation.sh, docs/testing.md): behaviours the tests above left open.


def test_seconds_per_item_is_the_fixed_part_plus_the_cost_times_the_rate():
    assert ItemCost(0.5, 2.0).seconds(3.0) == 6.5
    assert ItemCost(0.5, 2.0).seconds(0.0) == 0.5


def test_batches_of_zero_cost_or_zero_seconds_are_accepted():
    fit = ItemCostFit()
    fit.add(3, 0.0, 1.0)  # items that cost nothing (e.g. empty ones)
    fit.add(1, 10.0, 0.0)  # a batch too fast for the clock
    assert list(fit.points) == [(0.0, 1 / 3), (10.0, 0.0)]


def test_a_batch_of_cost_zero_measures_the_fixed_part():
    fit = ItemCostFit()
    batches(fit, ItemCost(0.01, 1e-4), [(1, 100.0), (1, 200.0), (2, 0.0)])  # two empty items: 0.01 s each
    got = fit.fit()
    assert got.fixed == pytest.approx(0.01) and got.per_unit == pytest.approx(1e-4)
    alone = ItemCostFit()
    batches(alone, ItemCost(0.01, 1e-4), [(1, 0.0), (3, 0.0), (2, 0.0)])  # nothing tells the slope
    assert alone.fit() is None


def test_the_window_keeps_exactly_its_number_of_batches():
    fit = ItemCostFit(window=3)
    batches(fit, ItemCost(0.001, 1e-5), [(1, 100.0), (1, 400.0), (1, 1000.0)])
    assert len(fit.points) == 3 and fit.fit() is not None  # the three batches it may hold suffice
    batches(fit, ItemCost(0.001, 1e-5), [(1, 50.0)])
    assert list(fit.points) == [(400.0, 0.001 + 400 * 1e-5), (1000.0, 0.001 + 1000 * 1e-5), (50.0, 0.001 + 50 * 1e-5)]


def test_a_spread_of_exactly_the_threshold_is_enough():
    fit = ItemCostFit()  # spread 1.5: mean costs per item of 100 and 150 tell the parts apart
    batches(fit, ItemCost(0.002, 1e-5), [(1, 100.0), (1, 150.0), (2, 200.0)])
    got = fit.fit()
    assert got.fixed == pytest.approx(0.002) and got.per_unit == pytest.approx(1e-5)


def test_costs_in_any_unit_fit_the_same_line():
    truth = ItemCost(0.002, 1e-6)
    scale = 1e-6  # the same items, their costs counted in millions of units
    fine, coarse = ItemCostFit(), ItemCostFit()
    shapes = [(10, 1000.0), (10, 100_000.0), (4, 4000.0)]
    batches(fine, truth, shapes)
    batches(coarse, ItemCost(truth.fixed, truth.per_unit / scale), [(n, c * scale) for n, c in shapes])
    got = coarse.fit()
    assert got is not None
    assert got.fixed == pytest.approx(fine.fit().fixed) and got.per_unit == pytest.approx(fine.fit().per_unit / scale)


def test_all_weight_on_the_newest_batch_abstains():
    fit = ItemCostFit(alpha=1.0)  # older batches weigh 0: one point cannot give a slope
    batches(fit, ItemCost(0.002, 1e-6), [(1, 100.0), (1, 1000.0), (1, 10_000.0)])
    assert fit.fit() is None


def test_the_first_batch_with_its_warm_up_is_left_out_once_three_more_can_fit():
    truth = ItemCost(0.001, 0.01)
    fit = ItemCostFit()
    fit.add(1, 0.1, truth.seconds(0.1) + 0.5)  # map's probe: one item, and 0.5 s of imports and planning
    batches(fit, truth, [(1, 0.1), (1, 10.0)])
    assert fit.fit() is None  # three batches: the first counts while no three others can fit (a falling line)
    batches(fit, truth, [(2, 10.0)])
    got = fit.fit()
    assert got.fixed == pytest.approx(0.001) and got.per_unit == pytest.approx(0.01)  # was 16 ms and 5 ms

