"""dask-octopus: make every worker of a heterogeneous Dask cluster finish together."""

from __future__ import annotations

import logging
from typing import Any

from dask_octopus import config  # noqa: F401  (registers the dask.config defaults)
from dask_octopus.annotation import annotate
from dask_octopus.client_api import NotRegisteredError, profiles, register, speeds
from dask_octopus.mapping import map
from dask_octopus.planning import PlanningError

__version__ = "0.1.0"
__all__ = ["NotRegisteredError", "PlanningError", "annotate", "balance", "map", "profiles", "register", "speeds"]

logger = logging.getLogger(__name__)


def balance(*args: Any, **kwargs: Any) -> Any:
    """See :func:`dask_octopus.balance.balance` (imported lazily: it pulls in dask.dataframe)."""
    from dask_octopus.balancing import balance as _balance

    return _balance(*args, **kwargs)


def dask_setup(service: Any) -> None:
    """Preload hook: ``dask scheduler --preload dask_octopus`` installs the scheduler plugin;
    ``dask worker --preload dask_octopus`` only checks that the package imports on the worker
    (the scheduler plugin sends the worker plugin itself)."""
    from distributed import Scheduler

    if isinstance(service, Scheduler):
        from dask_octopus.scheduler_plugin import OctopusScheduler

        service.add_plugin(OctopusScheduler())
    else:
        logger.info("dask_octopus %s available on %s", __version__, getattr(service, "address", service))
