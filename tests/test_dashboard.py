"""The /octopus page, its JSON, the dask_octopus_* series on /metrics, the optional libraries missing,
the records behind them, and ``dask-octopus profile --watch`` (CPU, in-process clusters)."""

import dataclasses
import itertools
import json
import logging
import re
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import dask
import dask.array as da
import pytest
from click.testing import CliRunner
from distributed import Client, LocalCluster, wait
from distributed.utils_test import captured_logger, cluster, gen_cluster
from prometheus_client.parser import text_string_to_metric_families

import dask_octopus
from dask_octopus import cli, dashboard
from dask_octopus.dashboard import columns, serve
from dask_octopus.dashboard.records import PlanRecord, PlanRecords, WeightHistory, spread
from dask_octopus.dashboard.snapshot import PlanRow, Snapshot, WorkerRow
from dask_octopus.groups.streams import EXTENSION, HEARTBEAT_KEY
from dask_octopus.plugins.scheduler import HISTORY_CALLBACK
from dask_octopus.plugins.worker import OctopusWorkerPlugin

COMPUTE, MEMORY = (3.0, 1.0), (1.0, 3.0)  # priors of the two workers, sorted by address


def get(port, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{path}", timeout=30) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode()


def metrics(port):
    """``{(name, labels...): value}`` of the dask_octopus samples on /metrics."""
    out = {}
    for family in text_string_to_metric_families(get(port, "metrics")[2]):
        for s in family.samples:
            if s.name.startswith("dask_octopus_"):
                out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


def embedded_columns(page):
    """The columns of the Bokeh data sources embedded in the page: ``{column name: values}``."""
    docs = re.search(r'<script type="application/json" id="[^"]+">\s*(.*?)\s*</script>', page, re.S).group(1)
    found = {}

    def walk(node):
        if isinstance(node, dict):
            if node.get("name") in ("ColumnDataSource", "AjaxDataSource"):
                for name, values in node["attributes"]["data"]["entries"]:
                    found.setdefault(name, values)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(json.loads(docs))
    return found


def wait_for(condition, timeout=10):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def slow_double(block):
    time.sleep(0.3)  # long enough to stand out of a loaded machine's noise (a 2-core CI run once stalled a
    # fast run of the same plan for 0.47 s against 0.15 s per block here), short enough for a fast test
    return 2 * block


@pytest.fixture
def dashboard_cluster():
    """Two in-process workers, a dashboard on 127.0.0.1, the plugin registered (calibrated briefly) with
    fixed priors and refinement off: compute weights 0.75 and 0.25, memory weights 0.25 and 0.75."""
    with dask.config.set({"octopus.refine.min-duration": "1h"}), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0") as lc, \
            Client(lc) as client:
        dask_octopus.register(client, calibration_seconds=0.05)
        plugin = lc.scheduler.plugins["octopus"]
        for w, c, m in zip(sorted(lc.scheduler.workers), COMPUTE, MEMORY):
            plugin.model.set_prior(w, {"compute": c, "memory": m})
        yield lc, client, lc.scheduler.http_server.port


def one_over(x):
    return 1 / x


def fails_on_block_three(block, block_info=None):
    if block_info[0]["chunk-location"][0] == 3:
        raise ValueError("block three")
    return block


def test_without_dask_s_dashboard_the_page_does_not_link_to_it():
    """A scheduler without Dask's own dashboard (``dask scheduler --no-dashboard``) still serves the page
    and its data, with no link to a Dask dashboard that is not there (a 404)."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0",
                      scheduler_kwargs={"dashboard": False}) as lc, Client(lc) as client:
        dask_octopus.register(client, calibration_seconds=0.05)
        port = lc.scheduler.http_server.port
        with pytest.raises(urllib.error.HTTPError, match="404"):
            get(port, "status")
        assert get(port, "octopus")[0] == 200
        summary = json.loads(get(port, "octopus/data.json")[2])["summary"]
        assert summary.endswith("Refreshed every 2 s.") and "href" not in summary, summary


def test_a_run_with_a_failed_task_shows_as_ended_not_running(dashboard_cluster):
    """A balanced compute of which one block raised, and a map of which one item raised: no task is left
    to run, and the plans table says so (they stayed "running, n of N tasks" for good)."""
    _, client, port = dashboard_cluster
    y = dask_octopus.balance(da.ones((800, 10), chunks=(100, 10)), per_worker=2)
    with pytest.raises(ValueError, match="block three"):
        y.map_blocks(fails_on_block_three, dtype=y.dtype).sum().compute()
    futures = dask_octopus.map(one_over, [1, 0, 2], client=client)
    wait(futures)
    del futures

    def runs():
        return json.loads(get(port, "octopus/data.json")[2])["plans"]["run"]

    deadline = time.monotonic() + 10
    while not all(r.startswith("ended") for r in runs()[:2]) and time.monotonic() < deadline:
        time.sleep(0.1)
    map_run, balance_run = runs()[:2]
    assert re.fullmatch(r"ended, 2 of 3 tasks finished, 1 failed or cancelled", map_run), map_run
    assert re.fullmatch(r"ended, \d+ of \d+ tasks finished, [1-9]\d* failed or cancelled", balance_run), balance_run


def slowly_increased(block):
    time.sleep(0.02)
    return block + 1


HELD = threading.Event()  # (the workers run in this process)


def held_increased(block):
    HELD.wait(10)
    return block + 1


def test_an_annotated_compute_of_blocks_still_being_persisted_shows_its_own_run(dashboard_cluster):
    """Balanced blocks persisted and, before they are all in memory, an annotated compute reading them:
    the plan's latest complete run is that compute's (its fragment on each worker, each counted once),
    not the persist's blocks that finished meanwhile (counted as its finish: 18 "tasks" of 2)."""
    lc, client, _ = dashboard_cluster
    plugin = lc.scheduler.plugins["octopus"]
    x = dask_octopus.balance(da.ones((4000, 10), chunks=(100, 10)), per_worker=4)
    HELD.clear()  # the persist's blocks wait until the compute's run is seen (40 blocks of 20 ms left a
    x = x.map_blocks(held_increased, dtype=x.dtype).persist()  # window of 0.1-0.3 s on a loaded machine)
    (record,) = plugin.plan_records.latest(5)
    with dask_octopus.annotate():
        total = client.compute((x * 2).sum())
    try:
        wait_for(lambda: record.current is not None and record.current.number == 1)
        opened = [r.number for r in record._open]
    finally:
        HELD.set()
    assert opened == [0, 1]  # (the persist's run still open as the compute came)
    assert total.result() == 4 * 4000 * 10
    wait(x)
    wait_for(lambda: record.done is not None and record.done is record.current)
    run = record.done
    assert run.tasks == dict.fromkeys(lc.scheduler.workers, 1), run
    assert run.expected == 2 and set(run.finish()) == set(lc.scheduler.workers)


def test_a_compute_again_while_the_first_runs_expects_only_the_tasks_it_runs(dashboard_cluster):
    """The same graph computed again while the first compute runs: Dask runs none of its tasks again
    (those released since included), so its run expects none of them; every run ends complete, none
    stays followed (29 keys stayed pending for good, and the run ended "29 failed or cancelled")."""
    lc, client, _ = dashboard_cluster
    plugin = lc.scheduler.plugins["octopus"]
    x = dask_octopus.balance(da.ones((400, 10), chunks=(10, 10)), per_worker=10).persist()
    wait(x)
    y = x.map_blocks(slowly_increased, dtype=float).map_blocks(one_over, dtype=float).sum()
    first = client.compute(y, optimize_graph=False)
    (record,) = plugin.plan_records.latest(5)
    wait_for(lambda: record.current.number == 1 and sum(record.current.tasks.values()) >= 10)
    second = client.compute(y, optimize_graph=False)
    assert first.result() == second.result() == 400 * 10 / 2
    wait_for(lambda: not record._open)
    assert record.done.number == record.current.number and record.current.lost == 0, record.current
    assert sum(record.current.tasks.values()) == record.current.expected < 20, record.current


def test_page_and_metrics_show_every_worker_and_its_weight(dashboard_cluster):
    lc, client, port = dashboard_cluster
    workers = sorted(lc.scheduler.workers)
    status, kind, page = get(port, "octopus")
    assert status == 200 and kind.startswith("text/html")
    assert "Bokeh" in page and not re.search(r"<(script|link)[^>]+(src|href)=", page)  # inline: renders offline
    cols = embedded_columns(page)
    assert cols["address"] == workers
    assert cols["weight_compute"] == pytest.approx([0.75, 0.25])
    assert cols["weight_memory"] == pytest.approx([0.25, 0.75])
    assert all(g.endswith("FLOP/s") for g in cols["gemm"]) and all(b.endswith("B/s") for b in cols["stream"])
    status, kind, body = get(port, "octopus/data.json")
    data = json.loads(body)
    assert status == 200 and kind == "application/json"
    assert data["workers"]["address"] == workers and data["workers"]["weight_compute"] == pytest.approx([0.75, 0.25])
    assert 'href="octopus"' in get(port, "status")[2]  # in the dashboard's "More..." menu
    assert data["summary"].endswith(' <a href="status">Dask dashboard</a>')

    profiles = dask_octopus.profiles(client)
    # the run counters come with each worker's heartbeat: wait for the first one after registering
    deadline = time.monotonic() + 30
    while not all(HEARTBEAT_KEY in ws.metrics for ws in lc.scheduler.workers.values()):
        assert time.monotonic() < deadline, "no heartbeat with the counters"
        time.sleep(0.05)
    m = metrics(port)
    for w, compute, memory in zip(workers, (0.75, 0.25), (0.25, 0.75)):
        assert m[("dask_octopus_weight", ("resource", "compute"), ("worker", w))] == pytest.approx(compute)
        assert m[("dask_octopus_weight", ("resource", "memory"), ("worker", w))] == pytest.approx(memory)
        assert m[("dask_octopus_calibrated_flops", ("worker", w))] == profiles[w]["compute"] > 0
        assert m[("dask_octopus_calibrated_bytes_per_second", ("worker", w))] == profiles[w]["memory"] > 0
        for name in ("dask_octopus_pinned_tasks", "dask_octopus_plans_active", "dask_octopus_task_timings",
                     "dask_octopus_graphs_captured", "dask_octopus_groups_run_total",
                     "dask_octopus_group_tasks_run_total", "dask_octopus_graphs_replayed_total"):
            assert m[(name, ("worker", w))] == 0, name


def test_a_refused_calibration_exports_no_figures(dashboard_cluster):
    lc, client, port = dashboard_cluster
    w = sorted(lc.scheduler.workers)[0]
    before = {**lc.scheduler.plugins["octopus"].profiles[w]}
    priors = {**lc.scheduler.plugins["octopus"].model.priors}

    def report(profile, dask_scheduler=None):
        dask_scheduler.plugins["octopus"].report(worker=w, profile=profile)

    try:
        client.run_on_scheduler(report, {"device": "cpu", "compute": float("nan"), "memory": float("inf")})
        m = metrics(port)
        assert ("dask_octopus_calibrated_flops", ("worker", w)) not in m
        assert ("dask_octopus_calibrated_bytes_per_second", ("worker", w)) not in m
    finally:  # as the other tests of this cluster expect it
        lc.scheduler.plugins["octopus"].profiles[w] = before
        lc.scheduler.plugins["octopus"].model.priors.update(priors)


def test_a_balanced_compute_shows_its_plan_pins_groups_and_observed_finish(dashboard_cluster):
    lc, client, port = dashboard_cluster
    fast, slow = sorted(lc.scheduler.workers)
    x = da.ones((800, 10), chunks=(100, 10))
    y = client.persist(dask_octopus.balance(x, per_worker=2))
    assert y.chunks[0] == (300, 300, 100, 100)  # by the weights 0.75 / 0.25
    with dask_octopus.annotate(group=2):
        z = y.map_blocks(slow_double)
    assert z.sum().compute() == 2 * 800 * 10

    data = json.loads(get(port, "octopus/data.json")[2])
    plans = data["plans"]
    assert plans["plan"][0] == y.name and plans["blocks"][0] == 4
    names = [str(lc.scheduler.workers[w].name) for w in (fast, slow)]
    assert plans["per_worker"][0] == f"{names[0]}: 2 · {names[1]}: 2"
    assert plans["predicted"][0] == f"{names[0]}: 1.00 · {names[1]}: 1.00"  # shares 0.75, 0.25 over those weights
    assert plans["run"][0].startswith("done")
    latest = data["latest"]
    assert latest["share"] == [0.75, 0.25] and latest["weight"] == pytest.approx([0.75, 0.25])
    assert all(f >= 0.6 for f in latest["observed"])  # each worker ran its two blocks (slow_double sleeps)
    assert re.fullmatch(rf"{names[0]}: \d+\.\d{{3}} s · {names[1]}: \d+\.\d{{3}} s", plans["observed"][0])
    assert "Latest plan" in data["latest_title"] and y.name in data["latest_title"]
    assert (y + 1).sum().compute() == 2 * 800 * 10  # a later run of the same plan replaces the slow one
    again = json.loads(get(port, "octopus/data.json")[2])
    # its own finish times (not compared with the slow run's: a 2-core CI run once stalled this fast run
    # past the slow one's 0.6 s), and complete
    assert again["latest"]["observed"] != latest["observed"] and again["plans"]["run"][0].startswith("done")

    ran = client.run(lambda dask_worker: dask_worker.extensions[EXTENSION].stats())
    assert sum(r["groups"] for r in ran.values()) >= 1 and all(r["members"] >= 2 * r["groups"] for r in ran.values())

    def reported():  # the workers send their counts with each heartbeat (every 0.5 s)
        m = metrics(port)
        return all(m.get(("dask_octopus_groups_run_total", ("worker", w))) == ran[w]["groups"] and
                   m.get(("dask_octopus_group_tasks_run_total", ("worker", w))) == ran[w]["members"] for w in ran)

    wait_for(reported)
    m = metrics(port)
    for w in (fast, slow):
        assert m[("dask_octopus_pinned_tasks", ("worker", w))] == 2  # y's two blocks, persisted
        assert m[("dask_octopus_plans_active", ("worker", w))] == 1
        assert m[("dask_octopus_graphs_replayed_total", ("worker", w))] == 0  # CPU workers capture nothing
    page_cols = embedded_columns(get(port, "octopus")[2])
    assert page_cols["plan"] == [y.name] and page_cols["groups"] == [ran[w]["groups"] for w in (fast, slow)]


def test_the_weight_history_shows_how_the_weights_moved(dashboard_cluster):
    lc, _, port = dashboard_cluster
    plugin = lc.scheduler.plugins["octopus"]
    fast, slow = sorted(lc.scheduler.workers)
    wait_for(lambda: plugin.history.points and plugin.history.points[-1][1][fast] == pytest.approx((0.75, 0.25)))
    plugin.model.set_prior(slow, {"compute": 3.0, "memory": 1.0})  # the slow worker speeds up
    wait_for(lambda: plugin.history.points[-1][1][slow] == pytest.approx((0.5, 0.5)))
    compute = json.loads(get(port, "octopus/data.json")[2])["compute"]
    assert compute["label"] == [columns.worker_label(w, str(lc.scheduler.workers[w].name)) for w in (fast, slow)]
    ys = dict(zip((fast, slow), compute["ys"]))
    assert ys[slow][-1] == pytest.approx(0.5) and ys[fast][-1] == pytest.approx(0.5)
    assert pytest.approx(0.25) in ys[slow] and pytest.approx(0.75) in ys[fast]  # before the change
    assert all(a <= b for xs in compute["xs"] for a, b in itertools.pairwise(xs))  # in time order
    for xs, ys in zip(compute["xs"], compute["ys"]):  # steps: a weight holds until it changes
        assert all(x0 == x1 for (x0, y0), (x1, y1) in itertools.pairwise(zip(xs, ys)) if y0 != y1)


def test_without_bokeh_and_prometheus_client_the_plugin_works_and_says_once_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "bokeh", None)  # import bokeh raises ImportError
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "dask_octopus.dashboard.metrics", raising=False)
    monkeypatch.delattr(dashboard, "metrics", raising=False)  # else the import finds the module loaded earlier
    monkeypatch.setattr(serve, "_said", set())
    with captured_logger("dask_octopus", level=logging.INFO) as log:
        for _ in range(2):  # a second scheduler in the process: nothing said again
            with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                              dashboard_address="127.0.0.1:0") as lc, Client(lc) as client:
                dask_octopus.register(client, calibrate=False)
                port = lc.scheduler.http_server.port
                assert dask_octopus.balance(da.ones((40, 2), chunks=10)).sum().compute() == 80
                status, _, page = get(port, "octopus")
                assert status == 200 and "pip install 'dask-octopus[dashboard]'" in page
                data = json.loads(get(port, "octopus/data.json")[2])  # the data needs neither library
                assert data["workers"]["address"] == sorted(lc.scheduler.workers)
                assert "dask_octopus_" not in get(port, "metrics")[2]
    lines = log.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert any("bokeh is not installed" in line and "dask-octopus[dashboard]" in line for line in lines)
    assert any("prometheus_client is not installed" in line for line in lines)


