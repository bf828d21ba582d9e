"""`onnx2fused doctor`: what this host has for building and running fused models, and the fix for each gap.

Checks (each: ok / warn / missing, a one-line summary, and a one-line fix when not ok):
  python      Python and the package's own dependencies (onnx, jinja2, numpy)
  cxx         the C++ compiler that builds the CPU kernels and the plugin (required)
  nvcc        the CUDA compiler (optional: without it the library has CPU kernels only)
  gpu         GPU name and compute capability (nvidia-smi, else torch.cuda; optional)
  onnxruntime version, distribution (onnxruntime or onnxruntime-gpu) and providers (required)
  headers     the ONNX Runtime C/C++ headers, looked up without fetching (required, or fetchable)
  cache       the build cache folder, and whether it is writable (required)
  tuning      the wide design's per-GPU kernel search: on (a Hopper GPU), off (ONNX2FUSED_TUNE=0) or
              not applicable here, and how many choices the cache holds (informational)
  targets     what a build targets: the C++ kernels' -march (ONNX2FUSED_CPU_ARCH), the CUDA archs
              (ONNX2FUSED_CUDA_ARCHS) and the embedded PTX (ONNX2FUSED_CUDA_PTX); warn on a bad value

Exit status: 0 when a CPU conversion is possible here (cxx, onnxruntime, headers found or fetchable with
apt-get, writable cache); 1 otherwise. GPU and nvcc gaps are warnings: they only cost the CUDA kernels.
"""
from __future__ import annotations

import importlib.util
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

OK, WARN, MISSING = "ok", "warn", "missing"
REQUIRED = ("python", "cxx", "onnxruntime", "headers", "cache")   # what a CPU conversion needs


@dataclass
class Check:
    name: str
    status: str                # ok | warn | missing
    summary: str
    fix: str | None = None
    data: dict = field(default_factory=dict)


def add_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="the build cache to check (default $ONNX2FUSED_CACHE or ~/.cache/onnx2fused)")
    parser.epilog = ("exit status 0 when a CPU conversion is possible here (C++ compiler, onnxruntime, "
                     "ONNX Runtime headers found or fetchable, writable cache), else 1")


def main(args) -> int:
    checks = run_checks(getattr(args, "cache_dir", None))
    ok = conversion_possible(checks)
    if args.json:
        print(json.dumps({"cpu_conversion_possible": ok, "checks": [asdict(c) for c in checks]}, indent=1))
    else:
        print(format_checks(checks, ok))
    return 0 if ok else 1


def conversion_possible(checks: list[Check]) -> bool:
    return all(c.status != MISSING for c in checks if c.name in REQUIRED)


def run_checks(cache_dir=None) -> list[Check]:
    return [check_python(), check_cxx(), check_nvcc(), check_gpu(), check_onnxruntime(),
            check_headers(cache_dir), check_cache(cache_dir), check_tuning(cache_dir), check_targets()]


