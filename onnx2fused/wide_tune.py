"""Per-GPU kernel selection for the wide design: the "small search over tile shapes when the plugin is
built for a GPU that is present", cached per spec and GPU.

When a library with a wide chain (plan/wide.py) is built and the first visible GPU runs the Hopper
kernels (compute capability 9.0), `resolve` first builds a *tuning library* of that chain: the same
source with every configuration of plan.sm90.SM90_KERNELS and an exported entry,
`<name>_cuda_tune`, which, for each layer's GEMM and each row bucket, runs every candidate
(sm90.sm90_candidates: kernel configuration x stream-K decomposition) on pseudo-random data,
rejects one whose output differs from the default kernel's, and times the rest with CUDA events.
The fastest (kept only when it beats the default by MIN_GAIN, so noise never swaps kernels) becomes
that GEMM's choice for that bucket; the final library instantiates only the chosen kernels.

The choice is stored in <cache>/tune/<spec>-<gpu>.json and reused by every later build of the same
spec on the same GPU model (no tuning build then). Without a GPU, on other GPUs, with
$ONNX2FUSED_TUNE=0, or when tuning fails (it never fails the build: it reports and keeps the default),
the library uses sm90.default_choice() (DEFAULT_CHOICE unless the environment names another kernel).
"""
from __future__ import annotations

import ctypes
import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from .plan import sm90
from .plan.cost import NOMINAL_ROWS
from .plan.protocol import Plan
from .plan.wide import WidePlan, with_kernels
from .spec import MLPSpec, SpecError

TUNE_ENV = "ONNX2FUSED_TUNE"     # "0": never tune (default kernels); anything else: tune when possible
TUNE_FORMAT = 6                  # bump when the candidate list or the file's meaning changes
REPS = 20                        # timed launches per candidate (after one checked and one warm run)
MIN_GAIN = 0.03                  # a candidate replaces the default only when this much faster
PASS_ROWS = (8192, 4096, 2048)   # smaller passes through the chain that _time_passes tries


@dataclass(frozen=True)
class Gpu:
    name: str
    cc: int           # compute capability, major * 10 + minor


@lru_cache(maxsize=1)
def current_gpu() -> Gpu | None:
    """The first visible CUDA device (honours CUDA_VISIBLE_DEVICES), through the driver API, or None
    when there is no driver or no device. Cheap: no context is created."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, count = ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value < 1:
        return None
    if cuda.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return None
    name = ctypes.create_string_buffer(256)
    major, minor = ctypes.c_int(), ctypes.c_int()
    if (cuda.cuDeviceGetName(name, 256, dev) != 0
            or cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) != 0     # ..._COMPUTE_CAPABILITY_MAJOR
            or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev) != 0):   # ..._COMPUTE_CAPABILITY_MINOR
        return None
    return Gpu(name.value.decode(errors="replace").strip(), major.value * 10 + minor.value)


def tuning_enabled() -> bool:
    return os.environ.get(TUNE_ENV, "1").strip() != "0"


def tunable_gpu() -> Gpu | None:
    """The GPU to tune on: one that runs the Hopper kernels, when tuning is enabled."""
    gpu = current_gpu() if tuning_enabled() else None
    return gpu if gpu is not None and gpu.cc == 90 else None


def cache_file(cache: Path, spec: MLPSpec, gpu: Gpu) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu.name).strip("-") or "gpu"
    return Path(cache) / "tune" / f"{spec.name}-{slug}-sm{gpu.cc}.json"


def _tuned_plan(plan: WidePlan, record: dict, gpu: Gpu) -> WidePlan | None:
    """`plan` with the kernel choices of a cache record, or None when the record does not fit it."""
    try:
        if record.get("format") != TUNE_FORMAT or record.get("gpu") != gpu.name or \
                tuple(record["buckets"]) != plan.buckets:
            return None
        choices = tuple(tuple(sm90.Sm90Choice(int(k), str(m), int(s), int(sw), str(r)) for k, m, s, sw, r in per)
                        for per in record["choices"])
        chain_block = int(record.get("chain_block") or 0)
        return with_kernels(plan, choices=choices, tuned_on=gpu.name, chain_block=chain_block)  # validates them
    except (KeyError, TypeError, ValueError, SpecError):
        return None


def _tunable(plan: Plan) -> bool:
    """A wide plan with default kernels (not a tuning build, no choices given) and a GEMM the Hopper
    kernels can run."""
    return plan.design == "wide" and not plan.tuning and not plan.tuned_on and any(g.sm90 for g in plan.gemms)


def cached_plan(plan: Plan, cache: Path) -> Plan:
    """`plan` with the kernel choices stored for the current GPU, if any (what `inspect` shows)."""
    gpu = tunable_gpu()
    if gpu is None or not _tunable(plan):
        return plan
    return _stored_plan(plan, cache, gpu) or plan


def _stored_plan(plan: WidePlan, cache: Path, gpu: Gpu) -> WidePlan | None:
    try:
        record = json.loads(cache_file(cache, plan.spec, gpu).read_text())
    except (OSError, ValueError):
        return None
    return _tuned_plan(plan, record, gpu) if isinstance(record, dict) else None


def store_record(cache: Path, spec: MLPSpec, gpu: Gpu, record: dict) -> Path:
    """Writes a tuning record (marked with the GPU) where builds look for it, atomically; OSError if not."""
    record["gpu"] = gpu.name
    path = cache_file(cache, spec, gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    return path


class TuneError(RuntimeError):
    pass


load_library = ctypes.CDLL   # how run_tuning opens the tuning library (tests put a fake one in its place)


def run_tuning(library: Path, plan: WidePlan, reps: int = REPS) -> dict:
    """Calls the tuning library's entry; returns the cache record (choices and every time measured)."""
    lib = load_library(str(library))
    fn = getattr(lib, f"{plan.spec.name}_cuda_tune")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)] + [ctypes.POINTER(ctypes.c_float)] * 3
    candidates = sm90.sm90_candidates()
    n = len(plan.gemms) * len(plan.buckets)
    index, ms, default_ms = (ctypes.c_int * n)(), (ctypes.c_float * n)(), (ctypes.c_float * n)()
    every = (ctypes.c_float * (n * len(candidates)))()
    rc = fn(reps, index, ms, default_ms, every)
    if rc == -1:
        raise TuneError("this GPU does not run the Hopper kernels")
    if rc != 0:
        raise TuneError(f"the tuning run failed with CUDA error {rc}")
    nb = len(plan.buckets)
    default = sm90.default_choice()   # the kernel the timing build compared every candidate against
    choices, timings = [], []
    for g in range(len(plan.gemms)):
        per, per_t = [], []
        for b in range(nb):
            i, t, t0 = index[g * nb + b], ms[g * nb + b], default_ms[g * nb + b]
            best = candidates[i] if 0 <= i < len(candidates) and t < t0 * (1 - MIN_GAIN) else default
            per.append(best)
            all_t = every[(g * nb + b) * len(candidates):(g * nb + b + 1) * len(candidates)]
            per_t.append({"rows": plan.buckets[b], "choice": best.label, "ms": round(min(t, t0) if i >= 0 else t0, 5),
                          "default_ms": round(t0, 5), "fastest": candidates[i].label if 0 <= i < len(candidates) else "",
                          # every candidate's time; -1: cannot run the shape, -2: output differs from the default's
                          "candidates": {c.label: round(v, 5) for c, v in zip(candidates, all_t)}})
        choices.append(per)
        timings.append(per_t)
    chain_block, passes = _time_passes(lib, plan, [[candidates.index(c) for c in per] for per in choices], reps)
    return {"format": TUNE_FORMAT, "spec": plan.spec.name, "buckets": list(plan.buckets), "reps": reps,
            "choices": [[choice_record(c) for c in per] for per in choices], "timings": timings,
            "chain_block": chain_block, "passes": passes}


