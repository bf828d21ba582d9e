"""bench: the GPU's SM clock, power and throttle reasons, sampled by nvidia-smi while a case runs back to
back (`onnx2fused bench --sustain`, `benchmarks/kernel_check.py --sustain`).

Run for more than a few milliseconds, the issue-15 kernels reach an H100's 700 W limit and the GPU lowers
its SM clock to stay under it (throttle reason 0x4, the software power cap): their time is then their
energy, not the overlap of their pipes, and one commit differs ~10 % between boards (docs/DESIGN.md, "The
power limit"). A sustained time with its clock and power says which regime a number was taken in.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

import numpy as np

# the reasons field was renamed in newer drivers; the first one nvidia-smi accepts is used
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
SW_POWER_CAP = 0x4        # nvidia-smi's "SW Power Cap" reason bit
SAMPLE_MS = 50
RAMP = 0.25               # the first quarter of the samples (the clock still settling) is left out


@dataclass(frozen=True)
class Sample:
    sm_mhz: float
    max_sm_mhz: float
    watts: float
    limit_watts: float
    reasons: int


def _fields(reason_field: str) -> str:
    return f"clocks.sm,clocks.max.sm,power.draw,power.limit,{reason_field}"


def parse_samples(text: str) -> list[Sample]:
    """Samples from nvidia-smi's `--format=csv,noheader,nounits` lines (unparsable lines are skipped:
    "[N/A]" fields, a truncated last line)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            out.append(Sample(float(parts[0]), float(parts[1]), float(parts[2]), float(parts[3]), int(parts[4], 16)))
        except ValueError:
            continue
    return out


def summarize(samples: list[Sample]) -> dict | None:
    """Medians past the ramp: SM clock, its maximum, power, the power limit, and the share of samples in
    which the power cap held the clock down (None without samples)."""
    busy = samples[int(len(samples) * RAMP):]
    if not busy:
        return None
    med = lambda xs: float(np.median(xs))
    return {"sm_mhz": med([s.sm_mhz for s in busy]), "max_sm_mhz": med([s.max_sm_mhz for s in busy]),
            "watts": med([s.watts for s in busy]), "limit_watts": med([s.limit_watts for s in busy]),
            "power_capped": sum(bool(s.reasons & SW_POWER_CAP) for s in busy) / len(busy),
            "samples": len(busy)}


def describe(summary: dict | None) -> str:
    """One line for a table's note: the clock against its maximum, the power against its limit."""
    if not summary:
        return "no clock samples (nvidia-smi not available)"
    capped = (f"; held down by the power limit in {summary['power_capped']:.0%} of the samples"
              if summary["power_capped"] else "")
    return (f"SM clock {summary['sm_mhz']:.0f} of {summary['max_sm_mhz']:.0f} MHz, "
            f"{summary['watts']:.0f} of {summary['limit_watts']:.0f} W{capped}")


class ClockProbe:
    """`with ClockProbe() as probe: ...run...` then `probe.summary` (None where nvidia-smi is missing or
    refuses the query): nvidia-smi sampling GPU `device` every SAMPLE_MS while the block runs."""

    def __init__(self, device: int = 0):
        self.device, self.proc, self.summary = device, None, None

    def _query(self) -> list[str] | None:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return None
        for field in REASON_FIELDS:   # the one this driver knows
            cmd = [exe, f"--query-gpu={_fields(field)}", "--format=csv,noheader,nounits", "-i", str(self.device)]
            try:
                if subprocess.run(cmd, capture_output=True, text=True, timeout=20).returncode == 0:
                    return cmd
            except (OSError, subprocess.SubprocessError):
                return None
        return None

    def __enter__(self):
        cmd = self._query()
        if cmd is not None:
            self.proc = subprocess.Popen(cmd + ["-lms", str(SAMPLE_MS)], stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate()
            self.summary = summarize(parse_samples(out))
        return False
