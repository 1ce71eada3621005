"""LPT on speed-scaled workers against a brute-force optimum (hypothesis)."""

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_octopus.placement.packing import CLOSE_ENOUGH, lower_bound, pack, split_by_bytes, split_tail


def optimum(costs, speeds):
    best = math.inf
    for assignment in itertools.product(range(len(speeds)), repeat=len(costs)):
        load = [0.0] * len(speeds)
        for c, j in zip(costs, assignment):
            load[j] += c
        best = min(best, max(x / s for x, s in zip(load, speeds)))
    return best


costs_st = st.lists(st.floats(0.0, 100.0), min_size=1, max_size=7)


@given(costs=costs_st, n=st.integers(1, 3))
@settings(max_examples=150, deadline=None)
def test_identical_workers_within_four_thirds_of_optimal(costs, n):
    result = pack(costs, [1.0] * n)
    assert result.makespan <= 4 / 3 * optimum(costs, [1.0] * n) + 1e-9


@given(costs=costs_st, speeds=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=3))
@settings(max_examples=150, deadline=None)
def test_uniform_workers_close_to_optimal_and_consistent(costs, speeds):
    result = pack(costs, speeds)
    opt = optimum(costs, speeds)
    assert len(result.assignment) == len(costs) and all(0 <= j < len(speeds) for j in result.assignment)
    loads = [sum(c for c, j in zip(costs, result.assignment) if j == k) for k in range(len(speeds))]
    assert result.finish == pytest.approx([x / s for x, s in zip(loads, speeds)])
    assert result.floor <= opt + 1e-9 <= result.makespan + 2e-9
    assert result.makespan <= 1.5 * opt + 1e-9  # LPT's bound on uniform machines is below 1.583 (Gonzalez et al.)


def test_a_giant_item_sets_the_floor():
    result = pack([100, 1, 1, 1], [1.0, 1.0])
    assert result.floor == 100 and result.makespan == 100


def test_faster_worker_gets_proportionally_more():
    result = pack([1.0] * 30, [2.0, 1.0])
    assert result.assignment.count(0) == 20


@pytest.mark.parametrize("costs, speeds, match", [
    ([1, -1], [1], "cost of item 1"),
    ([1, math.nan], [1], "cost of item 1"),
    ([1], [], "no workers"),
    ([1], [0.0], "speed of worker 0"),
])
def test_bad_input(costs, speeds, match):
    with pytest.raises(ValueError, match=match):
        pack(costs, speeds)


def test_lower_bound_of_nothing():
    assert lower_bound([], [1.0]) == 0.0


def test_a_transfer_penalty_keeps_items_where_their_data_is_until_the_imbalance_costs_more():
    # four items of 1 held by worker 0; on worker 1 an item takes 1 + its transfer
    costly = pack([1.0] * 4, [1.0, 1.0], penalty=[[0.0, 4.0]] * 4)
    assert costly.assignment == [0] * 4 and costly.makespan == 4.0  # moving one would end at 5
    some = pack([1.0] * 4, [1.0, 1.0], penalty=[[0.0, 2.0]] * 4)
    assert sorted(some.assignment) == [0, 0, 0, 1] and some.finish == [3.0, 3.0]
    free = pack([1.0] * 4, [1.0, 1.0], penalty=[[0.0, 0.0]] * 4)
    assert sorted(free.assignment) == [0, 0, 1, 1] and free.makespan == 2.0


@given(costs=costs_st, speeds=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=3), data=st.data())
@settings(max_examples=150, deadline=None)
def test_finish_times_include_the_penalties_and_zero_penalties_change_nothing(costs, speeds, data):
    penalty = [[data.draw(st.floats(0.0, 50.0)) for _ in speeds] for _ in costs]
    result = pack(costs, speeds, penalty=penalty)
    for j in range(len(speeds)):
        mine = [i for i, w in enumerate(result.assignment) if w == j]
        assert result.finish[j] == pytest.approx(sum(costs[i] / speeds[j] + penalty[i][j] for i in mine), abs=1e-6)
    zero = pack(costs, speeds, penalty=[[0.0] * len(speeds) for _ in costs])
    assert zero.assignment == pack(costs, speeds).assignment


