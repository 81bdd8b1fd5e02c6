"""elastic-chaos reports the goodput of the fault run against the reference's: read from the agents'
`job_summary` events (the records elastic-run writes), kept in the reference, shown in report.md."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from chaos import lineage as ln
from chaos import report as rpt
from chaos import timeline as tl
from chaos.judge import JobResult, Reference, goodput_of, save_reference
from tests.unit.test_chaos_report import sample_report

pytestmark = pytest.mark.timeout(60)


def job_of(records: list[dict[str, object]]) -> JobResult:
    events = [e for i, r in enumerate(records) for e in tl.from_record(r, node=f"node{i}")]
    runs = ln.attempts(events)
    return JobResult(events, runs, ln.lineage(runs, 5), True, "ok", None, 2, 10.0, 0.0, [])


def test_goodput_is_the_mean_of_the_agents_summaries() -> None:
    summaries = [{"event": "job_summary", "ts": 10.0, "goodput": g, "steps": 40} for g in (0.5, 0.7)]
    assert goodput_of(job_of([*summaries, {"event": "job_summary", "ts": 10.0, "goodput": None}])) == 0.6
    assert goodput_of(job_of([{"event": "restart", "ts": 3.0, "reason": "worker failure"}])) is None


def test_report_and_reference_carry_goodput(tmp_path: Path) -> None:
    report = replace(sample_report(), goodput=0.6, reference_goodput=0.8)
    assert report.to_json()["goodput"] == 0.6 and report.to_json()["reference_goodput"] == 0.8
    md = rpt.markdown(report)  # (rpt.write adds the timeline plot: matplotlib, seconds)
    assert "## Goodput" in md and "0.60 (reference run 0.80); the faults cost 25% of the reference's" in md
    assert "not measured (reference run not measured)." in rpt.goodput_line(None, None)
    ref = Reference("ab", 2, {}, None, job={"steps": 20}, goodput=0.8)
    save_reference(ref, tmp_path)
    doc = json.loads((tmp_path / "reference.json").read_text())
    doc.pop("goodput")  # a reference written before goodput was measured still loads
    assert Reference.from_json(doc).goodput is None
