"""elastic-chaos: run a training job on simulated nodes under a seeded fault plan and check that it
survives exactly (see `chaos.cli` for the command line).

Library use:

    from chaos import ChaosConfig, parse_faults, run_chaos
    report = run_chaos(ChaosConfig(report_dir=Path("out"), nodes=2, faults=parse_faults("kill-worker,kill-node@last")))
    assert report.passed, report.invariant_details

Public surface: `ChaosConfig`, `parse_faults`, `FaultSpec`, `CATALOG`, `SCENARIOS`, `plan`, `run_chaos`,
`Report`. `run_chaos` imports torch lazily.
"""

from __future__ import annotations

from chaos.config import ChaosConfig
from chaos.faults import CATALOG, FaultSpec, parse_faults
from chaos.report import Report
from chaos.scenarios import SCENARIOS
from chaos.schedule import PlannedFault, plan


def run_chaos(config: ChaosConfig) -> Report:
    """Run the reference job and the chaos job, check the invariants, write the report; return it."""
    from chaos.runner import run

    report, _ = run(config)
    return report


__all__ = ["CATALOG", "SCENARIOS", "ChaosConfig", "FaultSpec", "PlannedFault", "Report", "parse_faults", "plan",
           "run_chaos"]
