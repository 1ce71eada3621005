"""Properties of the pure planning math (hypothesis) and its errors."""

import math
from bisect import bisect_left, bisect_right
from itertools import accumulate, pairwise

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dask_octopus.placement.planning import (
    PlanningError,
    at_once,
    axis_order,
    block_sizes,
    block_sizes_within,
    kept_groups,
    proportional_split,
    reassign,
    row_segments,
    snap_cuts,
    worth_moving,
)

weights_st = st.lists(st.floats(0.01, 100.0), min_size=1, max_size=8)


@given(total=st.integers(0, 10_000), weights=weights_st)
def test_split_sums_exactly_and_is_near_proportional(total, weights):
    sizes = proportional_split(total, weights)
    assert sum(sizes) == total
    assert all(s >= 0 for s in sizes)
    quotas = [total * w / sum(weights) for w in weights]
    assert all(abs(s - q) < 1 for s, q in zip(sizes, quotas))  # largest remainder: within one unit


@given(total=st.integers(0, 10_000), weights=weights_st)
def test_larger_weight_never_gets_less(total, weights):
    sizes = proportional_split(total, weights)
    for i in range(len(weights)):
        for j in range(len(weights)):
            if weights[i] > weights[j]:
                assert sizes[i] >= sizes[j]


@given(total=st.integers(1, 10_000), weights=weights_st, i=st.integers(0, 7), factor=st.floats(1.0, 10.0))
def test_monotone_when_one_weight_grows(total, weights, i, factor):
    assume(i < len(weights))
    before = proportional_split(total, weights)[i]
    grown = list(weights)
    grown[i] *= factor
    assert proportional_split(total, grown)[i] >= before


@given(total=st.integers(0, 10_000), weights=weights_st, data=st.data())
def test_caps_and_minimum_are_respected(total, weights, data):
    caps = data.draw(st.lists(st.one_of(st.none(), st.integers(0, 5_000)), min_size=len(weights),
                              max_size=len(weights)))
    fits = any(c is None for c in caps) or sum(caps) >= total
    if not fits:
        with pytest.raises(PlanningError, match="does not fit"):
            proportional_split(total, weights, caps=caps)
        return
    sizes = proportional_split(total, weights, caps=caps)
    assert sum(sizes) == total
    assert all(c is None or s <= c for s, c in zip(sizes, caps))


@given(weights=weights_st, per_worker=st.integers(1, 4), align=st.integers(1, 16), extra=st.integers(0, 50_000))
def test_block_sizes(weights, per_worker, align, extra):
    total = len(weights) * per_worker * align * 4 + extra
    share = total * min(weights) / sum(weights) / per_worker
    if align > 1 and align > share:
        with pytest.raises(PlanningError, match="align"):
            block_sizes(total, weights, per_worker=per_worker, align=align)
        return
    plan = block_sizes(total, weights, per_worker=per_worker, align=align)
    flat = [s for blocks in plan for s in blocks]
    assert len(plan) == len(weights) and all(len(b) == per_worker for b in plan)
    assert sum(flat) == total
    assert all(s > 0 for s in flat)
    assert all(s % align == 0 for s in flat[:-1])
    assert flat[-1] % align == total % align


def test_block_sizes_follow_weights_exactly():
    assert block_sizes(100, [1, 3]) == [[25], [75]]
    assert block_sizes(100, [1, 3], per_worker=2) == [[13, 12], [38, 37]]
    assert block_sizes(105, [1, 1], align=10) == [[50], [55]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(total=3, weights=[1, 1], per_worker=2), "cannot make 4 blocks"),
        (dict(total=100, weights=[1, 1], per_worker=0), "per_worker"),
        (dict(total=100, weights=[1, 1], align=0), "align"),
        (dict(total=100, weights=[1, 99], align=10), "align=10 is larger"),
        (dict(total=100, weights=[]), "no weights"),
        (dict(total=100, weights=[1, math.nan]), "finite"),
        (dict(total=100, weights=[1, -1]), "finite"),
        (dict(total=100, weights=[1, 0]), "finite"),
        (dict(total=100, weights=[1, 1], caps=[10, 10]), "does not fit"),
    ],
)
def test_block_sizes_errors(kwargs, match):
    with pytest.raises(PlanningError, match=match):
        block_sizes(**kwargs)