def test_the_routes_answer_404_once_the_plugin_is_unregistered(dashboard_cluster):
    _, client, port = dashboard_cluster
    client.unregister_scheduler_plugin("octopus")
    for path in ("octopus", "octopus/data.json"):
        with pytest.raises(urllib.error.HTTPError) as info:
            get(port, path)
        assert info.value.code == 404 and "not registered" in info.value.read().decode()
    assert "dask_octopus_" not in get(port, "metrics")[2]


def test_registering_again_after_unregistering_keeps_the_weight_history_going(dashboard_cluster):
    lc, client, _ = dashboard_cluster
    first = lc.scheduler.plugins["octopus"]
    client.unregister_scheduler_plugin("octopus")
    with captured_logger("tornado.application") as log:
        dask_octopus.register(client, calibrate=False)  # the order register's own warning recommends
        second = lc.scheduler.plugins["octopus"]
        assert second is not first
        deadline = time.monotonic() + 10
        # a sample a second; the first plugin's sampler stops itself at its next tick
        while not second.history.points or first._sampler is not None:
            assert time.monotonic() < deadline, "no weights sampled after registering again, or still two samplers"
            time.sleep(0.1)
    assert lc.scheduler.periodic_callbacks[HISTORY_CALLBACK] is second._sampler
    assert second._sampler.is_running()
    assert "Error" not in log.getvalue() and "KeyError" not in log.getvalue()


