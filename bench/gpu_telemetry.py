"""The GPU's clocks, power and temperature beside a benchmark, from `nvidia-smi` sampling every 100 ms.

A step of the GPT benchmark can take 10-40 ms longer with no change in what it launches: the GPU's own
clock dropped (power cap, thermal slowdown). This tells such steps apart from what a checkpointer costs:
`window(start, end)` summarises the samples of one run's timed window (unix times), and `per_step` gives
the SM clock nearest each step's end. Where nvidia-smi is missing or refuses the query, `why_not` says so
and the figures are None.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

FIELDS = ("timestamp", "clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active")
# The reasons that lower the clock under load (NVML's clocks event reasons), by bit.
REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}


class GpuTelemetry:
    def __init__(self, out: Path, interval_ms: int = 100) -> None:
        self.out = out
        self.why_not: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        smi = shutil.which("nvidia-smi")
        if smi is None:
            self.why_not = "nvidia-smi not found"
            return
        self._log = open(out, "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen([smi, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                                       f"-lms={interval_ms}", "-i", "0"], stdout=self._log,
                                      stderr=subprocess.STDOUT)
        time.sleep(0.5)
        if self._proc.poll() is not None:
            self.why_not = f"nvidia-smi exited {self._proc.returncode}: {out.read_text(errors='replace')[:200]}"

    def stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
            self._log.close()
            self._proc = None

    def samples(self) -> list[tuple[float, float, float, float, int]]:
        """(unix time, SM MHz, watts, deg C, reasons bits) of each sample so far."""
        if self.why_not is not None or not self.out.exists():
            return []
        rows = []
        for line in self.out.read_text(errors="replace").splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                ts = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), int(parts[4], 16)))
            except (ValueError, IndexError):
                continue
        return rows

    def window(self, start: float, end: float) -> dict[str, Any] | None:
        rows = [r for r in self.samples() if start <= r[0] <= end]
        if not rows:
            return None
        clocks, watts = [r[1] for r in rows], [r[2] for r in rows]
        reasons: dict[str, int] = {}
        for r in rows:
            for bit, name in REASONS.items():
                if r[4] & bit:
                    reasons[name] = reasons.get(name, 0) + 1
        return {"samples": len(rows), "sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
                "power_w_median": round(statistics.median(watts), 1), "power_w_max": max(watts),
                "temp_c_max": max(r[3] for r in rows),
                "clock_lowered_share": round(sum(1 for r in rows if r[4] & sum(REASONS)) / len(rows), 3),
                "reasons_samples": reasons}

    def per_step(self, ends_unix: list[float]) -> list[float | None]:
        """The SM clock of the sample nearest each step's end (within 0.3 s)."""
        rows = self.samples()
        out: list[float | None] = []
        i = 0
        for t in ends_unix:
            while i + 1 < len(rows) and abs(rows[i + 1][0] - t) <= abs(rows[i][0] - t):
                i += 1
            out.append(rows[i][1] if rows and abs(rows[i][0] - t) <= 0.3 else None)
        return out
