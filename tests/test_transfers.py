"""The transfer model: the pure math (bandwidth.py, worth_moving's move cost) and, on CPU clusters, that
map's and balance's plans follow the bandwidths the scheduler measured."""

import asyncio
import math

import dask.array as da
import numpy as np
import pytest
from distributed import wait
from distributed.utils_test import async_poll_for, gen_cluster
from hypothesis import given
from hypothesis import strategies as st
from test_balance import run_balance, setup

import dask_octopus
from dask_octopus.placement import transfers
from dask_octopus.placement.bandwidth import Bandwidths, owner_changes
from dask_octopus.placement.planning import worth_moving

TWO = [("127.0.0.1", 1)] * 2
NO_STEALING = {"octopus.map.steal-fraction": 0}  # the plan's shape alone: no stealable tails
bandwidth_st = st.floats(1.0, 1e12)
rows_st = st.lists(st.integers(0, 1000), min_size=1, max_size=6)


# -- pure: bandwidth.py -------------------------------------------------------------------------------


def test_a_measured_pair_counts_in_its_direction_and_every_other_pair_at_the_default():
    links = Bandwidths(100.0, {("a", "b"): 400.0})
    assert links.between("a", "b") == 400.0 and links.between("b", "a") == 100.0 and links.between("a", "c") == 100.0
    for bad in (0.0, -5.0, math.nan, math.inf, None):  # not a measurement: the default stands
        assert Bandwidths(100.0, {("a", "b"): bad}).between("a", "b") == 100.0
    with pytest.raises(ValueError, match="the default bandwidth must be finite and > 0"):
        Bandwidths(0.0)


def test_an_item_is_fetched_from_its_fastest_holder_and_costs_nothing_where_held():
    links = Bandwidths(100.0, {("a", "c"): 1000.0})
    assert links.fetch_seconds(500.0, {"a", "b"}, "c") == 0.5  # from a, at 1000 B/s
    assert links.fetch_seconds(500.0, {"b"}, "c") == 5.0  # from b, at the default
    assert links.fetch_seconds(500.0, {"a", "c"}, "c") == 0.0  # c holds it
    assert links.fetch_seconds(500.0, set(), "c") == 0.0  # not computed yet: nothing moves
    with pytest.raises(ValueError, match="bytes to move"):
        links.fetch_seconds(-1.0, {"a"}, "c")


@given(nbytes=st.floats(0, 1e12), default=bandwidth_st, fast=bandwidth_st, slow=bandwidth_st)
def test_fetch_time_is_bytes_over_the_best_link_and_more_holders_never_slow_it(nbytes, default, fast, slow):
    links = Bandwidths(default, {("a", "r"): fast, ("b", "r"): slow})
    one = links.fetch_seconds(nbytes, {"a"}, "r")
    both = links.fetch_seconds(nbytes, {"a", "b"}, "r")
    assert one == pytest.approx(nbytes / fast) and both == pytest.approx(nbytes / max(fast, slow))
    assert both <= one and links.fetch_seconds(nbytes, {"a", "b", "c"}, "r") <= both


def test_moves_between_different_workers_overlap_and_a_worker_s_own_moves_add_up():
    links = Bandwidths(10.0)
    assert links.move_seconds({}) == 0.0
    assert links.move_seconds({("a", "b"): 100.0}) == 10.0
    assert links.move_seconds({("a", "b"): 100.0, ("c", "d"): 50.0}) == 10.0  # at the same time
    assert links.move_seconds({("a", "c"): 100.0, ("b", "c"): 50.0}) == 15.0  # c receives one after the other
    assert links.move_seconds({("a", "b"): 100.0, ("a", "c"): 50.0}) == 15.0  # a sends one after the other
    assert Bandwidths(10.0, {("a", "b"): 40.0}).move_seconds({("a", "b"): 100.0, ("b", "a"): 100.0}) == 10.0