def choice_record(c: sm90.Sm90Choice) -> list:
    """A choice as the cache file stores it: [kernel, mode, splits, swizzle, raster]."""
    return [c.kernel, c.mode, c.splits, c.swizzle, c.raster]


def _time_passes(lib, plan: WidePlan, index: list[list[int]], reps: int) -> tuple[int, dict]:
    """The pass size (rows per trip through the chain) to use: the whole row block, or a smaller pass
    whose hidden activations stay in L2 between the GEMMs when that measures faster by MIN_GAIN.
    Times every size in PASS_ROWS below the row block, at NOMINAL_ROWS rows (or the row block)."""
    fn = getattr(lib, f"{plan.spec.name}_cuda_time_chain")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                   ctypes.POINTER(ctypes.c_float)]
    flat = (ctypes.c_int * (len(index) * len(plan.buckets)))(*[i for per in index for i in per])
    rows = min(NOMINAL_ROWS, plan.row_block)
    times = {}
    for block in [plan.row_block] + [b for b in PASS_ROWS if b < rows]:
        ms = ctypes.c_float()
        rc = fn(flat, rows, block, reps, ctypes.byref(ms))
        if rc != 0:
            raise TuneError(f"timing {block}-row passes failed with CUDA error {rc}")
        times[block] = round(ms.value, 5)
    best = min(times, key=times.get)
    chosen = best if times[best] < times[plan.row_block] * (1 - MIN_GAIN) else plan.row_block
    return chosen, {"rows": rows, "ms": {str(b): t for b, t in times.items()}}


def resolve(plans: dict[str, Plan], cache: Path, build: Callable, say: Callable[[str], None],
            tune: bool = False) -> dict[str, Plan]:
    """`plans` ({spec name: plan}) with the Hopper kernel choices of this GPU in the wide ones: the cached
    choice, else, with `tune`, a fresh tuning run (`build(specs, plans=..., cpu_enabled=...)` builds the
    tuning library), else the plan as it is (the default kernels). The search costs minutes of nvcc and
    GPU time per chain, so convert runs it only on request (`--tune`, or `onnx2fused tune`)."""
    gpu = tunable_gpu()
    out = dict(plans)
    if gpu is None:
        return out
    for name, plan in plans.items():
        if not _tunable(plan):
            continue
        cached = _stored_plan(plan, cache, gpu)
        if cached:
            out[name] = cached
            continue
        if not tune:
            continue
        spec = plan.spec
        say(f"tuning the Hopper GEMM kernels of {spec.name} on {gpu.name} (once per spec and GPU model)")
        try:
            lib = build([spec], plans={spec.name: with_kernels(plan, tuning=True)}, cpu_enabled={spec.name: False})
            record = run_tuning(lib.path, plan)
        except Exception as e:  # noqa: BLE001 - tuning is an optimisation: report, keep the defaults
            say(f"tuning {spec.name} failed ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                "using the default kernels")
            continue
        try:
            store_record(cache, spec, gpu, record)
        except OSError as e:
            say(f"cannot store the tuning result in {cache_file(cache, spec, gpu)}: {e}")
        tuned = _tuned_plan(plan, record, gpu)
        if tuned:
            out[name] = tuned
            say("tuned: " + "; ".join(f"layer {g}: " + ", ".join(f"{t['rows']} rows {t['choice']} {t['ms'] * 1e3:.0f} us"
                                                                   f" (default {t['default_ms'] * 1e3:.0f})" for t in per)
                                      for g, per in enumerate(record["timings"])))
    return out