# -- the records, pure -------------------------------------------------------------------------------


def test_weight_history_keeps_changes_only_and_is_bounded():
    h = WeightHistory(maxlen=3, tolerance=0.01)
    assert h.add(1.0, {"a": (0.5, 0.5), "b": (0.5, 0.5)})
    assert not h.add(2.0, {"a": (0.505, 0.5), "b": (0.495, 0.5)})  # within the tolerance
    assert h.add(3.0, {"a": (0.6, 0.5), "b": (0.4, 0.5)})
    assert h.add(4.0, {"a": (0.6, 0.5)})  # a worker left
    assert h.add(5.0, {"a": (0.6, 0.5), "c": (0.4, 0.5)})  # another joined
    assert [t for t, _ in h.points] == [3.0, 4.0, 5.0]
    wide = WeightHistory(max_weights=5)  # (each page poll sends them all)
    for t in range(4):
        wide.add(float(t), {"a": (t / 10, 0.5), "b": (1 - t / 10, 0.5)})
    assert [t for t, _ in wide.points] == [2.0, 3.0]
    wide.add(4.0, {w: (1 / 6, 1 / 6) for w in "abcdef"})
    assert [t for t, _ in wide.points] == [4.0]  # the newest alone, whatever its size


def test_plan_record_predicts_and_keeps_the_latest_complete_run():
    r = PlanRecord("x", 0.0, ["a", "a", "b"], [30.0, 30.0, 40.0], {"a": 0.75, "b": 0.25})
    assert r.blocks() == {"a": 2, "b": 1}
    assert r.shares() == {"a": 0.6, "b": 0.4}
    assert r.predicted() == pytest.approx({"a": 2 / 3, "b": 4 / 3})  # 0.6 / 0.75 and 0.4 / 0.25 over their mean
    assert r.shown() is None
    r.restart(["k0", "k1", "k2"])
    r.observe("a", 10.0, 11.0, "k0")
    r.observe("b", 10.5, 12.0, "k1")
    assert r.shown() is r.current and not r.current.complete and not r.current.ended
    r.observe("a", 9.5, 11.5, "k2")
    assert r.done is r.current and r.current.finish() == {"a": 2.0, "b": 2.5} and r.current.ended
    assert r.current.tasks == {"a": 2, "b": 1}
    r.restart(["k3", "k4"])  # the next graph: its run in progress does not hide the complete one
    r.observe("a", 20.0, 21.0, "k3")
    assert r.shown().finish() == {"a": 2.0, "b": 2.5}
    r.observe("b", 20.0, 20.5, "k4")
    assert r.shown().finish() == {"a": 1.0, "b": 0.5}