@pytest.mark.parametrize("penalty, match", [
    ([[0.0, 1.0]], "penalty must be 2 rows"),
    ([[0.0], [1.0]], "penalty must be 2 rows"),
    ([[0.0, -1.0], [0.0, 0.0]], "penalties of item 0"),
    ([[0.0, 0.0], [math.inf, 0.0]], "penalties of item 1"),
])
def test_bad_penalties(penalty, match):
    with pytest.raises(ValueError, match=match):
        pack([1.0, 2.0], [1.0, 1.0], penalty=penalty)


# Added for mutation testing (tools/mutation.sh, docs/testing.md): behaviours the tests above left open.


def optimum_with_penalty(costs, speeds, penalty):
    best = math.inf
    for assignment in itertools.product(range(len(speeds)), repeat=len(costs)):
        finish = [0.0] * len(speeds)
        for i, j in enumerate(assignment):
            finish[j] += costs[i] / speeds[j] + penalty[i][j]
        best = min(best, max(finish))
    return best


# Small instances on which pack reaches the optimum while weaker variants of its search do not (found by
# searching random instances against the mutants of tools/mutation.sh): items in input order or smallest
# first instead of largest first, ties to the slower worker, no moves, no swaps, stopping after one step.
@pytest.mark.parametrize("costs, speeds, penalty", [
    ([4, 6, 1, 1], [1, 2], None),
    ([2, 6, 6, 7], [3, 2, 1], None),
    ([8, 7, 4], [3, 2, 2], None),
    ([7, 7, 9, 8], [1, 1, 3], None),
    ([3, 4, 8, 7], [3, 2], None),
    ([1, 8, 6, 6], [3, 2], None),
    ([7, 9, 6], [1, 3, 2], None),
    ([9, 5, 8], [1, 3, 2], None),
    ([5, 5, 8], [3, 2], None),
    ([3, 3, 2, 2, 2], [1, 1], None),  # LPT alone ends at 7: one swap makes 6
    ([0, 7, 7, 6], [3, 1], [[2, 2], [0, 0], [2, 1], [2, 5]]),
    ([4, 3, 3], [3, 2, 2], [[0, 5, 0], [0, 1, 1], [0, 5, 2]]),
    ([2, 3], [3, 1, 3], [[2, 5, 5], [1, 0, 1]]),
])
def test_pack_reaches_the_optimum_on_small_instances(costs, speeds, penalty):
    costs, speeds = [float(c) for c in costs], [float(s) for s in speeds]
    if penalty is None:
        result, best = pack(costs, speeds), optimum(costs, speeds)
    else:
        penalty = [[float(p) for p in row] for row in penalty]
        result, best = pack(costs, speeds, penalty=penalty), optimum_with_penalty(costs, speeds, penalty)
    assert result.makespan == pytest.approx(best)


@given(costs=costs_st, speeds=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=3), data=st.data())
@settings(max_examples=150, deadline=None)
def test_no_single_move_or_swap_shortens_the_packing(costs, speeds, data):
    penalty = None
    if data.draw(st.booleans()):
        penalty = [[data.draw(st.floats(0.0, 50.0)) for _ in speeds] for _ in costs]
    result = pack(costs, speeds, penalty=penalty)

    def makespan(assignment):
        finish = [0.0] * len(speeds)
        for i, j in enumerate(assignment):
            finish[j] += costs[i] / speeds[j] + (penalty[i][j] if penalty else 0.0)
        return max(finish)

    best = makespan(result.assignment) * (1 - 1e-9)
    if result.makespan <= result.floor * (1 + CLOSE_ENOUGH):  # no move or swap is sought: none gains more
        best = result.floor * (1 - 1e-9)  # (than the rest; no packing ends before the bound)
    for i, j in itertools.product(range(len(costs)), range(len(speeds))):
        moved = list(result.assignment)
        moved[i] = j
        assert makespan(moved) >= best
    for i, k in itertools.combinations(range(len(costs)), 2):
        swapped = list(result.assignment)
        swapped[i], swapped[k] = swapped[k], swapped[i]
        assert makespan(swapped) >= best


def test_no_improvement_is_sought_within_close_enough_of_the_lower_bound():
    rng = random.Random(0)
    costs = [rng.uniform(1, 10) for _ in range(400)]  # many items: LPT ends within 0.01% of the bound
    lpt = pack(costs, [1.0, 1.3, 1.6, 1.9], rounds=0)
    assert lpt.makespan <= lpt.floor * (1 + CLOSE_ENOUGH)
    assert pack(costs, [1.0, 1.3, 1.6, 1.9]).assignment == lpt.assignment
    few = [3.0, 3.0, 2.0, 2.0, 2.0]  # LPT ends at 7 against a bound of 6: one swap makes 6
    assert pack(few, [1.0, 1.0], rounds=0).makespan == 7 and pack(few, [1.0, 1.0]).makespan == 6


