"""Compile sources into one ONNX Runtime custom-op library, cached. Only compiles: what the sources are
(rendering, planning, kernel tuning) is decided before (library.py, convert.py).

    compile(sources, with_cuda) -> BuiltLibrary(path=<cache>/<key>/libonnx2fused_<key>.so, sources_dir, cache_hit, ...)

`sources` are the generated files ({name: text}); the hand-written ort_plugin/ files are added here.
Each translation unit's object is cached on its own (<cache>/objects/<key>.o, key = sha256 of its source,
the headers among `sources` it includes, its flags, the compiler versions, the ONNX Runtime header version
and VERSION: a unit whose text names no chain, such as a wide design's CUTLASS kernel instance, is one
object for every library that includes it), and the
library entry `<cache>/<key>/` (key = the objects' keys and the link line) holds the library, the
sources it was built from (`sources/`) and a manifest with the library's sha256, which is checked on
every hit (a truncated or corrupt library is rebuilt). Builds happen in a temp folder inside the cache
and are moved into place with one atomic rename, under an flock per key, so concurrent builders never
see a half-written entry. A failed compile leaves no entry, writes the compiler output to
`<cache>/failed/<key>/build.log` and raises BuildError naming it.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import build_pool
from ._version import __version__
from .errors import BuildError, ConversionError
from .headers import default_cache_dir, find_cutlass_headers, locate_ort_headers, needs_cutlass
from .resources import ort_plugin_dir
from .targets import (compiler_version, cpu_arch, cpu_host_flags, find_cxx, find_nvcc, instance_nvcc_flags,
                      native_flags, needs_sm90a, nvcc_flags, sm90a_nvcc_flags, sm90a_only, wgmma_nvcc_flags,
                      wide_nvcc_flags)
from .wide_params import INSTANCE_PREFIX

VERSION = 1  # bump when the build recipe changes in a way the key does not see

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class BuiltLibrary:
    path: Path             # the shared library
    sources_dir: Path      # the sources it was built from
    cache_hit: bool
    build_seconds: float   # 0.0 on a cache hit
    key: str = ""
    with_cuda: bool = False
    plans: dict = field(default_factory=dict)  # {spec name: the CUDA plan the library was rendered from}


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def included_sources(name: str, sources: dict[str, str]) -> list[str]:
    """The files of `sources` that `name` includes (`#include "..."`, transitively, whatever the
    preprocessor conditions around them), sorted: with the unit's own text, all of `sources` its object
    can depend on."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for inc in _INCLUDE.findall(sources[todo.pop()]):
            if inc in sources and inc not in seen and inc != name:
                seen.add(inc)
                todo.append(inc)
    return sorted(seen)


