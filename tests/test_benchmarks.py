"""Smoke runs of the benchmark CLIs at tiny sizes (CPU): they run, and write what they promise."""

import json
import sys
from pathlib import Path

from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import local_octopus  # noqa: E402
import scheduler_overhead  # noqa: E402


def test_local_octopus_cpu_smoke(tmp_path):
    result = CliRunner().invoke(local_octopus.main, [
        "--type", "cpu", "--size", "4000", "--cols", "32", "--width", "8", "--passes", "1", "--runs", "1",
        "--variants", "equal,over-4,balance", "--out", str(tmp_path), "--tag", "smoke"])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "smoke-cpu-even.json").read_text())
    assert set(record["variants"]) == {"equal", "over-4", "balance"}
    assert record["variants"]["over-4"]["blocks"] == 8
    assert sum(record["variants"]["balance"]["rows_per_worker"].values()) == 4000
    assert record["ideal_seconds"] > 0 and record["versions"]["dask"]
    for png in ("smoke-cpu-even-timeline.png", "smoke-cpu-even-speedup.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_local_octopus_rejects_an_unknown_variant(tmp_path):
    result = CliRunner().invoke(local_octopus.main, ["--size", "400", "--variants", "equal,fastest",
                                                     "--out", str(tmp_path)])
    assert result.exit_code != 0 and "unknown variant 'fastest'" in str(result.exception)


def test_scheduler_overhead_smoke(tmp_path):
    result = CliRunner().invoke(scheduler_overhead.main, ["--tasks", "200", "--runs", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "scheduler-overhead.json").read_text())
    assert set(record["tasks_per_second"]) == {"dask", "registered", "plan-active"}
