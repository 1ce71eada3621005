"""A :class:`~dask_octopus.dashboard.snapshot.Snapshot` as the columns the ``/octopus`` page draws.

Pure: no Bokeh here, so the page's JSON route works without it. :func:`page_data` returns plain
JSON-able data (no NaN): one column mapping per table or plot of the page, and its texts.
"""

from __future__ import annotations

import html
import time
from typing import Any

from dask_octopus.dashboard.records import Weights
from dask_octopus.dashboard.snapshot import PlanRow, Snapshot, WorkerRow

#: Bokeh's Category10 palette: one colour per worker, by sorted address
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")


def si(value: float | None, unit: str) -> str:
    """``value`` with an SI prefix (``"51.2 TFLOP/s"``), ``"-"`` when unknown."""
    if value is None:
        return "-"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def percent(value: float | None) -> str:
    """``0.031`` as ``"3.1%"``; ``"-"`` when unknown."""
    return "-" if value is None else f"{100 * value:.1f}%"


def clock(when: float) -> str:
    """Seconds since the epoch as the scheduler's local time of day."""
    return time.strftime("%H:%M:%S", time.localtime(when))


def worker_name(address: str, name: str) -> str:
    """The worker's name, or ``host:port`` for a worker named after its address."""
    where = address.split("://")[-1]
    return where if name in (address, where) else str(name)


def worker_label(address: str, name: str) -> str:
    """``"name (host:port)"``, or ``host:port`` for a worker named after its address."""
    where, short = address.split("://")[-1], worker_name(address, name)
    return where if short == where else f"{short} ({where})"


def _workers(rows: list[WorkerRow], colors: dict[str, str]) -> dict[str, list[Any]]:
    return {
        "address": [r.address for r in rows],
        "label": [worker_label(r.address, r.name) for r in rows],
        "device": [r.model if r.device == "gpu" and r.model else r.device for r in rows],
        "gemm": [si(r.compute, "FLOP/s") for r in rows],
        "stream": [si(r.memory, "B/s") for r in rows],
        "weight_compute": [r.weight_compute for r in rows],
        "weight_memory": [r.weight_memory for r in rows],
        "samples": [r.samples for r in rows],
        "pinned": [r.pinned for r in rows],
        "plans": [r.plans for r in rows],
        "groups": [r.groups for r in rows],
        "members": [r.members for r in rows],
        "graphs": [r.graphs for r in rows],
        "replays": [r.replays for r in rows],
        "note": [r.error or "" for r in rows],
        "color": [colors[r.address] for r in rows],
    }


def _history(points: list[tuple[float, dict[str, Weights]]], now: float, live: dict[str, str], which: int,
             colors: dict[str, str]) -> dict[str, list[Any]]:
    """One step line per worker (times in ms since the epoch), each live worker's ending at ``now``."""
    xs: dict[str, list[float]] = {}
    ys: dict[str, list[float]] = {}
    for when, weights in points:
        for w, values in weights.items():
            x, y = xs.setdefault(w, []), ys.setdefault(w, [])
            if y:  # hold the previous value until this point: a step, not a slope
                x.append(when * 1e3)
                y.append(y[-1])
            x.append(when * 1e3)
            y.append(values[which])
    for w in xs:
        if w in live and xs[w][-1] < now * 1e3:
            xs[w].append(now * 1e3)
            ys[w].append(ys[w][-1])
    order = sorted(xs)
    return {"xs": [xs[w] for w in order], "ys": [ys[w] for w in order],
            "label": [live.get(w, w.split("://")[-1] + " (gone)") for w in order],
            "color": [colors[w] for w in order]}


def _scale(plan: PlanRow) -> float | None:
    """Seconds per unit of relative predicted finish that fit the observed finishes best (least squares)."""
    both = [w for w in plan.predicted if w in plan.observed]
    den = sum(plan.predicted[w] ** 2 for w in both)
    return sum(plan.predicted[w] * plan.observed[w] for w in both) / den if den > 0 else None


