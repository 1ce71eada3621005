"""The harness's PNGs: per-worker timelines (busy intervals of one pass) and bar charts."""

from __future__ import annotations

from collections.abc import Mapping

from dask_octopus.bench.workloads import PassRecord


def plot_timelines(panels: Mapping[str, PassRecord], path: str, title: str = "") -> str:
    """One panel per variant, one row per worker, a bar per task; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = sorted({w for rec in panels.values() for w in rec.intervals})
    end = max(rec.seconds for rec in panels.values())
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.2 + 0.6 * len(workers) * len(panels)),
                             sharex=True, squeeze=False)
    for ax, (label, rec) in zip(axes[:, 0], panels.items()):
        for row, w in enumerate(workers):
            spans = [(a, b - a) for a, b in rec.intervals.get(w, [])]
            ax.broken_barh(spans, (row - 0.4, 0.8), color=f"C{row}")
        ax.axvline(rec.seconds, color="k", ls="--", lw=1)
        ax.set_yticks(range(len(workers)), [w.rsplit(":", 1)[-1] for w in workers])
        ax.set_ylabel("worker port")
        ax.set_title(f"{label}: {rec.seconds:.3f} s, finish spread {rec.spread():.0%}", fontsize=10)
        ax.set_xlim(0, end * 1.05)
    axes[-1, 0].set_xlabel("seconds from pass start")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def bar_chart(seconds: Mapping[str, float], ideal: float | None, path: str, ylabel: str, log: bool = False,
              title: str = "") -> str:
    """Bars of each variant's median seconds, labelled, the ideal (if any) as a dashed line; returns
    ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(seconds), 3.2))
    bars = ax.bar(list(seconds), list(seconds.values()), color=[f"C{i}" for i in range(len(seconds))])
    ax.bar_label(bars, labels=[f"{s:.3g} s" for s in seconds.values()], fontsize=8)
    if ideal:
        ax.axhline(ideal, color="k", ls="--", label=f"ideal {ideal:.3f} s")
        ax.legend()
    top = max(seconds.values(), default=1.0)
    if log:
        ax.set_yscale("log")
        ax.set_ylim(top=top * 4)  # room for the labels
    else:
        ax.set_ylim(top=top * 1.2)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.tick_params(axis="x", rotation=30)
    plt.setp(ax.get_xticklabels(), ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
