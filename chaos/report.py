"""The report of a chaos run, written into `--report DIR`: report.json, report.md and timeline.png.

report.json:
    passed               every checked invariant held and the run did not error
    invariants           {name: bool} for the invariants that could be checked
    not_checked          {name: why} for those that could not (never counted as passed)
    invariant_details    {name: one line of evidence}
    faults               [{kind, node, at_step, detect_s, resume_s, steps_lost, skipped, ...}]
    goodput, reference_goodput   share of wall-clock time in kept steps, of the fault run and the reference
    reference_digest, final_digest, reference_world_size, final_world_size
    error                why the run could not be judged, or null
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class FaultRecord:
    index: int
    kind: str
    node: str | None
    target: str
    planned_step: int
    at_step: int | None
    """The step the job had reached when the fault fired (None: it never fired)."""
    detect_s: float | None = None
    resume_s: float | None = None
    steps_lost: int = 0
    restarts: int = 0
    skipped: str | None = None
    injected_t: float | None = None
    """Seconds since the start of the chaos job."""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plot:
    """What timeline.png shows (seconds since the chaos job started)."""

    steps: list[tuple[float, int, int]] = field(default_factory=list)
    """(t, step, attempt number)."""
    worlds: list[tuple[float, int]] = field(default_factory=list)
    faults: list[tuple[float, str]] = field(default_factory=list)
    recoveries: list[float] = field(default_factory=list)
    end_t: float = 0.0


@dataclass
class Report:
    passed: bool
    invariants: dict[str, bool]
    not_checked: dict[str, str]
    invariant_details: dict[str, str]
    faults: list[FaultRecord]
    reference_digest: str | None
    final_digest: str | None
    reference_world_size: int | None
    final_world_size: int | None
    scenario: str | None
    seed: int
    config: dict[str, Any]
    duration_s: float
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    plot: Plot = field(default_factory=Plot, repr=False)
    goodput: float | None = None
    """The fault run's goodput (its agents' `job_summary`): share of wall-clock time in steps kept."""
    reference_goodput: float | None = None
    """The same of the fault-free reference run."""

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc.pop("plot")
        return doc


def write(report: Report, directory: Path) -> list[Path]:
    """Write report.json, report.md and (with matplotlib) timeline.png. Returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    png = directory / "timeline.png"
    try:
        plot_timeline(report.plot, png, title=_title(report))
        written.append(png)
    except ImportError:
        report.notes.append("timeline.png not written: matplotlib is not installed "
                            "(pip install 'elastic-train[chaos]')")
    path = directory / "report.json"
    path.write_text(json.dumps(report.to_json(), indent=2, sort_keys=False, default=str) + "\n")
    written.append(path)
    md = directory / "report.md"
    md.write_text(markdown(report, has_png=png in written))
    written.append(md)
    return written


def _title(report: Report) -> str:
    kinds = ", ".join(f.kind for f in report.faults) or "no faults"
    return f"elastic-chaos {report.scenario or ''} seed {report.seed}: {kinds}".replace("  ", " ")


def markdown(report: Report, *, has_png: bool = False) -> str:
    verdict = "PASSED" if report.passed else "FAILED"
    lines = [f"# elastic-chaos: {verdict}", ""]
    cfg = report.config
    lines.append(f"Scenario `{report.scenario or 'custom'}`, seed {report.seed}: {cfg.get('nodes')} nodes x "
                 f"{cfg.get('nproc_per_node')} workers, {cfg.get('steps')} steps, checkpoint every "
                 f"{cfg.get('ckpt_every')}, etcd members {cfg.get('etcd_members')}, script `{cfg.get('script')}`. "
                 f"Took {report.duration_s:.1f} s.")
    lines.append("")
    if report.error:
        lines += [f"**Error:** {report.error}", ""]
    lines += ["## Invariants", "", "| invariant | result | evidence |", "|---|---|---|"]
    for name, detail in report.invariant_details.items():
        if name in report.invariants:
            result = "kept" if report.invariants[name] else "**BROKEN**"
        else:
            result = "not checked"
        lines.append(f"| {name} | {result} | {_cell(detail)} |")
    lines += ["", "## Faults", "",
              "| # | fault | node | target | at step | detect s | resume s | steps lost | restarts | outcome |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for f in report.faults:
        outcome = f"skipped: {f.skipped}" if f.skipped else ("fired" if f.at_step is not None else "**never fired**")
        lines.append(f"| {f.index + 1} | {f.kind} | {f.node or ''} | {_cell(f.target)} | "
                     f"{'' if f.at_step is None else f.at_step} (planned {f.planned_step}) | {_num(f.detect_s)} | "
                     f"{_num(f.resume_s)} | {f.steps_lost} | {f.restarts} | {_cell(outcome)} |")
    lines += ["", "## Goodput", "", goodput_line(report.goodput, report.reference_goodput)]
    lines += ["", "## Digests", "",
              f"- reference: `{report.reference_digest}` (world size {report.reference_world_size})",
              f"- final: `{report.final_digest}` (world size {report.final_world_size})", ""]
    if report.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in report.notes], ""]
    if has_png:
        lines += ["## Timeline", "", "![timeline](timeline.png)", ""]
    lines += ["Node logs are in `logs/` (each line prefixed with its monotonic read time).", ""]
    return "\n".join(lines)


def goodput_line(goodput: float | None, reference: float | None) -> str:
    """E.g. `0.62 (reference run 0.85): the faults cost 27% of the reference's useful time`."""
    def f(v: float | None) -> str:
        return "not measured" if v is None else f"{v:.2f}"

    line = f"Share of wall-clock time in steps that were kept: {f(goodput)} (reference run {f(reference)})"
    if goodput is not None and reference:
        line += f"; the faults cost {max(0.0, 1 - goodput / reference):.0%} of the reference's useful time"
    return line + "."


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def plot_timeline(plot: Plot, path: Path, *, title: str) -> None:
    """Steps against wall time (one colour per attempt), the world size, fault and recovery markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(10, 5), dpi=100)
    try:
        attempts = sorted({a for _, _, a in plot.steps})
        cmap = plt.get_cmap("tab10")
        for a in attempts:
            pts = [(t, s) for t, s, n in plot.steps if n == a]
            ax.plot([t for t, _ in pts], [s for _, s in pts], ".-", ms=3, lw=1, color=cmap(a % 10),
                    label=f"attempt {a}" if len(attempts) <= 8 else None)
        ax.set_xlabel("seconds since the job started")
        ax.set_ylabel("step")
        top = max((s for _, s, _ in plot.steps), default=1)
        for i, (t, kind) in enumerate(plot.faults):
            ax.axvline(t, color="red", lw=1.2)
            ax.annotate(kind, (t, top * (0.95 - 0.07 * (i % 4))), rotation=0, fontsize=8, color="red",
                        xytext=(3, 0), textcoords="offset points")
        for j, t in enumerate(plot.recoveries):
            ax.axvline(t, color="green", lw=1, ls="--", label="recovered" if j == 0 else None)
        if plot.worlds:
            ax2 = ax.twinx()
            xs = [t for t, _ in plot.worlds] + [max(plot.end_t, plot.worlds[-1][0])]
            ys = [w for _, w in plot.worlds] + [plot.worlds[-1][1]]
            ax2.step(xs, ys, where="post", color="gray", lw=1.5, alpha=0.7, label="world size")
            ax2.set_ylabel("world size")
            ax2.set_ylim(0, max(ys) + 1)
            ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title, fontsize=10)
        if ax.get_legend_handles_labels()[0]:  # a run with no step plotted has nothing to name
            ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
