"""The command line: demo (small), profile, and the module entry point."""

import contextlib
import gc
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner
from distributed import Client
from distributed.utils_test import cluster

import dask_octopus
from dask_octopus.bench.demo import place_parts
from dask_octopus.cli import main, profile_table
from dask_octopus.profiling.probes import gpu_count


@pytest.mark.xdist_group("cpu-cotenant")  # (tests/conftest.py)
def test_demo_runs_both_parts_on_cpu_with_their_tables_and_pngs(tmp_path, monkeypatch):
    from dask_octopus.bench import experiment

    called: list[str] = []  # the balance part's variant runs, in order

    def recorded(variants, runs, **kwargs):
        return interleave({v: lambda run, v=v, f=f: (called.append(v), f(run)) for v, f in variants.items()},
                          runs, **kwargs)

    interleave = experiment.interleave
    monkeypatch.setattr(experiment, "interleave", recorded)
    result = CliRunner().invoke(main, ["demo", "--type", "cpu", "--rows", "20000", "--passes", "2", "--blocks", "64",
                                       "--runs", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert called == ["equal", "balance", "balance", "equal"]  # two runs each (the default), neither always first
    out = result.output
    assert "Balance: per pass (median of 2 runs' passes)" in out
    assert "machine: " in out and "CPU cores" in out and "GPUs: none" in out and "protocol: tcp" in out
    assert "parts: balance on 2 CPU workers; small tasks on 1 CPU worker" in out
    for text in ("calibrated weights", "equal", "balance", "speedup vs equal", "ideal", "timeline written"):
        assert text in out
    finishes = r"\d+\.\d{3},\s+\d+\.\d{3}\s+/\s+\d+\.\d{3}"
    balance_rows = re.findall(r"│\s+(equal|balance) │\s+\d+ │\s+\d+\.\d{3} │\s+" + finishes + r"\s+│", out)
    assert balance_rows == ["equal", "balance"]  # each with its blocks, seconds per pass, and the median pass's
    # worker finishes beside that pass's own time
    assert "Small tasks: 64 blocks, one worker" in out
    for label in ("Dask, unannotated", "annotated, first run", "annotated, repeated", "plain loop in the client"):
        assert re.search(re.escape(label) + r" │.*│\s+\d+\.\d{4} │\s+\d+\.\d\dx │\s+\d+\.\d\d │", out), label
    for png in ("demo-timeline.png", "demo-tasks.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.xdist_group("cpu-cotenant")  # (tests/conftest.py)
def test_the_demo_fails_where_balance_s_result_differs_from_equal_blocks(tmp_path, monkeypatch):
    from dask_octopus.bench import experiment

    monkeypatch.setattr(experiment, "same_checksums", lambda a, b: a is b)  # balance's checksum "differs"
    result = CliRunner().invoke(main, ["demo", "--type", "cpu", "--part", "balance", "--rows", "4000", "--passes", "1",
                                       "--out", str(tmp_path)])
    assert result.exit_code != 0 and "balance's result differs from equal blocks'" in str(result.exception)


def test_demo_parts_run_one_at_a_time(tmp_path):
    result = CliRunner().invoke(main, ["demo", "--type", "cpu", "--part", "tasks", "--blocks", "32", "--runs", "1",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "balance not run; small tasks on 1 CPU worker" in result.output
    assert "Small tasks: 32 blocks" in result.output and "calibrated weights" not in result.output
    assert not (tmp_path / "demo-timeline.png").exists() and (tmp_path / "demo-tasks.png").exists()


@pytest.mark.parametrize("kind, gpus, part, balance, tasks, note", [
    ("auto", 0, "all", "cpu", "cpu", ""),
    ("cpu", 2, "all", "cpu", "cpu", ""),
    ("auto", 2, "all", "gpu", "gpu", ""),
    ("gpu", 4, "all", "gpu", "gpu", ""),
    ("auto", 1, "all", "cpu", "gpu", "one GPU: balance needs two workers"),
    ("gpu", 1, "all", None, "gpu", "balance needs two workers or more and this machine has one GPU"),
    ("auto", 1, "tasks", None, "gpu", ""),
    ("auto", 2, "balance", "gpu", None, ""),
])
def test_demo_places_each_part_where_the_machine_allows(kind, gpus, part, balance, tasks, note):
    where = place_parts(kind, gpus, part)
    assert (where.balance, where.tasks) == (balance, tasks)
    assert note in where.note and (note or not where.note)


def test_demo_refuses_what_the_machine_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="unknown part 'fft'"):
        place_parts("auto", 0, "fft")
    with pytest.raises(ValueError, match="CuPy sees no GPU"):
        place_parts("gpu", 0)
    with pytest.raises(ValueError, match="balance needs two workers or more and this machine has one GPU"):
        place_parts("gpu", 1, "balance")  # nothing left to run
    if gpu_count() == 0:
        result = CliRunner().invoke(main, ["demo", "--type", "gpu", "--out", str(tmp_path)])
        assert result.exit_code == 2 and "--type gpu: CuPy sees no GPU on this machine" in result.output


@pytest.mark.parametrize("args, message", [
    (["--runs", "0"], "Invalid value for '--runs': 0 is not in the range x>=1"),
    (["--passes", "0"], "Invalid value for '--passes': 0 is not in the range x>=1"),
    (["--blocks", "-4"], "Invalid value for '--blocks': -4 is not in the range x>=1"),
    (["--rows", "0"], "Invalid value for '--rows': 0 is not in the range x>=1"),
    (["--group", "0"], "Invalid value for '--group': 0 is not in the range x>=1"),
])
def test_demo_refuses_counts_below_one_before_it_starts(args, message):
    result = CliRunner().invoke(main, ["demo", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_demo_refuses_fewer_rows_than_balance_workers_before_it_starts():
    result = CliRunner().invoke(main, ["demo", "--type", "cpu", "--part", "balance", "--rows", "1"])
    assert result.exit_code == 2 and "Invalid value for --rows: the balance part gives each of its 2 workers a " \
        "block: at least 2 rows" in result.output, result.output


def test_demo_without_matplotlib_says_to_install_the_bench_extra_before_it_starts(monkeypatch, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None if name == "matplotlib"
                        else find_spec(name, *args))
    result = CliRunner().invoke(main, ["demo", "--type", "cpu", "--part", "tasks", "--blocks", "8", "--runs", "1",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 1 and result.output == (
        "Error: the demo draws its charts with matplotlib: pip install 'dask-octopus[bench]'\n"), result.output


def test_demo_refuses_an_out_folder_that_is_a_file_or_cannot_be_made(tmp_path):
    (tmp_path / "a-file").write_text("")
    result = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "a-file")])
    assert result.exit_code == 2 and "is a file" in result.output, result.output
    inside = tmp_path / "a-file" / "charts"  # under a file: said before any cluster starts, not a traceback
    result = CliRunner().invoke(main, ["demo", "--type", "cpu", "--out", str(inside)])
    assert result.exit_code == 2 and "Invalid value for --out: cannot make the folder" in result.output, (
        result.output)
    assert "Not a directory" in result.output and not inside.exists()


@pytest.mark.parametrize("kind, gpus, part, asked, ucx, used", [
    ("auto", 2, "all", "auto", True, "ucx"),  # two GPUs and distributed-ucxx: UCX
    ("auto", 2, "all", "auto", False, "tcp"),  # no distributed-ucxx
    ("auto", 1, "all", "auto", True, "tcp"),  # balance on CPU workers, one GPU for the small tasks
    ("gpu", 1, "tasks", "ucx", True, "ucx"),  # asked for: one GPU worker talks UCX
    ("auto", 2, "all", "tcp", True, "tcp"),
    ("cpu", 2, "all", "auto", True, "tcp"),
])
def test_demo_picks_its_protocol(monkeypatch, kind, gpus, part, asked, ucx, used):
    from dask_octopus.bench import protocol

    monkeypatch.setattr(protocol, "ucx_available", lambda: ucx)
    assert place_parts(kind, gpus, part, asked).protocol == used


def test_demo_with_ucx_on_cpu_workers_says_why_not(tmp_path, monkeypatch):
    from dask_octopus.bench import protocol

    monkeypatch.setattr(protocol, "ucx_available", lambda: True)
    result = CliRunner().invoke(main, ["demo", "--type", "cpu", "--protocol", "ucx", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "protocol ucx needs GPU workers" in result.output
    assert not list(tmp_path.iterdir())  # nothing started


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
    assert result.exit_code == 1
    assert "dask_octopus.register(client)" in result.output and "Traceback" not in result.output
    assert len(result.output.splitlines()) <= 2  # the message, not 54 lines of traceback


def test_profile_without_workers_says_so(loop):
    with cluster(nworkers=0) as (s, _), Client(s["address"], loop=loop) as c:
        dask_octopus.register(c)
        result = CliRunner().invoke(main, ["profile", "--scheduler-address", s["address"]])
    assert result.exit_code == 1 and "Error: the cluster has no workers" in result.output
    assert "Traceback" not in result.output


def test_profile_watch_keeps_watching_a_cluster_without_workers(loop):
    with cluster(nworkers=0) as (s, _):
        with Client(s["address"], loop=loop) as c:
            dask_octopus.register(c, calibrate=False)
        watching = subprocess.Popen([sys.executable, "-m", "dask_octopus", "profile", "--scheduler-address",
                                     s["address"], "--watch", "--interval", "0.2"],
                                    env={**os.environ, "COLUMNS": "500"}, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        try:
            tables = 0
            for line in watching.stdout:  # one table after the other (not a terminal), each saying why empty
                tables += "the cluster has no workers" in line
                if tables == 3:
                    break
            assert tables == 3 and watching.poll() is None  # still watching (it exited with 1 before)
        finally:
            watching.terminate()
            watching.communicate(timeout=60)


def test_profile_watch_that_loses_its_scheduler_says_so(loop):
    env = {**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "2s"}
    with cluster(nworkers=1) as (s, _):
        with Client(s["address"], loop=loop) as c:
            dask_octopus.register(c, calibrate=False)
        watching = subprocess.Popen([sys.executable, "-m", "dask_octopus", "profile", "--scheduler-address",
                                     s["address"], "--watch", "--interval", "0.2", "--timeout", "2s"], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in watching.stdout:  # a table, then the scheduler goes away
            if "weight compute" in line:
                break
    _, err = watching.communicate(timeout=60)
    assert watching.returncode == 1 and "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err  # (not distributed's "Failed to reconnect" besides)
    assert err.startswith(f"Error: lost the scheduler at {s['address']}: "), err


def test_a_worker_that_joined_between_the_two_calls_shows_no_memory_weight():
    profile = {"name_on_scheduler": "w", "device": "cpu", "weight": 0.5, "samples": 0}
    table = profile_table({"tcp://a:1": profile, "tcp://b:2": profile}, {"tcp://a:1": 0.5}, "t")
    assert table.columns[7]._cells == ["0.500", "-"]


@pytest.mark.skipif(importlib.util.find_spec("distributed_ucxx") is not None, reason="needs no distributed-ucxx")
def test_profile_of_a_ucx_address_without_distributed_ucxx_says_so_on_one_line():
    """distributed warns and then raises that the ucx protocol needs distributed-ucxx: one line, exit code 1."""
    result = subprocess.run([sys.executable, "-m", "dask_octopus", "profile", "--scheduler-address",
                             "ucx://127.0.0.1:1", "--timeout", "1s"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == "", result
    assert result.stderr.startswith("Error: cannot connect to 'ucx://127.0.0.1:1': The 'ucx' protocol was removed")
    assert "distributed-ucxx" in result.stderr and len(result.stderr.splitlines()) == 1, result.stderr


def test_profile_of_an_address_without_a_scheduler_says_so():
    result = CliRunner().invoke(main, ["profile", "--scheduler-address", "tcp://127.0.0.1:1", "--timeout", "1s"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.startswith("Error: no scheduler reachable at tcp://127.0.0.1:1: ")
    assert len(result.output.splitlines()) <= 2
    result = CliRunner().invoke(main, ["profile", "--scheduler-address", "localhost", "--timeout", "1s"])
    assert result.exit_code == 1 and "Traceback" not in result.output and len(result.output.splitlines()) <= 2
    assert result.output.startswith("Error: cannot connect to 'localhost': missing port number")
    result = CliRunner().invoke(main, ["profile", "--scheduler-address", "tls://127.0.0.1:1", "--timeout", "1s"])
    assert result.exit_code == 1 and "Traceback" not in result.output and len(result.output.splitlines()) <= 2
    assert result.output.startswith("Error: cannot connect to 'tls://127.0.0.1:1': TLS needs Dask's TLS settings")
    result = CliRunner().invoke(main, ["profile", "--scheduler-address", "ucx://127.0.0.1:1", "--timeout", "1s"])
    assert result.exit_code == 1 and "Traceback" not in result.output  # (a FutureWarning without distributed-ucxx)
    assert result.output.startswith(("Error: cannot connect to 'ucx://127.0.0.1:1': ", "Error: no scheduler reachable"))
    result = CliRunner().invoke(main, ["profile", "--scheduler-address", "tcp://127.0.0.1:1", "--timeout", "soon"])
    assert result.exit_code == 2 and "a duration > 0 and at most a day, such as 10s or 500ms, got 'soon'" in \
        result.output
    # (a Client given 0 would fail at once, saying it timed out; one given 1e10 s overflows as it closes)
    for timeout in ("0", "-1s", "1e400", "", " ", "1e10", "2 days"):
        result = CliRunner().invoke(main, ["profile", "--scheduler-address", "tcp://127.0.0.1:1", "--timeout", timeout])
        assert result.exit_code == 2, result.output
        assert f"a duration > 0 and at most a day, such as 10s or 500ms, got '{timeout}'" in result.output
    # no half-made Client left: one given a bad address stays "connecting"; collected later, its __del__
    # takes distributed's LoopRunner lock, which a sync cluster holds while its loop thread starts, and
    # where the collection runs in that thread the cluster gives up after 10 s ("assert loop is not None")
    assert not [c for c in gc.get_objects() if isinstance(c, Client) and c.status == "connecting"]


def test_profile_of_an_address_where_something_else_listens_says_so_within_the_timeout():
    """Something that is not a Dask server listens at the address (a dashboard's HTTP port): distributed's
    handshake would wait for its answer for ever, and a Client with it, past ``--timeout``."""
    import socket
    import time

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        start = time.monotonic()
        result = CliRunner().invoke(main, ["profile", "--scheduler-address", address, "--timeout", "1s"])
        took = time.monotonic() - start
    assert result.exit_code == 1 and took < 15, (result.output, took)
    assert result.output == (f"Error: no scheduler reachable at {address}: nothing answered as a Dask server "
                             "within 1 s (the scheduler's address, not its dashboard's?)\n")


def test_profile_of_an_address_where_another_protocol_speaks_first_or_nothing_listens_says_so():
    """A service that speaks first in another protocol (an SSH banner): distributed's handshake reads it
    as a Dask message and fails (out of memory for its frame lengths); a port where nothing listens:
    distributed's own reason at the timeout, not a hint about the dashboard. One line, exit code 1."""
    import socket
    import threading

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"

        def banner():
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6p1 Ubuntu-3ubuntu13\r\n")
                conn.recv(1)  # (until the client closes)

        thread = threading.Thread(target=banner, daemon=True)
        thread.start()
        result = CliRunner().invoke(main, ["profile", "--scheduler-address", address, "--timeout", "5s"])
        thread.join(timeout=10)
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: no scheduler reachable at {address}: what answered there is not a "
                                    "Dask server (its first bytes are not Dask's protocol"), result.output
    assert result.output.count("\n") == 1, result.output
    with socket.socket() as closed:  # (a free port, closed again: nothing listens there)
        closed.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
    result = CliRunner().invoke(main, ["profile", "--scheduler-address", address, "--timeout", "1s"])
    assert result.exit_code == 1 and result.output == (f"Error: no scheduler reachable at {address}: Timed out "
                                                       f"trying to connect to {address} after 1 s\n"), result.output


def test_profile_of_a_worker_s_address_says_it_is_not_a_scheduler(loop):
    """A worker's address speaks Dask's protocol: a Client there failed with a ``TypeError`` traceback
    (``Worker.identity() got an unexpected keyword argument``). One line, exit code 1."""
    with cluster(nworkers=1) as (_, [w]):
        result = CliRunner().invoke(main, ["profile", "--scheduler-address", w["address"], "--timeout", "5s"])
    assert result.exit_code == 1 and result.output == (f"Error: no scheduler reachable at {w['address']}: a Dask "
                                                       "Worker answers there, not a scheduler (the scheduler's "
                                                       "address?)\n"), result.output


def test_profile_table_shows_names_and_notes_as_they_are():
    """A worker's name (``dask worker --name``) or note with Rich's markup in it: shown as written, not
    read as markup (``[/x]`` raised a MarkupError, ``[red]gpu-7`` showed red ``gpu-7``)."""
    from rich.console import Console

    from dask_octopus.cli import profile_table

    profiles = {f"tcp://[fd00::{i}]:8786": {"name_on_scheduler": name, "device": "cpu", "weight": 0.5,
                                            "samples": 0, "error": note}
                for i, (name, note) in enumerate([("[/x]", None), ("[red]gpu-7", "[bold]n")])}
    out = Console(width=200, record=True)
    out.print(profile_table(profiles, {}, "profiles at tcp://[fd00::9]:8786"))
    text = out.export_text()
    assert "[/x]" in text and "[red]gpu-7" in text and "[bold]n" in text
    assert "tcp://[fd00::0]:8786" in text and "profiles at tcp://[fd00::9]:8786" in text


def test_module_entry_point():
    out = subprocess.run([sys.executable, "-m", "dask_octopus", "--help"], capture_output=True, text=True,
                         env={**os.environ}, check=True)
    assert "demo" in out.stdout and "profile" in out.stdout


@pytest.mark.xdist_group("cpu-cotenant")  # (tests/conftest.py)
def test_ctrl_c_in_the_demo_stops_cluster_and_cotenant_and_a_second_run_works(tmp_path):
    import signal
    import time

    import psutil

    def as_a_terminal_runs_it():  # its own process group, SIGINT handled, also when this suite runs in the
        signal.signal(signal.SIGINT, signal.default_int_handler)  # background (which ignores SIGINT)
        os.setsid()

    proc = subprocess.Popen([sys.executable, "-m", "dask_octopus", "demo", "--type", "cpu", "--rows", "200000",
                             "--passes", "200", "--out", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=as_a_terminal_runs_it)
    seen = []
    for line in proc.stdout:  # wait until the co-tenant runs and the variants compute
        seen.append(line)
        if "calibrated weights" in line:
            break
    time.sleep(2)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 3  # two workers and the co-tenant
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: to every process of the terminal's group
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(seen) + out
    assert "interrupted: the local cluster and the co-tenant load are stopped" in out
    assert "Traceback" not in out and "Aborted!" not in out, out  # (the workers' and the co-tenant's)
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [p.cmdline() for p in alive]
    again = subprocess.run([sys.executable, "-m", "dask_octopus", "demo", "--type", "cpu", "--part", "balance",
                            "--rows", "20000", "--passes", "1", "--runs", "1", "--out", str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "timeline written" in again.stdout, again.stdout + again.stderr


@pytest.mark.xdist_group("cpu-cotenant")  # (tests/conftest.py)
def test_ctrl_c_while_the_demo_s_workers_start_stops_it_once_they_are_up(tmp_path):
    """A Ctrl-C while the worker processes start (they must not see it: each would print a traceback) is
    held, not dropped: the demo stops once they are up, exit code 130, and no process is left."""
    import signal
    import time

    import psutil

    def as_a_terminal_runs_it():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.setsid()

    proc = subprocess.Popen([sys.executable, "-m", "dask_octopus", "demo", "--type", "cpu", "--part", "balance",
                             "--rows", "20000", "--passes", "1", "--runs", "1", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=as_a_terminal_runs_it)
    parent = psutil.Process(proc.pid)

    def pythons():  # (a process listed may be gone before its name is read)
        found = []
        for p in parent.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.name().startswith("python"):
                    found.append(p)
        return found

    start = time.monotonic()
    started = []
    while not started and time.monotonic() < start + 60:  # until the first worker process starts (not the
        started = pythons()  # sentinel, sleep); those seen are kept, also where one ends before the Ctrl-C
        time.sleep(0.01)
    assert started, f"no worker process started in {time.monotonic() - start:.1f} s"
    children = list({p.pid: p for p in [*parent.children(recursive=True), *started]}.values())
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: to every process of the terminal's group
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "interrupted: the local cluster and the co-tenant load are stopped" in out
    assert "Traceback" not in out and "timeline written" not in out, out
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, [p.cmdline() for p in alive]


def test_demo_with_ucx_and_one_gpu_names_the_parts_that_can_use_it(monkeypatch):
    from dask_octopus.bench import protocol

    monkeypatch.setattr(protocol, "ucx_available", lambda: True)
    with pytest.raises(ValueError, match="the balance part runs on CPU workers: run --part tasks over ucx"):
        place_parts("auto", 1, "all", "ucx")
    assert place_parts("auto", 1, "tasks", "ucx").protocol == "ucx"