def test_the_lower_bound_counts_each_item_s_least_penalty():
    # six items of 1 with a penalty of 1 everywhere: 12 units of work on two workers of speed 1
    packed = pack([1.0] * 6, [1.0, 1.0], penalty=[[1.0, 1.0]] * 6)
    assert lower_bound([1.0] * 6, [1.0, 1.0], [[1.0, 1.0]] * 6) == 6.0 == packed.floor == packed.makespan
    # a penalty counts as work times the speed of the worker where it is least: 2 x 1, not 2 x 2
    assert lower_bound([4.0, 2.0], [2.0, 1.0], [[1.0, 1.0], [1.0, 1.0]]) == pytest.approx(3.0)  # item 0 alone: 4/2+1
    assert lower_bound([0.0] * 4, [2.0, 1.0], [[1.0, 1.0]] * 4) == pytest.approx(4 / 3)  # 4 x 1 units over 3
    assert lower_bound([], [1.0], []) == 0.0


@given(costs=costs_st, speeds=st.lists(st.floats(0.1, 10.0), min_size=1, max_size=3), data=st.data())
@settings(max_examples=150, deadline=None)
def test_the_lower_bound_with_penalties_is_never_above_the_optimum(costs, speeds, data):
    penalty = [[data.draw(st.floats(0.0, 50.0)) for _ in speeds] for _ in costs]
    assert lower_bound(costs, speeds, penalty) <= optimum_with_penalty(costs, speeds, penalty) * (1 + 1e-9) + 1e-12
    assert lower_bound(costs, speeds, penalty) >= lower_bound(costs, speeds)


def test_swaps_are_sought_among_at_most_swap_pairs(monkeypatch):
    from dask_octopus.placement import packing

    few = [3.0, 3.0, 2.0, 2.0, 2.0]  # LPT ends at 7 (3+2+2 against 3+2): one swap of 3 for 2 makes 6
    assert pack(few, [1.0, 1.0]).makespan == 6
    monkeypatch.setattr(packing, "SWAP_PAIRS", 1)  # the first pair (3 for 3) gains nothing, the second does
    assert pack(few, [1.0, 1.0]).makespan == 7
    monkeypatch.setattr(packing, "SWAP_PAIRS", 2)
    assert pack(few, [1.0, 1.0]).makespan == 6


def test_on_a_tie_the_item_goes_to_the_faster_worker():
    # the second item of 4 ends at 4 on either worker: the faster one takes it
    assert pack([4.0, 4.0], [2.0, 1.0]).assignment == [0, 0]
    assert pack([4.0, 4.0], [1.0, 2.0]).assignment == [1, 1]


def test_items_of_no_cost_are_spread_by_speed_not_piled_on_one_worker():
    # every worker finishes at 0 whatever it gets: the items go where they make the fewest per speed
    assignment = pack([0.0] * 8, [3.0, 1.0]).assignment
    assert [assignment.count(j) for j in (0, 1)] == [6, 2]


def test_no_workers_says_so():
    with pytest.raises(ValueError, match=r"^no workers to pack onto$"):
        pack([1.0], [])


@given(st.lists(st.floats(0, 100), min_size=1, max_size=30), st.floats(0, 1), st.integers(1, 4))
def test_split_tail_keeps_every_item_once_and_the_tail_within_its_fraction(costs, fraction, pieces):
    costs = sorted(costs, reverse=True)
    parts = split_tail(costs, fraction, pieces)
    assert [i for a, b, _ in parts for i in range(a, b)] == list(range(len(costs)))  # in order, each once
    assert all(b > a for a, b, _ in parts)
    head = [p for p in parts if not p[2]]
    assert head == [parts[0]] and parts[0][0] == 0  # the head first, never empty
    tail = [(a, b) for a, b, st in parts if st]
    assert len(tail) <= pieces
    assert sum(costs[i] for a, b in tail for i in range(a, b)) <= fraction * sum(costs) + 1e-9
    if fraction * sum(costs) == 0:
        assert parts == [(0, len(costs), False)]  # nothing to steal: the list whole


