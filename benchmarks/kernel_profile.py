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


RUN_RANGE = "o2f_run"   # the CPU range host_timeline wraps each run in


def host_phases(events: Iterable) -> dict[str, list[float]]:
    """Where each run's host time goes, from profiler events with CPU activity (torch.profiler's
    `prof.events()`), each run inside a RUN_RANGE range, µs per run:
      "run": the range (the ORT call, as the host sees it);
      "to_first_launch": range start to the first kernel launch call's start (ORT's work before the GPU
        gets anything: its executor, the op's host code up to its first launch);
      "launching": first launch call's start to the last one's end;
      "after_last_launch": the last launch call's end to the range's end (the wait for the GPU and ORT's
        return);
      "gpu_idle_before": range start to the first kernel's start on the device;
    plus "api <name>": the summed time of each CUDA runtime/driver call inside the range."""
    evs = list(events)
    ranges = sorted((e.time_range.start, e.time_range.end) for e in evs
                    if e.device_type.name == "CPU" and e.name == RUN_RANGE)
    api = [e for e in evs if e.device_type.name == "CPU" and e.name.startswith("cu")]
    kernels = sorted(e.time_range.start for e in evs if e.device_type.name == "CUDA")
    out: dict[str, list[float]] = defaultdict(list)
    in_runs = [[e for e in api if start <= e.time_range.start <= end] for start, end in ranges]
    names = sorted({e.name for inside in in_runs for e in inside})
    for (start, end), inside in zip(ranges, in_runs):
        launches = sorted((e.time_range.start, e.time_range.end) for e in inside if "Launch" in e.name)
        out["run"].append(end - start)
        if launches:
            out["to_first_launch"].append(launches[0][0] - start)
            out["launching"].append(max(e for _, e in launches) - launches[0][0])
            out["after_last_launch"].append(end - max(e for _, e in launches))
        first = next((k for k in kernels if k >= start), None)
        if first is not None and first <= end:
            out["gpu_idle_before"].append(first - start)
        for n in names:   # 0 in a run without that call
            out[f"api {n}"].append(sum(e.time_range.end - e.time_range.start for e in inside if e.name == n))
    return dict(out)


def host_timeline(run: Callable[[], None], runs: int) -> dict[str, list[float]]:
    """`runs` calls of `run` under torch's profiler (CPU and CUDA activity), each in a RUN_RANGE range:
    host_phases of them."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            with record_function(RUN_RANGE):
                run()
        torch.cuda.synchronize()
    return host_phases(prof.events())


def ranked(per: dict[str, list[float]]) -> list[tuple[str, list[float]]]:
    """The kernels by total time, longest first."""
    return sorted(per.items(), key=lambda kv: -sum(kv[1]))


def kernel_table(per: dict[str, list[float]], runs: int, width: int = 110) -> list[str]:
    """One line per kernel: µs per run, launches per run, name (cut to `width`); then the total."""
    lines = [f"  {sum(t) / runs:8.1f}  x{len(t) // runs:<2d} {name[:width]}" for name, t in ranked(per)]
    total = sum(sum(t) for t in per.values()) / runs
    launches = sum(len(t) for t in per.values()) // runs
    return lines + [f"  {total:8.1f}  total per run (us), {launches} launches"]
