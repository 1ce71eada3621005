"""The dashboard's routes on the scheduler's HTTP server, and the metrics' registration.

Like distributed's own pages: ``/octopus`` (the page; without ``bokeh`` a short page saying what to
install) and ``/octopus/data.json`` (what the page polls) are added to ``Scheduler.http_application``
under the dashboard's prefix, and the page is linked from the dashboard's "More..." menu when
distributed's Bokeh dashboard runs. The ``dask_octopus_*`` series join distributed's ``/metrics``
through ``prometheus_client``'s default registry. A missing optional library turns its part off with
one log line per process. The handlers find the plugin on each request, so a plugin registered
again is served by the same routes.
"""

from __future__ import annotations

import json
import logging
import weakref
from typing import TYPE_CHECKING

from tornado import web

from dask_octopus.dashboard import columns, snapshot

if TYPE_CHECKING:
    from distributed.scheduler import Scheduler

    from dask_octopus.plugins.scheduler import OctopusSchedulerPlugin

logger = logging.getLogger(__name__)

PAGE = "octopus"  #: the page's route, under the dashboard's prefix
DATA = "octopus/data.json"  #: the page's data
REFRESH = 2.0  #: seconds between two refreshes of the page
INSTALL = "pip install 'dask-octopus[dashboard]'"

_said: set[str] = set()  # what was logged once in this process
_served: weakref.WeakSet = weakref.WeakSet()  # HTTP applications that have the routes
_exported: list[OctopusSchedulerPlugin] = []  # the plugins whose series /metrics carries


def _once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        logger.info(message)


class _OctopusHandler(web.RequestHandler):
    """A handler that reads the scheduler's octopus plugin, or answers 404 when it has none."""

    def initialize(self, dask_server: Scheduler, dask_dashboard: bool) -> None:
        self.server = dask_server
        self.dask_dashboard = dask_dashboard  # (whether Dask's own dashboard runs there: the page links to it)

    def plugin(self) -> OctopusSchedulerPlugin | None:
        from dask_octopus.plugins.scheduler import registered_plugin

        plugin = registered_plugin(self.server)
        if plugin is None:
            self.set_status(404)
            self.write("dask_octopus is not registered on this scheduler")
        return plugin


class DataHandler(_OctopusHandler):
    """``GET /octopus/data.json``: the page's columns now."""

    def get(self) -> None:
        plugin = self.plugin()
        if plugin is not None:
            self.set_header("Content-Type", "application/json")
            self.set_header("Cache-Control", "no-store")
            data = columns.page_data(snapshot.take(plugin), REFRESH, self.dask_dashboard)
            self.write(json.dumps(data, allow_nan=False))


class PageHandler(_OctopusHandler):
    """``GET /octopus``: the page."""

    def get(self) -> None:
        from dask_octopus.dashboard import page

        plugin = self.plugin()
        if plugin is not None:
            data = columns.page_data(snapshot.take(plugin), REFRESH, self.dask_dashboard)
            self.write(page.render(data, DATA, REFRESH))


class MissingBokehHandler(web.RequestHandler):
    """``GET /octopus`` without Bokeh: what to install."""

    def get(self) -> None:
        self.write(f"<p>The dask_octopus page needs bokeh: <code>{INSTALL}</code>. Its data is at "
                   f"<a href='{DATA}'>{DATA}</a>.</p>")


def _prefix(application: web.Application) -> str:
    """The dashboard's prefix (``--dashboard-prefix``), read from distributed's own ``health`` route."""
    for rule in application.wildcard_router.rules:
        pattern = getattr(getattr(rule.matcher, "regex", None), "pattern", "")
        if pattern.endswith("health$"):
            return pattern[: -len("health$")]
    return "/"


def _has_bokeh() -> bool:
    try:
        import bokeh  # noqa: F401
    except ImportError:
        return False
    return True


def _add_routes(scheduler: Scheduler) -> None:
    application = getattr(scheduler, "http_application", None)
    if application is None:
        _once("http", "dask_octopus: the scheduler has no HTTP server: the /octopus page is off")
        return
    if application in _served:
        return
    _served.add(application)
    prefix = _prefix(application)
    served = {"dask_server": scheduler, "dask_dashboard": False}
    if _has_bokeh():
        from dask_octopus._compat import dashboard_menu

        menu = dashboard_menu(scheduler)  # (None: Dask's dashboard does not run here, as with --no-dashboard)
        served["dask_dashboard"] = menu is not None
        if menu is not None and not any(item.get("url") == PAGE for item in menu):
            menu.append({"url": PAGE, "name": "Octopus"})
            menu.sort(key=lambda item: item["name"])
        page: tuple = (prefix + PAGE, PageHandler, served)
    else:
        _once("bokeh", f"dask_octopus: bokeh is not installed, so /octopus only says what to install: {INSTALL}")
        page = (prefix + PAGE, MissingBokehHandler)
    application.add_handlers(".*$", [page, (prefix + DATA, DataHandler, served)])


def install(plugin: OctopusSchedulerPlugin) -> None:
    """Serve ``plugin`` on its scheduler's dashboard and in ``/metrics`` (what the installed libraries allow).

    Parameters
    ----------
    plugin
        The scheduler plugin, started (its ``scheduler`` set).
    """
    _add_routes(plugin.scheduler)
    try:
        from dask_octopus.dashboard import metrics
    except ImportError:
        _once("prometheus", f"dask_octopus: prometheus_client is not installed, so /metrics has no dask_octopus "
                            f"series: {INSTALL}")
        return
    metrics.register(_exported)
    if plugin not in _exported:
        _exported.append(plugin)


def withdraw(plugin: OctopusSchedulerPlugin) -> None:
    """Stop exporting ``plugin``'s metrics (it closes); the routes stay and answer 404 without a plugin.

    Parameters
    ----------
    plugin
        The scheduler plugin that closes.
    """
    if plugin in _exported:
        _exported.remove(plugin)