def format_checks(checks: list[Check], ok: bool) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.name.ljust(width)}  {c.status.ljust(7)}  {c.summary}")
        if c.fix:
            lines.append(f"{' ' * width}  {'':7}  fix: {c.fix}")
    lines.append("CPU conversion: possible" if ok else
                 "CPU conversion: NOT possible (fix the 'missing' lines above)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ helpers
def _first_line(args: list[str]) -> str | None:
    """The first line of a tool's output, or None when it cannot run."""
    try:
        p = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    out = (p.stdout or p.stderr).strip()
    return out.splitlines()[0].strip() if p.returncode == 0 and out else None


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


# ------------------------------------------------------------------------------------------ checks
def check_python() -> Check:
    versions = {n: _dist_version(n) for n in ("onnx", "jinja2", "numpy")}
    absent = [n for n, v in versions.items() if v is None]
    data = {"python": platform.python_version(), "executable": sys.executable, **versions}
    found = ", ".join(f"{n} {v}" for n, v in versions.items() if v)
    summary = f"Python {platform.python_version()}" + (f"; {found}" if found else "")
    if absent:
        return Check("python", MISSING, summary + f"; missing: {', '.join(absent)}",
                     f"pip install {' '.join(absent)}", data)
    return Check("python", OK, summary, None, data)


def check_cxx() -> Check:
    from .targets import find_cxx
    from .errors import ConversionError
    try:
        cxx = find_cxx()
    except ConversionError:
        return Check("cxx", MISSING, "no C++ compiler (g++ / c++ / $CXX)",
                     "install g++ (Debian/Ubuntu: apt-get install g++) or set CXX")
    path = shutil.which(cxx) or cxx
    version = _first_line([cxx, "--version"])
    if version is None:
        return Check("cxx", MISSING, f"{path} does not run", "install g++ or point CXX at a working compiler",
                     {"path": path})
    return Check("cxx", OK, f"{path}: {version}", None, {"path": path, "version": version})


def check_nvcc() -> Check:
    from .targets import find_nvcc
    nvcc = find_nvcc()
    if not nvcc:
        return Check("nvcc", WARN, "no nvcc: fused models get CPU kernels only",
                     "install the CUDA toolkit (nvcc) and put it on PATH, or set CUDA_HOME")
    text = ""
    try:
        text = subprocess.run([nvcc, "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        pass
    m = re.search(r"release (\d+\.\d+)", text)
    if not m:
        return Check("nvcc", WARN, f"{nvcc} does not report a version", "check the CUDA toolkit installation",
                     {"path": nvcc})
    return Check("nvcc", OK, f"{nvcc}: CUDA {m.group(1)}", None, {"path": nvcc, "version": m.group(1)})


def _gpus_from_nvidia_smi() -> list[dict] | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        p = subprocess.run([smi, "--query-gpu=name,compute_cap,driver_version,memory.total",
                            "--format=csv,noheader"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:
        return []   # nvidia-smi present but no usable GPU / driver
    gpus = []
    for line in p.stdout.strip().splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) >= 2:
            gpus.append({"name": parts[0], "compute_capability": parts[1],
                         "driver": parts[2] if len(parts) > 2 else None,
                         "memory": parts[3] if len(parts) > 3 else None, "source": "nvidia-smi"})
    return gpus


def _gpus_from_torch() -> list[dict] | None:
    # torch is optional and heavy: only asked when nvidia-smi is absent
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch
        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            out.append({"name": torch.cuda.get_device_name(i), "compute_capability": f"{major}.{minor}",
                        "driver": None, "memory": None, "source": "torch.cuda"})
        return out
    except Exception:
        return []


def detected_gpus() -> list[dict] | None:
    """The GPUs nvidia-smi (else torch.cuda) reports, each {name, compute_capability, ...}; [] where a
    tool answers that there is none, None where neither can ask."""
    gpus = _gpus_from_nvidia_smi()
    if not gpus:
        gpus = _gpus_from_torch() or gpus
    return gpus


def check_gpu() -> Check:
    gpus = detected_gpus()
    if not gpus:
        return Check("gpu", WARN, "no GPU: fused models run their CPU kernels (or stock-op fallback)",
                     "for the CUDA kernels, run on a host with an NVIDIA GPU (compute capability 8.0 or newer) "
                     "and its driver", {"gpus": []})
    desc = "; ".join(f"{g['name']} (compute capability {g['compute_capability']})" for g in gpus)
    old = [g for g in gpus if _cc(g["compute_capability"]) < (8, 0)]
    if old:
        return Check("gpu", WARN, desc + ": below compute capability 8.0, no tensor-core kernels",
                     "use an Ampere (sm_80) or newer GPU", {"gpus": gpus})
    return Check("gpu", OK, desc, None, {"gpus": gpus})


def _cc(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_onnxruntime() -> Check:
    dists = {n: _dist_version(n) for n in ("onnxruntime", "onnxruntime-gpu")}
    installed = [n for n, v in dists.items() if v]
    try:
        import onnxruntime as ort
    except Exception as e:   # absent, or a broken install (both distributions fighting over one module)
        fix = ('pip install "onnx2fused[cpu]" (onnxruntime) or "onnx2fused[gpu]" (onnxruntime-gpu)'
               if not installed else f"reinstall one of them: pip install --force-reinstall {installed[0]}")
        return Check("onnxruntime", MISSING, f"cannot import onnxruntime: {' '.join(str(e).split())}", fix,
                     {"distributions": installed})
    providers = ort.get_available_providers()
    data = {"version": ort.__version__, "distributions": installed, "providers": providers}
    dist = " + ".join(installed) or "onnxruntime (unknown distribution)"
    summary = f"{dist} {ort.__version__}; providers: {', '.join(providers)}"
    if len(installed) > 1:
        return Check("onnxruntime", WARN, summary + " (both distributions installed: they share one module)",
                     "pip uninstall -y onnxruntime onnxruntime-gpu, then install only one of them", data)
    if "CUDAExecutionProvider" not in providers:
        if installed == ["onnxruntime-gpu"]:
            fix = "onnxruntime-gpu finds no usable CUDA (driver / CUDA 13 libraries); fused models run on the CPU EP"
        else:
            fix = "for the CUDA EP: pip uninstall -y onnxruntime && pip install onnxruntime-gpu"
        return Check("onnxruntime", WARN, summary + "; no CUDA EP", fix, data)
    return Check("onnxruntime", OK, summary, None, data)


def check_headers(cache_dir=None) -> Check:
    from .errors import ConversionError
    from .headers import FETCH_VERSION, HOW_TO, locate_ort_headers
    try:
        h = locate_ort_headers(cache_dir, fetch=False)
    except ConversionError as e:
        if os.environ.get("ONNXRUNTIME_INCLUDE_DIR"):   # set but wrong: convert would fail the same way
            return Check("headers", MISSING, str(e).split(";")[0], HOW_TO)
        if shutil.which("apt-get") and shutil.which("dpkg"):
            return Check("headers", WARN, f"not found; convert will fetch ONNX Runtime {FETCH_VERSION} headers "
                         "(Debian libonnxruntime-dev) with apt-get into the cache (needs network access once)",
                         "offline: " + HOW_TO, {"fetchable": True})
        return Check("headers", MISSING, "not found, and no apt-get/dpkg to fetch them", HOW_TO,
                     {"fetchable": False})
    return Check("headers", OK, f"{h.path} (ONNX Runtime {h.version}, from {h.source})", None,
                 {"path": str(h.path), "version": h.version, "source": h.source})


def check_cache(cache_dir=None) -> Check:
    from .headers import default_cache_dir
    d = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    # the cache is created on first use: what matters is that it or its nearest existing parent is writable
    probe = d
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    writable = probe.is_dir() and os.access(probe, os.W_OK | os.X_OK)
    data = {"path": str(d), "exists": d.exists(), "writable": writable}
    state = "" if d.exists() else " (created on first build)"
    if not writable:
        return Check("cache", MISSING, f"{d}{state} is not writable",
                     "set ONNX2FUSED_CACHE (or --cache-dir) to a writable folder", data)
    return Check("cache", OK, f"{d}{state}, writable", None, data)


def check_tuning(cache_dir=None) -> Check:
    """Whether wide chains get their kernels measured on this GPU at build time (onnx2fused/wide_tune.py)."""
    from . import wide_tune
    from .headers import default_cache_dir
    d = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "tune"
    cached = sorted(p.name for p in d.glob("*.json")) if d.is_dir() else []
    gpu = wide_tune.current_gpu()
    data = {"enabled": wide_tune.tuning_enabled(), "gpu": gpu.name if gpu else None, "cached": len(cached)}
    if not wide_tune.tuning_enabled():
        summary = f"off ({wide_tune.TUNE_ENV}=0): wide chains use the default kernels"
    elif gpu is None or gpu.cc != 90:
        why = f"{gpu.name} is not a Hopper GPU" if gpu else "no GPU"
        summary = f"not applicable ({why}): wide chains use the default kernels"
    else:
        summary = f"on: wide chains are tuned on {gpu.name} at their first build"
    return Check("tuning", OK, f"{summary}; {len(cached)} choice(s) cached in {d}", None, data)


def check_targets() -> Check:
    """Where a library built here runs (targets.py's cpu_arch, cuda_archs, cuda_ptx_arch; informational)."""
    from . import targets
    from .errors import ConversionError
    try:
        cpu, archs = targets.cpu_arch(), targets.cuda_archs()
        ptx = targets.cuda_ptx_arch(archs)
    except ConversionError as e:
        return Check("targets", WARN, str(e), "fix or unset the variable (README: Serving, portability)")
    data = {"cpu_arch": cpu, "cuda_archs": archs, "cuda_ptx": ptx}
    where = ("CPUs with this one's instruction sets only; for others set ONNX2FUSED_CPU_ARCH, e.g. x86-64-v3"
             if cpu == "native" else "CPUs that implement it")
    gpu = ", ".join(f"sm_{a}" for a in archs) + (f" + PTX compute_{ptx} (newer GPUs JIT it)" if ptx else ", no PTX")
    summary = f"C++ kernels -march={cpu} ({where}); CUDA {gpu}"
    return Check("targets", OK, summary, None, data)
