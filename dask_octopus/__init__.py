"""dask-octopus: make every worker of a heterogeneous Dask cluster finish together.

Public API: :func:`register`, :func:`speeds`, :func:`profiles` (profiling), :func:`balance` and
:func:`map` and :func:`imap` (placement), :func:`annotate` (stream groups), and the errors and warnings they
raise. The package
is also a Dask preload: ``dask scheduler --preload dask_octopus``.
"""

from __future__ import annotations

import logging
from typing import Any

from dask_octopus import config  # (importing it registers the dask.config defaults)
from dask_octopus.groups.marks import annotate
from dask_octopus.placement.blocks import WorkingSetWarning, balance
from dask_octopus.placement.items import imap, map
from dask_octopus.placement.planning import PlanningError
from dask_octopus.plugins.client import NotRegisteredError, profiles, register, speeds

__version__ = "0.1.0"
__all__ = ["NotRegisteredError", "PlanningError", "WorkingSetWarning", "annotate", "balance", "imap", "map",
           "profiles", "register", "speeds"]

logger = logging.getLogger(__name__)


def _log_as_distributed() -> None:
    """Send this package's log records where distributed's go, at its level (INFO by default), where
    nothing else would show them: the ``dask scheduler`` and ``dask worker`` commands set up
    distributed's loggers only, and the records of others reach Python's last resort, warnings and
    above, without time or name. Left as they are where logging was configured for ``dask_octopus``
    (a handler or a level, e.g. Dask's ``logging`` setting) or for the process (handlers on the root
    logger: a preload in the user's own process, whose logging is the user's)."""
    ours, theirs = logging.getLogger(__name__), logging.getLogger("distributed")
    if ours.handlers or ours.level != logging.NOTSET or not theirs.handlers or logging.getLogger().handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def dask_setup(service: Any) -> None:
    """Preload hook: ``dask scheduler --preload dask_octopus`` installs the scheduler plugin (once,
    however many times the module is preloaded; a bad ``octopus`` setting of the scheduler's process
    fails the preload, as distributed lets a preload fail, and the clients' calls that need the plugin
    say so); ``dask worker --preload dask_octopus`` only checks that
    the package imports on the worker and that the worker's ``octopus`` settings are good (the scheduler
    plugin sends the worker plugin itself). Both log
    as distributed does (:func:`_log_as_distributed`)."""
    from distributed import Scheduler

    _log_as_distributed()
    if isinstance(service, Scheduler):
        from dask_octopus.plugins.scheduler import PRELOAD_ERROR, OctopusSchedulerPlugin, registered_plugin

        if registered_plugin(service) is None:
            try:
                plugin = OctopusSchedulerPlugin()  # (checks the process's settings)
            except ValueError as e:  # distributed logs it and starts the scheduler without the plugin: clients
                setattr(service, PRELOAD_ERROR, str(e))  # asking for it are told why
                raise
            service.add_plugin(plugin)
    else:  # a bad setting of the worker's process fails the preload (distributed logs it, naming the key):
        config.check_all()  # the worker plugin would not set up there
        logger.info("dask_octopus %s available on %s", __version__, getattr(service, "address", service))