def test_a_run_whose_other_tasks_failed_or_were_cancelled_has_ended():
    """A run whose tasks did not all finish, but none is left to run (failed, cancelled): ended, not in
    progress for ever; a task that finished and is forgotten later was not lost."""
    r = PlanRecord("x", 0.0, ["a", "b"], [1.0, 1.0], {"a": 0.5, "b": 0.5})
    r.restart(["k0", "k1", "k2", "k3"])
    r.observe("a", 1.0, 2.0, "k0")
    r.lose("k0")  # (forgotten once its result was released)
    r.lose("other")  # (not of this run)
    assert not r.current.ended and r.current.lost == 0
    r.split("k3", ["p0", "p1"])  # (split into its members: its parts finish instead, and count in its place)
    r.lose("k3")
    r.lose("k1")
    assert not r.current.ended and r.current.lost == 1 and r.current.expected == 5
    r.observe("b", 2.0, 3.0, "p0")
    r.lose("p1")
    r.lose("k2")
    r.lose("k2")
    assert r.current.ended and not r.current.complete and r.current.lost == 3
    assert r.done is None and r.shown() is r.current and r.current.pending == set()
    assert r.current.tasks == {"a": 1, "b": 1}
    assert spread([1.0, 0.5]) == 0.5 and spread([1.0]) is None and spread([0.0, 0.0]) is None


