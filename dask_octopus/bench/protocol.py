"""The protocol the local clusters of the demo and the benchmarks talk over, their ``--protocol``, and
the check that this machine can start the cluster asked for.

``tcp`` everywhere; ``ucx`` (UCX through distributed-ucxx: NVLink between the GPUs of one machine)
for dask-cuda clusters only; ``auto`` is UCX where distributed-ucxx imports and the cluster has two
GPUs or more (where data moves between GPUs), else TCP. The clusters themselves are made by
:func:`dask_octopus.bench.experiment.local_cluster`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

import click
from distributed import Client
from distributed.comm import parse_address

from dask_octopus.profiling.probes import gpu_count

PROTOCOLS = ("auto", "tcp", "ucx")
F = TypeVar("F", bound=Callable)


def ucx_available() -> bool:
    """Whether Dask can talk UCX here: distributed-ucxx, which provides ``protocol="ucx"``, imports."""
    try:
        importlib.import_module("distributed_ucxx")
    except Exception:  # not installed, or its UCX libraries are missing
        return False
    return True


def resolve_protocol(protocol: str, gpus: int) -> str:
    """The protocol a local cluster of ``gpus`` GPU workers (0: CPU workers) talks over when
    ``protocol`` is asked for: ``auto`` is ``ucx`` with two GPUs or more where distributed-ucxx
    imports, else ``tcp``.

    Raises
    ------
    ValueError
        For an unknown protocol, ``ucx`` on CPU workers, or ``ucx`` without distributed-ucxx.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    if protocol == "auto":
        return "ucx" if gpus >= 2 and ucx_available() else "tcp"
    if protocol == "ucx" and gpus == 0:
        raise ValueError("protocol ucx needs GPU workers (a dask-cuda LocalCUDACluster); CPU workers talk over tcp")
    if protocol == "ucx" and not ucx_available():
        raise ValueError("protocol ucx needs distributed-ucxx (pip install distributed-ucxx-cu13, or -cu12 for "
                         "CUDA 12), which does not import here")
    return protocol


def check_cluster(kind: str, protocol: str, asked: str = "--type gpu") -> None:
    """Raise a ``click.UsageError`` where this machine cannot start the local cluster a benchmark is asked
    for: GPU workers (``kind="gpu"``, ``asked`` so: what the error names) without a GPU, ``--protocol ucx``
    on CPU workers or without distributed-ucxx (:func:`resolve_protocol`), before anything starts."""
    gpus = gpu_count() if kind == "gpu" else 0
    if kind == "gpu" and gpus == 0:
        raise click.UsageError(f"{asked}: CuPy sees no GPU on this machine")
    try:
        resolve_protocol(protocol, gpus)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def protocol_of(client: Client) -> str:
    """The protocol the client talks to its scheduler over: ``tcp``, ``ucx``, ``inproc``, ..."""
    return parse_address(client.scheduler.address)[0]


def protocol_option(func: F) -> F:
    """The ``--protocol`` option of the demo and of every benchmark that starts a cluster."""
    return click.option("--protocol", type=click.Choice(PROTOCOLS), default="auto", show_default=True,
                        help="how the local cluster's workers talk: auto is ucx where distributed-ucxx imports "
                             "and the cluster has 2 GPUs or more, else tcp")(func)
