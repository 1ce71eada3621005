"""README rows (Configuration, Errors, the balance / map options) that no other test file covers.

docs/tested-behaviour.md maps every row of the README's two tables to the test(s) that cover it.
"""

import asyncio
import logging
import os
import subprocess
import sys
import threading
import types

import dask
import dask.array as da
import numpy as np
import pandas as pd
import pytest
from distributed import Client, wait
from distributed.utils_test import captured_logger, gen_cluster
from test_balance import run_balance, setup

import dask_octopus
from dask_octopus import NotRegisteredError, PlanningError, config
from dask_octopus.groups import streams
from dask_octopus.groups.replay import GraphCache
from dask_octopus.plugins.messages import plannable_memory
from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin
from dask_octopus.profiling import probes
from dask_octopus.profiling.gpu_timing import TOPIC
from dask_octopus.profiling.itemcosts import ItemCostFit

TWO = [("127.0.0.1", 1)] * 2
FAST = {"octopus.calibration.seconds": 0.1}
MEMORY_LIMIT = 2**32  # bytes per worker: the memory a CPU worker's plan is capped by


def plugin(s):
    return s.plugins["octopus"]


def timing(s, worker, prefix, units, seconds, key=0):
    """A task timing as a GPU worker reports it (CUDA events), straight to the scheduler plugin."""
    s.log_event(TOPIC, {"worker": worker, "timings": [([prefix, key], prefix, units, seconds)]})


def call_map(c, *args, **kwargs):
    return asyncio.get_running_loop().run_in_executor(None, lambda: dask_octopus.map(*args, client=c, **kwargs))


# -- Configuration ---------------------------------------------------------------------------------


def test_calibration_seconds_is_split_between_the_two_probes(monkeypatch):
    budgets = []

    def fake_throughput(step, sync, work, seconds, stop):
        budgets.append(seconds)
        return 1.0

    monkeypatch.setattr(probes, "_throughput", fake_throughput)
    probes.run_probes(0.4, "cpu")
    assert budgets == [0.2, 0.2]  # half GEMM, half streaming pass


@gen_cluster(client=True, nthreads=TWO, config={"octopus.calibration.seconds": 0.3})
async def test_calibration_seconds_from_dask_config_is_each_worker_s_probe_budget(c, s, a, b):
    await dask_octopus.register(c)
    assert plugin(s).worker_plugin.seconds == 0.3
    profiles = await dask_octopus.profiles(c)
    assert set(profiles) == {a.address, b.address}
    for p in profiles.values():  # each probe repeats until it has run for half the budget
        assert p["error"] is None and 0.3 <= p["probe_seconds"] < 5


