"""Client-side entry points: register the plugins, read speeds and profiles."""

from __future__ import annotations

from typing import Any

from distributed import Client, default_client

from dask_octopus.scheduler_plugin import OctopusScheduler
from dask_octopus.speedmodel import check_resource


class NotRegisteredError(RuntimeError):
    """The scheduler has no dask_octopus plugin."""


def register(client: Client | None = None, *, calibrate: bool = True, **options: Any) -> None:
    """Install the octopus scheduler plugin (and through it the worker plugin) in one call.

    Idempotent: a second call, or a call on a scheduler started with
    ``--preload dask_octopus``, changes nothing. With ``calibrate=True`` it returns once every
    current worker is calibrated; workers that join later are calibrated when they arrive. With
    ``calibrate=False`` the weights start equal and come from task timings alone.
    ``options`` are ``calibration_seconds`` and ``device`` (``"auto"``, ``"cpu"``, ``"gpu"``).
    """
    client = client or default_client()
    unknown = set(options) - {"calibration_seconds", "device"}
    if unknown:
        raise TypeError(f"unknown register options: {sorted(unknown)}")
    client.register_plugin(OctopusScheduler(calibrate=calibrate, **options))


def _has_plugin(dask_scheduler: Any) -> bool:
    return OctopusScheduler.name in dask_scheduler.plugins


def call_scheduler(client: Client | None, handler: str, **kwargs: Any) -> Any:
    """Call one of the plugin's RPC handlers, with a clear error if the plugin is absent."""
    client = client or default_client()
    if not client.run_on_scheduler(_has_plugin):
        raise NotRegisteredError(
            "dask_octopus is not registered on this scheduler: call dask_octopus.register(client) "
            "or start the scheduler with --preload dask_octopus"
        )
    return client.sync(getattr(client.scheduler, handler), **kwargs)


def speeds(client: Client | None = None, resource: str = "compute") -> dict[str, float]:
    """Current relative weights of the live workers for ``resource``; they sum to 1."""
    check_resource(resource)
    return call_scheduler(client, "octopus_speeds", resource=resource)


def profiles(client: Client | None = None, resource: str = "compute") -> dict[str, dict[str, Any]]:
    """Per worker: device, calibration figures, memory, current weight and task samples."""
    check_resource(resource)
    return call_scheduler(client, "octopus_profiles", resource=resource)