@given(old=st.lists(st.integers(0, 50), min_size=1, max_size=10), weights=weights_st)
@settings(max_examples=200)
def test_row_segments_cover_every_row_once_in_order(old, weights):
    total = sum(old)
    new = proportional_split(total, weights)
    segments = row_segments(old, new)
    assert [sum(b - a for _, a, b in seg) for seg in segments] == new
    rows = [(i, r) for seg in segments for i, a, b in seg for r in range(a, b)]
    assert rows == [(i, r) for i, n in enumerate(old) for r in range(n)]


def test_row_segments_rejects_other_totals():
    with pytest.raises(PlanningError, match="different row counts"):
        row_segments([10], [5, 4])


@given(owners=st.lists(st.sampled_from("abcd"), min_size=1, max_size=30),
       alive=st.sets(st.sampled_from("abcd"), min_size=1))
def test_reassign_moves_only_orphans_to_workers_below_their_share(owners, alive):
    weights = {w: 1.0 for w in alive}
    new = reassign(owners, weights)
    assert all(w in alive for w in new)
    assert all(a == b for a, b in zip(owners, new) if a in alive)
    share = -(-len(owners) // len(alive))  # equal weights: no survivor takes orphans beyond its share
    assert all(new.count(w) <= max(owners.count(w), share) for w in alive)
    if all(owners.count(w) <= len(owners) // len(alive) for w in alive):  # none holds more than its share
        assert max(map(new.count, alive)) - min(map(new.count, alive)) <= 1


def test_reassign_fills_the_worker_that_joined_before_the_others():
    # a worker replaced: its blocks, moved to the survivor, go to the newcomer, not half of them
    assert reassign([None, None, "b", "b"], {"b": 1.0, "c": 1.0}) == ["c", "c", "b", "b"]
    assert reassign(["a", "a", "a", "b"], {"b": 3.0, "c": 1.0}) == ["b", "b", "c", "b"]


def test_reassign_without_survivors():
    with pytest.raises(PlanningError, match="no surviving worker"):
        reassign(["a"], {})


def test_worth_moving_only_when_the_makespan_gain_exceeds_the_threshold():
    assert not worth_moving([[500], [500]], [[501], [499]], [0.501, 0.499], 0.03)  # equal workers: keep
    assert worth_moving([[500], [500]], [[700], [300]], [0.7, 0.3], 0.03)  # 0.3-weight worker: 1667 vs 1000
    assert worth_moving([[250, 250], [250, 250]], [[350, 350], [150, 150]], [0.7, 0.3], 0.03)  # 1667 vs 1000
    assert not worth_moving([[250, 250], [250, 250]], [[500], [500]], [0.5, 0.5], 0.03)  # other blocks, same load


@given(data=st.data(), workers=st.integers(1, 6), per_worker=st.integers(1, 4))
def test_a_contiguous_layout_is_ordered_as_it_lies_and_kept_where_it_is(data, workers, per_worker):
    layout = data.draw(st.permutations(range(workers)))  # layout[k]: the worker holding the k-th range
    sizes = data.draw(st.lists(st.integers(1, 1000), min_size=workers * per_worker, max_size=workers * per_worker))
    holders = [layout[b // per_worker] for b in range(len(sizes))]
    order = axis_order(holders, sizes, workers)
    assert order == layout  # consecutive ranges planned in this order leave every row where it is
    groups = kept_groups(holders, workers, per_worker)
    for k, w in enumerate(layout):  # worker w keeps the k-th range of per_worker blocks, where its rows are
        assert groups[w] == list(range(k * per_worker, (k + 1) * per_worker))


def test_axis_order_puts_workers_holding_nothing_last_and_needs_one_holder_per_block():
    assert axis_order([2, None, 0], [10, 10, 10], 4) == [2, 0, 1, 3]
    assert axis_order([None, None], [5, 5], 2) == [0, 1]
    assert axis_order([1, 0, 1], [100, 10, 10], 2) == [1, 0]  # mean row position: worker 1 about 56, worker 0 105
    with pytest.raises(PlanningError, match="2 holders for 3 blocks"):
        axis_order([0, 1], [1, 1, 1], 2)


def test_kept_groups_without_known_holders_are_consecutive():
    assert kept_groups([None, None, None, None], 2, 2) == [[0, 1], [2, 3]]
    assert kept_groups([0, None, 1, 1], 2, 2) == [[0, 1], [2, 3]]  # one holder unknown: the consecutive layout
    assert kept_groups([None, None, None], 2, 2) is None
    assert kept_groups([1, 0, 1, 0], 2, 2) == [[1, 3], [0, 2]]


@given(runs=st.lists(st.integers(1, 30), min_size=1, max_size=40), weights=weights_st)
def test_snap_cuts_moves_each_cut_to_the_nearer_end_of_its_run(runs, weights):
    total = sum(runs)
    assume(total >= len(weights))
    sizes = proportional_split(total, weights, minimum=1)
    bounds = [0, *accumulate(runs)]  # where the value changes
    cuts = list(accumulate(sizes[:-1]))
    around = [(bounds[bisect_right(bounds, c) - 1], bounds[bisect_left(bounds, c)]) for c in cuts]
    new = snap_cuts(sizes, around)
    if new is None:  # only when two cuts, or a cut and an end, share a run
        assert any(r >= l2 for (_, r), (l2, _) in pairwise(around)) or around[0][0] == 0 \
            or around[-1][1] == total
        return
    assert sum(new) == total and all(n > 0 for n in new)
    for moved, cut, (left, right) in zip(accumulate(new[:-1]), cuts, around):
        assert moved in bounds and moved in (left, right)
        assert abs(moved - cut) <= min(cut - left, right - cut)


@given(runs=st.lists(st.integers(1, 30), min_size=1, max_size=40), weights=weights_st,
       per_worker=st.integers(1, 3), slack=st.lists(st.one_of(st.none(), st.integers(0, 40)), min_size=8, max_size=8))
def test_snap_cuts_keeps_every_worker_within_its_cap(runs, weights, per_worker, slack):
    total = sum(runs)
    assume(total >= len(weights) * per_worker)
    sizes = proportional_split(total, [w / per_worker for w in weights for _ in range(per_worker)], minimum=1)
    owners = [i // per_worker for i in range(len(sizes))]
    shares = [sum(sizes[i * per_worker:(i + 1) * per_worker]) for i in range(len(weights))]
    caps = {i: None if extra is None else share + extra for i, (share, extra) in enumerate(zip(shares, slack))}
    bounds = [0, *accumulate(runs)]
    cuts = list(accumulate(sizes[:-1]))
    around = [(bounds[bisect_right(bounds, c) - 1], bounds[bisect_left(bounds, c)]) for c in cuts]
    new = snap_cuts(sizes, around, owners, caps)
    free = snap_cuts(sizes, around)
    if all(cap is None for cap in caps.values()):
        assert new == free
    if new is None:
        return
    assert sum(new) == total and all(n > 0 for n in new)
    for w, cap in caps.items():
        assert cap is None or sum(n for n, o in zip(new, owners) if o == w) <= cap
    moves = list(zip(accumulate(new[:-1]), accumulate((free or new)[:-1]), around))
    for moved, _, (left, right) in moves:
        assert moved in (left, right)  # on a value boundary: the nearer end, or the farther one for a cap
    differ = [j for j, (moved, near, _) in enumerate(moves) if moved != near]
    if free is not None and differ:  # the first cut moved otherwise moved so for the cap of the worker before it
        assert caps[owners[differ[0]]] is not None


def test_snap_cuts_under_caps():
    # the nearer end (60) keeps worker a within 60 rows; within 55 the cut goes to the farther end (30)
    assert snap_cuts([50, 50], [(30, 60)], ["a", "b"], {"a": 60, "b": None}) == [60, 40]
    assert snap_cuts([50, 50], [(30, 60)], ["a", "b"], {"a": 55, "b": None}) == [30, 70]
    assert snap_cuts([50, 50], [(30, 60)], ["a", "b"], {"a": 55, "b": 65}) is None  # b then holds 70
    assert snap_cuts([50, 50], [(30, 60)], ["a", "b"], {"b": 55}) == [60, 40]  # a worker missing: no cap
    # a worker's rows count, not its blocks': a's first block grows by 4; at a's last cut, the nearer end
    # (62) would give it 62 rows of 60
    assert snap_cuts([30, 30, 40], [(20, 34), (55, 62)]) == [34, 28, 38]
    assert snap_cuts([30, 30, 40], [(20, 34), (55, 62)], ["a", "a", "b"], {"a": 60, "b": None}) == [34, 21, 45]
    # a plan already over a cap (50 of 45) is not made worse, and not refused
    assert snap_cuts([50, 50], [(40, 70)], ["a", "b"], {"a": 45, "b": None}) == [40, 60]
    assert snap_cuts([50, 50], [(45, 52)], ["a", "b"], {"a": 45, "b": None}) == [45, 55]
    with pytest.raises(PlanningError, match=r"owners and caps go together, one owner per block \(2 blocks\), "
                                            r"got 1 owners and caps \{\}"):
        snap_cuts([10, 10], [(10, 10)], ["a"], {})
    with pytest.raises(PlanningError, match="got None owners and caps"):
        snap_cuts([10, 10], [(10, 10)], None, {"a": 3})


def test_snap_cuts_ties_and_failures():
    assert snap_cuts([50, 50], [(40, 60)]) == [40, 60]  # a tie with nothing before it: the left end
    assert snap_cuts([50, 50], [(50, 50)]) == [50, 50]  # already on a boundary
    # the first cut moves 10 left; the second is a tie: the left end keeps the middle block at 50
    assert snap_cuts([50, 50, 50], [(40, 70), (90, 110)]) == [40, 50, 60]
    assert snap_cuts([50, 50, 50], [(30, 60), (90, 110)]) == [60, 50, 40]
    assert snap_cuts([10, 10, 10], [(5, 30), (5, 30)]) is None  # the second cut would empty the last block
    assert snap_cuts([8, 12], [(0, 20)]) is None  # the cut would empty the first block
    assert snap_cuts([7], []) == [7]
    with pytest.raises(PlanningError, match="does not hold the cut"):
        snap_cuts([10, 10], [(12, 15)])
    with pytest.raises(PlanningError, match="2 blocks have 1 cuts, got 0 runs"):
        snap_cuts([10, 10], [])


@settings(deadline=None)  # largest=1 makes up to 20,000 one-row blocks
@given(total=st.integers(2, 20_000), weights=st.lists(st.floats(0.05, 20), min_size=1, max_size=6),
       largest=st.integers(1, 5_000), align=st.sampled_from([1, 1, 4]))
def test_blocks_within_the_largest_block(total, weights, largest, align):
    try:
        plan = block_sizes_within(total, weights, largest, align=align)
    except PlanningError:
        return  # too few rows for the blocks that would fit (each block needs a unit)
    sizes = [b for blocks in plan for b in blocks]
    assert sum(sizes) == total
    sizes[-1] -= total % align  # the remainder rides on the last block
    assert max(sizes) <= max(largest, align)
    within = max(largest, align) // align * align  # the largest block made of whole align units
    for blocks in plan:  # and no worker has a block more than its rows need (+1 for rounding)
        assert len(blocks) <= math.ceil(sum(blocks) / within) + 1


@settings(deadline=None)
@given(weights=st.lists(st.floats(0.05, 20), min_size=1, max_size=6), align=st.integers(2, 32),
       extra=st.integers(0, 2_000))
def test_blocks_of_the_user_s_align_sized_chunks_are_planned_where_every_worker_s_share_holds_a_unit(
        weights, align, extra):
    total = math.ceil(align * sum(weights) / min(weights)) + extra  # the slowest worker's share: align rows or more
    plan = block_sizes_within(total, weights, align, align=align)  # the user's chunks: align rows each
    assert sum(map(sum, plan)) == total
    assert all(b == align for blocks in plan for b in blocks[:-1]) and all(blocks[-1] >= align for blocks in plan)


def test_align_sized_chunks_of_a_fast_and_a_slow_worker():
    assert [len(b) for b in block_sizes_within(400, [1, 3], 8, align=8)] == [12, 38]  # was: align larger
    assert [sum(b) for b in block_sizes_within(40, [1, 3], 4, align=4)] == [8, 32]  # than a block's share
    with pytest.raises(PlanningError, match=r"^align=16 is larger than the smallest worker's share \(9\.9 of 100\); "
                                            r"use a smaller align$"):
        block_sizes_within(100, [1, 9.1], 16, align=16)  # the slow worker's whole share is under one unit


# Added for mutation testing (tools/mutation.sh, docs/testing.md): behaviours the tests above left open.


def test_blocks_within_the_largest_block_exactly():
    assert block_sizes_within(100, [1, 3], 30) == [[25], [25, 25, 25]]  # 25 rows fit one block, 75 need 3
    assert block_sizes_within(101, [1, 1], 60) == [[51], [50]]  # align 1 by default: one row each unit
    assert block_sizes_within(4, [1, 1], 1) == [[1, 1], [1, 1]]  # blocks of one row are allowed
    # the remainder (5 rows) rides on the last block and does not count against the largest
    assert block_sizes_within(105, [1, 1], 50, align=10) == [[50], [55]]


def test_a_worker_of_more_threads_gets_the_rows_its_threads_run_at_once():
    assert block_sizes_within(1200, [1, 1], 100, threads=[1, 2]) == [[100] * 4, [100] * 8]  # both threads busy
    assert block_sizes_within(1200, [1, 1], 1200, threads=[1, 2]) == [[600], [600]]  # one block: one thread
    assert block_sizes_within(1200, [1, 1], 700, threads=[1, 4]) == [[400], [400, 400]]  # two blocks: two threads
    assert block_sizes_within(1200, [1, 3], 100, threads=[3, 1]) == [[100] * 6, [100] * 6]  # 3 x 1 against 1 x 3
    assert at_once([0.5, 0.5], [1, 4], [3, 2]) == [0.5, 1.0]
    with pytest.raises(PlanningError, match=r"^threads and blocks must be integers >= 1, got \[0\] and \[1\]$"):
        at_once([1.0], [0], [1])
    with pytest.raises(PlanningError, match=r"^2 weights, 1 thread counts and 2 block counts$"):
        at_once([1.0, 1.0], [1], [1, 1])


@settings(deadline=None)
@given(total=st.integers(2, 5_000), pairs=st.lists(st.tuples(st.floats(0.05, 20), st.integers(1, 8)), min_size=1,
                                                   max_size=6), largest=st.integers(1, 2_000),
       align=st.sampled_from([1, 1, 5]))
def test_blocks_within_the_largest_block_count_each_worker_s_threads(total, pairs, largest, align):
    """Counting threads never refuses what one thread each plans (a first version, scaling a slow worker
    of 8 threads by 8 at once, refused align over the share it then left another), and keeps the rows
    and the bound."""
    weights, threads = [w for w, _ in pairs], [t for _, t in pairs]
    try:
        block_sizes_within(total, weights, largest, align=align)
    except PlanningError:
        return  # too few rows for the blocks that would fit
    plan = block_sizes_within(total, weights, largest, align=align, threads=threads)
    sizes = [b for blocks in plan for b in blocks]
    assert sum(sizes) == total
    sizes[-1] -= total % align
    assert max(sizes) <= max(largest, align)


def test_counting_threads_keeps_a_plan_that_one_thread_each_makes_where_all_busy_cannot_be_planned():
    # the 8-thread worker scaled by 8 at once leaves the others shares under align=5
    assert block_sizes_within(36, [0.87, 1.91, 1.14, 1.24], 28, align=5, threads=[8, 1, 1, 1]) == [[5], [15], [5], [11]]


def test_blocks_within_the_largest_block_under_a_memory_cap():
    # worker 0 holds at most 20 rows: worker 1 takes 80, which needs two blocks of 40 each
    assert block_sizes_within(100, [1, 1], 50, caps=[20, None]) == [[20], [40, 40]]


def test_blocks_within_the_largest_block_leave_the_slow_workers_their_one_block():
    # 5 one-row items over speeds 10:1:1: the fast worker's real-valued share (4.2) would take 4 blocks
    # and leave too few rows for the others' one block each
    assert block_sizes_within(5, [10, 1, 1], 1) == [[1, 1, 1], [1], [1]]
    # a worker capped at 75 rows makes blocks of its 75, not of its uncapped 1000
    plan = block_sizes_within(2000, [1, 1], 10, caps=[75, None])
    assert sum(plan[0]) == 75 and max(plan[0]) <= 10 and len(plan[0]) == 8 and sum(plan[1]) == 1925


def test_the_align_remainder_fits_under_the_last_worker_s_cap():
    # 746 rows in units of 10: the 6 left ride on the last block, whose worker may hold 375
    assert block_sizes(746, [1, 1], align=10, caps=[750, 375]) == [[380], [366]]
    with pytest.raises(PlanningError, match="a cap is below its minimum"):  # no remainder: the cap is the problem
        block_sizes(100, [1, 1], align=10, caps=[None, 5])
    with pytest.raises(PlanningError, match="the last 6 rows do not fit under the memory cap of the last worker"):
        block_sizes(746, [1, 1], align=10, caps=[750, 12])  # one unit of 10 fits, not with the 6


def test_blocks_within_a_largest_block_per_worker():
    # worker 0 may process 10 rows at once, worker 1 the collection's largest block (50)
    assert block_sizes_within(100, [1, 1], [10, 50]) == [[10, 10, 10, 10, 10], [50]]
    assert block_sizes_within(100, [1, 3], [50, 30]) == block_sizes_within(100, [1, 3], 30)


@pytest.mark.parametrize("largest", [0, -3, [50, 0], [50]])
def test_blocks_within_a_largest_below_one(largest):
    with pytest.raises(PlanningError, match=r"^largest must be >= 1, for all or for each of the 2 workers, got "):
        block_sizes_within(100, [1, 1], largest)


def test_snap_cuts_keeps_a_planned_empty_block_empty():
    assert snap_cuts([10, 0, 10], [(10, 10), (10, 10)]) == [10, 0, 10]
    assert snap_cuts([0, 10], [(0, 0)]) == [0, 10]


def test_makespan_is_the_slowest_workers_rows_over_weight_and_needs_one_weight_per_worker():
    from dask_octopus.placement.planning import makespan

    assert makespan([[10, 20], [60]], [1.0, 3.0]) == 30.0
    with pytest.raises(ValueError):
        makespan([[1], [2]], [1.0])
    with pytest.raises(ValueError):
        makespan([[1]], [1.0, 1.0])


def test_reassign_without_survivors_says_so():
    with pytest.raises(PlanningError, match=r"^no surviving worker to take the blocks$"):
        reassign(["a", "b"], {})


def test_blocks_within_the_largest_block_are_the_fewest_that_fit():
    # one block per worker fits in both: 3 rows within 3; 333, 666 and 998 rows within 998
    assert block_sizes(3, [0.05]) == [[3]] and block_sizes(1997, [0.1, 0.2, 0.3]) == [[333], [666], [998]]
    assert block_sizes_within(3, [0.05], 3) == [[3]]  # 3 * 0.05 / 0.05 / 3 rounds to 1.0000000000000002
    assert block_sizes_within(1997, [0.1, 0.2, 0.3], 998) == [[333], [666], [998]]  # the share 998.5 > 998


def test_block_sizes_at_their_bounds():
    assert block_sizes(4, [1, 1], per_worker=2) == [[1, 1], [1, 1]]  # as many rows as blocks: one row each
    assert block_sizes(3, [3, 1]) == [[2], [1]]  # a share under one row (0.75) still gets its one row
    assert block_sizes(20, [1, 1], align=10) == [[10], [10]]  # align equal to the smallest share


def test_block_sizes_under_memory_caps():
    assert block_sizes(100, [1, 1], caps=[30, None]) == [[30], [70]]  # None: no cap on that worker
    assert block_sizes(100, [1, 1], align=10, caps=[35, None]) == [[30], [70]]  # a cap holds whole align units
    assert block_sizes(150, [1, 1, 1], align=10, caps=[None, None, 50]) == [[50], [50], [50]]  # exactly at the cap


def test_block_sizes_errors_in_full():
    with pytest.raises(PlanningError, match=r"^the last 5 rows do not fit under the memory cap of the last worker$"):
        block_sizes(155, [1, 1, 1], align=10, caps=[None, None, 14])  # under one unit and the 5 rows of remainder
    assert block_sizes(155, [1, 1, 1], align=10, caps=[None, None, 50]) == [[60], [50], [45]]  # 40 + the 5
    with pytest.raises(PlanningError, match=r"^align=10 is larger than the smallest block's share \(1\.0 of 100\); "
                                            r"use a smaller align or per_worker$"):
        block_sizes(100, [1, 99], align=10)


def test_a_split_with_both_a_minimum_and_a_cap_in_play():
    # worker 1 is capped at 5; the other two then share 12, well above their minimum of 2
    assert proportional_split(17, [1, 10, 1], minimum=2, caps=[None, 5, None]) == [6, 5, 6]  # gives [3, 6, 3]
    assert proportional_split(17, [0.1, 1.5, 0.1], minimum=1, caps=[None, 5, None]) == [6, 5, 6]  # gives [2, 6, 2]
    assert block_sizes(45, [2, 7], align=10, caps=[None, 27]) == [[20], [25]]  # raises PlanningError


@pytest.mark.parametrize("align", [0, -3, 2.5, True, "2", math.nan, math.inf, -math.inf])
def test_bad_aligns_name_the_problem_with_or_without_a_bound(align):
    with pytest.raises(PlanningError, match=r"^align must be an integer >= 1, got "):
        block_sizes(100, [1, 1], align=align)
    with pytest.raises(PlanningError, match=r"^align must be an integer >= 1, got "):
        block_sizes_within(100, [1, 1], 30, align=align)


def test_block_counts_per_worker():
    assert block_sizes(100, [1, 3], per_worker=[1, 3]) == [[25], [25, 25, 25]]
    for bad in ([1, 2.5], [True, 1], [1], [0, 1]):
        with pytest.raises(PlanningError, match=r"^per_worker must be an integer >= 1 \(or one per worker\), got "):
            block_sizes(100, [1, 1], per_worker=bad)


def test_a_fractional_total_is_refused():
    with pytest.raises(PlanningError, match=r"^total must be a non-negative integer, got 2\.5$"):
        proportional_split(2.5, [1.0])


def test_minimum_or_caps_of_another_length_than_the_weights_are_refused():
    with pytest.raises(PlanningError, match=r"^minimum and caps must have one entry per weight$"):
        proportional_split(3, [1.0, 1.0], minimum=[1])
    with pytest.raises(PlanningError, match=r"^minimum and caps must have one entry per weight$"):
        proportional_split(3, [1.0, 1.0], caps=[5])


def test_within_refuses_align_2_over_the_smallest_share():
    # align 2, the slow worker's share 1.0 row: its one block would be a whole unit of 2 rows
    with pytest.raises(PlanningError, match=r"^align=2 is larger than the smallest worker's share \(1\.0 of 7\)"):
        block_sizes_within(7, [1, 6], 100, align=2)


def test_snap_cuts_lets_a_worker_already_over_its_cap_keep_up_to_its_planned_rows():
    # a plans 5 rows, capped at 3: the nearer end (4) gives it 4 rows, over the cap but not over the plan
    assert snap_cuts([5, 5], [(4, 7)], ["a", "b"], {"a": 3, "b": None}) == [4, 6]