@pytest.mark.parametrize("device, probed", [("cpu", "cpu"), ("auto", "gpu"), ("gpu", "gpu")])
@gen_cluster(client=True, nthreads=TWO)
async def test_calibration_device_cpu_forces_numpy_probes_where_a_gpu_is_seen(c, s, a, b, monkeypatch, device,
                                                                               probed):
    def gpu_probe(seconds, stop):
        raise RuntimeError("the CuPy probe ran")

    monkeypatch.setattr(probes, "gpu_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(probes, "_probe_gpu", gpu_probe)
    with dask.config.set({**FAST, "octopus.calibration.device": device}):
        await dask_octopus.register(c)
    assert plugin(s).worker_plugin.device == device
    profiles = await dask_octopus.profiles(c)
    assert set(profiles) == {a.address, b.address}
    for p in profiles.values():
        if probed == "cpu":
            assert p["error"] is None and p["device"] == "cpu" and p["name"] == "CPU" and p["compute"] > 0
        else:  # a GPU worker whose probes failed stays a GPU worker: not planned on host memory
            assert p["error"] == "RuntimeError: the CuPy probe ran" and p["device"] == "gpu"
            assert "memory_total" not in p and plannable_memory(p, 2**30) is None


@gen_cluster(client=True, nthreads=TWO, config={"octopus.map.item-cost-alpha": 0.25})
async def test_map_item_cost_alpha_from_dask_config_weighs_each_new_map_batch(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    batches = [(4, 4.0, 1.0), (4, 8.0, 2.5), (4, 16.0, 4.5), (4, 32.0, 6.0), (4, 8.0, 2.0)]
    fit = plugin(s).item_costs.use("f")[a.address]
    expected, halves = ItemCostFit(alpha=0.25), ItemCostFit(alpha=0.5)
    for batch in batches:
        for f in (fit, expected, halves):
            f.add(*batch)
    assert fit.fit() == expected.fit() != halves.fit()  # each older batch weighs 0.75 times the next


@gen_cluster(client=True, nthreads=TWO, config={"octopus.refine.confidence-samples": 1})
async def test_refine_confidence_samples_one_makes_one_timing_count(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    p = plugin(s)
    assert p.model.confidence_samples == 1
    assert await dask_octopus.speeds(c) == {a.address: 0.5, b.address: 0.5}
    timing(s, a.address, "gemm", 100, 0.5)  # one timing each: a twice as fast as b
    timing(s, b.address, "gemm", 100, 1.0)
    weights = await dask_octopus.speeds(c)
    assert weights[a.address] == pytest.approx(2 / 3) and weights[b.address] == pytest.approx(1 / 3)
    profiles = await dask_octopus.profiles(c)
    assert profiles[a.address]["samples"] == profiles[b.address]["samples"] == 1


@gen_cluster(client=True, nthreads=TWO)
async def test_refine_confidence_samples_default_needs_three_timings(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    assert plugin(s).model.confidence_samples == 3
    for i in range(2):
        timing(s, a.address, "gemm", 100, 0.5, key=i)
        timing(s, b.address, "gemm", 100, 1.0, key=i)
    assert await dask_octopus.speeds(c) == {a.address: 0.5, b.address: 0.5}  # two timings: not yet
    timing(s, a.address, "gemm", 100, 0.5, key=2)
    timing(s, b.address, "gemm", 100, 1.0, key=2)
    weights = await dask_octopus.speeds(c)
    assert weights[a.address] == pytest.approx(2 / 3)  # three: the observed speeds count


@gen_cluster(client=True, nthreads=TWO, config={"octopus.refine.min-duration": "500ms"})
async def test_refine_min_duration_from_dask_config_drops_prefixes_mostly_shorter(c, s, a, b):
    """A timing counts while most of its prefix's recent timings on that worker before it (an average
    weighing each a half) lasted 500 ms or more; a first timing, when it does itself. A prefix that
    began short counts once its long timings outweigh the short ones, its short ones too from then on."""
    await dask_octopus.register(c, calibrate=False)
    p = plugin(s)
    assert p.min_duration == 0.5
    await c.submit(sum, [1, 2], key="t")

    def task_stream(seconds):  # a task-stream timing of "t"
        p.transition("t", "processing", "memory", worker=a.address, stimulus_id="x",
                     startstops=[{"action": "compute", "start": 0.0, "stop": seconds}])

    timing(s, a.address, "gemm", 100, 0.4)  # a GPU event timing below the minimum
    task_stream(0.4)
    assert p.model.table() == {}
    for _ in range(2):  # the share of short timings: 1, then 0.5, 0.25
        timing(s, a.address, "gemm", 100, 0.6)
        task_stream(0.6)
    assert p.model.table() == {}
    timing(s, a.address, "gemm", 100, 0.6)
    task_stream(0.6)
    timing(s, a.address, "gemm", 100, 0.4)  # short, after mostly long ones: it counts
    assert set(p.model.table()) == {"gemm", "t"}
    assert p.model.table()["gemm"][a.address][2] == 2
    timing(s, b.address, "gemm", 100, 0.6)  # b's first: long, it counts
    assert p.model.table()["gemm"][b.address][2] == 1


@gen_cluster(client=True, nthreads=TWO, config={"octopus.refine.significance": 1000.0})
async def test_refine_significance_from_dask_config_asks_for_more_evidence(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    assert plugin(s).model.significance == 1000.0
    for i, noise in enumerate([1.0, 1.1, 0.9, 1.05, 0.95]):  # b twice as slow, with +-10% noise
        timing(s, a.address, "gemm", 100, noise, key=i)
        timing(s, b.address, "gemm", 100, 2 * noise, key=i)
    assert await dask_octopus.speeds(c) == {a.address: 0.5, b.address: 0.5}  # within 1000 standard errors
    plugin(s).model.significance = 2.5  # the default: the same timings are evidence
    assert (await dask_octopus.speeds(c))[a.address] == pytest.approx(2 / 3)


@gen_cluster(client=True, nthreads=TWO, config={"octopus.refine.max-prefixes": 2})
async def test_refine_max_prefixes_from_dask_config_keeps_the_prefixes_that_ran_last(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    for prefix in ["job_1", "job_2", "job_1", "job_3"]:
        timing(s, a.address, prefix, 100, 0.1)
    assert set(plugin(s).model.table()) == {"job_1", "job_3"}


@gen_cluster(client=True, nthreads=TWO, worker_kwargs={"memory_limit": MEMORY_LIMIT})
async def test_balance_memory_fraction_caps_each_worker_s_share_of_its_memory(c, s, a, b):
    await setup(c, s, [3.0, 1.0])
    x = da.ones((800, 30), chunks=(100, 30))  # 240 bytes per row
    assert (await run_balance(c, x, per_worker=1)).chunks[0] == (600, 200)  # by weight
    with dask.config.set({"octopus.balance.memory-fraction": 480.5 * 240 / MEMORY_LIMIT}):  # 480 rows each
        y = await run_balance(c, x, per_worker=1)
    assert y.chunks[0] == (480, 320)
    assert await c.compute(y.sum()) == 800 * 30


@gen_cluster(client=True, nthreads=TWO, worker_kwargs={"memory_limit": MEMORY_LIMIT})
async def test_balance_larger_than_the_workers_memory_names_both_sizes(c, s, a, b):
    await setup(c, s, [3.0, 1.0])
    x = da.ones((800, 30), chunks=(100, 30))  # 187.50 kiB
    with dask.config.set({"octopus.balance.memory-fraction": 40.5 * 240 / MEMORY_LIMIT}), \
            pytest.raises(PlanningError) as info:  # 40 rows each: 18.75 kiB in all
        await run_balance(c, x)
    message = str(info.value)
    assert "the collection (187.50 kiB) does not fit in the workers' memory" in message
    assert "they can hold 18.75 kiB" in message


@gen_cluster(client=True, nthreads=TWO)
async def test_balance_min_gain_from_dask_config_keeps_blocks(c, s, a, b):
    await setup(c, s, [3.0, 2.0])
    x = da.ones((1000, 4), chunks=(500, 4))  # equal blocks: makespan 1250 against 1000 planned (25% shorter)
    moved = await run_balance(c, x)
    assert moved.chunks[0] == (300, 300, 400)  # 25% > 3%: re-chunked, each block within the user's 500 rows
    with dask.config.set({"octopus.balance.min-gain": 0.3}):
        kept = await run_balance(c, x)
    assert kept.chunks == x.chunks and "rechunk" not in str(dict(kept.dask))  # 25% < 30%: kept, only pinned
    fast, slow = sorted(s.workers)
    assert plugin(s).placement.plans[kept.name].workers == [fast, slow]
    assert await c.compute(kept.sum()) == 4000


@gen_cluster(client=True, nthreads=TWO, config={"octopus.max-plans": 2})
async def test_max_plans_from_dask_config_drops_the_oldest_plans(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    assert plugin(s).placement.max_plans == 2
    names = []
    for n in (40, 60, 80):
        y = await run_balance(c, da.ones((n, 2), chunks=10))
        names.append(y.name)
    assert list(plugin(s).placement.plans) == names[1:]


@pytest.mark.parametrize("key, value, message", [
    ("calibration.seconds", 0, "octopus.calibration.seconds must be a number > 0, got 0"),
    ("refine.significance", -1, "octopus.refine.significance must be a number >= 0, got -1"),
    ("balance.min-gain", "some", "octopus.balance.min-gain must be a number >= 0, got 'some'"),
    ("streams.max-streams", 0, "octopus.streams.max-streams must be an integer >= 1, got 0"),
    ("streams.max-streams", 2.5, "octopus.streams.max-streams must be an integer >= 1, got 2.5"),
    ("streams.capture-after", 0, "octopus.streams.capture-after must be an integer >= 1, got 0"),
    ("streams.max-graph-bytes", "big", "octopus.streams.max-graph-bytes must be a size such as 4GiB, got 'big'"),
    ("streams.max-graphs", 0, "octopus.streams.max-graphs must be an integer >= 1, got 0"),
    ("refine.max-prefixes", 0, "octopus.refine.max-prefixes must be an integer >= 1, got 0"),
    ("map.steal-fraction", 1.5, r"octopus.map.steal-fraction must be a number in \[0, 1\], got 1.5"),
    ("map.steal-min-seconds", "soon", "octopus.map.steal-min-seconds must be a duration such as 50ms, got 'soon'"),
    ("map.learn-result-size", "yes", "octopus.map.learn-result-size must be true or false, got 'yes'"),
    ("map.learn-result-wait", "later", "octopus.map.learn-result-wait must be a duration such as 5s, got 'later'"),
    ("fragments.plan-memo", -1, "octopus.fragments.plan-memo must be an integer >= 0, got -1"),
    ("fragments.plan-memo", True, "octopus.fragments.plan-memo must be an integer >= 0, got True"),
    ("fragments.task-cost", "cheap", "octopus.fragments.task-cost must be a duration of 0 or more such as 1ms, got 'c"),
    ("fragments.task-cost", "-1ms", "octopus.fragments.task-cost must be a duration of 0 or more such as 1ms, got '-1"),
    ("fragments.task-cost", None, "octopus.fragments.task-cost must be a duration of 0 or more such as 1ms, got None"),
    ("fragments.max-bytes", "lots", "octopus.fragments.max-bytes must be auto or a size such as 2GiB, got 'lots'"),
    ("streams.capture-spare-bytes", "a few", "octopus.streams.capture-spare-bytes must be a size such as 32MiB, got "),
    ("streams.large-bytes", True, "octopus.streams.large-bytes must be a size such as 128MiB, got True"),
    ("fragments.max-bytes", True, "octopus.fragments.max-bytes must be auto or a size such as 2GiB, got True"),
    ("calibration.wait", True, "octopus.calibration.wait must be a duration such as 30s, got True"),
    ("streams.switch-interval", "0s", "octopus.streams.switch-interval must be off or a duration of 1us or more, "),
    ("streams.switch-interval", "1ns", "octopus.streams.switch-interval must be off or a duration of 1us or more, "),
    ("streams.switch-interval", "on", "octopus.streams.switch-interval must be off or a duration of 1us or more, "),
    ("streams.switch-interval", 0, "octopus.streams.switch-interval must be off or a duration of 1us or more, "),
    # an empty YAML value (None), or a list, where a size or duration belongs: Dask's parsers raise AttributeError
    ("fragments.max-bytes", None, "octopus.fragments.max-bytes must be auto or a size such as 2GiB, got None"),
    ("streams.large-bytes", None, "octopus.streams.large-bytes must be a size such as 128MiB, got None"),
    ("streams.max-graph-bytes", [1], r"octopus.streams.max-graph-bytes must be a size such as 4GiB, got \[1\]"),
    ("calibration.wait", [1], r"octopus.calibration.wait must be a duration such as 30s, got \[1\]"),
    ("refine.min-duration", None, "octopus.refine.min-duration must be a duration such as 2ms, got None"),
    # an empty or blank value (an empty environment variable): Dask's parsers raise IndexError for a duration,
    # read a size as 1 byte; a duration or size too large for them (OverflowError); a size of part of a byte
    ("calibration.wait", "", "octopus.calibration.wait must be a duration such as 30s, got ''"),
    ("refine.min-duration", " ", "octopus.refine.min-duration must be a duration such as 2ms, got ' '"),
    ("map.steal-min-seconds", "", "octopus.map.steal-min-seconds must be a duration such as 50ms, got ''"),
    ("fragments.task-cost", "", "octopus.fragments.task-cost must be a duration of 0 or more such as 1ms, got ''"),
    ("streams.switch-interval", "", "octopus.streams.switch-interval must be off or a duration of 1us or more, "),
    ("calibration.wait", "1e999s", "octopus.calibration.wait must be a duration such as 30s, got '1e999s'"),
    ("fragments.max-bytes", "", "octopus.fragments.max-bytes must be auto or a size such as 2GiB, got ''"),
    ("streams.large-bytes", " ", "octopus.streams.large-bytes must be a size such as 128MiB, got ' '"),
    ("fragments.max-bytes", float("inf"), "octopus.fragments.max-bytes must be auto or a size such as 2GiB, got inf"),
    ("streams.max-graph-bytes", "1e999", "octopus.streams.max-graph-bytes must be a size such as 4GiB, got '1e999'"),
    ("streams.capture-spare-bytes", 0.5, "octopus.streams.capture-spare-bytes must be a size such as 32MiB, got 0.5"),
])
def test_the_other_settings_are_validated_naming_the_key(key, value, message):
    with dask.config.set({f"octopus.{key}": value}), pytest.raises(ValueError, match=message):
        config.get(key)


@pytest.mark.parametrize("key", ["max-plans", "refine.confidence-samples", "streams.max-streams",
                                 "fragments.plan-memo"])
def test_integer_settings_take_numpy_integers_as_the_public_calls_do(key):
    with dask.config.set({f"octopus.{key}": np.int64(4)}):
        assert config.get(key) == 4
    with dask.config.set({f"octopus.{key}": np.float64(4)}), pytest.raises(ValueError, match=f"octopus.{key} must be"):
        config.get(key)


def test_the_renamed_refine_alpha_is_refused_naming_its_new_key():
    message = (r"^octopus\.refine\.alpha was renamed octopus\.map\.item-cost-alpha \(it weighs map batches only; "
               r"the speed model has no smoothing weight: its rates are means since their last change\)$")
    with dask.config.set({"octopus.refine.alpha": 0.25}), pytest.raises(ValueError, match=message):
        config.check_all()
    with dask.config.set({"octopus.refine.alpha": 0.25}), pytest.raises(ValueError, match=message):
        OctopusSchedulerPlugin(calibrate=False)  # (register builds one: refused before anything starts)
    with dask.config.set({"octopus.refine.alpha": 0.25}), pytest.raises(ValueError, match=message), \
            dask_octopus.annotate():
        pass
    config.check_all()  # unset: nothing to say


@pytest.mark.parametrize("settings, message", [
    ({"octopus.fragment.max-bytes": "1GiB"}, r"^octopus\.fragment is not a dask_octopus setting; did you mean "
                                             r"octopus\.fragments\?$"),
    ({"octopus.fragments.max-byte": "1GiB"}, r"^octopus\.fragments\.max-byte is not a dask_octopus setting; "
                                             r"did you mean octopus\.fragments\.max-bytes\?$"),
    ({"octopus.colour": "red"}, r"^octopus\.colour is not a dask_octopus setting \(it reads calibration, refine, "),
    ({"octopus.calibration": 5}, r"^octopus\.calibration must be a section of settings \(seconds, device, wait\), "
                                 r"got 5$"),
    ({"octopus": "on"}, r"^octopus must be a section of settings \(calibration, refine, .*\), got 'on'$"),
])
def test_a_misspelt_key_or_a_value_in_place_of_a_section_is_refused_naming_it(settings, message):
    """Dask reads only the keys it is asked for: a misspelt one (``fragment.max-bytes``) would be ignored
    without a word, and a value where a section belongs hides the section's keys. ``register`` and
    ``annotate`` refuse both, naming the key and the nearest one dask_octopus reads."""
    with dask.config.set(settings):
        with pytest.raises(ValueError, match=message):
            config.check_all()
        with pytest.raises(ValueError, match=message), dask_octopus.annotate():
            pass
    with dask.config.set({"octopus.fragments.max_bytes": "1GiB", "octopus.streams.max_graphs": 4}):
        config.check_all()  # underscores read as hyphens, as dask.config reads them
        assert config.get("fragments.max-bytes") == "1GiB"
    with dask.config.set({"octopus.fragments": None}):  # a YAML section whose keys are all commented out
        config.check_all()
        assert config.get("fragments.max-bytes") == "auto"


@pytest.mark.parametrize("given, message", [
    ({"DASK_OCTOPUS__CALIBRATION": "5"}, "octopus.calibration must be a section of settings (seconds, device, "
                                         "wait), got 5"),
    ({"yaml": "octopus: 5\n"}, "octopus must be a section of settings (calibration, refine, "),
    ({"yaml": "octopus:\n  fragments:\n"}, None),  # a section whose keys are all commented out: the defaults
])
def test_a_value_in_place_of_a_section_from_the_environment_or_a_yaml_file_is_refused(given, message, tmp_path):
    """Dask replaces a value that the environment or a YAML file gives where dask_octopus's defaults have a
    section by that section as the package adds its defaults: the value as given is refused all the same."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    if "yaml" in given:
        (tmp_path / "octopus.yaml").write_text(given["yaml"])
        env["DASK_CONFIG"] = str(tmp_path)
    else:
        env.update(given)
    code = "import dask_octopus; dask_octopus.config.check_all(); print('checked')"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if message is None:
        assert run.returncode == 0 and run.stdout == "checked\n", run.stderr
    else:
        assert run.returncode == 1 and f"ValueError: {message}" in run.stderr, run.stderr


def test_a_value_checked_once_is_not_taken_for_an_equal_value_of_another_type():
    """Settings are checked once per value: ``False`` passing does not let ``0`` (equal to it) pass, nor
    ``True`` passing ``1``."""
    with dask.config.set({"octopus.streams.switch-interval": False}):
        assert config.get("streams.switch-interval") is False
    with dask.config.set({"octopus.streams.switch-interval": 0}), pytest.raises(ValueError, match=r"got 0$"):
        config.get("streams.switch-interval")
    with dask.config.set({"octopus.streams.capture": True}):
        assert config.get("streams.capture") is True
    with dask.config.set({"octopus.streams.capture": 1}), pytest.raises(ValueError, match=r"true or false, got 1$"):
        config.get("streams.capture")


@pytest.mark.package_defaults
def test_readme_defaults():
    expected = {"calibration.seconds": 0.6, "calibration.device": "auto", "calibration.wait": "30s",
                "refine.confidence-samples": 3, "refine.min-duration": "2ms",
                "refine.significance": 2.5, "refine.max-prefixes": 1000,
                "balance.memory-fraction": 0.6, "balance.min-gain": 0.03, "map.steal-fraction": 0.25,
                "map.item-cost-alpha": 0.5,
                "map.steal-min-seconds": "50ms", "map.learn-result-size": True, "map.learn-result-wait": "5s",
                "max-plans": 1000,
                "fragments.max-bytes": "auto", "fragments.plan-memo": 8, "fragments.task-cost": "1ms",
                "streams.max-streams": 8, "streams.large-bytes": "128MiB", "streams.capture": True,
                "streams.capture-after": 1, "streams.max-graphs": 64, "streams.max-graph-bytes": "4GiB",
                "streams.capture-spare-bytes": "32MiB",
                "streams.switch-interval": "100us"}
    assert {key: config.get(key) for key in expected} == expected
    assert set(config.CHECKS) == set(expected)  # every setting is in the README's table


def test_max_streams_is_read_from_dask_config():
    assert config.get("streams.max-streams") == 8
    with dask.config.set({"octopus.streams.max-streams": 3}):
        assert config.get("streams.max-streams") == 3


class FakeStream:
    """A CUDA stream of :class:`FakeCupy`: ``with stream`` makes it current."""

    def __init__(self, cp, name):
        self.cp, self.name = cp, name

    def __enter__(self):
        self.cp.current.append(self)
        return self

    def __exit__(self, *exc):
        self.cp.current.pop()

    def record(self):
        return types.SimpleNamespace(synchronize=lambda: None)  # an event

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass


class FakeCupy(types.ModuleType):
    """Just enough of CuPy for run_group's GPU path on a CPU machine: streams that record which is
    current, and no device arrays (so capture is refused: 'an input is not a CuPy array')."""

    class ndarray:  # CuPy's name
        pass

    def __init__(self):
        super().__init__("cupy")
        self.current = [FakeStream(self, "task's own")]
        self.made = 0

        def stream(non_blocking=False):
            self.made += 1
            return FakeStream(self, f"pool {self.made}")

        runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, getDevice=lambda: 0)
        self.cuda = types.SimpleNamespace(runtime=runtime, Stream=stream, get_current_stream=lambda: self.current[-1])


@pytest.fixture
def fake_gpu(monkeypatch):
    """run_group takes its GPU path (a fresh process runtime, made under the test's config)."""
    cp = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)

    def fresh_runtime():
        monkeypatch.setattr(streams, "_process_runtime", streams.StreamRuntime())

    return cp, fresh_runtime


def run_fake_group(cp, inputs):
    """Run one group of ``len(inputs)`` members; the name of the stream each member ran on."""
    ran_on = [None] * len(inputs)

    def member(i):
        def run(x):
            ran_on[i] = cp.cuda.get_current_stream().name
            return x

        return run

    out = streams.run_group([member(i) for i in range(len(inputs))], [[x] for x in inputs], ["memory"] * len(inputs),
                            lambda: [f"token-{i}" for i in range(len(inputs))])
    assert all(o is x for o, x in zip(out, inputs))
    return ran_on


@pytest.mark.parametrize("max_streams, used", [(8, 5), (2, 2), (1, 1)])
def test_max_streams_bounds_the_streams_of_a_group(fake_gpu, max_streams, used):
    cp, fresh_runtime = fake_gpu
    with dask.config.set({"octopus.streams.max-streams": max_streams}):
        fresh_runtime()
        ran_on = run_fake_group(cp, [np.ones(10) for _ in range(5)])
    assert len(set(ran_on)) == used and "task's own" not in ran_on


def test_large_bytes_members_run_on_the_task_s_own_stream(fake_gpu):
    cp, fresh_runtime = fake_gpu
    with dask.config.set({"octopus.streams.large-bytes": "1KiB"}):
        fresh_runtime()
        ran_on = run_fake_group(cp, [np.ones(10), np.ones(1000), np.ones(20)])  # 8 kB: large
    assert ran_on[1] == "task's own" and ran_on[0] != "task's own" and ran_on[2] != "task's own"


@pytest.mark.parametrize("settings, refused_on_run", [
    ({}, 2),  # capture-after 1: one eager run, then captured (here: refused)
    ({"octopus.streams.capture-after": 2}, 3),
    ({"octopus.streams.capture": False}, None),  # never captured
])
def test_capture_settings_decide_when_a_group_is_captured(fake_gpu, settings, refused_on_run):
    cp, fresh_runtime = fake_gpu
    inputs = [np.ones(10), np.ones(10)]
    logs = []
    with dask.config.set(settings):
        fresh_runtime()
        for _ in range(4):
            with captured_logger("dask_octopus.groups.streams", level=logging.DEBUG) as log:
                run_fake_group(cp, inputs)
            logs.append(log.getvalue())
    refusal = "dask_octopus: not captured, it runs eagerly: an input is not a CuPy array"
    assert [refusal in text for text in logs] == [i + 1 == refused_on_run for i in range(4)]
    assert streams.runtime().stats()["refused"] == (0 if refused_on_run is None else 1)


def test_a_group_of_items_that_are_not_arrays_runs_eagerly_when_its_capture_is_due(fake_gpu):
    cp, fresh_runtime = fake_gpu
    fresh_runtime()
    for _ in range(3):  # eager, then refused (not device arrays), then eager without trying again
        assert run_fake_group(cp, [3, "a frame's name", None]) != [None] * 3
    assert streams.runtime().stats()["refused"] == 1
    assert streams.runtime().last_refusal == "an input is not a CuPy array"


def test_stream_runtime_reads_capture_after_and_max_graphs_from_dask_config():
    rt = streams.StreamRuntime()
    assert (rt.graph_cache().after, rt.graph_cache().size) == (1, 64)
    with dask.config.set({"octopus.streams.capture-after": 3, "octopus.streams.max-graphs": 5}):
        rt = streams.StreamRuntime()
    assert (rt.graph_cache().after, rt.graph_cache().size) == (3, 5)


def test_graph_cache_captures_after_the_configured_sightings():
    cache = GraphCache(size=4, after=1)
    assert [cache.should_capture("g") for _ in range(2)] == [False, True]  # one eager run, then capture
    cache.add("g", "graph")
    assert cache.get("g") == "graph" and not cache.should_capture("g") and "g" not in cache.seen
    three = GraphCache(after=3)
    assert [three.should_capture("g") for _ in range(4)] == [False, False, False, True]
    assert GraphCache(after=0).should_capture("g")  # captured the first time it runs


@pytest.mark.parametrize("after, buffers, refuse, made, got", [
    # the same buffers again: captured reading them in place; other buffers of the same shapes: a
    # graph that copies its inputs in, replayed for any buffers; the first buffers: their own graph
    (1, "aaabba", False, [True, False], [None, "in place", "in place", "copies", "copies", "in place"]),
    # captured the first time: buffers not seen before get the copying graph, which every run replays
    (0, "abcd", False, [False], ["copies"] * 4),
    (0, "aaaa", False, [False], ["copies"] * 4),
    # a refusal holds for the shapes, whatever the buffers: never tried again
    (1, "aaabb", True, [True], [None] * 5),
    (0, "abc", True, [False], [None] * 3),
])
def test_a_group_is_captured_in_place_only_on_buffers_that_came_before(after, buffers, refuse, made, got):
    cache = GraphCache(after=after)
    calls = []

    def make(in_place):
        calls.append(in_place)
        return None if refuse else Graph("in place" if in_place else "copies")

    assert [streams._cached_graph(cache, "shapes", (b,), make) for b in buffers] == got
    assert calls == made


def test_graph_cache_drops_the_least_recently_used_graph_beyond_its_size():
    cache = GraphCache(size=2, after=0)
    cache.add("a", "graph a")
    cache.add("b", "graph b")
    assert cache.get("a") == "graph a"  # a is now the most recently used
    cache.add("c", "graph c")
    assert list(cache.graphs) == ["a", "c"] and cache.get("b") is None
    cache.add("d", "graph d")
    assert list(cache.graphs) == ["c", "d"]


class Graph(str):
    """A captured graph, as the graph cache sees it: its name and the bytes it holds."""

    nbytes = 0

    def held_bytes(self):
        return self.nbytes


def test_graph_cache_drops_the_least_recently_used_graphs_beyond_max_graph_bytes():
    cache = GraphCache(size=10, after=1, max_bytes=100)
    cache.add("a", "graph a", 40)
    cache.add("b", "graph b", 40)
    assert cache.get("a") == "graph a"  # a is now the most recently used
    cache.add("c", "graph c", 40)  # 120 bytes: b goes
    assert list(cache.graphs) == ["a", "c"] and cache.bytes == 80
    cache.add("d", "graph d", 100)  # alone within the bytes: the others go
    assert list(cache.graphs) == ["d"] and cache.bytes == 100
    cache.drop_graphs()
    cache.add("e", "graph e", 100)  # the dropped graphs hold nothing any more
    assert list(cache.graphs) == ["e"] and cache.bytes == 100 and cache.nbytes == {"e": 100}
    assert cache.fits(100) and not cache.fits(101) and GraphCache().fits(2**60)


def test_a_graph_larger_than_max_graph_bytes_is_replayed_once_then_its_shapes_run_eagerly():
    cache = GraphCache(after=1, max_bytes=100)
    kept = Graph("kept")
    kept.nbytes = 60
    large = Graph("large")
    large.nbytes = 101
    made = iter([kept, large])
    small = [streams._cached_graph(cache, "small", ("a",), lambda in_place: next(made)) for _ in range(2)]
    assert small == [None, kept]
    got = [streams._cached_graph(cache, "large", ("b",), lambda in_place: next(made)) for _ in range(4)]
    assert got == [None, large, None, None] and "large" in cache.refused
    assert list(cache.graphs.values()) == [kept] and cache.bytes == 60


def test_the_graphs_of_a_thread_that_ended_are_dropped_and_its_replays_stay_counted():
    """Dask replaces a worker's threads (a task that secedes leaves its slot to a new thread): the graphs
    of a thread that ended are never replayed again, and would hold device memory beyond any cache's
    max-graph-bytes."""
    rt = streams.StreamRuntime()
    graph = types.SimpleNamespace(inputs=None, streams=1, held_bytes=lambda: 100)
    made = []

    def capture(signature):
        cache = rt.graph_cache()
        cache.add(signature, graph, 100)
        cache.replays += 2
        made.append(cache)

    capture("here")
    ended = threading.Thread(target=capture, args=("ended",))
    ended.start()
    ended.join()
    here, gone = made
    assert gone is not here and rt.graph_cache() is here  # one cache a thread
    assert rt.stats() | {"last_refusal": None} == {
        "groups": 0, "members": 0, "graphs": 1, "graphs_in_place": 1, "graph_bytes": 100, "graphs_on_streams": 0,
        "refused": 0, "replays": 4, "last_refusal": None}
    assert not gone.graphs and gone.bytes == 0 and list(here.graphs) == ["here"]
    later = threading.Thread(target=capture, args=("later",))  # a new thread's cache: the live ones are kept
    later.start()
    later.join()
    assert list(here.graphs) == ["here"] and rt.stats()["graphs"] == 1 and rt.stats()["replays"] == 6
    rt.close()  # the graphs go, and their replays with them, those of ended threads too
    assert (rt.stats()["graphs"], rt.stats()["replays"]) == (0, 0) and not here.graphs


def test_the_graph_cache_reads_max_graph_bytes_from_dask_config():
    assert streams.StreamRuntime().graph_cache().max_bytes == 4 * 2**30
    with dask.config.set({"octopus.streams.max-graph-bytes": "1 MiB"}):
        assert streams.StreamRuntime().graph_cache().max_bytes == 2**20


def test_graph_cache_never_captures_a_refused_signature():
    cache = GraphCache(size=2, after=1)
    cache.should_capture("r")
    assert cache.should_capture("r")
    cache.add("r", None)  # capture refused
    assert set(cache.refused) == {"r"} and cache.get("r") is None and not cache.graphs
    assert not any(cache.should_capture("r") for _ in range(5)) and "r" not in cache.seen


def test_a_groups_signature_tells_shapes_and_dtypes_apart_and_hashes_any_dtype():
    """Graphs and member classes are kept by signature: equal for equal shapes and dtypes (also made
    apart, or in another byte order's name), apart otherwise; a dtype that does not hash goes by name."""
    sig = streams._signature
    a = np.ones((2, 3), dtype="float32")
    assert sig("t", [a]) == sig("t", [np.zeros((2, 3), dtype=np.dtype("<f4"))])
    assert hash(sig("t", [a])) == hash(sig("t", [np.zeros((2, 3), dtype=np.float32)]))
    others = [a.astype("float64"), a.astype(">f4"), a.T, a[:1], pd.Series([1.0]), pd.Series(["x"], dtype="category"),
              pd.Series(["x"], dtype="string"), 2.5]
    assert len({sig("t", [x]) for x in [a, *others]}) == 1 + len(others)
    odd = types.SimpleNamespace(shape=(2,), dtype=["not", "hashable"])
    assert hash(sig("t", [odd])) == hash(sig("t", [types.SimpleNamespace(shape=(2,), dtype=["not", "hashable"])]))


# -- Errors ----------------------------------------------------------------------------------------


@gen_cluster(client=True, nthreads=TWO)
async def test_not_registered_error_names_register_and_the_preload(c, s, a, b):
    calls = {"speeds": lambda: dask_octopus.speeds(c), "profiles": lambda: dask_octopus.profiles(c),
             "balance": lambda: run_balance(c, da.ones((10, 2), chunks=5))}
    for name, call in calls.items():
        with pytest.raises(NotRegisteredError) as info:
            await call()
        message = str(info.value)
        assert "dask_octopus.register(client)" in message and "--preload dask_octopus" in message, name


@gen_cluster(client=True, nthreads=TWO)
async def test_a_closed_client_or_something_else_than_a_client_is_refused_by_name(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    async with Client(s.address, asynchronous=True) as closed:
        pass
    calls = {"register": lambda cl: dask_octopus.register(cl), "speeds": lambda cl: dask_octopus.speeds(cl),
             "profiles": lambda cl: dask_octopus.profiles(cl),
             "balance": lambda cl: dask_octopus.balance(da.ones((10, 2), chunks=5), client=cl),
             "map": lambda cl: dask_octopus.map(abs, [1], client=cl),
             "imap": lambda cl: dask_octopus.imap(abs, [1], client=cl)}
    for call in calls.values():
        with pytest.raises(RuntimeError, match=r"^the client is closed: <Client"):
            call(closed)
        with pytest.raises(TypeError, match=r"^client must be a distributed\.Client, got str 'tcp://x:1'"):
            call("tcp://x:1")
    assert await dask_octopus.speeds(c) == {a.address: 0.5, b.address: 0.5}


@gen_cluster(client=True, nthreads=TWO)
async def test_profiles_with_an_unknown_resource(c, s, a, b):
    await dask_octopus.register(c, calibrate=False)
    with pytest.raises(ValueError, match="unknown resource 'disk': expected one of compute, memory"):
        await dask_octopus.profiles(c, resource="disk")
    assert set(await dask_octopus.profiles(c, resource="memory")) == {a.address, b.address}


# -- balance and map options of the README's Use section -------------------------------------------


@gen_cluster(client=True, nthreads=TWO)
async def test_balance_along_axis_1_pins_column_blocks(c, s, a, b):
    rec = await setup(c, s, [3.0, 1.0])
    x = da.random.default_rng(3).random((30, 800), chunks=(15, 100))
    y = await run_balance(c, x, axis=1, per_worker=2)
    assert y.chunks == ((15, 15), (300, 300, 100, 100))
    fast, slow = sorted(s.workers)
    plan = plugin(s).placement.plans[y.name]
    assert plan.workers == [fast, fast, slow, slow] and plan.index == 2  # the block index is the key's third
    reference = await c.compute((x * 2 + 1).sum(axis=0))
    rec.worker.clear()
    np.testing.assert_array_equal(await c.compute((y * 2 + 1).sum(axis=0)), reference)
    ran = {k: w for k, w in rec.worker.items() if isinstance(k, tuple) and "sum" in str(k[0])}
    blocks = {k: w for k, w in ran.items() if len(k) == 3}  # (fused) per-block tasks: (name, i, j)
    aggregates = {k: w for k, w in ran.items() if len(k) == 2}  # (name, j): sums of blocks (0, j) and (1, j)
    assert len(blocks) >= 8 and all(w == plan.workers[k[2]] for k, w in blocks.items()), blocks
    assert len(aggregates) == 4 and all(w == plan.workers[k[1]] for k, w in aggregates.items()), aggregates


@gen_cluster(client=True, nthreads=TWO)
async def test_balance_align_makes_block_sizes_multiples(c, s, a, b):
    await setup(c, s, [3.0, 1.0])
    x = da.arange(800.0 * 4, chunks=400).reshape(800, 4)
    y = await run_balance(c, x, per_worker=1, align=64)
    assert y.chunks[0] == (576, 224)  # 9 and 3 units of 64; the last block takes the 32 left over
    y2 = await run_balance(c, x, per_worker=2, align=64)
    assert y2.chunks[0] == (320, 256, 128, 96)  # 5 + 4 and 2 + 1 units; the last also takes the 32
    np.testing.assert_array_equal(await c.compute(y2.sum(axis=1)), np.arange(3200.0).reshape(800, 4).sum(axis=1))


@gen_cluster(client=True, nthreads=TWO)
async def test_balance_by_memory_weights_uses_the_memory_priors(c, s, a, b):
    await setup(c, s, [3.0, 1.0])
    first, second = sorted(s.workers)
    model = plugin(s).model
    model.set_prior(first, {"compute": 3.0, "memory": 1.0})  # first computes faster, second streams faster
    model.set_prior(second, {"compute": 1.0, "memory": 3.0})
    x = da.ones((800, 4), chunks=(100, 4))
    by_compute = await run_balance(c, x, per_worker=1)
    by_memory = await run_balance(c, x, per_worker=1, resource="memory")
    assert by_compute.chunks[0] == (600, 200) and by_memory.chunks[0] == (200, 600)
    assert plugin(s).placement.plans[by_memory.name].workers == [first, second]
    assert await c.compute(by_memory.sum()) == 3200


@gen_cluster(client=True, nthreads=TWO)
async def test_tasks_that_combine_blocks_of_two_workers_are_left_to_dask(c, s, a, b):
    rec = await setup(c, s, [3.0, 1.0])
    x = da.arange(800.0 * 4, chunks=400).reshape(800, 4)
    y = await run_balance(c, x, per_worker=1)
    assert y.chunks[0] == (600, 200)
    z = c.persist((y * 2).sum(axis=0))  # the aggregate combines the partial sums of both workers' blocks
    await wait(z)
    np.testing.assert_array_equal(await c.compute(z), np.arange(3200.0).reshape(800, 4).sum(axis=0) * 2)
    fast, slow = sorted(s.workers)
    aggregate = (z.name, 0)
    assert aggregate in rec.worker and aggregate not in rec.restricted  # no worker_restrictions: Dask places it
    assert not s.tasks[aggregate].worker_restrictions
    partials = {k for k in rec.restricted if isinstance(k, tuple) and str(k[0]).startswith("sum-")}
    assert {k[1] for k in partials} == {0, 1}  # each block's partial sum is pinned to its block's worker
    assert all(rec.worker[k] == (fast, slow)[k[1]] for k in partials)


@gen_cluster(client=True, nthreads=TWO)
async def test_map_by_memory_weights_uses_the_memory_priors(c, s, a, b):
    await setup(c, s, [3.0, 1.0])
    first, second = sorted(s.workers)
    model = plugin(s).model
    model.set_prior(first, {"compute": 3.0, "memory": 1.0})
    model.set_prior(second, {"compute": 1.0, "memory": 3.0})
    plans = plugin(s).placement.plans
    for resource, on_first, item in (("compute", 6, np.ones(4)), ("memory", 2, np.ones(5))):
        futs = await call_map(c, np.sum, [item] * 8, cost=[1] * 8, resource=resource)
        assert await c.gather(futs) == [float(item.size)] * 8
        workers = plans[next(reversed(plans))].workers  # the latest plan: one worker per item
        assert (workers.count(first), workers.count(second)) == (on_first, 8 - on_first), resource
