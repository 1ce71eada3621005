"""The examples run on CPU at small sizes (and check their own results across variants)."""

import json

import pytest
from click.testing import CliRunner
from scripts import load_script

images = load_script("examples/images.py")


def test_specs_follow_the_scenarios():
    from dask_octopus.bench.workloads import specs

    items = specs("video", 1.0, 2)
    assert len({seed for _, _, seed in items}) == len(items) == 60  # every image its own seed
    sizes = [(h, w) for h, w, _ in items]
    assert sizes.count((360, 640)) == 58 and sizes.count((2160, 3840)) == 2


def test_images_example_runs_every_variant_on_cpu(tmp_path, monkeypatch):
    from dask_octopus.bench import workloads
    from dask_octopus.bench.workloads import ClockShifts

    # each worker's estimate of the scheduler's clock off by an hour: a busy machine's error (tens to
    # hundreds of ms, bench.workloads.clock_shifts) put a short pass's tasks before its start
    monkeypatch.setattr(workloads, "clock_shifts",
                        lambda client: {w: ClockShifts(3600.0) for w in client.scheduler_info()["workers"]})
    out = tmp_path / "images.json"
    result = CliRunner().invoke(images.main, ["--type", "cpu", "--scale", "0.03", "--runs", "1",
                                              "--scenarios", "web,video", "--json-out", str(out)])
    assert result.exit_code == 0, result.output
    assert "video: 30 images" in result.output and "vs one-task-each" in result.output
    record = json.loads(out.read_text())
    assert set(record["video"]["seconds"]) == {"octopus", "octopus-gather", "octopus-gather-host", "one-task-each",
                                               "equal-batches", "loop"}
    video = record["video"]
    alone = video["total_alone_seconds"]
    assert len(alone) == 2 and 0 < video["ideal_seconds"] < min(alone.values())
    assert 0 < video["largest_item_seconds"] <= max(video["total_alone_seconds"].values())
    assert video["round_trip_seconds"] > 0
    # each worker's pipelines run within the measured time, whatever its estimate of the scheduler's clock
    spans = {v: (video["work_span_seconds"][v], video["median_seconds"][v]) for v in video["seconds"]}
    assert all(0 < span < total for span, total in spans.values()), spans


@pytest.mark.parametrize("args, message", [
    (["--scenarios", "web,foo"], "Invalid value for '--scenarios': unknown foo: choose among web"),
    (["--variants", "fast"], "Invalid value for '--variants': unknown fast: choose among"),
    (["--runs", "0"], "Invalid value for '--runs': 0 is not in the range x>=1"),
    (["--scale", "0"], "Invalid value for '--scale': 0.0 is not in the range x>0"),
    (["--scale", "inf"], "Invalid value for '--scale': 'inf' is not a finite number"),
    (["--cotenant", "0,x"], "Invalid value for --cotenant: CPU cores are numbers, got x"),
])
def test_images_example_refuses_bad_arguments_before_it_starts(args, message):
    result = CliRunner().invoke(images.main, args)
    assert result.exit_code == 2 and message in result.output, result.output
