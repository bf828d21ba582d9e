"""What a library is compiled with and for: the tools (nvcc, the C++ compiler, their versions), the build
targets (the C++ kernels' -march, the CUDA archs and the PTX embedded for newer GPUs, from the
environment that `--cpu-arch`, `--cuda-archs` and `--cuda-ptx` set) and each kind of translation unit's
nvcc flags (a wide design's units and CUTLASS kernel instances, the wgmma design's). build.py compiles with
them; doctor, inspect and export-triton report them.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from .errors import ConversionError

HOST_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-march=native", "-fvisibility=hidden", "-pthread",
              "-fopenmp-simd", "-fno-trapping-math", "-fno-math-errno"]  # the last two let activations vectorize
DEFAULT_CUDA_ARCHS = ["80", "90"]

def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME/bin (or $CUDA_PATH/bin)."""
    found = shutil.which("nvcc")
    if found:
        return found
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.access(Path(home) / "bin" / "nvcc", os.X_OK):
            return str(Path(home) / "bin" / "nvcc")
    return None


def find_cxx() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise ConversionError("no C++ compiler found: install g++ (Debian/Ubuntu: apt-get install g++) or set CXX")
    return cxx


@lru_cache(maxsize=None)
def _tool_output(args: tuple[str, ...]) -> str:
    try:
        p = subprocess.run(list(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConversionError(f"cannot run {args[0]}: {e}") from e
    return p.stdout


def compiler_version(tool: str) -> str:
    return _tool_output((tool, "--version")).strip()


def native_flags(cxx: str, arch: str = "native") -> list[str]:
    """What -march=<arch> means to this compiler (the -m flags cc1 receives; for native: this host's CPU),
    for the cache key. An arch the compiler rejects is a ConversionError naming ONNX2FUSED_CPU_ARCH."""
    out = _tool_output((cxx, f"-march={arch}", "-E", "-v", "-x", "c++", "/dev/null"))
    bad = [l for l in out.splitlines() if "error" in l and "march" in l]
    if bad:
        raise ConversionError(f"CPU target {arch!r} (ONNX2FUSED_CPU_ARCH / --cpu-arch): {bad[0].strip()}")
    for line in out.splitlines():
        if "cc1" in line and "-march=" in line:
            return [t for t in line.split() if t.startswith("-m")]
    return [f"-march={arch}:" + hashlib.sha256(out.encode()).hexdigest()[:16]]


DEFAULT_CPU_ARCH = "native"


def cpu_arch() -> str:
    """The -march of the C++ kernels: $ONNX2FUSED_CPU_ARCH, default native (this host's CPU: the library
    then needs a CPU with the same instruction-set extensions; x86-64-v3 = any AVX2 x86 server)."""
    arch = os.environ.get("ONNX2FUSED_CPU_ARCH", "").strip() or DEFAULT_CPU_ARCH
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]*", arch):
        raise ConversionError(f"ONNX2FUSED_CPU_ARCH={arch!r}: expected a -march value such as native, "
                              "x86-64-v3 or armv8.2-a")
    return arch


def cpu_host_flags() -> list[str]:
    """HOST_FLAGS with the selected CPU target (cpu_arch) in place of -march=native."""
    return [f"-march={cpu_arch()}" if f == "-march=native" else f for f in HOST_FLAGS]


def cuda_archs() -> list[str]:
    env = os.environ.get("ONNX2FUSED_CUDA_ARCHS")
    if not env:
        return list(DEFAULT_CUDA_ARCHS)
    archs = [a.strip().replace("sm_", "").replace(".", "") for a in env.replace(";", ",").split(",") if a.strip()]
    if not archs or not all(a.rstrip("af").isdigit() for a in archs):
        raise ConversionError(f"ONNX2FUSED_CUDA_ARCHS={env!r}: expected a list like 80,90")
    return archs


def cuda_ptx_arch(archs: list[str] | None = None) -> str | None:
    """The virtual arch whose PTX is embedded beside the SASS, so that GPUs newer than every listed arch
    JIT-compile it at load: $ONNX2FUSED_CUDA_PTX = auto (default: the highest listed arch that is not
    arch-specific, e.g. 90 of 80,90; PTX of 90a runs on 9.0 only), off, or an arch such as 80."""
    archs = cuda_archs() if archs is None else archs
    env = os.environ.get("ONNX2FUSED_CUDA_PTX", "").strip().lower().replace("sm_", "").replace("compute_", "")
    if env in ("0", "off", "no", "none", "false"):
        return None
    if env in ("", "auto", "1", "on", "yes", "true"):
        portable = [a for a in archs if a.isdigit()]
        return max(portable, key=int) if portable else None
    if not env.isdigit():
        raise ConversionError(f"ONNX2FUSED_CUDA_PTX={env!r}: expected auto, off or an arch such as 90")
    return env


def nvcc_flags() -> list[str]:
    # --threads 0: the per-arch device compilations of one unit run in parallel (one unit per chain: the
    # cold build of a one-chain model is otherwise one arch after the other)
    flags = ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden", "-lineinfo",
             "--threads", "0"]
    archs = cuda_archs()
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    ptx = cuda_ptx_arch(archs)
    if ptx:   # code=compute_XX: PTX in the fatbinary (the same front-end pass as sm_XX's SASS when listed)
        flags += ["-gencode", f"arch=compute_{ptx},code=compute_{ptx}"]
    return flags


