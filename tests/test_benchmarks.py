"""Smoke runs of the benchmark CLIs at tiny sizes (CPU): they run, and write what they promise."""

import itertools
import json
import math
import os
import time

import numpy as np
import pytest
from click.testing import CliRunner
from dask.core import flatten
from scripts import load_script

import dask_octopus
from dask_octopus.bench import protocol

local_octopus = load_script("benchmarks/local_octopus.py")
scheduler_overhead = load_script("benchmarks/scheduler_overhead.py")
speed_model = load_script("benchmarks/speed_model.py")
stream_groups = load_script("benchmarks/stream_groups.py")

OPS = ["matmul_iterate", "dot", "transpose_sum", "map_overlap", "images"]
VARIANTS = ["defaults", "over-4", "balance", "balance-4", "streams", "balance-4-streams"]  # all but over-16


@pytest.mark.parametrize("script", ["calibration", "dask_cuda_overhead", "fft_filter", "fragment_phases",
                                    "local_octopus", "long_run", "stream_groups"])
def test_each_benchmark_says_what_this_machine_cannot_start_before_starting(script, tmp_path, monkeypatch):
    """GPU workers without a GPU, UCX on CPU workers and an --out that cannot be a folder are usage errors
    (exit code 2, one line) before any cluster starts; they were tracebacks, some after the whole run."""
    main = load_script(f"benchmarks/{script}.py").main
    monkeypatch.setattr(protocol, "gpu_count", lambda: 0)
    monkeypatch.chdir(tmp_path)  # (click makes the default --out folder as it reads the defaults)
    gpu_only = script in ("dask_cuda_overhead", "fft_filter")
    result = CliRunner().invoke(main, [] if gpu_only else ["--type", "gpu"])
    assert result.exit_code == 2 and "CuPy sees no GPU on this machine" in result.output, result.output
    if not gpu_only:
        result = CliRunner().invoke(main, ["--protocol", "ucx"])
        assert result.exit_code == 2 and "protocol ucx needs GPU workers" in result.output, result.output
    (tmp_path / "a-file").write_text("")
    result = CliRunner().invoke(main, ["--out", str(tmp_path / "a-file")])
    assert result.exit_code == 2 and "cannot make the folder" in result.output, result.output


@pytest.mark.parametrize("script, option, choices", [
    ("local_octopus", "--operation", "matmul_iterate, dot, transpose_sum, map_overlap, images"),
    ("stream_groups", "--operations", "chain-sum, tiny, dataframe, frames, large, mixed"),
    ("fragment_phases", "--workloads", "chain-sum, frames"),
])
def test_lists_of_operations_name_known_ones_and_at_least_one(script, option, choices, tmp_path):
    """An empty list (``,``) ran nothing and wrote an empty record; an unknown name is said with the choices."""
    main = load_script(f"benchmarks/{script}.py").main
    for value, message in ((",", f"name at least one of {choices}"), ("", f"name at least one of {choices}"),
                           ("fft,,x,fft", f"unknown fft, x: choose among {choices}")):
        result = CliRunner().invoke(main, [option, value, "--out", str(tmp_path)])
        assert result.exit_code == 2 and f"Invalid value for '{option}': {message}" in result.output, result.output
    assert not list(tmp_path.iterdir())


def test_the_suite_refuses_more_cpu_workers_than_cores_and_too_few_rows_before_starting(tmp_path, monkeypatch):
    """Tracebacks once the cluster had started (from pinning the workers to cores), or after the
    variants before the one that could not cut its rows (balance's PlanningError)."""
    monkeypatch.setattr(local_octopus, "connect", lambda *a: pytest.fail("a cluster started"))
    cases = [(["--n-workers", "3"], "Invalid value for --n-workers: 3 CPU workers are pinned one per core, and "
                                    "this process may use 2"),
             (["--size", "1", "--variants", "defaults,balance"],
              "Invalid value for --size: matmul_iterate has 1 row, fewer than the 2 workers x 1 blocks of variant "
              "balance"),
             (["--size", "7"], "Invalid value for --size: matmul_iterate has 7 rows, fewer than the 2 workers x 4 "
                               "blocks of variant over-4")]
    monkeypatch.setattr(local_octopus.os, "sched_getaffinity", lambda pid: {0, 1})
    for args, message in cases:
        result = CliRunner().invoke(local_octopus.main, [*args, "--out", str(tmp_path)])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_the_measured_ideal_comes_from_the_first_pinned_variant_else_the_first_and_says_which():
    from dask_octopus.bench.experiment import Variant, ideal_reference

    assert ideal_reference({n: Variant(n) for n in ("defaults", "over-4", "balance-4", "balance")}) == "balance-4"
    assert ideal_reference({n: Variant(n) for n in ("over-4", "defaults", "streams")}) == "over-4"


