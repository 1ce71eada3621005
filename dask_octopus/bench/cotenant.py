"""Co-tenant load: real processes that share a CPU core or a GPU with a worker.

Heterogeneity for tests, the demo and benchmarks, without sleeps: on CPU, busy processes pinned
(``sched_setaffinity``) to the core of one worker that is pinned likewise (:func:`pin_workers`);
on GPU, a process that loops matmuls on one device, which time-slicing turns into about half the
speed for the worker on that device (measured on H200). Children exit when their parent dies or
after ``max_seconds``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from types import TracebackType

import click
import psutil
from distributed import Client

from dask_octopus.bench.workloads import workers_info


def pin_process(cores: set[int]) -> None:
    """Pin every thread of this process (and so the threads it starts later) to ``cores``."""
    for thread in psutil.Process().threads():
        os.sched_setaffinity(thread.id, cores)


def pin_workers(client: Client) -> dict[str, int]:
    """Pin each worker process of ``client`` to its own CPU core (sorted addresses, sorted cores)."""
    cores = sorted(os.sched_getaffinity(0))
    workers = sorted(workers_info(client))
    if len(workers) > len(cores):
        raise ValueError(f"{len(workers)} workers cannot each get one of {len(cores)} cores")
    plan = dict(zip(workers, cores))
    for addr, core in plan.items():
        client.run(pin_process, {core}, workers=[addr])
    return plan


class CoTenant:
    """Start ``procs`` busy processes on each of ``cores`` (CPU) and ``gpus`` (CUDA device ids).

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, *, cores: Sequence[int] = (), gpus: Sequence[int | str] = (), procs: int = 1,
                 max_seconds: float = 3600):
        if procs < 1:
            raise ValueError(f"procs must be >= 1, got {procs}")
        available = os.sched_getaffinity(0)
        if set(cores) - available:
            raise ValueError(f"cores {sorted(set(cores) - available)} are not available; "
                             f"this process may use {sorted(available)}")
        self.targets = [("cpu", str(c)) for c in cores] + [("gpu", str(g)) for g in gpus]
        self.procs = procs
        self.max_seconds = max_seconds
        self.children: list[subprocess.Popen] = []

    @classmethod
    def from_option(cls, text: str, gpu: bool, procs: int = 1, option: str = "--cotenant") -> CoTenant:
        """The co-tenants a command-line option asks for: ``text`` lists GPUs (``gpu``: CUDA device ids,
        as ``CUDA_VISIBLE_DEVICES`` takes them) or CPU cores, comma-separated; a core that is not a
        number or not available to this process is a :class:`click.BadParameter` naming ``option``."""
        targets = [t.strip() for t in text.split(",") if t.strip()]
        if gpu:
            return cls(gpus=targets, procs=procs)
        bad = [t for t in targets if not t.isdigit()]
        if bad:
            raise click.BadParameter(f"CPU cores are numbers, got {', '.join(bad)}", param_hint=option)
        try:
            return cls(cores=[int(t) for t in targets], procs=procs)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint=option) from None

    def start(self) -> CoTenant:
        for kind, target in self.targets:
            env = dict(os.environ)
            if kind == "gpu":
                env["CUDA_VISIBLE_DEVICES"] = target
            for _ in range(self.procs):
                self.children.append(subprocess.Popen(
                    [sys.executable, "-m", "dask_octopus.bench.cotenant", kind, target,
                     "--parent", str(os.getpid()), "--max-seconds", str(self.max_seconds)],
                    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                    start_new_session=True,  # a terminal's Ctrl-C is not its: it ends with this process, or stop()
                ))
        for child in self.children:  # each child prints one line once its load runs
            if child.stdout.readline().strip() != "ready":
                code = child.wait()
                self.stop()
                raise RuntimeError(f"co-tenant process exited at start with code {code}")
        return self

    def stop(self) -> None:
        for child in self.children:
            child.terminate()
        for child in self.children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.children.clear()

    def __enter__(self) -> CoTenant:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _ready() -> None:
    print("ready", flush=True)


def _cpu_loop(core: int, alive) -> None:
    os.sched_setaffinity(0, {core})
    x = 1.0
    _ready()
    while alive():
        for _ in range(100_000):
            x = x * 1.0000001 + 1e-9


def _gpu_loop(alive) -> None:
    import cupy

    a = cupy.ones((8192, 8192), dtype=cupy.float32)
    out = cupy.empty_like(a)
    cupy.matmul(a, a, out=out)
    cupy.cuda.get_current_stream().synchronize()
    _ready()
    while alive():
        for _ in range(4):
            cupy.matmul(a, a, out=out)
        cupy.cuda.get_current_stream().synchronize()


@click.command()
@click.argument("kind", type=click.Choice(["cpu", "gpu"]))
@click.argument("target")
@click.option("--parent", type=int, required=True, help="exit when this process is gone")
@click.option("--max-seconds", type=float, default=3600.0)
def _main(kind: str, target: str, parent: int, max_seconds: float) -> None:
    """Run one co-tenant load loop (started by :class:`CoTenant`)."""
    deadline = time.monotonic() + max_seconds

    def alive() -> bool:
        return time.monotonic() < deadline and psutil.pid_exists(parent)

    if kind == "cpu":
        _cpu_loop(int(target), alive)
    else:
        _gpu_loop(alive)


if __name__ == "__main__":
    _main()