WIDE_SM90A_DEFINE = "-DONNX2FUSED_WIDE_SM90A"
SM90A_DEFINE = "-DONNX2FUSED_SM90A"     # a source marked `// onnx2fused-arch: sm_90a` has its sm_90a kernel
_SM90A_MARK = re.compile(r"^// onnx2fused-arch: sm_90a$", re.M)


def needs_sm90a(text: str) -> bool:
    """Whether a generated source asks for sm_90a in place of sm_90 (templates/cuda_wgmma.cu.j2: wgmma)."""
    return bool(_SM90A_MARK.search(text))


def wgmma_nvcc_flags(flags: list[str]) -> list[str]:
    """nvcc flags for a source marked sm_90a (the wgmma design): the gencodes of wide_nvcc_flags (sm_90
    becomes sm_90a; other archs keep theirs and run the source's fallback), and ONNX2FUSED_SM90A, which
    tells its host code that the Hopper kernel was compiled."""
    out = wide_nvcc_flags(flags)
    if WIDE_SM90A_DEFINE not in out:
        return out
    return [SM90A_DEFINE if f == WIDE_SM90A_DEFINE else f for f in out]


def wide_nvcc_flags(flags: list[str]) -> list[str]:
    """nvcc flags for a wide-design source (one that includes CUTLASS; plan/wide.py): its Hopper kernels
    (CUTLASS 3.x, wgmma + TMA) need the arch-specific target sm_90a, so the sm_90 gencode becomes
    sm_90a for these sources only (sm_90a SASS runs on compute capability 9.0 only, as sm_90 SASS
    does, so nothing is lost), and ONNX2FUSED_WIDE_SM90A tells their host code the kernels exist.
    Other archs keep their gencodes (the source's CUTLASS 2.x sm80 kernels serve them)."""
    out, sm90a = [], False
    for f in flags:
        if f in ("arch=compute_90,code=sm_90", "arch=compute_90a,code=sm_90a"):
            f, sm90a = "arch=compute_90a,code=sm_90a", True
        out.append(f)
    if sm90a and "arch=compute_90,code=compute_90" in out:
        # the embedded PTX (nvcc_flags): compute_90 is no longer compiled for SASS here, so it would cost a
        # pass of its own per unit; an older listed arch's PTX serves newer GPUs as well (they run the sm80
        # kernels: the Hopper ones are for 9.0 only)
        sass = [re.fullmatch(r"arch=compute_(\d+),code=sm_\1", f) for f in out]
        older = [m.group(1) for m in sass if m and int(m.group(1)) < 90]
        if older:
            top = max(older, key=int)
            out[out.index("arch=compute_90,code=compute_90")] = f"arch=compute_{top},code=compute_{top}"
    return out + ([WIDE_SM90A_DEFINE] if sm90a else [])


SM90A_GENCODE = "arch=compute_90a,code=sm_90a"
_SM90A_ONLY = re.compile(r"^// onnx2fused-arch: sm90a$", re.M)


def sm90a_only(text: str) -> bool:
    """Whether a generated source holds Hopper kernels only (templates/cuda_wide_instance.cu.j2's
    `onnx2fused-arch: sm90a` line): it runs on compute capability 9.0 only, so it compiles for sm_90a only."""
    return bool(_SM90A_ONLY.search(text))


def sm90a_nvcc_flags(flags: list[str]) -> list[str]:
    """nvcc flags for a source of Hopper kernels only: wide_nvcc_flags with the sm_90a gencode alone (the
    other archs' passes would compile its kernels to nothing, CUTLASS's arch guards, at the full cost of
    CUTLASS 3.x's front end each). No sm_90a in the list: wide_nvcc_flags (the unit compiles empty)."""
    wide = wide_nvcc_flags(flags)
    if SM90A_GENCODE not in wide:
        return wide
    out, i = [], 0
    while i < len(wide):
        if wide[i] == "-gencode" and i + 1 < len(wide):
            if wide[i + 1] == SM90A_GENCODE:
                out += wide[i:i + 2]
            i += 2
            continue
        out.append(wide[i])
        i += 1
    return out


def instance_nvcc_flags(flags: list[str]) -> list[str]:
    """A CUTLASS kernel instance unit's flags: `flags` without `-lineinfo`, unless ONNX2FUSED_LINEINFO=1.
    Line info changes no SASS (the GPU host's mnist instance: cuobjdump -sass identical) and costs a
    Hopper instance 5 of its 40 s of nvcc (benchmarks/RESULTS.md, seventeenth run); it only maps
    CUTLASS's own lines in Nsight's source view. The chain units, our kernels, keep it."""
    if os.environ.get("ONNX2FUSED_LINEINFO", "").strip() == "1":
        return list(flags)
    return [f for f in flags if f != "-lineinfo"]
