"""Find, or fetch once, the ONNX Runtime C/C++ headers the plugin is compiled against.

The onnxruntime wheels ship no headers. In order, we use:
  1. `$ONNXRUNTIME_INCLUDE_DIR` (a folder holding `onnxruntime_cxx_api.h`),
  2. `/usr/include/onnxruntime` (Debian/Ubuntu `libonnxruntime-dev`),
  3. the cache: `<$ONNX2FUSED_CACHE or ~/.cache/onnx2fused>/headers/1.21.0/`,
  4. a fetch into that cache of Debian trixie's `libonnxruntime-dev` 1.21.0 .deb with apt-get (a private
     source list; the system's apt configuration is not touched), unpacked with dpkg -x and moved into
     place with an atomic rename.
Headers of an older version work with newer runtimes: the C API is append-only.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ConversionError

FETCH_VERSION = "1.21.0"
HEADER = "onnxruntime_cxx_api.h"
_DEB_SOURCE = ("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
               "http://deb.debian.org/debian trixie main\n")
HOW_TO = ("set ONNXRUNTIME_INCLUDE_DIR to the include/ folder of an ONNX Runtime release archive "
          "(https://github.com/microsoft/onnxruntime/releases), or install libonnxruntime-dev")


@dataclass(frozen=True)
class OrtHeaders:
    path: Path      # folder holding onnxruntime_cxx_api.h
    version: str    # e.g. "1.21.0" (ORT_API_VERSION when the exact release is unknown)
    source: str     # "env", "system", "cache", "fetched"


def default_cache_dir() -> Path:
    env = os.environ.get("ONNX2FUSED_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "onnx2fused"


def header_version(include_dir: Path) -> str:
    """The header version: a `VERSION` file beside them (ours), else `api<ORT_API_VERSION>`."""
    vf = include_dir / "VERSION"
    if vf.is_file():
        return vf.read_text().strip()
    try:
        text = (include_dir / "onnxruntime_c_api.h").read_text(errors="replace")
    except OSError:
        return "unknown"
    m = re.search(r"#define\s+ORT_API_VERSION\s+(\d+)", text)
    return f"api{m.group(1)}" if m else "unknown"


def _ok(d: Path) -> bool:
    return (d / HEADER).is_file()


def find_ort_headers(cache_dir: Path | str | None = None, fetch: bool = True, progress=None) -> Path:
    """The folder that holds `onnxruntime_cxx_api.h`. See `locate_ort_headers` for the version too."""
    return locate_ort_headers(cache_dir, fetch, progress).path


_found: dict = {}


def locate_ort_headers(cache_dir: Path | str | None = None, fetch: bool = True, progress=None) -> OrtHeaders:
    env = os.environ.get("ONNXRUNTIME_INCLUDE_DIR")
    if env:
        d = Path(env).expanduser()
        if not _ok(d):
            raise ConversionError(f"ONNXRUNTIME_INCLUDE_DIR={env} has no {HEADER}; {HOW_TO}")
        return OrtHeaders(d.resolve(), header_version(d), "env")
    sysdir = Path("/usr/include/onnxruntime")
    if _ok(sysdir):
        return OrtHeaders(sysdir, header_version(sysdir), "system")
    caches = [default_cache_dir()]
    if cache_dir:
        caches.insert(0, Path(cache_dir).expanduser())
    for cache in caches:
        target = cache / "headers" / FETCH_VERSION
        if _ok(target):
            return OrtHeaders(target, header_version(target), "cache")
    if not fetch:
        raise ConversionError(f"no ONNX Runtime headers found; {HOW_TO}")
    # fetch into the shared default cache when it is writable, else into the given one
    target = caches[-1] / "headers" / FETCH_VERSION
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(target.parent, os.W_OK):
            raise OSError("not writable")
    except OSError:
        target = caches[0] / "headers" / FETCH_VERSION
    _fetch(target, progress)
    return OrtHeaders(target, header_version(target), "fetched")


def _run(args: list[str], log: list[str], cwd: Path | None = None) -> None:
    p = subprocess.run(args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.append("$ " + " ".join(args) + "\n" + p.stdout)
    if p.returncode != 0:
        raise RuntimeError(f"{args[0]} exited with {p.returncode}")


def _fetch(target: Path, progress=None) -> None:
    if not (shutil.which("apt-get") and shutil.which("dpkg")):
        raise ConversionError(f"no ONNX Runtime headers found and no apt-get/dpkg to fetch them; {HOW_TO}")
    if progress:
        progress(f"fetching ONNX Runtime {FETCH_VERSION} headers (Debian libonnxruntime-dev) into {target}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
    except OSError as e:
        raise ConversionError(f"cannot write the header cache {target.parent}: {e}; {HOW_TO}") from e
    log: list[str] = []
    try:
        (work / "lists" / "partial").mkdir(parents=True)
        (work / "trixie.list").write_text(_DEB_SOURCE)
        opts = ["-o", f"Dir::Etc::SourceList={work / 'trixie.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
                "-o", f"Dir::State::Lists={work / 'lists'}", "-o", "Debug::NoLocking=1"]
        _run(["apt-get", *opts, "update"], log)
        _run(["apt-get", *opts, "download", f"libonnxruntime-dev={FETCH_VERSION}*"], log, cwd=work)
        debs = sorted(work.glob("libonnxruntime-dev_*.deb"))
        if not debs:
            raise RuntimeError("apt-get download produced no .deb")
        _run(["dpkg", "-x", str(debs[0]), str(work / "x")], log)
        inc = work / "x" / "usr" / "include" / "onnxruntime"
        if not _ok(inc):
            raise RuntimeError(f"the package holds no {HEADER}")
        (inc / "VERSION").write_text(FETCH_VERSION + "\n")
        staged = work / "include"
        os.replace(inc, staged)
        try:
            os.replace(staged, target)  # atomic; fails if another process got there first
        except OSError:
            if not _ok(target):
                raise
    except (RuntimeError, OSError) as e:
        tail = "".join(log)[-2000:]
        raise ConversionError(f"could not fetch the ONNX Runtime headers ({e}); {HOW_TO}\n{tail}") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------------------ CUTLASS
CUTLASS_HEADER = "cutlass/gemm/device/gemm.h"
CUTLASS_HOW_TO = ("pip install nvidia-cutlass (its headers are under cutlass_library/source/include), or set "
                  "ONNX2FUSED_CUTLASS_DIR to the include/ folder of a CUTLASS checkout")


@dataclass(frozen=True)
class CutlassHeaders:
    path: Path      # folder holding cutlass/ (and cute/)
    version: str    # e.g. "4.2.0" from cutlass/version.h, for the build-cache key
    source: str     # "env", "package"


def _cutlass_version(include_dir: Path) -> str:
    try:
        text = (include_dir / "cutlass" / "version.h").read_text(errors="replace")
    except OSError:
        return "unknown"
    parts = [re.search(rf"#define\s+CUTLASS_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def find_cutlass_headers() -> CutlassHeaders:
    """CUTLASS's include folder (header-only; the wide CUDA design needs it): `$ONNX2FUSED_CUTLASS_DIR`,
    else the installed `nvidia-cutlass` package. Nothing is fetched: GPU hosts may have no network, so
    the folder is carried there and named by the variable."""
    env = os.environ.get("ONNX2FUSED_CUTLASS_DIR")
    if env:
        d = Path(env).expanduser()
        if not (d / CUTLASS_HEADER).is_file():
            raise ConversionError(f"ONNX2FUSED_CUTLASS_DIR={env} has no {CUTLASS_HEADER}; {CUTLASS_HOW_TO}")
        return CutlassHeaders(d.resolve(), _cutlass_version(d), "env")
    try:
        import importlib.util
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    if spec and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            d = Path(loc) / "source" / "include"
            if (d / CUTLASS_HEADER).is_file():
                return CutlassHeaders(d.resolve(), _cutlass_version(d), "package")
    raise ConversionError(f"no CUTLASS headers found; {CUTLASS_HOW_TO}")


def needs_cutlass(sources: dict[str, str]) -> bool:
    """Whether any rendered CUDA source includes CUTLASS (only the wide design does)."""
    return any(name.endswith(".cu") and '#include "cutlass/' in text for name, text in sources.items())