def test_suite_runs_every_operation_and_variant_on_cpu(tmp_path):
    result = CliRunner().invoke(local_octopus.main, [
        "--type", "cpu", "--operation", ",".join(OPS), "--size", "2000", "--cols", "32", "--width", "8",
        "--passes", "1", "--runs", "1", "--warmup-runs", "0", "--image-scale", "0.02",
        "--variants", ",".join(VARIANTS),  # over-16 below: on transpose_sum it takes 1,024 blocks, 7 s here
        "--image-repeat", "1", "--out", str(tmp_path), "--tag", "smoke"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "smoke-cpu-even.json").read_text())
    assert list(record["operations"]) == OPS and record["versions"]["dask"]
    assert record["protocol"] == "tcp" and record["config"]["protocol"] == "auto"  # used, and asked for
    for op in OPS[:-1]:
        rec = record["operations"][op]
        assert list(rec["variants"]) == VARIANTS
        assert rec["variants"]["over-4"]["blocks"] == 8 and rec["variants"]["streams"]["grouped"]
        assert sum(rec["variants"]["balance"]["rows_per_worker"].values()) == 2000
        assert rec["ideal_seconds"] > 0 and rec["ideal_formula"] and rec["work_formula"]
        # (timed apart for matmul_iterate alone; in the first pinned variant, not the first one)
        assert rec["measured_ideal_variant"] == ("balance" if op == "matmul_iterate" else None)
        assert all(v["same_values_as_reference"] for v in rec["variants"].values())  # compared, and equal
        assert all(len(v["result_checksums"]) == 1 for v in rec["variants"].values())
        for png in (f"smoke-cpu-even-{op}-timeline.png", f"smoke-cpu-even-{op}-speedup.png"):
            assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    video = record["operations"]["images"]["scenarios"]["video"]
    assert set(video["seconds"]) == {"one-task-each", "equal-batches", "loop", "octopus", "octopus-gather",
                                     "octopus-gather-host"}
    assert video["ideal_seconds"] > 0 and set(video["ratio_to_ideal"]) == set(video["seconds"])
    assert (tmp_path / "smoke-cpu-even-images-video-timeline.png").read_bytes()[:4] == b"\x89PNG"
    again = CliRunner().invoke(local_octopus.main, [
        "--type", "cpu", "--operation", "dot", "--size", "2000", "--cols", "32", "--passes", "1", "--runs", "1",
        "--octopus", "off", "--chunk-size", "500", "--out", str(tmp_path), "--tag", "second",
        "--compare", str(tmp_path / "smoke-cpu-even.json")])
    assert again.exit_code == 0, again.output
    second = json.loads((tmp_path / "second-cpu-even.json").read_text())
    variants = second["operations"]["dot"]["variants"]
    assert list(variants) == ["defaults", "over-4", "over-16"]
    assert variants["defaults"]["blocks"] == 4  # the user's chunking
    assert variants["over-16"]["blocks"] == 32
    assert "change against" in again.output and "over-16" in again.output


@pytest.mark.parametrize("args, message", [
    (["--variants", "equal,fastest"], "Invalid value for --variants: unknown variant 'fastest'"),
    (["--variants", "over-0"], "Invalid value for --variants: unknown variant 'over-0'"),
    (["--operation", "fft"], "Invalid value for '--operation': unknown fft: choose among matmul_iterate, dot"),
    (["--passes", "0"], "Invalid value for '--passes': 0 is not in the range x>=1"),
    (["--size", "-5"], "Invalid value for '--size': -5 is not in the range x>=1"),
    (["--warmup-runs", "-1"], "Invalid value for '--warmup-runs': -1 is not in the range x>=0"),
    (["--cotenant", "abc"], "Invalid value for --cotenant: CPU cores are numbers, got abc"),
    (["--cotenant", "100000"], "Invalid value for --cotenant: cores [100000] are not available"),
    (["--image-scale", "nan"], "Invalid value for '--image-scale': 'nan' is not a finite number"),
])
def test_suite_refuses_bad_arguments_before_it_starts(tmp_path, args, message):
    result = CliRunner().invoke(local_octopus.main, [*args, "--out", str(tmp_path)])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not list(tmp_path.iterdir())  # refused before a cluster started or a file was written


