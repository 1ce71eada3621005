"""The ``/octopus`` page: a Bokeh standalone document with its JavaScript inline.

The page is drawn from the data of one snapshot (:func:`~dask_octopus.dashboard.columns.page_data`)
and then polls the JSON route every few seconds, as distributed's own pages refresh themselves; a
saved copy shows the data it was saved with, offline. Needs ``bokeh``.
"""

from __future__ import annotations

from typing import Any

from bokeh.embed import file_html
from bokeh.layouts import column, row
from bokeh.models import (
    AjaxDataSource,
    ColumnDataSource,
    CustomJS,
    DataTable,
    DatetimeTickFormatter,
    Div,
    FactorRange,
    HoverTool,
    NumberFormatter,
    Range1d,
    TableColumn,
)
from bokeh.plotting import figure
from bokeh.resources import INLINE
from bokeh.transform import dodge

WIDTH = 1360  #: pixels: the page fits a 1400-pixel window

# The one request per refresh feeds every source: the workers' source returns its own columns and
# hands the others theirs (the plan plots' workers first, so that no bar lacks its category).
_ADAPTER = """
const d = cb_data.response;
summary.text = d.summary;
latest_title.text = "<b>" + d.latest_title + "</b>";
workers_range.factors = d.latest.label;
latest.data = d.latest;
compute.data = d.compute;
memory.data = d.memory;
plans.data = d.plans;
return d.workers;
"""


def _workers_table(source: ColumnDataSource, rows: int) -> DataTable:
    weight = NumberFormatter(format="0.000")
    count = NumberFormatter(format="0,0")
    columns = [
        TableColumn(field="label", title="worker", width=180),
        TableColumn(field="device", title="device", width=90),
        TableColumn(field="gemm", title="GEMM", width=100),
        TableColumn(field="stream", title="stream", width=90),
        TableColumn(field="weight_compute", title="weight compute", formatter=weight, width=100),
        TableColumn(field="weight_memory", title="weight memory", formatter=weight, width=100),
        TableColumn(field="samples", title="task timings", formatter=count, width=85),
        TableColumn(field="pinned", title="pinned tasks", formatter=count, width=85),
        TableColumn(field="plans", title="plans pinned", formatter=count, width=85),
        TableColumn(field="groups", title="groups run", formatter=count, width=80),
        TableColumn(field="members", title="tasks in groups", formatter=count, width=100),
        TableColumn(field="graphs", title="CUDA graphs", formatter=count, width=85),
        TableColumn(field="replays", title="graph replays", formatter=count, width=90),
        TableColumn(field="note", title="note", width=90),
    ]
    return DataTable(source=source, columns=columns, width=WIDTH, height=30 + 28 * max(rows, 2), index_position=None)


def _legend_below(fig: Any) -> None:
    legend = fig.legend[0]
    legend.orientation = "horizontal"
    legend.location = "center"
    fig.add_layout(legend, "below")


def _weight_plot(source: ColumnDataSource, resource: str, what: str) -> Any:
    fig = figure(title=f"{resource.title()} weight over time ({what})", x_axis_type="datetime",
                 width=WIDTH // 2 - 10, height=340, y_range=Range1d(0, 1), tools="pan,wheel_zoom,box_zoom,reset,save",
                 toolbar_location="right")
    fig.multi_line(xs="xs", ys="ys", line_color="color", line_width=3, legend_field="label", source=source)
    fig.xaxis.axis_label = "time (scheduler's clock)"
    fig.xaxis.formatter = DatetimeTickFormatter(seconds="%H:%M:%S", minsec="%H:%M:%S", minutes="%H:%M",
                                                hourmin="%H:%M", hours="%H:%M")
    fig.yaxis.axis_label = "weight (share of the work; sums to 1)"
    fig.add_tools(HoverTool(tooltips=[("worker", "@label"), ("weight", "$y{0.000}")], line_policy="nearest"))
    _legend_below(fig)
    return fig


def _pair(fig: Any, source: ColumnDataSource, left: str, right: str, left_label: str, right_label: str) -> None:
    """Two bars per worker: ``left`` solid, ``right`` dashed and light."""
    fig.vbar(x=dodge("label", -0.18, range=fig.x_range), top=left, width=0.34, color="color", source=source,
             legend_label=left_label)
    fig.vbar(x=dodge("label", 0.18, range=fig.x_range), top=right, width=0.34, fill_color="color", fill_alpha=0.25,
             line_color="color", line_dash="dashed", line_width=2, source=source, legend_label=right_label)
    fig.xaxis.axis_label = "worker"
    fig.y_range.start = 0
    _legend_below(fig)


