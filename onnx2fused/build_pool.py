"""Compiling translation units in parallel within the host's memory (build.py's worker pool).

One compile per core is right for time, not for memory: cicc on a CUTLASS 3.x kernel instance peaks at
~3.3 GB resident (the GPU host's OOM killer took one at 3.25 GB while five builds ran at once,
benchmarks/RESULTS.md, seventeenth run), so a host with many cores and little memory, or several
converts at once on one host, would have the kernel kill compilers and the convert fail. So:
  - a job starts only while the estimated peaks of the running jobs and its own fit in the memory that
    was available when the pool started (/proc/meminfo's MemAvailable; a job larger than all of it runs
    alone); without /proc/meminfo there is no limit but the workers;
  - a compile that was killed (the OOM killer's SIGKILL: nvcc says its child "died due to signal 9", a
    shell says "Killed") runs again after the others, one at a time, which is what other processes'
    builds cannot take from it.
$ONNX2FUSED_BUILD_JOBS caps the compiles at once below the core count.
"""
from __future__ import annotations

import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from .errors import ConversionError

Job = TypeVar("Job")

# Peak resident memory of one compile, by kind of unit (MB; measured peaks rounded up): a CUTLASS 3.x
# instance (Hopper), another unit that includes CUTLASS (its 2.x instances, a wide chain's unit), any other.
PEAK_MB_HOPPER = 4096
PEAK_MB_CUTLASS = 2560
PEAK_MB_OTHER = 1024

JOBS_ENV = "ONNX2FUSED_BUILD_JOBS"   # at most this many compiles at once (default: one per core)

_KILLED = re.compile(r"died due to signal 9|\bKilled\b|signal 9 \(Kill")


def jobs_cap() -> int | None:
    """$ONNX2FUSED_BUILD_JOBS as a number of compiles (None when unset); anything else is an error."""
    text = os.environ.get(JOBS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConversionError(f"{JOBS_ENV}={text!r}: expected a whole number of compiles, 1 or more")
    return int(text)


def max_workers(units: int, cap: int | None) -> int:
    """Compiles to run at once for `units` translation units: one per core, at most `cap`."""
    return max(1, min(units, os.cpu_count() or 1, cap or units))


def available_memory_mb(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable in MB, or None where the file is missing or has no such line (not Linux)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def was_killed(rc: int, output: str) -> bool:
    """Whether a compile ended by SIGKILL (the OOM killer's signal): its own (rc -9, or 137 through a
    shell) or a child's, which nvcc and shells report in their output."""
    return rc in (-9, 137) or (rc != 0 and bool(_KILLED.search(output)))


class MemoryGate:
    """Admits jobs while the sum of their peaks stays within `budget_mb`; one larger than the whole
    budget waits for every other to end, then runs alone."""

    def __init__(self, budget_mb: int):
        self.budget = budget_mb
        self.free = budget_mb
        self._cond = threading.Condition()

    def acquire(self, peak_mb: int) -> int:
        need = min(peak_mb, self.budget)
        with self._cond:
            self._cond.wait_for(lambda: self.free >= need)
            self.free -= need
        return need

    def release(self, held_mb: int) -> None:
        with self._cond:
            self.free += held_mb
            self._cond.notify_all()


def run_all(jobs: Sequence[Job], run: Callable[[Job], tuple[int, str]], peak_mb: Callable[[Job], int],
            workers: int, budget_mb: int | None, say: Callable[[str], None]) -> list[tuple[Job, int, str]]:
    """(job, return code, output) for every job, in order: run in parallel on `workers` threads, within
    `budget_mb` of estimated peaks (None: no limit); the killed ones again, one at a time."""
    gate = MemoryGate(budget_mb) if budget_mb else None

    def gated(job: Job) -> tuple[Job, int, str]:
        held = gate.acquire(peak_mb(job)) if gate else 0
        try:
            rc, text = run(job)
        finally:
            if gate:
                gate.release(held)
        return job, rc, text

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(gated, jobs))
    for i, (job, rc, text) in enumerate(results):
        if was_killed(rc, text):
            say(f"  {getattr(job, 'name', job)} was killed (out of memory?); compiling it again on its own")
            rc, text = run(job)
            results[i] = (job, rc, text)
    return results
