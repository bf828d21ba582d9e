"""Kernel-by-kernel GPU time of ORT runs under torch's profiler (which sees every kernel of the process,
ONNX Runtime's included, through CUPTI): the shared part of benchmarks/ort_kernels.py and
benchmarks/profile_case.py.

    per = profiled_kernels(lambda: sess.run_with_iobinding(io), runs)   # name -> device µs of each launch
    for line in kernel_table(per, runs): print(line)
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable


def kernel_times(events: Iterable) -> dict[str, list[float]]:
    """name -> device time (µs) of each launch, from profiler events (torch.profiler's `prof.events()`):
    the CUDA ones, by `device_time` (older torch: `cuda_time`)."""
    per: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.device_type.name == "CUDA":
            per[e.name].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    return dict(per)


def run_spans(events: Iterable, runs: int) -> list[float]:
    """Device time (µs) from the first kernel's start to the last one's end of each of `runs` runs that
    launch the same number of kernels each: the kernels and the gaps between them (which kernel_times
    leaves out: launch latency, a kernel's tail before the next starts, or, with programmatic dependent
    launch, their overlap)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type.name == "CUDA")
    if runs <= 0 or not spans or len(spans) % runs:
        return []
    n = len(spans) // runs
    return [max(end for _, end in spans[i:i + n]) - spans[i][0] for i in range(0, len(spans), n)]


def profiled_kernels(run: Callable[[], None], runs: int, spans: list | None = None) -> dict[str, list[float]]:
    """`runs` calls of `run` under torch's profiler (CUDA activity), synchronised at the end; `spans`, if
    given, receives run_spans."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            run()
        torch.cuda.synchronize()
    events = prof.events()
    if spans is not None:
        spans.extend(run_spans(events, runs))
    return kernel_times(events)


def ranked(per: dict[str, list[float]]) -> list[tuple[str, list[float]]]:
    """The kernels by total time, longest first."""
    return sorted(per.items(), key=lambda kv: -sum(kv[1]))


def kernel_table(per: dict[str, list[float]], runs: int, width: int = 110) -> list[str]:
    """One line per kernel: µs per run, launches per run, name (cut to `width`); then the total."""
    lines = [f"  {sum(t) / runs:8.1f}  x{len(t) // runs:<2d} {name[:width]}" for name, t in ranked(per)]
    total = sum(sum(t) for t in per.values()) / runs
    launches = sum(len(t) for t in per.values()) // runs
    return lines + [f"  {total:8.1f}  total per run (us), {launches} launches"]
