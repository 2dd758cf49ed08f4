"""The sweep's Pareto plot: readable on its own, without the table beside it in a terminal.

Every trial is numbered as in ``pareto.md`` and ``trials.csv`` (the same order), and the numbers
are listed beside the axes with each trial's id, objectives and status; the legend sits under
the axes, never on the data; the axes say what they measure, in words and by metric name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

from raysys.tune.pareto import UNSTABLE, TrialRecord
from raysys.tune.report import fmt_value

MAX_LISTED = 24  # rows beside the plot; the rest are in trials.csv


def axis_label(metric: str, better: str, higher: bool = True) -> str:
    """'perf/tokens_per_s' -> 'tokens per second (perf/tokens_per_s; higher is faster)'."""
    leaf = metric.rsplit("/", 1)[-1]
    words = f"{leaf[:-len('_per_s')].replace('_', ' ')} per second" if leaf.endswith("_per_s") else leaf.replace("_", " ")
    return f"{words}  ({metric}; {'higher' if higher else 'lower, axis reversed,'} is {better})"


def plot(records: Sequence[TrialRecord], front_ids: set[str], recommended: Optional[str], path: Path,
         throughput_metric: str, quality_metric: str, title: str) -> Path:
    """``records`` in display order (``report.ordered``): point k is row k of the tables."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig = plt.figure(figsize=(11.5, 5.2), dpi=110)
    ax = fig.add_axes((0.08, 0.2, 0.54, 0.72))
    listing = fig.add_axes((0.65, 0.05, 0.34, 0.87))
    listing.axis("off")

    number = {r.trial_id: i for i, r in enumerate(records, 1)}
    stable = [r for r in records if r.eligible]
    front = sorted((r for r in stable if r.trial_id in front_ids), key=lambda r: r.throughput)
    shaky = [r for r in records if r.status == UNSTABLE and r.throughput is not None and math.isfinite(r.throughput)]
    # The quality axis is scaled to the finished stable trials: one diverged trial (a loss of 1e20)
    # would otherwise set the scale and squash the front onto one pixel row.
    qs = ([r.quality for r in stable]
          or [r.quality for r in shaky if r.quality is not None and math.isfinite(r.quality)] or [0.0])
    lower = bool(records) and not records[0].higher_is_better
    margin = 0.08 * ((max(qs) - min(qs)) or abs(max(qs)) or 1.0)
    bottom, top = min(qs) - margin, max(qs) + margin
    floor = top if lower else bottom  # the worse side: where unstable trials without a quality sit

    def y(r: TrialRecord) -> float:
        q = r.quality
        return min(max(q, bottom), top) if q is not None and math.isfinite(q) else floor

    def off_scale(r: TrialRecord) -> bool:
        return r.quality is not None and math.isfinite(r.quality) and y(r) != r.quality

    def no_quality(r: TrialRecord) -> bool:
        return r.quality is None or not math.isfinite(r.quality)

    handles = [ax.scatter([r.throughput for r in stable], [r.quality for r in stable], c="#8a96a3", s=30, zorder=2,
                          label="finished trial")] if stable else []
    if front:  # the attainment staircase: between two front points the better quality is the slower one's,
        # so the step down comes at the slower point (corners at (x_i, q_i+1): no corner reads as a trial)
        handles += ax.plot([r.throughput for r in front], [r.quality for r in front], "-o", c="#1f77b4", ms=7,
                           drawstyle="steps-pre", zorder=3, label="Pareto front")
    if shaky:
        handles.append(ax.scatter([r.throughput for r in shaky], [y(r) for r in shaky], marker="x", c="#d62728", s=44, zorder=3,
                                  label="unstable (stopped)"))
    rec = next((r for r in stable if r.trial_id == recommended), None)
    if rec is not None:
        handles.append(ax.scatter([rec.throughput], [rec.quality], s=260, facecolors="none", edgecolors="#2ca02c",
                                  linewidths=2.2, zorder=4, label="recommended"))
    for r in stable + shaky:
        label = f"{number[r.trial_id]}{' (off scale)' if off_scale(r) else ' (no quality)' if no_quality(r) else ''}"
        ax.annotate(label, (r.throughput, y(r)), textcoords="offset points", xytext=(5, 5), fontsize=8,
                    fontweight="bold" if r.trial_id in front_ids else "normal", zorder=5)
    ax.margins(x=0.12, y=0.15)  # room for the labels and the ring inside the frame
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_value(v)))  # 1,200,000: not 1.2 and a "1e6" aside
    ax.set_xlabel(axis_label(throughput_metric, "faster"), fontsize=9)
    ax.set_ylabel(axis_label(quality_metric, "better", higher=not lower), fontsize=9)
    if lower:  # better stays up: the front keeps its staircase shape and the axis label its arrow
        ax.invert_yaxis()
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.08, 0.01), ncol=len(handles), fontsize=8,
               frameon=False)

    rows = [f"{'#':>2}  {'trial':<10} {'speed':>9} {'quality':>8}  status"]
    for r in records[:MAX_LISTED]:
        mark = "> " if r.trial_id == recommended else "* " if r.trial_id in front_ids else "  "
        rows.append(f"{number[r.trial_id]:>2}{mark}{r.trial_id[-10:]:<10} {fmt_value(r.throughput):>9} {fmt_value(r.quality):>8}  "
                    f"{r.status}")
    if len(records) > MAX_LISTED:
        rows.append(f"... {len(records) - MAX_LISTED} more in trials.csv")
    rows += ["", "* on the front   > recommended", f"speed: {throughput_metric}", f"quality: {quality_metric}"]
    if any(off_scale(r) for r in shaky):
        rows.append("off scale: drawn at the axis edge")
    if any(no_quality(r) for r in shaky):
        rows.append("no quality: drawn at the worse edge")
    listing.text(0.0, 1.0, "\n".join(rows), va="top", ha="left", family="monospace", fontsize=8,
                 transform=listing.transAxes)
    fig.savefig(path)
    plt.close(fig)
    return path