def test_the_calibrated_ideal_is_the_work_over_the_summed_speeds_or_none_without_a_calibration():
    from dask_octopus.bench.operations import OPERATIONS, calibrated_ideal

    op = OPERATIONS["matmul_iterate"]
    work = op.work(1000, 64, 8)
    calibrated = {"a": {"compute": 3e9}, "b": {"compute": 1e9}}
    assert calibrated_ideal(op, 1000, 64, 8, calibrated) == pytest.approx(work / 4e9)
    for b in ({"calibrated": False}, {"compute": None}):
        missing = {"a": {"compute": 3e9}, "b": b}
        assert calibrated_ideal(op, 1000, 64, 8, missing) is None  # was a KeyError (or a TypeError)


def test_suite_fails_where_a_variant_s_result_differs_from_the_first_variant_s(tmp_path, monkeypatch):
    from dask_octopus.bench import experiment

    monkeypatch.setattr(experiment, "same_checksums", lambda a, b: a is b)  # all but the first variant differ
    result = CliRunner().invoke(local_octopus.main, [
        "--type", "cpu", "--operation", "dot", "--size", "2000", "--cols", "32", "--passes", "1", "--runs", "1",
        "--warmup-runs", "0", "--variants", "defaults,balance", "--out", str(tmp_path), "--tag", "differ"])
    assert result.exit_code == 1 and "results differ from the first variant's: dot: balance" in result.output
    record = json.loads((tmp_path / "differ-cpu-even.json").read_text())  # written first: it holds the checksums
    assert record["operations"]["dot"]["variants"]["defaults"]["same_values_as_reference"] is True


def test_the_suite_s_input_holds_the_same_values_however_it_is_cut():
    from dask_octopus.bench.workloads import random_matrix

    a = random_matrix(1000, 37, (100, 37)).compute(scheduler="sync")
    assert a.dtype == np.float32 and a.min() >= 0 and a.max() < 1 and abs(a.mean() - 0.5) < 0.02
    assert np.array_equal(a, random_matrix(1000, 37, (333, 10)).compute(scheduler="sync"))
    assert not np.array_equal(a, random_matrix(1000, 37, (100, 37), seed=1).compute(scheduler="sync"))
    assert len(np.unique(a)) > 0.99 * a.size


