"""The ``dask-octopus`` command line (``python -m dask_octopus`` too)."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import click
from dask.utils import format_bytes, parse_timedelta
from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dask_octopus.bench.options import FiniteRange
from dask_octopus.bench.protocol import protocol_option
from dask_octopus.profiling.probes import gpu_count

POSITIVE = click.IntRange(min=1)  #: counts and sizes of the demo


def console() -> Console:
    """A console that keeps tables readable in logs (160 columns when not on a terminal)."""
    c = Console()
    return c if c.is_terminal else Console(width=160)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """Show a warning as a line of the command's own: its class and text (the line of code it names is the
    package's, or click's that called it, which says nothing to the command's user)."""
    click.echo(f"{category.__name__}: {message}", err=True)


@click.group()
@click.version_option(package_name="dask-octopus")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Speed-weighted placement for heterogeneous Dask clusters."""
    ctx.with_resource(warnings.catch_warnings())  # (as it was once the command returns: CliRunner, say)
    warnings.showwarning = _show_warning


@main.command()
@click.option("--type", "kind", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="auto: GPUs where CuPy sees them (balance needs two); cpu: CPU workers; gpu: GPU workers only")
@click.option("--part", type=click.Choice(["all", "balance", "tasks"]), default="all", show_default=True,
              help="balance: a worker per GPU (two on CPU), one slowed down; tasks: many small tasks on one worker")
@click.option("--rows", type=POSITIVE, default=None,
              help="balance: rows of the array [default: 400000 cpu, 1000000 gpu]")
@click.option("--cols", type=POSITIVE, default=None, help="balance: columns [default: 256 cpu, 2048 gpu]")
@click.option("--width", type=POSITIVE, default=None, help="balance: subspace width [default: 128 cpu, 2048 gpu]")
@click.option("--passes", type=POSITIVE, default=3, show_default=True, help="balance: timed passes per run")
@click.option("--balance-runs", type=POSITIVE, default=2, show_default=True,
              help="balance: runs per variant, in alternating orders (equal, balance; balance, equal; ...)")
@click.option("--cotenant/--no-cotenant", default=True, show_default=True, help="balance: slow one worker down")
@click.option("--blocks", type=POSITIVE, default=None,
              help="tasks: number of small blocks [default: 512 cpu, 1024 gpu]")
@click.option("--runs", type=POSITIVE, default=3, show_default=True, help="tasks: timed runs per variant")
@click.option("--group", type=POSITIVE, default=None,
              help="tasks: most blocks per fragment [default: one fragment per worker thread]")
@click.option("--out", type=click.Path(file_okay=False), default="octopus-demo", show_default=True,
              help="folder for the PNGs")
@protocol_option
def demo(kind: str, part: str, rows: int | None, cols: int | None, width: int | None, passes: int, balance_runs: int,
         cotenant: bool, blocks: int | None, runs: int, group: int | None, out: str, protocol: str) -> None:
    """Both halves of dask_octopus on this machine: balance (a worker per GPU, or two CPU workers, one slowed
    by a co-tenant) and small tasks (Dask's per-task cost against fragments and a plain loop), each with a
    table and a PNG."""
    from dask_octopus.bench.demo import balance_worker_count, place_parts, run_demo  # the "bench" extra

    if importlib.util.find_spec("matplotlib") is None:  # (the PNGs come after the runs: say so before them)
        raise click.ClickException("the demo draws its charts with matplotlib: pip install 'dask-octopus[bench]'")
    gpus = gpu_count()
    try:
        where = place_parts(kind, gpus, part, protocol)
    except ValueError as e:  # the machine cannot run what was asked
        raise click.UsageError(str(e)) from None
    workers = balance_worker_count(where, gpus)
    if where.balance and rows is not None and rows < workers:
        raise click.BadParameter(f"the balance part gives each of its {workers} workers a block: at least "
                                 f"{workers} rows", param_hint="--rows")
    try:  # (the PNGs come after the runs: a folder that cannot be made is said before them)
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise click.BadParameter(f"cannot make the folder {out!r}: {e.strerror or e}", param_hint="--out") from None
    try:
        run_demo(where, gpus=gpus, rows=rows, cols=cols, width=width, passes=passes, balance_runs=balance_runs,
                 blocks=blocks, runs=runs, group=group, out=out, cotenant=cotenant, console=console())
    except KeyboardInterrupt:  # the cluster and the co-tenant were stopped on the way out
        console().print("interrupted: the local cluster and the co-tenant load are stopped")
        raise SystemExit(130) from None


def _si(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if value >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def profile_table(profiles: dict[str, dict], memory_weights: dict[str, float], title: str) -> Table:
    """A table of :func:`dask_octopus.profiles` with the memory weights beside the compute ones (``-`` for a
    worker that joined between the two calls)."""
    table = Table(title=Text(title))
    for col in ("worker", "name", "device", "memory", "GEMM", "stream", "weight compute", "weight memory",
                "task timings", "note"):
        table.add_column(col)
    for addr, p in sorted(profiles.items()):
        device = p.get("name", "?") if p.get("device") == "gpu" else p.get("device", "?")
        memory = format_bytes(p["memory_total"]) if p.get("memory_total") else "-"
        # names, devices and notes as written, not read as markup (an IPv6 address's brackets, a name's)
        table.add_row(Text(addr), Text(str(p["name_on_scheduler"])), Text(str(device)), memory,
                      _si(p.get("compute"), "FLOP/s"), _si(p.get("memory"), "B/s"), f"{p['weight']:.3f}",
                      f"{memory_weights[addr]:.3f}" if addr in memory_weights else "-", str(p["samples"]),
                      Text(p.get("error") or ""))
    return table


def watch(make: Callable[[], RenderableType], interval: float, out: Console) -> None:
    """Show ``make()`` every ``interval`` seconds until Ctrl-C: redrawn in place on a terminal, one
    table after the other elsewhere (a pipe, a log)."""
    try:
        if out.is_terminal:
            with Live(make(), console=out, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(make(), refresh=True)
        else:
            while True:
                out.print(make())
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


def _duration(value: str) -> float:
    try:
        seconds = parse_timedelta(value)
    except (ValueError, KeyError, TypeError, OverflowError, IndexError):  # (OverflowError: 1e400; IndexError: "")
        seconds = None
    if seconds is None or not 0 < seconds <= 86400:  # (a Client waits twice it as it closes: 1e10 s overflows)
        raise click.BadParameter(f"a duration > 0 and at most a day, such as 10s or 500ms, got {value!r}")
    return seconds


def _answers(address: str, timeout: float, connection_args: dict[str, Any]) -> None:
    """Raise ``OSError`` where no Dask scheduler at the ``tcp://`` or ``tls://`` ``address`` answers within
    ``timeout`` seconds: distributed's handshake waits for ever on something else that listens there
    and stays silent (a dashboard's HTTP port), and a ``Client`` with it; and fails with whatever
    reading garbage raises on something that speaks first in another protocol (SSH, SMTP); a Dask
    server of another kind (a worker's, a nanny's address) fails a ``Client`` with a ``TypeError``."""
    from distributed.comm import connect, parse_address

    if parse_address(address)[0] not in ("tcp", "tls"):
        return

    async def reach() -> None:
        try:
            comm = await connect(address, timeout=timeout, **connection_args)
        except OSError:  # (nothing listens there, the host is not reached: distributed says so at the timeout)
            raise
        except Exception as e:
            raise OSError(f"what answered there is not a Dask server (its first bytes are not Dask's protocol: "
                          f"{type(e).__name__} reading them)") from None
        try:
            await comm.write({"op": "identity", "reply": True})  # (a worker's takes no n_workers)
            identity = await comm.read()
        finally:
            await comm.close()
        if not isinstance(identity, dict) or "n_workers" not in identity:  # (a scheduler's, of any class)
            kind = identity.get("type") if isinstance(identity, dict) else None
            raise OSError(f"a Dask {kind or 'server'} answers there, not a scheduler (the scheduler's address?)")

    try:  # (a second more than the connection's own timeout, whose error says why it failed)
        asyncio.run(asyncio.wait_for(reach(), timeout + 1))
    except TimeoutError:
        raise OSError(f"nothing answered as a Dask server within {timeout:g} s (the scheduler's address, "
                      "not its dashboard's?)") from None


@main.command()
@click.option("--scheduler-address", required=True, help="address of a scheduler running dask_octopus")
@click.option("--watch", "watching", is_flag=True, help="refresh the table until Ctrl-C")
@click.option("--interval", type=FiniteRange(min=0.1, max=86400), default=2.0, show_default=True,
              help="--watch: seconds between refreshes")
@click.option("--timeout", default="10s", show_default=True, callback=lambda ctx, param, value: _duration(value),
              help="how long to try to reach the scheduler")
def profile(scheduler_address: str, watching: bool, interval: float, timeout: float) -> None:
    """Print each worker's device, calibration figures, current weights and refining samples."""
    from distributed import Client, Security
    from distributed.comm import parse_address, resolve_address

    import dask_octopus

    def make() -> RenderableType:
        when = f", {time.strftime('%H:%M:%S')}, every {interval:g} s (Ctrl-C stops)" if watching else ""
        title = f"dask_octopus profiles at {scheduler_address}{when}"
        try:
            return profile_table(dask_octopus.profiles(client, "compute"), dask_octopus.speeds(client, "memory"),
                                 title)
        except ValueError as e:  # no workers: say so, exit 1; --watch waits for workers to come (back)
            if watching:
                return Text(f"{title}: {e}")
            raise click.ClickException(str(e)) from None
        except dask_octopus.NotRegisteredError as e:  # no plugin: say so, exit 1
            raise click.ClickException(str(e)) from None
        except OSError as e:  # the scheduler went away (closed comms, a timeout): say so, exit 1
            raise click.ClickException(f"lost the scheduler at {scheduler_address}: {e!r}") from None

    try:
        with warnings.catch_warnings():  # (ucx:// without distributed-ucxx: distributed warns, then raises it)
            warnings.simplefilter("ignore", FutureWarning)
            resolve_address(scheduler_address)  # before a Client: one given a bad address stays half made
            connection_args = Security().get_connection_args("client")
            if parse_address(scheduler_address)[0] == "tls" and not connection_args.get(
                    "ssl_context"):  # (a Client would raise a TypeError, half made)
                raise ValueError("TLS needs Dask's TLS settings (distributed.comm.tls.ca-file, .client.cert, "
                                 ".client.key: DASK_DISTRIBUTED__COMM__TLS__... variables)")
            _answers(scheduler_address, timeout, connection_args)
            client = Client(scheduler_address, timeout=timeout)
    except OSError as e:  # no scheduler there (distributed's timeout is an OSError): say so, exit 1
        raise click.ClickException(f"no scheduler reachable at {scheduler_address}: {e}") from None
    except (ValueError, ImportError, FutureWarning) as e:  # not an address (no port, say); tls:// without Dask's
        # TLS settings; ucx:// without distributed-ucxx (distributed raises a FutureWarning saying to install it)
        raise click.ClickException(f"cannot connect to {scheduler_address!r}: {' '.join(str(e).split())}") from None
    with client:
        if watching:  # (distributed's client logs that it failed to reconnect: this command says so itself)
            logging.getLogger("distributed.client").setLevel(logging.CRITICAL)
            watch(make, interval, console())
        else:
            console().print(make())