# ------------------------------------------------------------------------------------------ cache
def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _valid_entry(entry: Path) -> Path | None:
    """The library of a complete, uncorrupted entry, else None."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        lib = entry / manifest["library"]
        if lib.name != Path(manifest["library"]).name or not lib.is_file():
            return None
        if lib.stat().st_size != manifest["size"] or _sha256_file(lib) != manifest["sha256"]:
            return None
        return lib
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _unwritable(cache: Path, e: OSError) -> ConversionError:
    why = "it is full" if e.errno == errno.ENOSPC else f"{e.strerror or e}"
    return ConversionError(f"cannot write the onnx2fused build cache {cache} ({why}); set ONNX2FUSED_CACHE "
                           "to a writable folder with free space, or pass cache_dir")


def _ensure_writable(cache: Path) -> None:
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=cache)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _unwritable(cache, e) from e


def _compile(args: list[str], cwd: Path) -> tuple[int, str]:
    try:
        p = subprocess.run(args, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        return 127, f"cannot run {args[0]}: {e}"
    return p.returncode, p.stdout


# ------------------------------------------------------------------------------------------ build
def plugin_sources(with_cuda: bool) -> dict[str, str]:
    """The hand-written ort_plugin/ files compiled into every library (CUDA ones only with CUDA)."""
    kinds = (".cc", ".h", ".cu") if with_cuda else (".cc", ".h")
    return {p.name: p.read_text() for p in sorted(ort_plugin_dir().iterdir()) if p.is_file() and p.suffix in kinds}


@dataclass(frozen=True)
class _Job:
    """One translation unit: `name` (the source), its compile command
    with the placeholders {src} (sources folder), {inc} (ORT headers) and {obj} (the object written), and
    the key of its object in the cache (everything that can change the object, never a temp path)."""
    name: str
    args: tuple[str, ...]
    key: str
    peak_mb: int = build_pool.PEAK_MB_OTHER   # the compile's estimated peak memory (build_pool)

    def command(self, src: Path, inc: Path, obj: Path) -> list[str]:
        return [a.format(src=src, inc=inc, obj=obj) for a in self.args]


def cache_folder(cache_dir=None) -> Path:
    """The build cache, absolute (compilers run in a temp cwd), created and checked writable."""
    cache = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()).resolve()
    _ensure_writable(cache)
    return cache


def compile(sources: dict[str, str], with_cuda: bool, cache_dir=None,
            say: Callable[[str], None] | None = None) -> BuiltLibrary:
    """Compile `sources` (generated, plus ort_plugin/ added here) into one library in the cache.

    Each translation unit's object is cached on its own under <cache>/objects/, keyed by its source,
    the headers of `sources` it includes, its flags and the compiler: a library that shares units with an
    earlier one (another precision of one chain, an unchanged registry's neighbours, the CUTLASS kernel
    instances of another model's wide chains) compiles only what differs, then links.
    """
    say = say or (lambda msg: None)
    jobs_cap = build_pool.jobs_cap()   # a bad ONNX2FUSED_BUILD_JOBS stops here, before any work
    cache = cache_folder(cache_dir)
    nvcc = find_nvcc() if with_cuda else None
    if with_cuda and not nvcc:
        raise ConversionError("CUDA kernels need nvcc: put it on PATH or set CUDA_HOME, or build with with_cuda=False")
    cxx = find_cxx()
    headers = locate_ort_headers(cache, progress=say)
    sources = dict(sources)
    plugin = plugin_sources(with_cuda)
    for name, text in plugin.items():
        if name in sources:
            raise ConversionError(f"generated file {name} clashes with ort_plugin/{name}")
        sources[name] = text

    host_flags = cpu_host_flags() + (["-DONNX2FUSED_WITH_CUDA"] if with_cuda else [])
    cu_flags = nvcc_flags() + ["-DONNX2FUSED_WITH_CUDA"] if with_cuda else []
    cutlass = find_cutlass_headers() if with_cuda and needs_cutlass(sources) else None  # wide design only
    toolchain = {
        "version": VERSION,
        "onnx2fused": __version__,
        "native": native_flags(cxx, cpu_arch()),   # what the -march in the host flags means here
        "cxx": compiler_version(cxx),
        "nvcc": compiler_version(nvcc) if with_cuda else "",
        "ort_headers": headers.version,
    }
    jobs = _jobs(sources, cxx, nvcc, host_flags, cu_flags, set(plugin) if with_cuda else set(), toolchain,
                 cutlass)
    link = _link_args(cxx, nvcc, with_cuda)
    key = _sha(json.dumps({"version": VERSION, "objects": sorted(j.key for j in jobs), "link": link}))[:16]
    entry = cache / key
    lib_name = f"libonnx2fused_{key}.so"

    lib = _valid_entry(entry)
    if lib:
        return BuiltLibrary(lib, entry / "sources", True, 0.0, key, with_cuda)
    lock_path = cache / f".{key}.lock"
    try:
        lock = open(lock_path, "a+")
    except OSError as e:
        raise _unwritable(cache, e) from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lib = _valid_entry(entry)  # another process may have built it while we waited
        if lib:
            return BuiltLibrary(lib, entry / "sources", True, 0.0, key, with_cuda)
        if entry.exists():
            say(f"cached plugin {entry} is incomplete or corrupt; rebuilding")
        t0 = time.monotonic()
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache))
        except OSError as e:
            raise _unwritable(cache, e) from e
        try:
            _build_into(tmp, sources, jobs, link, with_cuda, lib_name, headers.path, cache, key,
                        {"toolchain": toolchain, "objects": {j.name: j.key for j in jobs}}, say, t0, jobs_cap)
            _install(tmp, entry, cache)
        except OSError as e:
            raise _unwritable(cache, e) from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        lib = _valid_entry(entry)
        if not lib:
            raise BuildError(f"the plugin built into {entry} does not verify; remove that folder and retry")
        seconds = time.monotonic() - t0
        say(f"built {lib} in {seconds:.1f} s")
        return BuiltLibrary(lib, entry / "sources", False, seconds, key, with_cuda)


def _install(tmp: Path, entry: Path, cache: Path) -> None:
    """Move the finished build to `entry` atomically; an old (corrupt) entry is moved aside first."""
    if entry.exists():
        trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=cache))
        os.replace(entry, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(tmp / "entry", entry)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _jobs(sources: dict[str, str], cxx: str, nvcc: str | None, host_flags: list[str], cu_flags: list[str],
          nvcc_hosted: set[str], toolchain: dict, cutlass=None) -> list[_Job]:
    """The translation units of `sources`, each with its command and object key: the toolchain, the
    command, the unit's text and the texts of the headers of `sources` it includes (included_sources;
    not the library's other files), and CUTLASS's version where it includes CUTLASS."""
    includes = ["-I", "{src}", "-I", "{inc}"]
    out = []

    def add(name: str, args: list[str], extra: dict | None = None, peak_mb: int = build_pool.PEAK_MB_OTHER):
        key = _sha(json.dumps({"toolchain": toolchain, "args": args, "source": name, "text": _sha(sources[name]),
                               "headers": {h: _sha(sources[h]) for h in included_sources(name, sources)},
                               **(extra or {})}, sort_keys=True))
        out.append(_Job(name, tuple(args), key, peak_mb))

    for name in sorted(sources):
        src = "{src}/" + name
        if name.endswith(".cu"):
            uses_cutlass = bool(cutlass) and needs_cutlass({name: sources[name]})
            hopper = sm90a_only(sources[name])
            if uses_cutlass or hopper:
                # wide-design sources get sm_90a instead of sm_90 (wide_nvcc_flags); a unit of Hopper kernels
                # only (a kernel instance: CUTLASS 3.x's, or our own GEMM's without CUTLASS) sm_90a alone
                flags = sm90a_nvcc_flags(cu_flags) if hopper else wide_nvcc_flags(cu_flags)
                if name.startswith(INSTANCE_PREFIX):
                    flags = instance_nvcc_flags(flags)
                extra, peak = None, build_pool.PEAK_MB_OTHER
                if uses_cutlass:
                    flags += ["-I", str(cutlass.path), "--expt-relaxed-constexpr"]
                    extra = {"cutlass": cutlass.version}
                    peak = build_pool.PEAK_MB_HOPPER if hopper else build_pool.PEAK_MB_CUTLASS
                add(name, [nvcc, *flags, *includes, "-c", src, "-o", "{obj}"], extra, peak)
            elif needs_sm90a(sources[name]):    # the wgmma design: sm_90a in place of sm_90 (wgmma_nvcc_flags)
                add(name, [nvcc, *wgmma_nvcc_flags(cu_flags), *includes, "-c", src, "-o", "{obj}"])
            else:
                add(name, [nvcc, *cu_flags, *includes, "-c", src, "-o", "{obj}"])
        elif name.endswith(".cc"):
            if name in nvcc_hosted:  # hand-written host code that calls the CUDA runtime: nvcc knows its headers
                xflags = ",".join(f for f in host_flags if f != "-pthread")
                add(name, [nvcc, "-std=c++17", "-O3", "-Xcompiler", xflags, "-DONNX2FUSED_WITH_CUDA",
                           *includes, "-c", src, "-o", "{obj}"])
            else:
                add(name, [cxx, *host_flags, *includes, "-c", src, "-o", "{obj}"])
    # the longest first: the heaviest compiles are the longest (CUTLASS 3.x instances, then the other
    # CUTLASS units), so the pool then ends together
    return sorted(out, key=lambda j: (-j.peak_mb, j.name))


def _link_args(cxx: str, nvcc: str | None, with_cuda: bool) -> list[str]:
    """The link command before its output and objects (`-o LIB OBJECTS...` and the tail follow)."""
    if with_cuda:
        return [nvcc, "-shared", "-Xcompiler", "-fPIC", "-cudart", "static"]
    return [cxx, "-shared", "-pthread"]


def _link_tail(with_cuda: bool) -> list[str]:
    return ["-Xlinker", "-z,defs", "-lpthread"] if with_cuda else ["-Wl,-z,defs"]


def _cached_object(cache: Path, job: _Job) -> Path:
    return cache / "objects" / f"{job.key[:32]}.o"


@contextmanager
def _object_lock(cache: Path, job: _Job):
    """An exclusive lock on one unit's object across processes (flock on objects/.<key>.lock)."""
    with open(cache / "objects" / f".{job.key[:32]}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _publish_object(built: Path, cached: Path) -> None:
    """Copy a compiled object into the object cache atomically, as soon as it compiled: the object is
    keyed by everything that makes it, so it is good for any library, even if this build fails later."""
    fd, part = tempfile.mkstemp(prefix=".obj-", dir=cached.parent)
    os.close(fd)
    shutil.copyfile(built, part)
    os.replace(part, cached)


def _build_into(tmp: Path, sources: dict[str, str], jobs: list[_Job], link: list[str], with_cuda: bool,
                lib_name: str, include: Path, cache: Path, key: str, key_parts: dict, say, t0: float,
                jobs_cap: int | None = None) -> None:
    out = tmp / "entry"
    src = out / "sources"
    obj = tmp / "obj"
    src.mkdir(parents=True)
    obj.mkdir()
    for name, text in sources.items():
        (src / name).write_text(text)
    todo = [j for j in jobs if not _cached_object(cache, j).is_file()]
    reused = len(jobs) - len(todo)
    say(f"compiling {len(todo)} of {len(jobs)} translation units{' (with CUDA)' if with_cuda else ''}"
        + (f"; {reused} from the object cache" if reused else ""))
    done = [0]

    (cache / "objects").mkdir(exist_ok=True)

    def compile_one(job: _Job) -> tuple[int, str]:
        # One compile of a unit at a time across processes: a concurrent build of another library that
        # shares it (a CUTLASS instance: ~40 s, ~3.3 GB) waits for this one and links its object.
        with _object_lock(cache, job):
            if _cached_object(cache, job).is_file():
                done[0] += 1
                say(f"  {job.name} from the object cache, built meanwhile ({done[0]}/{len(todo)})")
                return 0, "(from the object cache: a concurrent build compiled it)"
            target = obj / (job.name + ".o")
            rc, text = _compile(job.command(src, include, target), tmp)
            if rc == 0:
                _publish_object(target, _cached_object(cache, job))
                done[0] += 1
                say(f"  compiled {job.name} ({done[0]}/{len(todo)}, {time.monotonic() - t0:.1f} s)")
        return rc, text

    results = build_pool.run_all(todo, compile_one, lambda j: j.peak_mb, build_pool.max_workers(len(todo), jobs_cap),
                                 build_pool.available_memory_mb(), say)
    log = [f"$ {' '.join(job.command(src, include, obj / (job.name + '.o')))}\n{text}" for job, rc, text in results]
    failed = [job.name + (" (killed twice: out of memory?)" if build_pool.was_killed(rc, text) else "")
              for job, rc, text in results if rc != 0]
    if not failed:
        objs = [str(obj / (j.name + ".o")) if (obj / (j.name + ".o")).is_file() else str(_cached_object(cache, j))
                for j in jobs]
        cmd = [*link, "-o", str(out / lib_name), *objs, *_link_tail(with_cuda)]
        rc, text = _compile(cmd, tmp)
        log.append(f"$ {' '.join(cmd)}\n{text}")
        if rc != 0:
            failed = ["the link"]
    if failed:
        fail_dir = cache / "failed" / key
        shutil.rmtree(fail_dir, ignore_errors=True)
        (fail_dir / "sources").mkdir(parents=True)
        for name, text in sources.items():
            (fail_dir / "sources" / name).write_text(text)
        log_path = fail_dir / "build.log"
        log_path.write_text("\n".join(log))
        raise BuildError(f"compiling the plugin failed ({', '.join(failed)}); the compiler output is in {log_path}")
    lib = out / lib_name
    manifest = {"library": lib_name, "sha256": _sha256_file(lib), "size": lib.stat().st_size, "key": key,
                "key_parts": key_parts, "onnx2fused": __version__}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