def test_a_worker_moves_its_share_at_its_fastest_link_at_most_and_each_pair_at_its_own_figure():
    """One link per worker, as fast as its fastest measured pair (Dask measures each transfer while the
    others run): c receives from a (10 B/s), b (5 B/s) and d (40 B/s) at 40 B/s in all at most."""
    links = Bandwidths(10.0, {("b", "c"): 5.0, ("d", "c"): 40.0})
    assert links.move_seconds({("a", "c"): 100.0, ("d", "c"): 100.0}) == 10.0  # a -> c's own 10 s
    assert links.move_seconds({("a", "c"): 100.0, ("b", "c"): 60.0}) == 16.0  # 160 bytes at a -> c's 10 B/s
    assert links.move_seconds({("a", "c"): 100.0, ("d", "c"): 100.0, ("e", "c"): 100.0}) == 10.0  # 300 at 40: 7.5
    assert links.move_seconds({("d", "c"): 400.0, ("a", "c"): 10.0}) == 10.25  # 410 bytes at 40 B/s
    with pytest.raises(ValueError, match="bytes to move must be finite and >= 0"):
        links.move_seconds({("a", "c"): -1.0})


@given(moves=st.dictionaries(st.tuples(st.sampled_from("abcd"), st.sampled_from("abcd")), st.floats(0, 1e9),
                             max_size=8),
       default=bandwidth_st, factor=st.floats(1.5, 100.0))
def test_move_time_is_at_least_the_largest_move_and_falls_with_bandwidth(moves, default, factor):
    moves = {pair: b for pair, b in moves.items() if pair[0] != pair[1]}
    links = Bandwidths(default)
    seconds = links.move_seconds(moves)
    assert seconds >= max(moves.values(), default=0.0) / default * (1 - 1e-12)
    assert seconds <= sum(moves.values()) / default * (1 + 1e-12)
    assert Bandwidths(default * factor).move_seconds(moves) == pytest.approx(seconds / factor)


@given(old=rows_st, data=st.data())
def test_rows_changing_owner_leave_their_old_worker_and_reach_their_new_one(old, data):
    total = sum(old)
    cuts = sorted(data.draw(st.lists(st.integers(0, total), min_size=len(old) - 1, max_size=len(old) - 1)))
    new = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    changes = owner_changes(old, new)
    assert all(i != j and rows > 0 for (i, j), rows in changes.items())
    starts = [sum(old[:k]) for k in range(len(old))]
    new_starts = [sum(new[:k]) for k in range(len(new))]
    for k in range(len(old)):  # a worker keeps the overlap of its two ranges and moves the rest
        kept = max(0, min(starts[k] + old[k], new_starts[k] + new[k]) - max(starts[k], new_starts[k]))
        assert kept + sum(r for (i, _), r in changes.items() if i == k) == old[k]
        assert kept + sum(r for (_, j), r in changes.items() if j == k) == new[k]
    assert owner_changes(old, old) == {}


def test_owner_changes_between_two_workers_and_bad_input():
    assert owner_changes([500, 500], [600, 400]) == {(1, 0): 100}
    assert owner_changes([10, 0, 10], [0, 20, 0]) == {(0, 1): 10, (2, 1): 10}
    for old, new in (([1, 2], [3]), ([1, 2], [2, 2]), ([-1, 2], [1, 0])):
        with pytest.raises(ValueError, match="one per worker"):
            owner_changes(old, new)


# -- pure: the move cost in worth_moving ------------------------------------------------------------