def test_a_run_counts_its_own_tasks_once_each():
    """A task of an earlier graph that finishes once the next graph's run began counts in its own run,
    not the new one; a task computed again (its worker left) counts once; an earlier run that completes
    after a later one does not hide it. The dashboard showed a persist's blocks, still running, as the
    finish of the annotated compute that read them (its two fragments "complete" at the second block)."""
    r = PlanRecord("x", 0.0, ["a", "b"], [1.0, 1.0], {"a": 0.5, "b": 0.5})
    r.restart(["k0", "k1", "k2"])
    r.observe("a", 1.0, 2.0, "k0")
    r.restart(["f0", "f1"])
    first, second = r._open
    r.observe("a", 2.0, 3.0, "k1")
    r.observe("b", 2.0, 3.5, "k2")
    assert first.complete and r.done is first and first.tasks == {"a": 2, "b": 1}
    assert second.tasks == {} and not second.ended and r.current is second
    r.observe("a", 3.0, 4.0, "f0")
    r.observe("b", 3.0, 5.0, "f0")  # (computed again elsewhere: counted once)
    assert second.tasks == {"a": 1} and not second.complete
    r.observe("b", 3.0, 6.0, "f1")
    assert r.done is second and second.tasks == {"a": 1, "b": 1} and second.finish() == {"a": 1.0, "b": 3.0}
    r.restart(["g0"])
    r.restart(["h0"])
    r.observe("a", 7.0, 8.0, "h0")
    r.observe("a", 7.0, 9.0, "g0")  # an earlier run completing later
    assert r.done.finish() == {"a": 1.0} and r.done.number == 3 and not r._open
    r.restart([])  # (nothing of the plan to run: no run)
    assert r.current.number == 3 and not r._open
    r.restart(["s0", "s1"])
    older = r.current
    r.restart(["s1", "s2"])  # s1: the same task, which both graphs run
    newer = r.current
    r.observe("b", 10.0, 11.0, "s1")
    r.lose("s2")
    assert older.tasks == newer.tasks == {"b": 1} and newer.ended and not newer.complete and newer.lost == 1
    assert list(r._open) == [older]
    r.lose("s0")
    assert not r._open and r.done.number == 3


def test_plan_records_keep_the_most_recent_plans():
    records = PlanRecords(maxlen=2)
    for name in "xyz":
        records.add(PlanRecord(name, 0.0, ["a"], [1.0], {"a": 1.0}))
    assert [r.name for r in records.latest(5)] == ["z", "y"] and records.get("x") is None
    records.restart({"y": ["a", "b", "c", "d"], "x": ["e"]})
    assert records.get("y").current.expected == 4 and records.get("y").current.pending == {"a", "b", "c", "d"}