def _latest(plans: list[PlanRow], labels: dict[str, str], colors: dict[str, str]) -> tuple[dict[str, list], str]:
    """The newest plan with a complete run (else the newest that ran, else the newest): per worker its share
    of the work, its weight when planned, its observed finish and its predicted one in seconds (scaled to
    the observed by least squares), and the plots' title."""
    plan = next((p for p in plans if p.complete), None) or next((p for p in plans if p.observed), None)
    plan = plan or (plans[0] if plans else None)
    if plan is None:
        return {"label": [], "share": [], "weight": [], "observed": [], "predicted": [], "blocks": [],
                "color": []}, "Latest plan: none yet"
    scale = _scale(plan)
    order = sorted(plan.blocks)
    data = {
        "label": [labels.get(w, w.split("://")[-1] + " (gone)") for w in order],
        "share": [plan.shares.get(w, 0.0) for w in order],
        "weight": [plan.weights.get(w, 0.0) for w in order],
        "observed": [plan.observed.get(w, 0.0) for w in order],
        "predicted": [plan.predicted.get(w, 0.0) * scale if scale is not None else 0.0 for w in order],
        "blocks": [plan.blocks[w] for w in order],
        "color": [colors.get(w, PALETTE[7]) for w in order],
    }
    made = f"{html.escape(str(plan.name))}, made at {clock(plan.made)}"  # the page shows it as HTML
    if not plan.observed:
        return data, f"Latest plan ({made}): not run yet"
    what = "latest complete run" if plan.complete else \
        f"run {'ended' if plan.ended else 'in progress'}, {_progress(plan)}"
    return data, (f"Latest plan ({made}), {what}: finish spread {percent(plan.observed_spread)} observed, "
                  f"{percent(plan.predicted_spread)} predicted")


def _tasks(n: int) -> str:
    return f"{n} task" if n == 1 else f"{n} tasks"


def _progress(plan: PlanRow) -> str:
    """``n of N tasks`` of a run not complete, with those failed or cancelled once it ended."""
    done = f"{sum(plan.tasks.values())} of {_tasks(plan.expected)}"
    return f"{done} finished, {plan.lost} failed or cancelled" if plan.ended else done


def _run(plan: PlanRow) -> str:
    done = sum(plan.tasks.values())
    if plan.complete:
        return f"done, {_tasks(done)}"
    if not (plan.expected or done):
        return "not run"
    return f"{'ended' if plan.ended else 'running'}, {_progress(plan)}"


def _per_worker(values: dict[str, Any], labels: dict[str, str], fmt: str) -> str:
    return " · ".join(f"{labels.get(w, w)}: {fmt.format(values[w])}" for w in sorted(values)) or "-"


def _plans(plans: list[PlanRow], short: dict[str, str]) -> dict[str, list[Any]]:
    return {
        "plan": [p.name for p in plans],
        "made": [clock(p.made) for p in plans],
        "blocks": [sum(p.blocks.values()) for p in plans],
        "per_worker": [_per_worker(p.blocks, short, "{}") for p in plans],
        "predicted": [_per_worker(p.predicted, short, "{:.2f}") for p in plans],
        "observed": [_per_worker(p.observed, short, "{:.3f} s") for p in plans],
        "predicted_spread": [percent(p.predicted_spread) for p in plans],
        "observed_spread": [percent(p.observed_spread) for p in plans],
        "run": [_run(p) for p in plans],
    }


def _summary(snap: Snapshot, refresh: float, dask_dashboard: bool = True) -> str:
    changed = clock(snap.history[-1][0]) if snap.history else "-"
    link = ' <a href="status">Dask dashboard</a>' if dask_dashboard else ""
    return (f"Scheduler <code>{html.escape(snap.scheduler)}</code> at {clock(snap.time)}: "
            f"{len(snap.workers)} workers, {snap.plans_kept} plans placing new graphs, {snap.plans_active} with "
            f"tasks pinned now; weights last changed at {changed}. Refreshed every {refresh:g} s.{link}")


def page_data(snap: Snapshot, refresh: float, dask_dashboard: bool = True) -> dict[str, Any]:
    """The page's columns and texts for one snapshot.

    Parameters
    ----------
    snap
        What the scheduler plugin holds now.
    refresh
        Seconds between two refreshes of the page (said in its summary line).
    dask_dashboard
        Whether Dask's own dashboard runs beside the page (the summary line links to it).

    Returns
    -------
    dict
        ``summary`` and ``latest_title`` (texts), and the columns of ``workers`` (the table),
        ``compute`` and ``memory`` (weight history, one line per worker), ``latest`` (the latest
        plan's work share, weight and finish per worker) and ``plans`` (the table of recent plans).
    """
    seen = sorted({r.address for r in snap.workers} | {w for _, ws in snap.history for w in ws}
                  | {w for p in snap.plans for w in p.blocks})
    colors = {w: PALETTE[i % len(PALETTE)] for i, w in enumerate(seen)}
    labels = {r.address: worker_label(r.address, r.name) for r in snap.workers}
    latest, title = _latest(snap.plans, labels, colors)
    return {
        "summary": _summary(snap, refresh, dask_dashboard),
        "workers": _workers(snap.workers, colors),
        "compute": _history(snap.history, snap.time, labels, 0, colors),
        "memory": _history(snap.history, snap.time, labels, 1, colors),
        "latest": latest,
        "latest_title": title,
        "plans": _plans(snap.plans, {r.address: worker_name(r.address, r.name) for r in snap.workers}),
    }