def test_a_re_chunk_is_worth_its_moves_only_when_the_gain_in_seconds_exceeds_them():
    current, planned, weights = [[500], [500]], [[600], [400]], [0.6, 0.4]  # makespan 1250 -> 1000
    assert worth_moving(current, planned, weights, 0.03)  # 25% > 3%, no time scale: moves not weighed
    # 1000 rows per second in all: the planned pass is 1.0 s, the kept one 1.25 s
    assert worth_moving(current, planned, weights, 0.03, speed=1000.0, move_seconds=0.2)
    assert not worth_moving(current, planned, weights, 0.03, speed=1000.0, move_seconds=0.25)
    assert not worth_moving(current, planned, weights, 0.03, speed=1000.0, move_seconds=0.3)
    # weights that do not sum to 1 are shares of the speed all the same
    assert worth_moving(current, planned, [6.0, 4.0], 0.03, speed=1000.0, move_seconds=0.2)
    assert not worth_moving(current, planned, [6.0, 4.0], 0.03, speed=1000.0, move_seconds=0.3)
    assert not worth_moving(current, planned, weights, 0.3, speed=1000.0, move_seconds=0.0)  # min-gain still rules
    with pytest.raises(ValueError, match="speed"):
        worth_moving(current, planned, weights, 0.03, speed=0.0)


@given(weights=st.lists(st.floats(0.1, 10.0), min_size=2, max_size=5), speed=st.floats(1.0, 1e9),
       move=st.floats(0.0, 1e3), data=st.data())
def test_faster_moves_never_turn_a_re_chunk_down(weights, speed, move, data):
    current = [[n] for n in data.draw(st.lists(st.integers(1, 1000), min_size=len(weights), max_size=len(weights)))]
    planned = [[n] for n in data.draw(st.lists(st.integers(1, 1000), min_size=len(weights), max_size=len(weights)))]
    if worth_moving(current, planned, weights, 0.0, speed=speed, move_seconds=move):
        assert worth_moving(current, planned, weights, 0.0, speed=speed, move_seconds=move / 2)
        assert worth_moving(current, planned, weights, 0.0)


# -- on a cluster: the scheduler's figures reach the plans ---------------------------------------------


def links(c):
    return asyncio.get_running_loop().run_in_executor(None, transfers.bandwidths, c)


def set_bandwidths(s, workers, default, pairs=()):
    """The scheduler's overall estimate (and the workers' own, which their heartbeats blend into it),
    and measured pairs as the scheduler keeps them: ``(receiver, sender)``."""
    s.bandwidth = default
    for w in workers:
        w.bandwidth = default
    for (sender, receiver), bw in dict(pairs).items():
        s.bandwidth_workers[receiver, sender] = bw


@gen_cluster(client=True, nthreads=TWO)
async def test_the_pairs_dask_measured_reach_the_model_sender_first(c, s, a, b):
    await setup(c, s, [1.0, 1.0])
    assert (await links(c)).pairs == {} and (await links(c)).default == s.bandwidth
    x = c.submit(np.ones, 2**20, workers=[a.address], pure=False)  # 8 MiB: Dask times fetches over 1 MB
    await wait(c.submit(np.sum, x, workers=[b.address], pure=False))
    await async_poll_for(lambda: (b.address, a.address) in s.bandwidth_workers, timeout=10)  # the next heartbeat
    got = await links(c)
    assert set(got.pairs) == {(a.address, b.address)}
    assert got.between(a.address, b.address) == s.bandwidth_workers[b.address, a.address] > 0
    assert got.between(b.address, a.address) == got.default > 0
    # the overall figure moves with every heartbeat: read it in the scheduler's own event loop tick
    assert s.plugins["octopus"].bandwidth()["default"] == s.bandwidth