def test_observed_finish_is_scaled_to_seconds_against_the_prediction():
    plan = types.SimpleNamespace(predicted={"a": 1.2, "b": 0.8}, observed={"a": 2.4, "b": 1.6})
    assert columns._scale(plan) == pytest.approx(2.0)  # the prediction, in seconds, matches exactly


# -- dask-octopus profile --watch --------------------------------------------------------------------


def set_priors(dask_scheduler):
    for w, c, m in zip(sorted(dask_scheduler.workers), COMPUTE, MEMORY):
        dask_scheduler.plugins["octopus"].model.set_prior(w, {"compute": c, "memory": m})


class Clock:
    """Stands in for the ``time`` module of the command line: each sleep runs ``between`` and the
    ``stop_after``-th is a Ctrl-C."""

    def __init__(self, stop_after, between=lambda n: None):
        self.sleeps = []
        self.stop_after = stop_after
        self.between = between

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        if len(self.sleeps) == self.stop_after:
            raise KeyboardInterrupt
        self.between(len(self.sleeps))

    @staticmethod
    def strftime(fmt):
        return time.strftime(fmt)


@pytest.mark.parametrize("terminal", [False, True])
def test_profile_watch_refreshes_until_ctrl_c(loop, monkeypatch, terminal):
    with cluster(nworkers=2) as (s, workers), Client(s["address"], loop=loop) as c:
        dask_octopus.register(c, calibrate=False)
        addresses = sorted(w["address"] for w in workers)

        def slow_down(n):  # after the first table: the workers' weights change
            if n == 1:
                c.run_on_scheduler(set_priors)

        clock = Clock(stop_after=3, between=slow_down)
        monkeypatch.setattr(cli, "time", clock)
        env = {"FORCE_COLOR": "1", "COLUMNS": "200"} if terminal else {"COLUMNS": "200"}
        result = CliRunner(env=env).invoke(cli.main, ["profile", "--scheduler-address", s["address"], "--watch",
                                                      "--interval", "0.5"])
    assert result.exit_code == 0, result.output
    assert clock.sleeps == [0.5, 0.5, 0.5]  # Ctrl-C at the third pause ends it quietly
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", result.output)  # colours and cursor moves of a terminal
    tables = out.count("every 0.5 s (Ctrl-C stops)")  # a table before each pause (Live redraws the last as it stops)
    assert tables == 3 if not terminal else tables >= 3
    assert "0.500" in out and "0.750" in out and "0.250" in out  # the weights before and after the change
    assert ("\x1b[1A" in result.output) == terminal  # redrawn in place (cursor up) on a terminal; one by one in a log
    for a in addresses:
        assert a in out


@pytest.mark.parametrize("interval, message", [("0", "0.0 is not in the range 0.1<=x<=86400"),
                                               ("nan", "'nan' is not a finite number"),
                                               ("1e308", "1e+308 is not in the range 0.1<=x<=86400")])
def test_profile_watch_interval_must_be_a_positive_number_of_seconds(interval, message):
    result = CliRunner().invoke(cli.main, ["profile", "--scheduler-address", "tcp://127.0.0.1:1", "--watch",
                                           "--interval", interval])
    assert result.exit_code == 2 and f"Invalid value for '--interval': {message}" in result.output, result.output


@pytest.mark.parametrize("value, text", [(None, "-"), (5.1e13, "51.0 TFLOP/s"), (2.5e9, "2.5 GFLOP/s"),
                                         (1e9, "1.0 GFLOP/s"), (1e3, "1.0 kFLOP/s"), (512.0, "512 FLOP/s")])
def test_si_units(value, text):  # (at a prefix's boundary, the larger prefix)
    assert columns.si(value, "FLOP/s") == text


def test_labels_name_the_workers_and_numbers_read_as_text():
    assert columns.worker_label("tcp://10.0.0.1:4000", "0") == "0 (10.0.0.1:4000)"
    assert columns.worker_label("tcp://10.0.0.1:4000", "tcp://10.0.0.1:4000") == "10.0.0.1:4000"
    assert columns._scale(types.SimpleNamespace(predicted={"a": 0.0}, observed={"a": 1.0})) is None
    assert columns.percent(0.031) == "3.1%" and columns.percent(None) == "-"


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_the_worker_plugin_never_changes_the_metrics_a_heartbeat_is_iterating(c, s, a):
    # a heartbeat iterates Worker.metrics and may be suspended at an awaitable metric meanwhile; the
    # plugin arriving or leaving then must not change that dict (a changed dict closes the worker)
    plugin = OctopusWorkerPlugin(calibrate=False)
    a.metrics = {**a.metrics, "one": lambda w: 1, "two": lambda w: 2}  # a heartbeat between two metrics
    during = iter(a.metrics.items())
    next(during)
    await plugin.setup(a)
    list(during)  # no "dictionary changed size during iteration"
    assert HEARTBEAT_KEY in a.metrics
    during = iter(a.metrics.items())
    next(during)
    plugin.teardown(a)
    list(during)
    assert HEARTBEAT_KEY not in a.metrics


