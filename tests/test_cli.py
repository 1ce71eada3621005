"""The command line: demo (small), profile, and the module entry point."""

import os
import subprocess
import sys

from click.testing import CliRunner
from distributed import Client
from distributed.utils_test import cluster

import dask_octopus
from dask_octopus.cli import main


def test_demo_runs_on_cpu_and_writes_a_timeline(tmp_path):
    result = CliRunner().invoke(main, ["demo", "--type", "cpu", "--rows", "20000", "--passes", "2",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    for text in ("calibrated weights", "equal", "balance", "speedup vs equal", "ideal", "timeline written"):
        assert text in result.output
    png = tmp_path / "demo-timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_prints_every_worker(loop):
    with cluster(nworkers=2) as (s, workers), Client(s["address"], loop=loop) as c:
        dask_octopus.register(c, calibration_seconds=0.1)
        result = CliRunner().invoke(main, ["profile", "--scheduler-address", s["address"]])
    assert result.exit_code == 0, result.output
    for w in workers:
        assert w["address"] in result.output
    assert "FLOP/s" in result.output and "weight compute" in result.output


def test_profile_without_the_plugin_says_how_to_register(loop):
    with cluster(nworkers=1) as (s, _):
        result = CliRunner().invoke(main, ["profile", "--scheduler-address", s["address"]])
    assert result.exit_code != 0
    assert "dask_octopus.register(client)" in str(result.exception)


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "dask_octopus", "--help"], capture_output=True, text=True,
                         env={**os.environ}, check=True)
    assert "demo" in out.stdout and "profile" in out.stdout


def test_ctrl_c_in_the_demo_stops_cluster_and_cotenant_and_a_second_run_works(tmp_path):
    import signal
    import time

    import psutil

    proc = subprocess.Popen([sys.executable, "-m", "dask_octopus", "demo", "--type", "cpu", "--rows", "200000",
                             "--passes", "200", "--out", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # wait until the co-tenant runs and the variants compute
        seen.append(line)
        if "calibrated weights" in line:
            break
    time.sleep(2)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 3  # two workers and the co-tenant
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(seen) + out
    assert "interrupted: the local cluster and the co-tenant load are stopped" in out
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [p.cmdline() for p in alive]
    again = subprocess.run([sys.executable, "-m", "dask_octopus", "demo", "--type", "cpu", "--rows", "20000",
                            "--passes", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "timeline written" in again.stdout, again.stdout + again.stderr