@pytest.mark.parametrize("default, pair, spread", [
    (1e15, None, True),  # moving an item (1 MiB) takes a nanosecond, its work a microsecond: 4 + 4
    (1e3, None, False),  # moving takes 1000 s: every item stays with its data
    (1e15, 1e3, False),  # the pair holder -> other measured slow: it outweighs a fast overall figure
    (1e3, 1e15, True),  # the pair measured fast: it outweighs a slow overall figure
])
@gen_cluster(client=True, nthreads=TWO, config=NO_STEALING)
async def test_map_packs_items_that_are_futures_by_the_measured_bandwidth(c, s, a, b, default, pair, spread):
    await setup(c, s, [1.0, 1.0])
    holder, other = sorted(s.workers)
    items = [c.submit(np.ones, 2**17, workers=[holder], pure=False) for _ in range(8)]  # 1 MiB each, on holder
    await wait(items)
    set_bandwidths(s, (a, b), default, {(holder, other): pair} if pair else ())
    for w in s.workers:  # np.sum was observed: one unit of cost takes a microsecond on either worker
        s.plugins["octopus"].model.observe(w, "sum-octopus-map", 1e6, 1.0)
    futs = await asyncio.get_running_loop().run_in_executor(None, lambda: dask_octopus.map(np.sum, items, client=c))
    assert await c.gather(futs) == [2.0**17] * 8
    (plan,) = [p for n, p in s.plugins["octopus"].placement.plans.items() if n.startswith("sum-octopus-map")]
    assert sorted(plan.workers) == ([holder] * 4 + [other] * 4 if spread else [holder] * 8)


def stream_at(s, speed):
    """Give every worker a calibrated streaming speed (bytes/s), as the memory probe reports it."""
    for w in s.workers:
        s.plugins["octopus"].profiles[w]["memory"] = speed


# weights 3:2 and two equal blocks of 500 rows of 32 bytes: the plan moves 100 rows (3200 bytes) from the
# slower worker to the faster, and shortens the makespan from 1250 to 1000 rows per unit weight. Read once
# at 1 GB/s on each worker, a pass gains 250 rows / (2e9 / 32 rows/s) = 4 us: moving pays at more than
# 3200 bytes / 4 us = 800 MB/s.
@pytest.mark.parametrize("default, pairs, moved", [
    (1e12, (), True),
    (1e6, (), False),
    (4e9, (), True),  # five times the break-even bandwidth
    (2e8, (), False),  # a quarter of it
    (1e12, {"slow->fast": 1e6}, False),  # the pair the rows move over is slow
    (1e12, {"fast->slow": 1e6}, True),  # only the other direction is slow: nothing moves that way
    (1e6, {"slow->fast": 1e12}, True),
])
@gen_cluster(client=True, nthreads=TWO)
async def test_balance_by_memory_keeps_the_blocks_when_moving_rows_costs_more_than_a_pass_gains(
        c, s, a, b, default, pairs, moved):
    await setup(c, s, [3.0, 2.0])
    stream_at(s, 1e9)
    fast, slow = sorted(s.workers)
    names = {"slow->fast": (slow, fast), "fast->slow": (fast, slow)}
    set_bandwidths(s, (a, b), default, {names[k]: bw for k, bw in dict(pairs).items()})
    x = da.ones((1000, 4), chunks=(500, 4))
    y = await run_balance(c, x, resource="memory")
    if moved:
        assert y.chunks[0] == (300, 300, 400) and "rechunk" in str(dict(y.dask))
        assert s.plugins["octopus"].placement.plans[y.name].workers == [fast, fast, slow]
    else:  # kept and pinned: block 0 to the faster worker, block 1 to the slower
        assert y.chunks == x.chunks and "rechunk" not in str(dict(y.dask))
        assert s.plugins["octopus"].placement.plans[y.name].workers == [fast, slow]
    assert await c.compute(y.sum()) == 4000


@gen_cluster(client=True, nthreads=TWO)
async def test_balance_by_compute_is_not_held_back_by_slow_moves(c, s, a, b):
    """A compute-bound pass's time is not known before its graph is: the move cost is not weighed and
    min-gain alone decides (docs/placement.md)."""
    await setup(c, s, [3.0, 2.0])
    stream_at(s, 1e9)
    set_bandwidths(s, (a, b), 1e3)
    y = await run_balance(c, da.ones((1000, 4), chunks=(500, 4)))
    assert y.chunks[0] == (300, 300, 400)