@gen_cluster(client=True, config={"octopus.calibration.seconds": 0.5})
async def test_a_scrape_while_the_workers_calibrate_leaves_the_series_to_come(c, s, a, b):
    import asyncio

    from distributed.utils_test import async_poll_for

    from dask_octopus.dashboard import metrics as exporter

    registering = asyncio.ensure_future(dask_octopus.register(c))
    await async_poll_for(lambda: "octopus-worker" in a.plugins, 5)  # its probes run for 0.5 s
    assert "octopus" not in s.plugins  # Dask adds it once the workers calibrated
    assert not [f for f in exporter.register(serve._exported).collect()]  # a scrape: nothing yet
    await registering
    families = {f.name: f for f in exporter.register(serve._exported).collect()}
    assert {sample.labels["worker"] for sample in families["dask_octopus_weight"].samples} == {a.address, b.address}


def test_a_scrape_reads_the_plugins_of_its_own_event_loop_only():
    """Two clusters of one process, each on its own thread's event loop: a scrape of one reads the
    other's state no more while that loop changes it (a "dictionary changed size during iteration"
    failed the whole scrape)."""
    from dask_octopus.dashboard import metrics as exporter

    async def scrape():
        return {s.labels["worker"] for f in exporter.register(serve._exported).collect()
                if f.name == "dask_octopus_weight" for s in f.samples}

    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as one, Client(one) as a, \
            LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as other, Client(other) as b:
        assert a.loop.asyncio_loop is not b.loop.asyncio_loop
        dask_octopus.register(a, calibrate=False)
        dask_octopus.register(b, calibrate=False)
        assert a.sync(scrape) == set(one.scheduler.workers)
        assert b.sync(scrape) == set(other.scheduler.workers)


def test_spread_of_finishes_one_of_which_is_zero():
    assert spread([1.0, 0.0]) == 1.0  # only a maximum that is not > 0 gives None


def test_weight_history_compares_with_the_last_point_and_says_false_when_it_adds_none():
    h = WeightHistory()
    assert h.add(1.0, {"a": (0.5, 0.5)}) is True
    assert h.add(2.0, {"a": (0.6, 0.4)}) is True
    assert h.add(3.0, {"a": (0.5, 0.5)}) is True  # back to the first point's weights: a change from the last
    assert h.add(4.0, {"a": (0.5, 0.5)}) is False
    assert [t for t, _ in h.points] == [1.0, 2.0, 3.0]


def test_weight_history_keeps_exactly_max_weights():
    h = WeightHistory(max_weights=4)
    h.add(1.0, {"a": (0.5, 0.5), "b": (0.5, 0.5)})
    h.add(2.0, {"a": (0.6, 0.5), "b": (0.4, 0.5)})
    assert [t for t, _ in h.points] == [1.0, 2.0]  # 4 weights of 4: none dropped


def test_a_run_before_its_first_task_finishes_nowhere():
    r = PlanRecord("x", 0.0, ["a"], [1.0], {"a": 1.0})
    r.restart(["k0", "k1"])
    assert r.current.finish() == {}


def test_a_plan_of_no_work_or_of_workers_without_weight_predicts_only_what_it_can():
    empty = PlanRecord("x", 0.0, ["a", "b"], [0.0, 0.0], {"a": 1.0, "b": 1.0})
    assert empty.shares() == {} and empty.predicted() == {}
    r = PlanRecord("y", 0.0, ["a", "b", "c"], [1.0, 1.0, 1.0], {"a": 1.0, "b": 0.0})  # b weight 0, c none
    assert r.predicted() == {"a": 1.0}


def test_clock_is_the_local_time_of_day():
    assert columns.clock(3600.0) == time.strftime("%H:%M:%S", time.localtime(3600.0))


def worker_row(address, device, model, error):
    return WorkerRow(address, address, device, model, None, None, 0.5, 0.5, 0, 0, 0, None, None, None, None, error)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, config={"octopus.max-plans": 2})
async def test_tasks_pinned_by_plans_dropped_since_still_count_per_worker(c, s, a, b):
    """Five persisted balanced arrays, the plugin keeping two plans (``octopus.max-plans``): the blocks of
    the three dropped plans stay pinned, and each worker's pinned tasks and plans count them (the table
    and the metrics counted the two kept plans' only, the summary all five)."""
    from dask_octopus.dashboard.snapshot import take

    await dask_octopus.register(c, calibration_seconds=0.05)
    ys = []
    for i in range(5):  # each graph in before the next plan (one to come would keep its plan: max-plans)
        ys.append(c.persist(await dask_octopus.balance(da.ones((1000 + i, 10), chunks=(100, 10)), client=c)))
        await wait(ys[-1])
    snap = take(s.plugins["octopus"], 10)
    blocks = [len(y.chunks[0]) for y in ys]  # (10 or 11 each: as the weights calibrated cut them)
    assert sum(r.pinned for r in snap.workers) == sum(blocks) and sum(blocks) > sum(blocks[-2:]) + 20
    assert [r.plans for r in snap.workers] == [5, 5] and snap.plans_active == 5


