"""Client-side entry points: register the plugins, read speeds and profiles.

Like distributed's own API, every public call returns its result with a synchronous client and an
awaitable with an asynchronous one used in its event loop (:func:`awaitable_on_async_clients`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from types import FrameType
from typing import Any, TypeVar

from distributed import Client, Future, as_completed, default_client

from dask_octopus import config
from dask_octopus._checks import check_flag
from dask_octopus.plugins.messages import Profile
from dask_octopus.plugins.scheduler import (
    ERROR,
    LATE,
    PRELOAD_ERROR,
    REPLY,
    OctopusSchedulerPlugin,
    not_calibrated,
    not_loaded,
    registered_plugin,
    remedy,
)
from dask_octopus.profiling.speedmodel import check_resource

F = TypeVar("F", bound=Callable[..., Any])

Caller = tuple[str, int, dict[str, Any]]  # a line of code: its file, its number, its module's globals

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# the line that called a public function for an asynchronous client, read in the thread that runs it
_CALLER: ContextVar[Caller | None] = ContextVar("dask_octopus_caller", default=None)


class NotRegisteredError(RuntimeError):
    """The scheduler has no dask_octopus plugin."""


def client_of(client: Client | None) -> Client:
    """``client``, or the default client where ``None``; ``TypeError`` for what is not a
    :class:`~distributed.Client`, ``RuntimeError`` for a client that is closed."""
    client = default_client() if client is None else client
    if not isinstance(client, Client):
        raise TypeError(f"client must be a distributed.Client, got {type(client).__name__} {client!r}")
    check_open(client)
    return client


def closed(client: Client) -> bool:
    """Whether ``client`` is closing or closed."""
    return client.status in ("closing", "closed")


def check_open(client: Client) -> None:
    """Raise ``RuntimeError`` where ``client`` is closing or closed."""
    if closed(client):
        raise RuntimeError(f"the client is {client.status}: {client!r}")


def _outside(frame: FrameType | None) -> FrameType | None:
    """The first frame from ``frame`` up its stack that runs no code of this package."""
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame = frame.f_back
    return frame


def outside_caller() -> Caller | None:
    """The line that called into this package: the first one outside it on this thread's stack (``None``
    where none is: the package's own command line, say)."""
    frame = _outside(sys._getframe(1))
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno, frame.f_globals)


