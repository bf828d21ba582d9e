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
from functools import lru_cache
from pathlib import Path
from typing import Callable

from . import build_pool
from ._version import __version__
from .errors import BuildError, ConversionError
from .headers import default_cache_dir, find_cutlass_headers, locate_ort_headers, needs_cutlass
from .resources import ort_plugin_dir
from .wide_params import INSTANCE_PREFIX

VERSION = 1  # bump when the build recipe changes in a way the key does not see

HOST_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-march=native", "-fvisibility=hidden", "-pthread",
              "-fopenmp-simd", "-fno-trapping-math", "-fno-math-errno"]  # the last two let activations vectorize
DEFAULT_CUDA_ARCHS = ["80", "90"]
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


# ------------------------------------------------------------------------------------------ tools
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


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def instance_nvcc_flags(flags: list[str]) -> list[str]:
    """A CUTLASS kernel instance unit's flags: `flags` without `-lineinfo`, unless ONNX2FUSED_LINEINFO=1.
    Line info changes no SASS (the GPU host's mnist instance: cuobjdump -sass identical) and costs a
    Hopper instance 5 of its 40 s of nvcc (benchmarks/RESULTS.md, seventeenth run); it only maps
    CUTLASS's own lines in Nsight's source view. The chain units, our kernels, keep it."""
    if os.environ.get("ONNX2FUSED_LINEINFO", "").strip() == "1":
        return list(flags)
    return [f for f in flags if f != "-lineinfo"]


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
            if cutlass and needs_cutlass({name: sources[name]}):
                # wide-design sources get sm_90a instead of sm_90 (wide_nvcc_flags); a unit of Hopper kernels
                # only (a CUTLASS 3.x kernel instance) sm_90a alone
                hopper = sm90a_only(sources[name])
                flags = sm90a_nvcc_flags(cu_flags) if hopper else wide_nvcc_flags(cu_flags)
                if name.startswith(INSTANCE_PREFIX):
                    flags = instance_nvcc_flags(flags)
                flags += ["-I", str(cutlass.path), "--expt-relaxed-constexpr"]
                add(name, [nvcc, *flags, *includes, "-c", src, "-o", "{obj}"], {"cutlass": cutlass.version},
                    build_pool.PEAK_MB_HOPPER if hopper else build_pool.PEAK_MB_CUTLASS)
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
    # the longest first (CUTLASS 3.x instances, then other CUTLASS units): the pool then ends together
    return sorted(out, key=lambda j: (0 if sm90a_only(sources[j.name]) else 1 if needs_cutlass({j.name: sources[j.name]})
                                      and j.name.endswith(".cu") else 2, j.name))


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
