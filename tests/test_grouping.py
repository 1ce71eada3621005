"""Pure planning of fragments: which tasks run together, their order, their streams, bad input."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_octopus.groups.planning import (
    arena_peak,
    assign_streams,
    check_group_spec,
    follow_or_fetch,
    interleave,
    launch_order,
    layer_order,
    live_peak,
    plan_fragments,
    pull_upstream,
    topological,
)
from dask_octopus.placement.bandwidth import Bandwidths


@st.composite
def dags(draw):
    """A random DAG over keys 0..n-1 (edges only from lower to higher keys), some keys candidates, each
    with a place and a label, and the parts per place."""
    n = draw(st.integers(1, 30))
    deps = {k: sorted(draw(st.sets(st.integers(0, k - 1), max_size=3))) if k else [] for k in range(n)}
    candidates = sorted(draw(st.sets(st.integers(0, n - 1))))
    places = {k: draw(st.sampled_from(["w0", "w1", None])) for k in candidates}
    labels = {k: draw(st.sampled_from(["priority-1", None])) for k in candidates}
    parts = {p: draw(st.integers(1, 4)) for p in ("w0", "w1", None)}
    cap = draw(st.one_of(st.none(), st.integers(1, 6)))
    return deps, candidates, places, parts, cap, labels


def reaches(deps, a, b):
    """Whether b depends on a, directly or not."""
    stack, seen = [b], set()
    while stack:
        k = stack.pop()
        for d in deps[k]:
            if d == a:
                return True
            if d not in seen:
                seen.add(d)
                stack.append(d)
    return False


@given(dags())
@settings(max_examples=400, deadline=None)
def test_fragments_are_candidates_of_one_place_that_contract_to_an_acyclic_graph(dag):
    deps, candidates, places, parts, cap, labels = dag
    steps = topological(list(deps)[::-1], deps)  # built in any order, then dependencies first
    fragments = plan_fragments(steps, deps, candidates, places, parts, cap, labels)
    flat = [k for f in fragments for k in f]
    assert len(flat) == len(set(flat)) and set(flat) <= set(candidates)
    owner = {k: i for i, f in enumerate(fragments) for k in f}
    for i, f in enumerate(fragments):
        assert len(f) >= 2
        assert len({places[k] for k in f} - {None}) <= 1  # one place (members of no place join any)
        assert len({labels[k] for k in f}) == 1  # one label: the same annotations
        position = {k: j for j, k in enumerate(f)}
        assert all(position[d] < position[k] for k in f for d in deps[k] if d in position)  # dependency order
        assert all(owner.get(d, i) == i for k in f for d in deps[k])  # never reads another fragment's member
        sources = [k for k in f if not any(reaches(deps, c, k) for c in candidates if c != k)]
        assert sources  # every fragment starts from sources
        if cap is not None:
            assert len(sources) <= cap
    # contracting each fragment to one node leaves no cycle: no path leaves a fragment and comes back
    for i, f in enumerate(fragments):
        outside = [k for k in deps if owner.get(k) != i]
        for k in outside:
            if any(reaches(deps, m, k) for m in f):
                assert not any(reaches(deps, k, m) for m in f), (f, k)


def test_a_reduction_tree_joins_the_fragments_of_its_leaves_and_its_top_stays_a_task():
    # leaves a..d (places w0, w0, w1, w1), chains a2..d2, partial sums p (a2, b2) and q (c2, d2), top t
    deps = {"a": [], "b": [], "c": [], "d": [], "a2": ["a"], "b2": ["b"], "c2": ["c"], "d2": ["d"],
            "p": ["a2", "b2"], "q": ["c2", "d2"], "t": ["p", "q"]}
    places = {k: None for k in deps} | {"a": "w0", "b": "w0", "c": "w1", "d": "w1"}
    got = plan_fragments(list(deps), deps, set(deps), places, {"w0": 1, "w1": 1, None: 1})
    assert [sorted(f) for f in got] == [["a", "a2", "b", "b2", "p"], ["c", "c2", "d", "d2", "q"]]
    # two parts for w0: a and b apart, so p combines two fragments and stays out, with t
    got = plan_fragments(list(deps), deps, set(deps), places, {"w0": 2, "w1": 1, None: 1})
    assert [sorted(f) for f in got] == [["a", "a2"], ["b", "b2"], ["c", "c2", "d", "d2", "q"]]
    # the cap of 1 source per fragment does the same to both workers
    got = plan_fragments(list(deps), deps, set(deps), places, {"w0": 1, "w1": 1, None: 1}, cap=1)
    assert [sorted(f) for f in got] == [["a", "a2"], ["b", "b2"], ["c", "c2"], ["d", "d2"]]


def interleaved_tree():
    """Leaves a..d reading inputs xa..xd (3 MiB each) held by w0, w1, w0, w1; chains a2..d2; partial sums
    p (a2, b2) and q (c2, d2); top t (not a candidate)."""
    deps = {"a": ["xa"], "b": ["xb"], "c": ["xc"], "d": ["xd"], "a2": ["a"], "b2": ["b"], "c2": ["c"],
            "d2": ["d"], "p": ["a2", "b2"], "q": ["c2", "d2"], "t": ["p", "q"]}
    follow = {k: None for k in deps} | {"a": "w0", "b": "w1", "c": "w0", "d": "w1"}
    holders = {"xa": {"w0"}, "xb": {"w1"}, "xc": {"w0"}, "xd": {"w1"}}
    return deps, follow, dict.fromkeys(deps), {f"x{k}": 3 * 2 ** 20 for k in "abcd"}, holders


@pytest.mark.parametrize("task_seconds, bandwidth, fetched", [
    # following: fragments {a, a2, c, c2} and {b, b2, d, d2}; p and q each read part of both, so stay, with
    # t, and the 4 chains' ends are picked apart: 2 + 2 + 4 = 8 tasks with t (not a candidate: not counted,
    # as in fetching). Fetching: {a, a2, b, b2, p} on w0 (first by name of the two holding 3 MiB) fetching
    # xb, and {c, c2, d, d2, q} on w1 (receiving less so far) fetching xc; t reads p and q inline: 2 tasks,
    # and 3 MiB moved each way at once
    (1e-3, 1.25e9, True),  # 8 ms against 2 + 2.5 ms (t reads p and q inline: were they picked, 4 + 2.5)
    (1e-3, 1e8, False),  # 8 ms against 2 + 31 ms
    (2 ** -10, 2 ** 29, False),  # 8 against 2 + 6 task costs, exactly (powers of two): equal, follow
    (2 ** -10, 2 ** 30, True),  # 8 against 2 + 3 (the 6 MiB counted one after the other: 2 + 6, equal)
    (0.0, 1e12, False),  # tasks cost nothing: moving anything costs more
])
def test_fragments_follow_their_inputs_unless_fetching_them_costs_less_than_the_tasks_left(task_seconds, bandwidth,
                                                                                          fetched):
    deps, follow, fetch, sizes, holders = interleaved_tree()
    parts = {"w0": 1, "w1": 1, None: 2}
    got = follow_or_fetch(list(deps), deps, set(deps) - {"t"}, follow, fetch, parts, None, None, sizes, holders,
                          task_seconds, Bandwidths(bandwidth))
    assert got is (fetch if fetched else follow)
    planned = [sorted(f) for f in plan_fragments(list(deps), deps, set(deps) - {"t"}, got, parts)]
    assert planned == ([["a", "a2", "b", "b2", "p"], ["c", "c2", "d", "d2", "q"]] if fetched
                       else [["a", "a2", "c", "c2"], ["b", "b2", "d", "d2"]])


def test_following_inputs_all_on_one_worker_moves_nothing_also_for_members_of_no_place():
    """The bytes moved go by where each input is held: members of no place of their own (pulled in
    downstream) reading inputs on the fragment's worker move nothing, so at no task cost following (one
    fragment on w1) is kept; charged to a holder of their own (their place), following would move 110
    bytes against 10 for a cut that fetches."""
    deps = {"s0": ["x0"], "s1": ["x1"], "d0": ["s0", "y0"], "d1": ["d0", "y1"]}
    follow = {"s0": "w1", "s1": "w1", "d0": None, "d1": None}
    fetch = dict.fromkeys(deps)
    sizes = {"x0": 10, "x1": 100, "y0": 10, "y1": 100}
    holders = dict.fromkeys(sizes, frozenset({"w1"}))
    parts = {"w1": 1, None: 2}
    assert plan_fragments(list(deps), deps, set(deps), follow, parts) == [["s0", "s1", "d0", "d1"]]
    assert plan_fragments(list(deps), deps, set(deps), fetch, parts) == [["s0", "d0", "d1"]]
    assert follow_or_fetch(list(deps), deps, set(deps), follow, fetch, parts, None, None, sizes, holders,
                           0.0, Bandwidths(1.0)) is follow


def round_robin(leaves, workers):
    """Leaves l0.. reading inputs x0.. (1 MiB each) held by workers w0.. in turn, a chain step each, and a
    binary tree of sums over the chains' ends up to one top, "t" (not a candidate)."""
    deps = {f"l{i}": [f"x{i}"] for i in range(leaves)} | {f"c{i}": [f"l{i}"] for i in range(leaves)}
    level = [f"c{i}" for i in range(leaves)]
    while len(level) > 1:
        nxt = [f"s{len(deps)}-{j}" for j in range(len(level) // 2)]
        deps |= {k: level[2 * j:2 * j + 2] for j, k in enumerate(nxt)}
        level = nxt
    deps["t"] = level
    follow = {k: None for k in deps} | {f"l{i}": f"w{i % workers}" for i in range(leaves)}
    holders = {f"x{i}": {f"w{i % workers}"} for i in range(leaves)}
    return deps, follow, dict.fromkeys(deps), dict.fromkeys(holders, 2 ** 20), holders


@pytest.mark.parametrize("bandwidth, pairs, fetched", [
    (2 ** 30, {}, True), (2 ** 28, {}, True), (2 ** 26, {}, False),
    (2 ** 26, {(f"w{s}", f"w{r}"): 2 ** 28 for s in range(4) for r in range(4) if s != r}, True),
    (2 ** 26, {(f"w{(r + 1) % 4}", f"w{r}"): 2 ** 28 for r in range(4)}, True),  # each worker's fastest link counts
])
def test_fetching_is_priced_at_the_busiest_worker_as_workers_move_data_at_the_same_time(bandwidth, pairs, fetched):
    """16 leaves held by 4 workers in turn, one thread each: following leaves the whole tree (15 sums), 4
    fragments and 16 picks, 35 tasks; fetching, 4 fragments of 4 leaves, each on one of the workers
    holding 1 MiB of its inputs (the one receiving least so far) fetching 1 MiB from each of the 3
    others: the 3 sums above them and 4 fragments, 7 tasks, and each worker sending and receiving 3 MiB
    at once, over its fastest link. At 1 ms a task: 35 ms against 7 ms plus 3 MiB at that link's figure
    (12 MiB one after the other, as priced before, would follow at 2 ** 28 B/s: 7 + 47 ms)."""
    deps, follow, fetch, sizes, holders = round_robin(16, 4)
    parts = {"w0": 1, "w1": 1, "w2": 1, "w3": 1, None: 4}
    candidates = set(deps) - {"t"}
    got = follow_or_fetch(list(deps), deps, candidates, follow, fetch, parts, None, None, sizes, holders,
                          1e-3, Bandwidths(bandwidth, pairs))
    assert got is (fetch if fetched else follow)
    planned = plan_fragments(list(deps), deps, candidates, fetch, parts)
    assert [{m for m in f if m[0] == "l"} for f in planned] == [{f"l{i}" for i in range(j, j + 4)}
                                                                 for j in (0, 4, 8, 12)]


def test_fetching_is_priced_by_the_fastest_link_from_a_holder_to_the_receiver():
    """The fragments of :func:`interleaved_tree` fetching: b's input over the link w1 -> w0 and c's over
    w0 -> w1; a slow link either way makes following cheaper, unless the input is held by a third worker
    too, whose link to the receiver is fast."""
    deps, follow, fetch, sizes, holders = interleaved_tree()
    parts = {"w0": 1, "w1": 1, None: 2}
    candidates = set(deps) - {"t"}

    def choice(pairs, holders=holders):
        return follow_or_fetch(list(deps), deps, candidates, follow, fetch, parts, None, None, sizes, holders,
                               1e-3, Bandwidths(2 ** 30, pairs))

    assert choice({}) is fetch  # 8 ms against 2 + 3 ms
    assert choice({("w1", "w0"): 2 ** 20}) is follow  # 3 s
    assert choice({("w0", "w1"): 2 ** 20}) is follow
    assert choice({("w0", "w1"): 2 ** 20}, holders | {"xc": {"w0", "w2"}}) is fetch  # from w2, at 2 ** 30
    assert choice({("w0", "w1"): 2 ** 20, ("w2", "w1"): 2 ** 20}, holders | {"xc": {"w0", "w2"}}) is follow


def test_a_fetching_fragment_is_priced_on_the_worker_holding_most_of_its_inputs():
    """The fragments of :func:`interleaved_tree` with c's input 4x larger: {c, c2, d, d2, q} runs on w0,
    which holds xc (12 MiB), fetching xd (3 MiB) over w1 -> w0; on w1 it would fetch 12 MiB. With that
    link slow, fetching costs more than following; the other way, not."""
    deps, follow, fetch, sizes, holders = interleaved_tree()
    sizes = sizes | {"xc": 12 * 2 ** 20}
    parts = {"w0": 1, "w1": 1, None: 2}
    candidates = set(deps) - {"t"}

    def choice(pairs):
        return follow_or_fetch(list(deps), deps, candidates, follow, fetch, parts, None, None, sizes, holders,
                               1e-3, Bandwidths(2 ** 30, pairs))

    assert choice({}) is fetch  # 8 ms against 2 + 6 MiB into w0 at 2 ** 30: 5.9 ms
    assert choice({("w1", "w0"): 2 ** 20}) is follow
    assert choice({("w0", "w1"): 2 ** 20}) is fetch  # nothing moves w0 -> w1


@pytest.mark.parametrize("task_seconds", [-1.0, float("nan")])
def test_follow_or_fetch_refuses_a_negative_task_cost(task_seconds):
    deps, follow, fetch, sizes, holders = interleaved_tree()
    with pytest.raises(ValueError, match="task_seconds must be >= 0"):
        follow_or_fetch(list(deps), deps, set(deps), follow, fetch, {None: 1}, None, None, sizes, holders,
                        task_seconds, Bandwidths(1e9))


def test_a_task_read_through_a_task_outside_the_fragment_stays_out():
    # x is no candidate (e.g. a key the client asked for): b reads a through x, so b may not join a's
    # fragment (the fragment would wait for x, which waits for the fragment)
    deps = {"a": [], "a2": ["a"], "x": ["a2"], "b": ["x", "a2"], "c": ["b"]}
    got = plan_fragments(list(deps), deps, {"a", "a2", "b", "c"}, dict.fromkeys("abc", None) | {"a2": None},
                         {None: 1})
    assert got == [["a", "a2"]]


def test_a_pinned_task_joins_only_a_fragment_of_its_place():
    deps = {"a": [], "b": ["a"], "c": ["a"]}
    got = plan_fragments(list(deps), deps, set(deps), {"a": "w0", "b": "w1", "c": None}, {"w0": 1, "w1": 1})
    assert got == [["a", "c"]]


def test_a_task_joins_only_a_fragment_of_its_label_and_sources_of_two_labels_part():
    deps = {"a": [], "b": [], "a2": ["a"], "a3": ["a"], "b2": ["b"]}
    labels = {"b": "fpga", "a3": "fpga", "b2": "fpga"}  # a, a2: no label
    got = plan_fragments(list(deps), deps, set(deps), dict.fromkeys(deps), {None: 1}, labels=labels)
    assert got == [["a", "a2"], ["b", "b2"]]  # one thread, yet two fragments; a3 runs alone


@pytest.mark.parametrize("order", [["a", "b", "c"], ["c", "b", "a"]])
def test_topological_order_puts_dependencies_first_and_reports_cycles(order):
    deps = {"a": [], "b": ["a", "outside"], "c": ["b"]}
    assert topological(order, deps) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="cycle through"):
        topological(["a", "b", "c"], {"a": ["b"], "b": ["c"], "c": ["b"]})


@given(st.permutations([("a", i, j) for i in range(4) for j in range(2)] + [("b", i) for i in range(5)] + ["t", "u"]))
def test_layer_order_lists_each_layers_blocks_in_index_order_where_its_first_block_was(keys):
    got = layer_order(keys)
    assert sorted(got, key=repr) == sorted(keys, key=repr)
    for name, n in (("a", 8), ("b", 5)):
        blocks = [k for k in got if type(k) is tuple and k[0] == name]
        assert blocks == sorted(blocks) and len(blocks) == n
    first = {}  # each layer, and each other key, where it came first
    for i, k in enumerate(keys):
        first.setdefault(k[0] if type(k) is tuple else k, i)
    runs = [k[0] if type(k) is tuple else k for k in got]
    assert list(dict.fromkeys(runs)) == sorted(first, key=first.get)  # layers, other keys: as they came
    assert len(list(dict.fromkeys(runs))) == sum(a != b for a, b in zip([None, *runs], runs))  # each together


def test_layer_order_keeps_the_order_of_a_layer_whose_indices_do_not_compare():
    keys = [("a", "x"), ("a", 1), ("b", 1), ("b", 0)]
    assert layer_order(keys) == keys


@given(st.lists(st.sets(st.integers(0, 40), max_size=3), max_size=40), st.integers(1, 8))
def test_streams_keep_chains_and_stay_in_range(raw, n):
    deps = [{d for d in ds if d < i} for i, ds in enumerate(raw)]
    got = assign_streams(deps, n)
    assert len(got) == len(deps) and all(0 <= s < n for s in got)
    readers = {}
    for i, ds in enumerate(deps):
        for d in ds:
            readers.setdefault(d, []).append(i)
    for i, ds in enumerate(deps):
        if len(ds) == 1 and readers[min(ds)] == [i]:  # the only reader of its only input: same stream
            assert got[i] == got[min(ds)]


def test_independent_chains_take_streams_round_robin():
    # two chains 0-1-2 and 3-4, then 5 reading both ends
    deps = [set(), {0}, {1}, set(), {3}, {2, 4}]
    assert assign_streams(deps, 8) == [0, 0, 0, 1, 1, 0]
    assert assign_streams(deps, 1) == [0] * 6
    with pytest.raises(ValueError, match="streams must be >= 1"):
        assign_streams(deps, 0)
    with pytest.raises(ValueError, match="step 1 reads a later step"):
        assign_streams([set(), {1}], 2)


@given(st.lists(st.tuples(st.sets(st.integers(0, 30), max_size=3), st.sampled_from(["compute", "memory"])),
                max_size=30))
def test_interleave_is_a_dependency_order_that_alternates_classes_when_both_are_ready(raw):
    deps = [{d for d in ds if d < i} for i, (ds, _) in enumerate(raw)]
    classes = [c for _, c in raw]
    got = interleave(deps, classes)
    assert sorted(got) == list(range(len(deps)))
    position = {i: j for j, i in enumerate(got)}
    assert all(position[d] < position[i] for i, ds in enumerate(deps) for d in ds)
    if not any(deps):  # all independent: the classes alternate while both last
        seq = [classes[i] for i in got]
        fewer = min(seq.count("compute"), seq.count("memory"))
        assert all(seq[k] != seq[k + 1] for k in range(2 * fewer - 1))


def test_interleave_with_one_class_keeps_the_order():
    assert interleave([set(), {0}, set(), {2}], ["memory"] * 4) == [0, 1, 2, 3]
    assert interleave([set(), set(), set()], ["memory", "memory", "compute"]) == [0, 2, 1]
    with pytest.raises(ValueError, match="classes must be 'compute' or 'memory'"):
        interleave([set()], ["auto"])


def test_launch_order_alternates_classes_largest_first():
    classes = ["memory", "compute", "memory", "compute", "memory"]
    sizes = [1, 50, 3, 40, 2]
    # compute holds more work, so it leads; memory members follow largest first; the rest trails
    assert launch_order(classes, sizes) == [1, 2, 3, 4, 0]
    assert launch_order(["memory"] * 3, [1, 3, 2]) == [1, 2, 0]


@given(st.lists(st.tuples(st.sampled_from(["compute", "memory"]), st.floats(0, 1e9)), max_size=20))
def test_launch_order_is_a_permutation_that_never_runs_two_of_a_class_while_the_other_waits(members):
    classes = [c for c, _ in members]
    order = launch_order(classes, [s for _, s in members])
    assert sorted(order) == list(range(len(members)))
    seq = [classes[i] for i in order]
    fewer = min(seq.count("compute"), seq.count("memory"))
    assert all(seq[k] != seq[k + 1] for k in range(2 * fewer - 1))


@pytest.mark.parametrize("resource, group, message", [
    ("disk", 8, "unknown resource 'disk'"),
    ("auto", 0, "group must be None or an integer >= 1, got 0"),
    ("memory", True, "group must be None or an integer >= 1, got True"),
    ("compute", 2.5, "group must be None or an integer >= 1, got 2.5"),
    (np.array(["compute", "memory"]), 2, "unknown resource array"),
])
def test_bad_group_specs(resource, group, message):
    with pytest.raises(ValueError, match=message):
        check_group_spec(resource, group)


def test_tasks_that_only_one_fragment_reads_join_it_upstream():
    # load -> prep -> a (fragment 0); shared -> a and b (two fragments); tagged -> b, with another label;
    # pinned -> b, placed elsewhere; held -> b, not pullable (the scheduler has it)
    steps = ["load", "prep", "shared", "tagged", "pinned", "held", "a", "b"]
    dependents = {"load": ["prep"], "prep": ["a"], "shared": ["a", "b"], "tagged": ["b"], "pinned": ["b"],
                  "held": ["b"]}
    pullable = {"load", "prep", "shared", "tagged", "pinned"}
    places = {"a": None, "b": "w1", "pinned": "w2"}
    out = pull_upstream([["a"], ["b"]], steps, dependents, pullable, places, {"tagged": "gpu"})
    assert out == [["a", "load", "prep"], ["b"]]  # a fragment's own members first
    assert pull_upstream([["a"], ["b"]], steps, dependents, pullable, {**places, "pinned": "w1"}) == [
        ["a", "load", "prep"], ["b", "tagged", "pinned"]]


def test_numpy_integers_are_groups_too():
    assert check_group_spec("auto", np.int64(2)) == 2 and type(check_group_spec("auto", np.int32(3))) is int
    assert check_group_spec("memory", None) is None


def test_bad_launch_classes():
    with pytest.raises(ValueError, match="classes must be 'compute' or 'memory'"):
        launch_order(["auto"], [1.0])
    with pytest.raises(ValueError, match="2 classes for 1 sizes"):
        launch_order(["memory", "compute"], [1.0])


# Added for mutation testing (tools/mutation.sh, docs/testing.md): behaviours the tests above left open.


def test_group_of_one_is_valid_and_errors_name_the_valid_resources():
    check_group_spec("auto", 1)  # 1 is the smallest group (the task runs alone)
    check_group_spec("compute", 1)
    with pytest.raises(ValueError, match=r"^unknown resource 'disk': expected one of auto, compute, memory$"):
        check_group_spec("disk", 1)


def test_the_class_with_more_work_leads_whatever_its_members_positions():
    # memory holds one member of 1, compute one of 5: compute leads although memory comes first
    assert launch_order(["memory", "compute"], [1.0, 5.0]) == [1, 0]
    assert launch_order(["compute", "memory", "memory"], [1.0, 2.0, 3.0]) == [2, 0, 1]


@given(st.lists(st.tuples(st.sampled_from(["compute", "memory"]), st.floats(0, 1e9)), min_size=1, max_size=20))
def test_launch_order_starts_with_the_largest_member_of_the_class_with_more_work(members):
    classes = [c for c, _ in members]
    sizes = [s for _, s in members]
    work = {c: sum(s for k, s in members if k == c) for c in ("compute", "memory")}
    order = launch_order(classes, sizes)
    lead = classes[order[0]]
    assert work[lead] >= work["memory" if lead == "compute" else "compute"]
    assert sizes[order[0]] == max(s for k, s in members if k == lead)


def test_on_equal_work_the_compute_class_leads():
    assert launch_order(["memory", "compute"], [2.0, 2.0]) == [1, 0]
    assert launch_order(["memory", "memory", "compute"], [1.0, 1.0, 2.0]) == [2, 0, 1]


@st.composite
def runs(draw):
    """Step result sizes and, for each result, the step after which it is freed (``None``: held)."""
    sizes = draw(st.lists(st.integers(0, 1000), max_size=20))
    freed = [draw(st.one_of(st.none(), st.integers(i, len(sizes) - 1))) for i in range(len(sizes))]
    return sizes, freed


@given(runs())
@settings(max_examples=300, deadline=None)
def test_live_peak_is_the_largest_sum_of_results_alive_after_any_step(run):
    sizes, freed = run
    frees = [[i for i, f in enumerate(freed) if f == j] for j in range(len(sizes))]
    alive = [sum(s for i, s in enumerate(sizes) if i <= j and (freed[i] is None or freed[i] >= j))
             for j in range(len(sizes))]
    assert live_peak(sizes, frees) == max(alive, default=0)


def test_a_result_freed_before_it_exists_or_missing_free_lists_are_errors():
    with pytest.raises(ValueError, match="step 1's result freed after step 0"):
        live_peak([1, 2], [[1], []])
    with pytest.raises(ValueError, match="1 free lists for 2 steps"):
        live_peak([1, 2], [[]])


@given(runs(), st.data())
@settings(max_examples=300, deadline=None)
def test_arena_peak_sums_each_stream_s_own_peak_and_is_live_peak_on_one_stream(run, data):
    sizes, freed = run
    frees = [[i for i, f in enumerate(freed) if f == j] for j in range(len(sizes))]
    streams = data.draw(st.lists(st.integers(0, 3), min_size=len(sizes), max_size=len(sizes)))
    expected = 0
    for s in set(streams):  # each stream alone: its results alive after each step
        expected += max(sum(sizes[i] for i in range(j + 1) if streams[i] == s and (freed[i] is None or freed[i] >= j))
                        for j in range(len(sizes)))
    assert arena_peak(sizes, frees, streams) == expected
    assert arena_peak(sizes, frees, [0] * len(sizes)) == live_peak(sizes, frees)
    assert arena_peak(sizes, frees, streams) >= live_peak(sizes, frees)


def test_scratch_counts_on_its_stream_while_the_step_runs():
    # two steps of 10 bytes, each with 50 bytes of temporaries, the first freed after the second
    assert arena_peak([10, 10], [[], [0]], [0, 0], [50, 50]) == 70  # one stream: 10 + 10 + 50
    assert arena_peak([10, 10], [[], [0]], [0, 1], [50, 50]) == 120  # two arenas: 60 each


def test_arena_peak_checks_its_input():
    with pytest.raises(ValueError, match="2 sizes, 2 free lists, 1 streams and 2 scratch sizes"):
        arena_peak([1, 2], [[], []], [0], [0, 0])
    with pytest.raises(ValueError, match="step 1's result freed after step 0"):
        arena_peak([1, 2], [[1], []], [0, 1])


def test_topological_walks_a_keys_dependencies_in_the_order_given():
    # c comes first but reads a and b: they go before it, in the order of ``order`` (a, then b),
    # whatever order c's dependencies are listed in
    assert topological(["c", "a", "b"], {"c": ["a", "b"], "a": [], "b": []}) == ["a", "b", "c"]
    assert topological(["c", "a", "b"], {"c": ["b", "a"], "a": [], "b": []}) == ["a", "b", "c"]


def test_a_cap_of_zero_sources_is_refused():
    deps = {"a": [], "b": ["a"]}
    with pytest.raises(ValueError, match=r"^cap must be >= 1 or None, got 0$"):
        plan_fragments(list(deps), deps, set(deps), dict.fromkeys(deps), {None: 1}, cap=0)