def test_recent_plans_tell_workers_apart_by_their_whole_names():
    """Workers named ``node (a)`` and ``node (b)``: the plans table shows both names, not ``node`` twice
    (a label's ``" ("`` was taken for the start of its address)."""
    a, b = "tcp://h:1", "tcp://h:2"
    rows = [dataclasses.replace(worker_row(a, "cpu", "CPU", None), name="node (a)"),
            dataclasses.replace(worker_row(b, "cpu", "CPU", None), name="node (b)"),
            worker_row("tcp://h:3", "cpu", "CPU", None)]  # named after its address
    plan = PlanRow("p", 0.0, {a: 1, b: 2, "tcp://h:3": 1}, {}, {}, {}, {}, {}, 0, False)
    data = columns.page_data(Snapshot(0.0, "tcp://s:1", rows, [], [plan], 1, 1), 2.0)
    assert data["plans"]["per_worker"] == ["node (a): 1 · node (b): 2 · h:3: 1"]
    assert data["workers"]["label"][:2] == ["node (a) (h:1)", "node (b) (h:2)"]


def test_worker_table_names_gpu_models_only_and_notes_errors():
    rows = [worker_row("tcp://a:1", "gpu", "H200", None), worker_row("tcp://b:1", "cpu", "CPU", None),
            worker_row("tcp://c:1", "gpu", "", "no calibration")]
    data = columns._workers(rows, {r.address: "#000000" for r in rows})
    assert data["device"] == ["H200", "cpu", "gpu"]
    assert data["note"] == ["", "", "no calibration"]


def test_history_lines_end_now_for_live_workers_only():
    a, b = "tcp://a:1", "tcp://b:1"
    points = [(1.0, {a: (0.5, 0.5), b: (0.5, 0.5)}), (2.0, {a: (1.0, 1.0)})]
    got = columns._history(points, 3.0, {a: "a:1"}, 0, {a: "#1", b: "#2"})
    assert got["xs"] == [[1000.0, 2000.0, 2000.0, 3000.0], [1000.0]]  # b left: its line stops where it did
    assert got["ys"] == [[0.5, 0.5, 1.0, 1.0], [0.5]]
    assert got["label"] == ["a:1", "b:1 (gone)"]
    now = columns._history([(1.0, {a: (0.5, 0.5)}), (3.0, {a: (1.0, 1.0)})], 3.0, {a: "a:1"}, 0, {a: "#1"})
    assert now["xs"] == [[1000.0, 3000.0, 3000.0]]  # its last point is now already


def plan_row(name, observed, complete):
    return PlanRow(name, 0.0, {"a": 1}, {"a": 1.0}, {"a": 1.0}, {"a": 1.0}, observed,
                   {"a": 1} if observed else {}, 2, complete)


def test_latest_plan_is_the_newest_that_ran_else_the_newest():
    _, title = columns._latest([plan_row("new", {}, False), plan_row("old", {"a": 1.0}, False)], {}, {})
    assert title.startswith("Latest plan (old, made at ") and "run in progress, 1 of 2 tasks" in title
    _, title = columns._latest([plan_row("new", {}, False), plan_row("old", {}, False)], {}, {})
    assert title.startswith("Latest plan (new, made at ") and title.endswith("): not run yet")


def test_latest_plan_names_gone_workers_and_gives_the_prediction_in_seconds():
    a, b = "tcp://a:1", "tcp://b:1"
    p = PlanRow("p", 0.0, {a: 2, b: 1}, {a: 0.6, b: 0.4}, {a: 0.6, b: 0.4}, {a: 1.2, b: 0.8},
                {a: 2.4, b: 1.6}, {a: 2, b: 1}, 3, True)
    data, _ = columns._latest([p], {a: "0 (a:1)"}, {})
    assert data["label"] == ["0 (a:1)", "b:1 (gone)"]
    assert data["predicted"] == pytest.approx([2.4, 1.6])  # scaled by 2 s per unit of relative finish


def test_run_column_of_a_graph_whose_tasks_have_not_finished_yet():
    assert columns._run(plan_row("p", {}, False)) == "running, 0 of 2 tasks"  # expected 2, none done
    assert columns._run(PlanRow("q", 0.0, {"a": 1}, {}, {}, {}, {}, {}, 0, False)) == "not run"
    one = PlanRow("r", 0.0, {"a": 1}, {}, {}, {}, {}, {}, 1, False)
    assert columns._run(one) == "running, 0 of 1 task"
    assert columns._run(dataclasses.replace(one, tasks={"a": 1}, complete=True)) == "done, 1 task"
    ended = dataclasses.replace(plan_row("s", {"a": 1.0}, False), lost=1, ended=True)
    assert columns._run(ended) == "ended, 1 of 2 tasks finished, 1 failed or cancelled"
    _, title = columns._latest([ended], {}, {})
    assert "run ended, 1 of 2 tasks finished, 1 failed or cancelled: finish spread" in title


def test_summary_says_when_the_weights_last_changed():
    snap = Snapshot(7200.0, "tcp://s:1", [], [(0.0, {}), (3600.0, {})], [], 0, 0)
    assert f"weights last changed at {columns.clock(3600.0)}. " in columns._summary(snap, 2.0)