def test_stream_groups_benchmark_cpu_smoke(tmp_path):
    result = CliRunner().invoke(stream_groups.main, [
        "--type", "cpu", "--operations", "tiny,dataframe,frames,large", "--blocks", "64", "--scale", "0.02",
        "--sets", "1", "--side", "64", "--runs", "1", "--warmup-runs", "0", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "stream-groups-cpu.json").read_text())
    ops = record["operations"]
    assert record["protocol"] == "tcp"
    assert all(v["same_values_as_reference"] for v in ops["tiny"]["variants"].values())
    assert all(v["same_values_as_reference"] for v in ops["dataframe"]["variants"].values())
    assert set(ops["frames"]["variants"]) == {"one-task-each", "grouped-eager", "grouped", "map", "loop"}
    assert all(v["same_values_as_reference"] for v in ops["frames"]["variants"].values())
    assert all(v["same_values_as_reference"] for t in ops["large"]["variants"].values() for v in t.values())
    bad = CliRunner().invoke(stream_groups.main, ["--type", "cpu", "--operations", "mixed", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "mixed needs --type gpu" in bad.output


def test_the_suite_refuses_an_unreadable_earlier_record_and_an_unreachable_scheduler_in_one_line(tmp_path):
    """``--compare`` of a file that is not a record of this suite is a usage error before the run (it was a
    traceback after it); ``--scheduler-address`` where nothing answers, one line (it was a traceback)."""
    import dask

    args = ["--type", "cpu", "--operation", "dot", "--size", "200", "--runs", "1", "--out", str(tmp_path)]
    for content, message in (("[1, 2]", "is not a record of this suite"), ("nope", "cannot read")):
        (tmp_path / "earlier.json").write_text(content)
        result = CliRunner().invoke(local_octopus.main, [*args, "--compare", str(tmp_path / "earlier.json")])
        assert result.exit_code == 2 and message in result.output, result.output
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        result = CliRunner().invoke(local_octopus.main, [*args, "--scheduler-address", "tcp://127.0.0.1:1"])
    assert result.exit_code == 1 and result.output.startswith(
        "Error: no scheduler reachable at tcp://127.0.0.1:1: ") and result.output.count("\n") == 1, result.output


def test_the_chain_sum_and_the_images_that_differ_fail_after_writing_their_json(tmp_path, monkeypatch):
    """A chain-sum way whose sum differs from the loop's, and an image variant whose histograms differ
    from the first's: the run writes its JSON (what each measured), then fails naming them. They raised
    an AssertionError mid-run, losing the JSON (and the other operations' results)."""
    from dask_octopus.bench import images, small_tasks

    loop = small_tasks._loop
    monkeypatch.setattr(small_tasks, "_loop", lambda blocks, xp: 2 * loop(blocks, xp))  # the loop is off
    monkeypatch.setattr(stream_groups, "CHAIN_SUM_BLOCKS", 16)  # (the failure does not need 1024)
    result = CliRunner().invoke(stream_groups.main, [
        "--type", "cpu", "--operations", "chain-sum", "--runs", "1", "--out", str(tmp_path), "--tag", "cs"])
    assert result.exit_code == 1 and "results differ from the reference: chain-sum: Dask, unannotated" \
        in result.output, result.output
    record = json.loads((tmp_path / "cs-cpu.json").read_text())["operations"]["chain-sum"]["variants"]
    assert record["plain loop in the client"]["same_values_as_reference"] is True
    assert record["annotated, repeated"]["same_values_as_reference"] is False
    run_variant = images.run_variant

    def first_off_by_one(client, v, items, workers):  # the first variant's histograms all one more
        futures = run_variant(client, v, items, workers)
        return [client.submit(lambda r: r + 1, f) for f in futures] if v == "one-task-each" else futures

    monkeypatch.setattr(images, "run_variant", first_off_by_one)
    result = CliRunner().invoke(local_octopus.main, [
        "--type", "cpu", "--operation", "images", "--octopus", "off", "--runs", "1", "--warmup-runs", "0",
        "--image-scale", "0.02", "--image-repeat", "1", "--out", str(tmp_path), "--tag", "im"])
    assert result.exit_code == 1 and "results differ from the first variant's: images " in result.output, \
        result.output
    scenarios = json.loads((tmp_path / "im-cpu-even.json").read_text())["operations"]["images"]["scenarios"]
    assert all(r["same_values_as_reference"] == {"one-task-each": True, "equal-batches": False, "loop": False}
               for r in scenarios.values())


def test_stream_groups_benchmark_fails_where_a_variant_differs_from_the_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(stream_groups, "same", lambda a, b: a is b)  # every variant but the reference differs
    result = CliRunner().invoke(stream_groups.main, [
        "--type", "cpu", "--operations", "tiny,large", "--blocks", "16", "--side", "32", "--runs", "1",
        "--warmup-runs", "0", "--out", str(tmp_path)])
    assert result.exit_code == 1 and "results differ from the reference: tiny: grouped" in result.output, result.output
    assert "large: grouped" in result.output and (tmp_path / "stream-groups-cpu.json").exists()


def test_scheduler_overhead_smoke(tmp_path):
    result = CliRunner().invoke(scheduler_overhead.main, ["--blocks", "200", "--runs", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "scheduler-overhead.json").read_text())
    assert set(record["tasks_per_second"]) == {"dask", "registered", "plan-active"}
    # the scheduler's count, after fusion: 200 fused ones+add tasks, 13 partial sums, 1 aggregate, 1 finalize
    assert record["tasks_run"] == 215 and record["graph_keys"] > record["tasks_run"]
    assert record["protocol"] == "inproc"  # in-process clusters


def test_speed_model_benchmark_smoke(tmp_path):
    result = CliRunner().invoke(speed_model.main, ["--seeds", "2", "--timings", "20", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "speed-model.json").read_text())
    assert set(record["mean_error"]) == set(speed_model.SCENARIOS)
    assert record["mean_error"]["identical, 25% noise"] == 0  # identical workers: equal weights throughout
    assert {k: len(v) for k, v in record["step_timings"].items()} == dict.fromkeys(speed_model.STEPS, 2)


def test_the_speed_model_benchmark_measures_the_error_against_the_true_ratio(monkeypatch):
    # b twice as slow, no noise: the calibration (equal) until three timings each, then the timings
    assert speed_model.ratios([1.0] * 4, [2.0] * 4, (1.0, 1.0)) == pytest.approx([1, 1, 2, 2])
    monkeypatch.setitem(speed_model.SCENARIOS, "steady", (lambda rng, n: ([1.0] * n, [2.0] * n),
                                                          lambda i, n: 2.0, (1.0, 1.0)))
    assert speed_model.mean_error("steady", 3, 4) == pytest.approx(math.log(2) / 2)  # off by 2x half the time
    # a step the model does not follow within the timings after it counts as all of them (a mix that
    # ends shows as the window rolls on), one it follows as the timings it took
    assert speed_model.lags("b 3x slower on 30% of tasks, then on none", 1, after=10) == [10]
    assert speed_model.lags("b slows down 2x, 5% noise", 1, after=10) == [1]


def test_suite_runs_against_an_existing_cluster(tmp_path):
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster:
        result = CliRunner().invoke(local_octopus.main, [
            "--type", "cpu", "--scheduler-address", cluster.scheduler_address, "--operation", "dot",
            "--size", "2000", "--cols", "16", "--passes", "1", "--runs", "1", "--warmup-runs", "0",
            "--octopus", "off", "--out", str(tmp_path), "--tag", "external"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "external-cpu-even.json").read_text())
    assert record["config"]["scheduler_address"] == cluster.scheduler_address and record["protocol"] == "tcp"
    assert list(record["operations"]["dot"]["variants"]) == ["defaults", "over-4", "over-16"]


@pytest.mark.parametrize("asked, gpus, ucx, used", [
    ("auto", 2, True, "ucx"), ("auto", 8, True, "ucx"),
    ("auto", 1, True, "tcp"), ("auto", 0, True, "tcp"), ("auto", 2, False, "tcp"),  # nothing moves / no UCX
    ("tcp", 2, True, "tcp"), ("tcp", 0, False, "tcp"), ("ucx", 1, True, "ucx"), ("ucx", 2, True, "ucx"),
])
def test_the_protocol_a_local_cluster_talks_over(monkeypatch, asked, gpus, ucx, used):
    monkeypatch.setattr(protocol, "ucx_available", lambda: ucx)
    assert protocol.resolve_protocol(asked, gpus) == used


@pytest.mark.parametrize("asked, gpus, ucx, error", [
    ("ucx", 0, True, "protocol ucx needs GPU workers"),
    ("ucx", 2, False, "protocol ucx needs distributed-ucxx"),
    ("inproc", 2, True, "unknown protocol 'inproc'"),
])
def test_a_protocol_the_cluster_cannot_talk_is_refused_before_it_starts(monkeypatch, asked, gpus, ucx, error):
    monkeypatch.setattr(protocol, "ucx_available", lambda: ucx)
    with pytest.raises(ValueError, match=error):
        protocol.resolve_protocol(asked, gpus)


def test_a_record_over_ucx_names_the_ucx_environment_its_workers_inherited(monkeypatch):
    from dask_octopus.bench.record import header

    for k in [k for k in os.environ if k.startswith(("UCX_", "UCXPY_"))]:
        monkeypatch.delenv(k)
    assert header(False, "ucx")["ucx_environment"] == {}  # none set
    monkeypatch.setenv("UCXPY_PROGRESS_MODE", "thread")
    monkeypatch.setenv("UCXPY_ENABLE_PYTHON_FUTURE", "1")
    monkeypatch.setenv("UCX_TLS", "tcp,cuda_copy")
    monkeypatch.setenv("UCXX_NOT_UCX", "x")
    assert header(False, "ucx")["ucx_environment"] == {
        "UCXPY_ENABLE_PYTHON_FUTURE": "1", "UCXPY_PROGRESS_MODE": "thread", "UCX_TLS": "tcp,cuda_copy"}
    assert "ucx_environment" not in header(False, "tcp")


def test_ucx_on_cpu_workers_fails_with_the_reason(tmp_path):
    from dask_octopus.bench.experiment import local_cluster

    with pytest.raises(ValueError, match="protocol ucx needs GPU workers"), local_cluster(False, protocol="ucx"):
        pass
    result = CliRunner().invoke(local_octopus.main, ["--type", "cpu", "--protocol", "ucx", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "protocol ucx needs GPU workers" in result.output  # a usage error
    assert not list(tmp_path.iterdir())  # no record of a run that did not happen


def test_a_variant_replica_runs_as_its_variant():
    from dask_octopus.bench.experiment import parse_variant

    assert parse_variant("defaults@2") == parse_variant("defaults") == ("defaults", 1, False)
    assert parse_variant("balance-4-streams@3") == ("balance", 4, True)
    with pytest.raises(ValueError, match="unknown variant 'dflts@2'"):
        parse_variant("dflts@2")


@pytest.mark.parametrize("n", range(1, 9))
def test_run_orders_balance_positions_and_predecessors(n):
    from dask_octopus.bench.runner import run_orders

    orders = run_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    times = len(orders) // n  # each variant this often in each position, and after each other variant
    for position in range(n):
        assert sorted(order[position] for order in orders) == sorted(list(range(n)) * times)
    pairs = [pair for order in orders for pair in itertools.pairwise(order)]
    follows = {(a, b): 0 for a in range(n) for b in range(n) if a != b}
    for pair in pairs:
        follows[pair] += 1
    assert len(set(follows.values())) <= 1  # every variant right after every other equally often


def test_interleave_calls_each_variant_once_per_run_in_those_orders():
    from dask_octopus.bench.runner import interleave, run_orders

    calls = []
    got = interleave({v: (lambda run, v=v: calls.append((run, v)) or f"{v}{run}") for v in "ABCD"}, 4, warmup=1)
    assert got == {v: [f"{v}{run}" for run in range(1, 5)] for v in "ABCD"}
    runs = ["".join(v for r, v in calls if r == run) for run in range(5)]
    assert runs == ["".join("ABCD"[i] for i in run_orders(4)[run % 4]) for run in range(5)]
    assert runs[:2] == ["ABDC", "BCAD"]
    assert interleave({}, 3) == {}


def test_interleave_calls_between_before_each_call():
    from dask_octopus.bench.runner import interleave

    calls = []
    interleave({v: (lambda run, v=v: calls.append(v)) for v in "AB"}, 2, warmup=1, between=lambda: calls.append("|"))
    assert "".join(calls) == "|A|B|B|A|A|B"


def test_settle_waits_until_the_tasks_of_a_compute_are_let_go():
    """A compute's result comes before the scheduler and the worker forget its tasks; once settled,
    they hold the persisted blocks alone."""
    import dask.array as da
    from distributed import Client, LocalCluster, wait

    from dask_octopus.bench.runner import settle

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        x = client.persist(da.ones(4000, chunks=10))
        wait(x)
        held = set(flatten(x.__dask_keys__()))
        (worker,) = cluster.workers.values()
        for i in range(3):
            assert (x + i).sum().compute() == 4000 * (1 + i)
            settle(client)
            assert set(cluster.scheduler.tasks) == held and set(worker.state.tasks) == held


def test_interleave_continues_the_run_orders_from_start():
    from dask_octopus.bench.runner import interleave, run_orders

    calls = []
    interleave({v: (lambda run, v=v: calls.append((run, v))) for v in "AB"}, 2, start=3)
    assert calls == [(3, v) for v in "BA"] + [(4, v) for v in "AB"]
    assert [run_orders(2)[r % 2] for r in (3, 4)] == [[1, 0], [0, 1]]


@pytest.mark.parametrize("case, exit_code, message, same", [
    ("equal", 0, None, {"defaults": True, "balance": True, "balance-1": True}),
    ("differs", 1, "results differ from defaults's, or could not be read: balance-1",
     {"defaults": True, "balance": True, "balance-1": False}),
    ("defaults out of memory", 0, None, {"defaults": None, "balance": True, "balance-1": True}),
    ("checksum failed", 1, "results differ from defaults's, or could not be read: balance",
     {"defaults": True, "balance": False, "balance-1": True}),
])
def test_the_fft_filter_checks_every_variant_s_row_sums_against_the_first_s(tmp_path, monkeypatch, case, exit_code,
                                                                             message, same):
    """fft_filter.py compared none (its 1.81x was unchecked): each run's checksum against the first
    variant's that has one, the script failing after it wrote its record (the cluster and the runs are
    stand-ins, CPU)."""
    import contextlib
    import types

    fft = load_script("benchmarks/fft_filter.py")
    sums = {"defaults": (1.0, 2.0, 3.0), "balance": (1.0, 2.0, 3.0 + 1e-6),
            "balance-1": (1.0, 2.0, 3.5 if case == "differs" else 3.0)}

    def run_variant(client, v, *args):
        if v == "defaults" and case == "defaults out of memory":
            return {"block_gib": [1.0], "error": "OutOfMemoryError: out of memory"}
        if v == "balance" and case == "checksum failed":
            return {"block_gib": [1.0], "seconds": [0.1], "checksum_error": "KilledWorker: ..."}
        return {"block_gib": [1.0], "seconds": [0.1], "checksum": sums[v]}

    monkeypatch.setattr(fft, "check_cluster", lambda *a, **k: None)
    monkeypatch.setattr(fft, "local_cluster", lambda *a, **k: contextlib.nullcontext("client"))
    monkeypatch.setattr(fft, "protocol_of", lambda client: "tcp")
    monkeypatch.setattr(fft, "header", lambda gpu, protocol, **fields: fields)  # (no GPU's hardware to read)
    monkeypatch.setattr(fft, "slowest_target", lambda client, gpu: (None, {}))
    monkeypatch.setattr(fft, "CoTenant", lambda **k: contextlib.nullcontext())
    monkeypatch.setattr(fft, "settle", lambda client: None)
    monkeypatch.setattr(fft, "dask_octopus", types.SimpleNamespace(register=lambda c: None, speeds=lambda c: {}))
    monkeypatch.setattr(fft, "run_variant", run_variant)
    result = CliRunner().invoke(fft.main, ["--runs", "2", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "fft-filter-gpu.json").read_text())
    assert {v: r["same_values_as_reference"] for v, r in record["variants"].items()} == same
    assert record["reference_variant"] == ("balance" if case == "defaults out of memory" else "defaults")
    assert result.exit_code == exit_code and (message is None or message in result.output), result.output


def test_overhead_benchmark_starts_fresh_clusters_warms_them_and_alternates(tmp_path, monkeypatch):
    """dask_cuda_overhead.py's schedule, with the cluster and local_cupy.py replaced by stand-ins (CPU)."""
    import contextlib

    overhead = load_script("benchmarks/dask_cuda_overhead.py")
    events = []

    class Client:
        def register_plugin(self, plugin):
            events.append(("plugin", type(plugin).__name__))

        def scheduler_info(self):
            return {"address": "tcp://stand-in"}

    @contextlib.contextmanager
    def cluster(gpu, devs, protocol):
        events.append(("cluster", devs))
        yield Client()

    def local_cupy(address, protocol, op, size, chunk_size, runs, folder, label):
        events.append(("call", label, runs))
        return [1.0 + 0.1 * ("on" in label)] * runs

    monkeypatch.setattr(overhead, "local_cluster", cluster)
    monkeypatch.setattr(overhead, "protocol_of", lambda client: "tcp")
    monkeypatch.setattr(overhead, "run_local_cupy", local_cupy)
    monkeypatch.setattr(overhead, "set_plugin", lambda client, on: None)
    monkeypatch.setattr(overhead, "check_cluster", lambda *args, **kwargs: None)  # (no GPU: stand-ins instead)
    real_header = overhead.header
    monkeypatch.setattr(overhead, "header", lambda gpu, protocol, **fields: real_header(False, protocol, **fields))
    result = CliRunner().invoke(overhead.main, ["--devs", "0,0", "--operations", "dot", "--runs", "2", "--rounds",
                                                "3", "--rounds-per-cluster", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert events == [
        ("cluster", "0,0"), ("plugin", "NoRMM"), ("call", "dot-warmup-0", 1),
        ("call", "dot-off-0", 2), ("call", "dot-on-0", 2), ("call", "dot-on-1", 2), ("call", "dot-off-1", 2),
        ("cluster", "0,0"), ("plugin", "NoRMM"), ("call", "dot-warmup-2", 1),
        ("call", "dot-off-2", 2), ("call", "dot-on-2", 2)]
    record = json.loads((tmp_path / "dask-cuda-local-cupy-overhead.json").read_text())
    assert record["config"]["rounds_per_cluster"] == 2
    assert record["operations"]["dot"]["seconds"] == {"off": [1.0] * 6, "on": [1.1] * 6}
    assert record["operations"]["dot"]["on_over_off"] == pytest.approx(1.1)


def test_the_small_tasks_first_run_is_timed_once_per_run_each_planned_anew_on_a_runtime_that_forgot(monkeypatch):
    """Each first run is one: the worker's runtime forgot its fragments, and the scheduler its plans (from
    the third compute of a shape on, it reused the plan of the first, renamed)."""
    from distributed import Client, LocalCluster

    from dask_octopus.bench.small_tasks import run_small_tasks
    from dask_octopus.groups import memo, streams

    events = []  # the worker's runtime: forgetting, and running a fragment; the scheduler: planning
    monkeypatch.setattr(streams.StreamRuntime, "close", lambda self: events.append(("forget", self)))
    count = streams.StreamRuntime.count
    monkeypatch.setattr(streams.StreamRuntime, "count",
                        lambda self, n: events.append(("fragment", self)) or count(self, n))
    plan = memo.PlanMemo.plan

    def recorded_plan(self, inputs, make, *args):
        made = []
        out = plan(self, inputs, lambda: made.append(True) or make(), *args)
        events.append(("planned" if made else "reused", None))
        return out

    monkeypatch.setattr(memo.PlanMemo, "plan", recorded_plan)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        dask_octopus.register(client, calibrate=False)
        (worker,) = cluster.workers.values()
        runtime = worker.extensions[streams.EXTENSION]
        timings = {t.label: t for t in run_small_tasks(client, gpu=False, blocks=4, shape=(4, 4), runs=3, group=None)}
        ran = list(events)
    assert len(timings["annotated, first run"].seconds) == 3 and len(timings["annotated, repeated"].seconds) == 3
    assert all(rt is runtime for e, rt in ran if e in ("forget", "fragment"))
    kinds = [e for e, _ in ran]
    first_runs = ["forget", "planned", "fragment"] * 3
    assert kinds[:9] == first_runs and kinds.count("forget") == 3  # (then the repeated runs)


def test_task_intervals_take_each_worker_s_clock_shift_back_off():
    """A worker adds its estimate of the scheduler's clock (``scheduler_delay``, from heartbeats) to its task
    timings; on one host every process reads the same clock, and the estimates of two workers can differ
    by more than a short pass: their finishes are compared only with the shifts taken off."""
    from dask_octopus.bench.workloads import ClockShifts, PassRecord, intervals

    stream = [{"key": ("block", 0), "worker": "a", "startstops": [{"action": "compute", "start": 100.2 + 0.05,
                                                                   "stop": 100.5 + 0.05}]},
              {"key": ("block", 1), "worker": "b", "startstops": [{"action": "compute", "start": 100.1 - 0.03,
                                                                   "stop": 100.5 - 0.03}]}]
    busy = intervals(stream, 100.0, shifts={"a": ClockShifts(0.05), "b": ClockShifts(-0.03)})
    assert {w: [(round(a, 9), round(b, 9)) for a, b in iv] for w, iv in busy.items()} == {
        "a": [(0.2, 0.5)], "b": [(0.1, 0.5)]}
    assert PassRecord(0.6, busy, busy).spread() < 1e-9  # (0.08 / 0.6 with the shifts left on)
    # a shift estimated 0.02 s short: a task that ended as the pass began ends at 0, not before it
    early = [{"key": ("block", 2), "worker": "a", "startstops": [{"action": "compute", "start": 99.99,
                                                                  "stop": 100.03}]}]
    assert intervals(early, 100.0, shifts={"a": ClockShifts(0.05)}) == {"a": [(0.0, 0.0)]}


def test_each_task_s_timings_lose_the_clock_shift_they_were_made_with():
    """A heartbeat moves a worker's shift between its tasks: the shift read after a pass put the tasks
    that ran before it up to 0.2 s after their pass ended (a finish past the pass). Here two tasks run
    with shifts 100 s apart, each within the pass."""
    from distributed import Client, LocalCluster, get_task_stream
    from distributed.utils_test import inc

    from dask_octopus.bench.workloads import TaskClockShifts, clock_shifts, intervals, watching_clock_shifts

    # (no heartbeat after the worker's start: each sets a shift of its own)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0",
                      heartbeat_interval="1h") as cluster, Client(cluster) as client:
        (worker,) = cluster.workers.values()
        with watching_clock_shifts(client):
            with get_task_stream(client) as stream:
                t0 = time.time()
                worker.scheduler_delay = 50.0
                client.submit(inc, 1, key="first").result()
                worker.scheduler_delay = -50.0
                client.submit(inc, 2, key="second").result()
                seconds = time.time() - t0
            shifts = clock_shifts(client)
            assert clock_shifts(client)[worker.address].tasks == {}  # (each read takes what was recorded)
        assert TaskClockShifts.name not in worker.plugins  # (it would keep an entry per task for good)
    assert [shifts[worker.address].of(k) for k in ("first", "second")] == [50.0, -50.0]
    busy = intervals(stream.data, t0, shifts=shifts)
    assert len(busy[worker.address]) == 2 and all(0 <= a <= b <= seconds for a, b in busy[worker.address])