def _plan_plots(source: ColumnDataSource, workers: FactorRange) -> Any:
    shares = figure(title="Work per worker: the plan's share against the worker's weight", x_range=workers,
                    width=WIDTH // 2 - 10, height=340, tools="save", toolbar_location="right")
    _pair(shares, source, "share", "weight", "share of the work (rows or item costs)", "weight when planned")
    shares.yaxis.axis_label = "fraction (each sums to 1)"
    shares.add_tools(HoverTool(tooltips=[("worker", "@label"), ("blocks", "@blocks"), ("share", "@share{0.000}"),
                                         ("weight", "@weight{0.000}")]))
    finish = figure(title="Finish per worker: observed against predicted", x_range=workers, width=WIDTH // 2 - 10,
                    height=340, tools="save", toolbar_location="right")
    _pair(finish, source, "observed", "predicted", "observed: last task's end", "predicted: share / weight (scaled)")
    finish.yaxis.axis_label = "seconds from the run's first start"
    finish.add_tools(HoverTool(tooltips=[("worker", "@label"), ("observed", "@observed{0.000} s"),
                                         ("predicted", "@predicted{0.000} s")]))
    return row(shares, finish)


def _plans_table(source: ColumnDataSource) -> DataTable:
    columns = [
        TableColumn(field="plan", title="plan (collection)", width=250),
        TableColumn(field="made", title="made at", width=65),
        TableColumn(field="blocks", title="blocks", width=50),
        TableColumn(field="per_worker", title="blocks per worker", width=130),
        TableColumn(field="predicted", title="predicted finish (1 = mean)", width=190),
        TableColumn(field="observed", title="observed finish", width=210),
        TableColumn(field="predicted_spread", title="spread predicted", width=110),
        TableColumn(field="observed_spread", title="spread observed", width=110),
        TableColumn(field="run", title="run shown", width=165),
    ]
    return DataTable(source=source, columns=columns, width=WIDTH, height=30 + 28 * 10, index_position=None)


def _note(text: str) -> Div:
    return Div(text=text, width=WIDTH, styles={"font-size": "14px", "margin-top": "10px"})


def render(data: dict[str, Any], data_url: str, refresh: float) -> str:
    """The page's HTML for ``data``, refreshed from ``data_url`` every ``refresh`` seconds.

    Parameters
    ----------
    data
        What :func:`~dask_octopus.dashboard.columns.page_data` returns.
    data_url
        The JSON route that serves the same data (relative to the page).
    refresh
        Seconds between two polls.

    Returns
    -------
    str
        A whole HTML document, Bokeh's JavaScript and CSS inline.
    """
    summary = Div(text=data["summary"], width=WIDTH, styles={"font-size": "14px"})
    latest_title = _note(f"<b>{data['latest_title']}</b>")
    sources = {name: ColumnDataSource(data[name]) for name in ("compute", "memory", "latest", "plans")}
    workers_range = FactorRange(factors=list(data["latest"]["label"]))
    adapter = CustomJS(args=dict(summary=summary, latest_title=latest_title, workers_range=workers_range, **sources),
                       code=_ADAPTER)
    workers = AjaxDataSource(data_url=data_url, polling_interval=int(refresh * 1000), mode="replace",
                             data=data["workers"], adapter=adapter)
    layout = column(
        Div(text="<h2 style='margin:4px 0'>dask-octopus: speed-weighted placement</h2>", width=WIDTH), summary,
        _note("<b>Workers</b>: device, calibration (GEMM FLOP/s, streaming bytes/s), current weights and the task "
              "timings behind them, work pinned now, stream groups (tasks run as one) and CUDA graph replays"),
        _workers_table(workers, len(data["workers"]["address"])),
        row(_weight_plot(sources["compute"], "compute", "GEMM speed, refined by task timings"),
            _weight_plot(sources["memory"], "memory", "streaming speed, refined by task timings")),
        latest_title,
        _plan_plots(sources["latest"], workers_range),
        _note("<b>Recent plans</b>, newest first: blocks per worker, predicted finish relative to the mean, and "
              "the observed finish of each worker's pinned tasks in the plan's latest complete run (the seconds "
              "from its first task's start to the worker's last task's end)"),
        _plans_table(sources["plans"]),
    )
    return file_html(layout, INLINE, title="dask-octopus")