def warn_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` naming the line that called into this package, however deep in it the warning is.

    Parameters
    ----------
    message
        The warning's text.
    category
        Its class.

    Notes
    -----
    The line is the first outside the package on this thread's stack or, in a thread that runs a call for
    an asynchronous client (:func:`called_from`), the line that made the call. The warning filters act
    on it as on ``warnings.warn``'s.
    """
    caller = _CALLER.get() or outside_caller()
    if caller is None:
        warnings.warn(message, category, stacklevel=2)
        return
    filename, lineno, module_globals = caller
    # as warnings.warn does for a frame: the module's registry makes the "default" action show it once per
    # line (no module_globals: its loader, asked for the line's source, refuses __main__ at a prompt, -c, stdin)
    warnings.warn_explicit(message, category, filename, lineno, module_globals.get("__name__"),
                           module_globals.setdefault("__warningregistry__", {}))


def called_from(caller: Caller | None, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``func(*args, **kwargs)``, whose warnings name ``caller`` (:func:`outside_caller`, taken where the call
    was made): for a call that ``asyncio.to_thread`` runs, in a thread where the caller's line is on no
    stack."""
    token = _CALLER.set(caller)
    try:
        return func(*args, **kwargs)
    finally:
        _CALLER.reset(token)


def awaitable_on_async_clients(func: F) -> F:
    """Make ``func`` (which takes a ``client`` argument, default: the default client) return an
    awaitable when its client is asynchronous and called from its event loop, as distributed's own
    API does: ``func`` then runs in a thread, where the client's calls block as usual (and its
    warnings name the line that called it: :func:`called_from`)."""
    signature = inspect.signature(func)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        client = bound.arguments["client"] = client_of(bound.arguments.get("client"))
        if client.asynchronous:
            return asyncio.to_thread(called_from, outside_caller(), func, *bound.args, **bound.kwargs)
        return func(*bound.args, **bound.kwargs)

    return wrapper  # type: ignore[return-value]


def _settings_error(dask_scheduler: Any) -> str | None:
    """The error of the first ``octopus`` setting of the scheduler's own process that is not what its key
    takes (its ``dask.config``: another machine's files and environment), if any."""
    try:
        config.check_all()
    except ValueError as e:
        return str(e)
    return None


async def _registered_options(dask_scheduler: Any
                              ) -> tuple[str, dict[str, Any], dict[str, str], dict[str, str], list[str], float] | None:
    """The name and options of the plugin registered on ``dask_scheduler`` (``None``: none is), its worker
    plugin set up again where that was unregistered alone, the live workers where that did not load, and,
    once the others calibrated, those whose calibration failed (with the error) and those that did not
    report within ``octopus.calibration.wait`` seconds (and those seconds)."""
    plugin = registered_plugin(dask_scheduler)
    if plugin is None:
        return None
    if plugin.worker_plugin.name not in dask_scheduler.worker_plugins:
        await plugin.set_up_workers()
    await plugin.calibrations()
    name = next(n for n, p in list(dask_scheduler.plugins.items()) if p is plugin)
    late = sorted(plugin.unreported & dask_scheduler.workers.keys() - plugin.profiles.keys())
    return (name, plugin.options(), not_loaded(plugin.profiles), not_calibrated(plugin.profiles), late,
            plugin.calibration_wait)


@awaitable_on_async_clients
def register(client: Client | None = None, *, calibrate: bool = True, **options: Any) -> None:
    """Install the octopus scheduler plugin (and through it the worker plugin) in one call.

    Idempotent: a second call, or a call on a scheduler started with ``--preload dask_octopus``,
    changes nothing (but where only the worker plugin was unregistered, it is set up again). Workers
    that join later are calibrated when they arrive, and plans (``balance``, ``map``, ``imap``) wait
    for their reports (``octopus.calibration.wait``). To register with other options, first
    ``client.unregister_scheduler_plugin("octopus")``: the workers then calibrate anew.

    Parameters
    ----------
    client
        The client of the cluster (default: the default client).
    calibrate
        Run the calibration probes on every worker and return once they are done. ``False``: the
        weights start equal and come from task timings alone.
    **options
        ``calibration_seconds`` (probe budget per worker, default ``octopus.calibration.seconds``)
        and ``device`` (``"auto"``, ``"cpu"``, ``"gpu"``, default ``octopus.calibration.device``).

    Raises
    ------
    TypeError
        For an unknown option, a ``calibrate`` that is not True or False, or a ``client`` that is not a
        Client.
    RuntimeError
        When ``client`` is closed.
    NotRegisteredError
        When dask_octopus is not installed where the scheduler runs (a ``RuntimeError``).
    ValueError
        For a ``calibration_seconds`` or ``device`` that the setting of the same name does not take,
        or a setting under ``octopus`` in ``dask.config`` that is not what its key takes (naming the key),
        here or in the scheduler's process (before anything is registered).

    Examples
    --------
    >>> from dask_cuda import LocalCUDACluster  # doctest: +SKIP
    >>> client = Client(LocalCUDACluster())  # doctest: +SKIP
    >>> dask_octopus.register(client)  # doctest: +SKIP
    """
    unknown = set(options) - {"calibration_seconds", "device"}
    if unknown:
        raise TypeError(f"unknown register options: {sorted(unknown)}")
    check_flag(calibrate, "calibrate")
    plugin = OctopusSchedulerPlugin(calibrate=calibrate, **options)  # (checks this process's settings)
    error = _run_on_scheduler(client, _settings_error)
    if error is not None:  # the plugin would only log it there, and leave fragments unmade
        raise ValueError(f"on the scheduler at {client.scheduler.address}: {error}")
    client.register_plugin(plugin)  # (where one is registered already, it stays: the plugin is idempotent)
    current = client.run_on_scheduler(_registered_options)  # the one that stands: a concurrent call's, maybe
    if current is None:
        return
    name, options, failed, uncalibrated, late, wait = current
    if options != plugin.options():
        warn_caller(
            f"dask_octopus is already registered on this scheduler with {options}; register() with "
            f"{plugin.options()} changes nothing. To change them, first call "
            f"client.unregister_scheduler_plugin({name!r})")
    if failed:
        first = failed[min(failed)]
        warn_caller(
            f"dask_octopus's worker plugin did not load on {', '.join(sorted(failed))} ({first}): "
            f"{remedy(first)} (they get the mean weight, no map items, balanced blocks or fragments)")
    if uncalibrated:
        first = uncalibrated[min(uncalibrated)]
        warn_caller(
            f"dask_octopus: calibration failed on {', '.join(sorted(uncalibrated))} ({first}): they get the mean "
            "weight until their task timings set it (dask_octopus.profiles() shows each error)")
    if late:
        _warn_late(late, wait)


def _warn_late(late: list[str], wait: float) -> None:
    """Warn that the workers ``late`` did not report their calibration within ``wait`` seconds."""
    warn_caller(f"dask_octopus: no calibration report from {', '.join(late)} within "
                f"octopus.calibration.wait={wait}s: they get the mean weight until they report")


def wait_for(client: Client, futures: list[Future], timeout: float | None = None) -> bool:
    """Wait until ``futures`` finish or fail, or ``timeout`` seconds pass.

    Parameters
    ----------
    client
        Their client, which need not be the default client.
    futures
        The futures to wait for; those done already cost nothing.
    timeout
        Seconds to wait at most (``None``: no limit).

    Returns
    -------
    bool
        Whether they all finished or failed (``False``: the time ran out first).
    """
    pending = [f for f in futures if not f.done()]  # (as_completed costs 90 us a future, done or not)
    try:
        for _ in as_completed(pending, loop=client.loop, timeout=timeout) if pending else ():
            pass
    except TimeoutError:
        return False
    return True


def release(futures: Iterable[Future]) -> None:
    """Let go of ``futures`` now rather than when their last reference goes: an error's traceback keeps
    the frames that raised it, and the futures they hold (Dask's among them, as ``Client.gather``'s), for
    as long as the caller keeps the error (IPython and Jupyter keep the last one)."""
    for future in futures:
        future.release()


@contextlib.contextmanager
def released_on_error(items: list[Any]) -> Iterator[None]:
    """Where the block raises, :func:`release` the futures it put in ``items``, in place of what was there
    (collections computed, local data scattered, ...) or after it (futures made): none reached the caller."""
    given = list(items)
    try:
        yield
    except BaseException:
        release(now for i, now in enumerate(items)
                if isinstance(now, Future) and (i >= len(given) or now is not given[i]))
        raise


def _missing_plugin(dask_scheduler: Any) -> str | None:
    """``None`` where the plugin is registered, else why not: the error of a ``--preload dask_octopus``
    that failed there, or ``""``."""
    return None if registered_plugin(dask_scheduler) is not None else getattr(dask_scheduler, PRELOAD_ERROR, "")


def _run_on_scheduler(client: Client, func: Callable[..., Any]) -> Any:
    """``client.run_on_scheduler(func)``, a function of this package: ``NotRegisteredError`` saying to
    install it where the scheduler's environment lacks it (unpickling ``func`` there imports it)."""
    try:
        return client.run_on_scheduler(func)
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("dask_octopus"):
            raise
        raise NotRegisteredError(
            "dask_octopus is not installed where the scheduler runs: install it in the scheduler's and "
            "the workers' environments, then start the scheduler with --preload dask_octopus"
        ) from e


def _not_registered(client: Client) -> NotRegisteredError:
    """Why the plugin's handler did not answer on ``client``'s scheduler, asked there."""
    missing = _run_on_scheduler(client, _missing_plugin)
    if missing:
        return NotRegisteredError(f"dask_octopus is not registered on this scheduler: its --preload dask_octopus "
                                  f"failed there: {missing}")
    if missing is not None:
        return NotRegisteredError("dask_octopus is not registered on this scheduler: call "
                                  "dask_octopus.register(client) or start the scheduler with --preload dask_octopus")
    return NotRegisteredError("dask_octopus's plugin did not answer on this scheduler: it was starting, or was "
                              "unregistered meanwhile; call again")


def call_scheduler(client: Client | None, handler: str, **kwargs: Any) -> Any:
    """Call one of the plugin's RPC handlers, with a clear error if the plugin is absent; the ``octopus``
    settings of this process checked first (:func:`~dask_octopus.config.check_all`: a misspelt key is read
    by nothing, where the scheduler was started with ``--preload dask_octopus`` and no ``register`` ran).

    The handler is called directly: every handler of the plugin replies something other than ``None``,
    which distributed replies for a handler the scheduler lacks (logging a warning there); only then is the
    scheduler asked why (``run_on_scheduler``, which logs a line there at each call)."""
    config.check_all()
    client = client_of(client)
    reply = client.sync(getattr(client.scheduler, handler), **kwargs)
    if reply is None:
        raise _not_registered(client)
    if isinstance(reply, dict) and LATE in reply:  # (the scheduler logged it too: this is the caller's word)
        _warn_late(*reply[LATE])
        reply = reply[REPLY]
    if isinstance(reply, dict) and ERROR in reply:
        raise ValueError(reply[ERROR])
    return reply


@awaitable_on_async_clients
def speeds(client: Client | None = None, resource: str = "compute") -> dict[str, float]:
    """Current relative weights of the live workers for ``resource``, once the workers that joined
    have reported their calibrations (each waited for up to ``octopus.calibration.wait`` after it joined).

    Parameters
    ----------
    client
        The client of the cluster (default: the default client).
    resource
        ``"compute"`` (from the GEMM FLOP/s) or ``"memory"`` (from the streaming bytes/s): the
        calibration the weights start from; the same task timings refine both.

    Returns
    -------
    dict
        Worker address -> weight; the weights sum to 1.

    Raises
    ------
    NotRegisteredError
        When the scheduler has no dask_octopus plugin.
    ValueError
        For an unknown ``resource``, or a cluster with no workers.

    Examples
    --------
    >>> dask_octopus.speeds(client)  # doctest: +SKIP
    {'tcp://10.0.0.1:40001': 0.7, 'tcp://10.0.0.2:40002': 0.3}
    """
    check_resource(resource)
    return call_scheduler(client, "octopus_speeds", resource=resource)


@awaitable_on_async_clients
def profiles(client: Client | None = None, resource: str = "compute") -> dict[str, Profile]:
    """Each worker's device, calibration figures, memory, current weight and task samples, once the
    workers that joined have reported their calibrations (as :func:`speeds` waits for them).

    Parameters
    ----------
    client
        The client of the cluster (default: the default client).
    resource
        The resource whose weight each profile carries: ``"compute"`` or ``"memory"``.

    Returns
    -------
    dict
        Worker address -> :class:`~dask_octopus.plugins.messages.Profile`.

    Raises
    ------
    NotRegisteredError
        When the scheduler has no dask_octopus plugin.
    ValueError
        For an unknown ``resource``, or a cluster with no workers.

    Examples
    --------
    >>> dask_octopus.profiles(client)["tcp://10.0.0.1:40001"]["compute"]  # doctest: +SKIP
    5.1e+13
    """
    check_resource(resource)
    return call_scheduler(client, "octopus_profiles", resource=resource)