def test_split_tail_examples_and_bad_input():
    assert split_tail([8, 4, 2, 1, 1, 1, 1], 0.25, 2) == [(0, 3, False), (3, 5, True), (5, 7, True)]
    assert split_tail([8, 4, 2, 1], 0, 2) == [(0, 4, False)]
    assert split_tail([5], 1.0, 2) == [(0, 1, False)]
    assert split_tail([5, 3, 0, 0], 0.0, 2) == [(0, 4, False)]  # items of no cost are no tail at fraction 0
    assert split_tail([0, 0], 0.5, 2) == [(0, 2, False)]
    assert split_tail([], 0.5, 2) == []
    with pytest.raises(ValueError, match="fraction must be in"):
        split_tail([1, 1], 1.5, 2)
    with pytest.raises(ValueError, match="cost of item 1"):
        split_tail([1, -1], 0.5, 2)


def test_split_tail_parts_share_the_tail_evenly_in_run_order():
    # budget 8 of 16: the six 1s form the tail (the 10 would exceed it), in three parts of 2
    assert split_tail([10, 1, 1, 1, 1, 1, 1], 0.5, 3) == [(0, 1, False), (1, 3, True), (3, 5, True), (5, 7, True)]
    assert split_tail([4, 3, 2, 2, 1, 1], 0.5, 2) == [(0, 2, False), (2, 3, True), (3, 6, True)]  # 6 of 6.5: 2 | 4
    assert split_tail([1, 1, 1, 1], 1.0, 1) == [(0, 1, False), (1, 4, True)]  # one stealable part
    assert split_tail([2, 1, 1], 0.5, 2) == [(0, 1, False), (1, 2, True), (2, 3, True)]  # a tail of exactly 2
    assert split_tail([1, 0.5, 0.5], 0.5, 2) == [(0, 1, False), (1, 2, True), (2, 3, True)]  # budget 1
    # free items: the first part may take them all but must leave one for the last
    assert split_tail([3, 0, 0, 0], 0.5, 2) == [(0, 1, False), (1, 3, True), (3, 4, True)]
    with pytest.raises(ValueError, match=r"^fraction must be in \[0, 1\] and pieces >= 1, got 0.5 and 0$"):
        split_tail([1, 1], 0.5, 0)
    with pytest.raises(ValueError, match=r"got -0.1 and 2$"):
        split_tail([1, 1], -0.1, 2)


@given(st.lists(st.floats(0.01, 100), min_size=2, max_size=30), st.floats(0.05, 1), st.integers(1, 4))
def test_split_tail_parts_each_cost_about_an_equal_share_of_the_tail(costs, fraction, pieces):
    costs = sorted(costs, reverse=True)
    parts = [(a, b) for a, b, stealable in split_tail(costs, fraction, pieces) if stealable]
    if not parts:
        return
    tail = [costs[i] for a, b in parts for i in range(a, b)]
    share = sum(tail) / len(parts)
    for a, b in parts:  # a greedy cut by cumulated cost is off its share by less than one item (two, last)
        assert abs(sum(costs[a:b]) - share) <= 2 * max(tail) + 1e-9


@given(st.lists(st.floats(0, 100), max_size=30), st.floats(0, 300))
def test_split_by_bytes_keeps_every_item_once_and_each_part_within_the_budget(nbytes, budget):
    parts = split_by_bytes(nbytes, budget)
    assert [i for a, b in parts for i in range(a, b)] == list(range(len(nbytes)))  # in order, each once
    for a, b in parts:
        assert b > a and (b - a == 1 or sum(nbytes[a:b]) <= budget)  # within it, or one item alone
    for (a, b), _ in itertools.pairwise(parts):
        assert sum(nbytes[a:b + 1]) > budget  # greedy: the next part's first item did not fit


def test_split_by_bytes_examples_and_bad_input():
    assert split_by_bytes([3, 3, 3, 5, 1], 6) == [(0, 2), (2, 3), (3, 5)]
    assert split_by_bytes([9, 1], 4) == [(0, 1), (1, 2)]  # an item over the budget alone
    assert split_by_bytes([9, 1], None) == [(0, 2)] and split_by_bytes([], 4) == []
    with pytest.raises(ValueError, match=r"^bytes of item 1 must be finite and >= 0, got -1$"):
        split_by_bytes([1, -1], 4)
    assert split_by_bytes([1, 0, 2], 0) == [(0, 1), (1, 2), (2, 3)]  # (fragments.max-bytes: 0) each alone
    with pytest.raises(ValueError, match=r"^budget must be finite and >= 0, got -1$"):
        split_by_bytes([1], -1)
