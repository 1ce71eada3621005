"""Pure planning of stream groups: independence of members, sizes, launch order, bad input."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_octopus.groups.planning import check_group_spec, depths, launch_order, plan_groups


@st.composite
def dags(draw):
    """A random DAG over keys 0..n-1 (edges only from lower to higher keys), some keys annotated."""
    n = draw(st.integers(1, 25))
    deps = {k: sorted(draw(st.sets(st.integers(0, k - 1), max_size=3))) if k else [] for k in range(n)}
    marked = sorted(draw(st.sets(st.integers(0, n - 1))))
    size = draw(st.integers(1, 6))
    places = {k: draw(st.sampled_from(["w0", "w1", None])) for k in marked}
    return deps, marked, size, places


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
@settings(max_examples=300, deadline=None)
def test_groups_hold_independent_annotated_tasks_of_one_place_within_size(dag):
    deps, marked, size, places = dag
    groups = plan_groups(marked, {k: size for k in marked}, deps, places)
    flat = [k for g in groups for k in g]
    assert len(flat) == len(set(flat)) and set(flat) <= set(marked)
    for g in groups:
        assert 2 <= len(g) <= size
        assert len({places[k] for k in g}) == 1
        assert not any(reaches(deps, a, b) for a in g for b in g if a != b)


def test_same_depth_tasks_group_in_order_and_leftovers_of_one_run_alone():
    deps = {"a": [], "b": [], "c": [], "d": ["a"], "e": ["b"], "f": ["c", "e"]}
    assert depths(deps) == {"a": 0, "b": 0, "c": 0, "d": 1, "e": 1, "f": 2}
    assert plan_groups(list(deps), dict.fromkeys(deps, 2), deps) == [["a", "b"], ["d", "e"]]
    assert plan_groups(list(deps), dict.fromkeys(deps, 8), deps) == [["a", "b", "c"], ["d", "e"]]


def test_cycle_is_reported():
    with pytest.raises(ValueError, match="cycle"):
        depths({"a": ["b"], "b": ["a"]})


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
    ("auto", 0, "group must be an integer >= 1, got 0"),
    ("memory", True, "group must be an integer >= 1, got True"),
    ("compute", 2.5, "group must be an integer >= 1, got 2.5"),
])
def test_bad_group_specs(resource, group, message):
    with pytest.raises(ValueError, match=message):
        check_group_spec(resource, group)


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


def test_depths_of_keys_listed_before_their_dependencies_and_outside_dependencies():
    # "c" is listed first but depends on later keys; "x" is outside the mapping: a source
    deps = {"c": ["b", "x"], "b": ["a"], "a": ["x"], "d": []}
    assert depths(deps) == {"a": 0, "b": 1, "c": 2, "d": 0}
    assert depths({"a": ["x", "y"]}) == {"a": 0}


def test_a_cycle_that_does_not_pass_through_the_first_key_is_reported():
    with pytest.raises(ValueError, match="cycle through"):
        depths({"a": ["b"], "b": ["c"], "c": ["b"]})


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
