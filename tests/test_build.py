"""build_plugin: content-addressed cache, verification, atomic/concurrent installs, clean failures."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onnx2fused import build as build_mod
from onnx2fused import targets
from onnx2fused import expr as ex
from onnx2fused.build import BuiltLibrary
from onnx2fused.targets import find_nvcc
from onnx2fused.library import build_plugin
from onnx2fused.errors import BuildError, ConversionError
from onnx2fused.spec import LayerSpec, MLPSpec

REPO = Path(__file__).resolve().parent.parent
SPEC = MLPSpec((LayerSpec(8, 24, True, ex.relu()), LayerSpec(24, 3, False, ex.identity())), io_dtype="f32")


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and p.name not in ("failed", "headers", "objects"))


def test_second_build_is_a_cache_hit(tmp_path):
    lines: list[str] = []
    first = build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path, progress=lines.append)
    assert isinstance(first, BuiltLibrary) and not first.cache_hit and first.build_seconds > 0
    assert first.path.name == f"libonnx2fused_{first.key}.so" and first.path.parent == tmp_path / first.key
    assert (first.sources_dir / f"{SPEC.name}_cpu.cc").is_file()
    assert (first.sources_dir / "plugin.cc").is_file() and (first.sources_dir / "registry.cc").is_file()
    assert any("built" in line for line in lines)
    second = build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path)
    assert second.cache_hit and second.path == first.path and second.build_seconds == 0.0
    assert entries(tmp_path) == [first.path.parent]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]


def test_key_changes_with_the_spec(tmp_path):
    a = build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path)
    other = MLPSpec((LayerSpec(8, 24, True, ex.tanh()), LayerSpec(24, 3, False, ex.identity())))
    b = build_plugin([other], with_cuda=False, cache_dir=tmp_path)
    assert a.key != b.key and not b.cache_hit


def test_corrupt_library_is_detected_and_rebuilt(tmp_path):
    first = build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path)
    good = first.path.read_bytes()
    with open(first.path, "r+b") as f:
        f.truncate(len(good) // 2)
    again = build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path)
    assert not again.cache_hit and again.path == first.path
    assert again.path.stat().st_size == len(good)
    manifest = json.loads((again.path.parent / "manifest.json").read_text())
    assert manifest["sha256"] == build_mod._sha256_file(again.path)
    # same size, one byte changed: only the hash can tell (detection only; the rebuild is shown above)
    entry = again.path.parent
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF
    again.path.write_bytes(bytes(data))
    assert build_mod._valid_entry(entry) is None
    again.path.write_bytes(good)
    assert build_mod._valid_entry(entry) == again.path
    # a manifest whose hash does not match the library (edited, or from another build)
    manifest_path = entry / "manifest.json"
    manifest_path.write_text(json.dumps(dict(manifest, sha256="0" * 64)))
    assert build_mod._valid_entry(entry) is None
    # a missing manifest counts as corrupt too
    (again.path.parent / "manifest.json").unlink()
    assert not build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path).cache_hit


def test_failed_compile_leaves_no_entry_and_names_the_log(tmp_path, monkeypatch):
    from onnx2fused import library
    real = library.render

    def broken(specs, with_cuda, cpu_enabled=None, plans=None):
        files = real(specs, with_cuda, cpu_enabled, plans)
        files[f"{SPEC.name}_cpu.cc"] += "\nthis is not C++;\n"
        return files

    monkeypatch.setattr(library, "render", broken)
    with pytest.raises(BuildError) as err:
        build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path)
    log = Path(str(err.value).split(" is in ")[-1].strip())
    assert log.name == "build.log" and log.parent.parent == tmp_path / "failed"
    assert "this is not C++" in log.read_text() or "error" in log.read_text()
    assert (log.parent / "sources" / f"{SPEC.name}_cpu.cc").is_file()
    assert entries(tmp_path) == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".build-")]


def test_unwritable_cache_is_a_conversion_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(ConversionError) as err:
        build_plugin([SPEC], with_cuda=False, cache_dir=blocker / "cache")
    assert not isinstance(err.value, BuildError)
    assert "cannot write the onnx2fused build cache" in str(err.value)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores permission bits")
def test_read_only_cache_is_a_conversion_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConversionError) as err:
            build_plugin([SPEC], with_cuda=False, cache_dir=ro)
        assert "ONNX2FUSED_CACHE" in str(err.value)
    finally:
        ro.chmod(0o755)


def test_concurrent_builds_from_two_processes_give_one_library(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from onnx2fused import expr as ex
        from onnx2fused.library import build_plugin
        from onnx2fused.spec import LayerSpec, MLPSpec
        spec = MLPSpec((LayerSpec(8, 24, True, ex.relu()), LayerSpec(24, 3, False, ex.identity())), io_dtype="f32")
        lib = build_plugin([spec], with_cuda=False, cache_dir=sys.argv[1])
        print(lib.path, lib.cache_hit)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    results = [o[0].split() for o in outs]
    assert results[0][0] == results[1][0]
    assert sorted(r[1] for r in results) == ["False", "True"]  # one built, the other waited and hit
    lib = Path(results[0][0])
    assert build_mod._valid_entry(lib.parent) == lib
    assert entries(tmp_path) == [lib.parent]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".build-", ".trash-"))]


def test_concurrent_builds_of_two_libraries_compile_their_shared_units_once(tmp_path):
    """Two processes build two different libraries at once that share units (a chain's CPU kernel, the
    hand-written plugin): each shared unit compiles once (the per-object lock; the second waits and links
    the first's object), and both libraries load. A wrapper compiler logs each compile."""
    log = tmp_path / "compiles.log"
    cxx = tmp_path / "logging-g++"
    real_cxx = targets.find_cxx()
    cxx.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for a in "$@"; do case "$a" in *.cc) echo "$(basename "$a")" >> {str(log)!r};; esac; done
        sleep 0.3
        exec {real_cxx!r} "$@"
    """))
    cxx.chmod(0o755)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from onnx2fused import expr as ex
        from onnx2fused.library import build_plugin
        from onnx2fused.spec import LayerSpec, MLPSpec
        spec = MLPSpec((LayerSpec(8, 24, True, ex.relu()), LayerSpec(24, 3, False, ex.identity())), io_dtype="f32")
        other = MLPSpec((LayerSpec(8, 16, True, ex.tanh()), LayerSpec(16, 3, True, ex.identity())), io_dtype="f32")
        specs = [spec] if sys.argv[2] == "one" else [spec, other]
        print(build_plugin(specs, with_cuda=False, cache_dir=sys.argv[1]).path)
    """)
    env = {**os.environ, "CXX": str(cxx)}
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "cache"), which], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for which in ("one", "two")]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    libs = [Path(o[0].strip()) for o in outs]
    assert libs[0] != libs[1] and all(lib.is_file() for lib in libs)
    compiled = log.read_text().split()
    spec_unit = next(n for n in compiled if n.startswith("FusedMLP_8x24x3"))
    assert compiled.count(spec_unit) == 1 and compiled.count("plugin.cc") == 1, compiled
    assert compiled.count("registry.cc") == 2   # each library's own registry (other chains listed)
    import ctypes
    for lib in libs:
        ctypes.CDLL(str(lib))


def test_cuda_archs_env(monkeypatch):
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", "sm_90, 100a")
    assert targets.cuda_archs() == ["90", "100a"]
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", "hopper")
    with pytest.raises(ConversionError):
        targets.cuda_archs()


@pytest.mark.cuda_build
@pytest.mark.skipif(find_nvcc() is None, reason="nvcc not found")
def test_build_compiles_cuda(tmp_path):
    """Compiles CUDA (slow): the library links with the CUDA kernels; running it needs a GPU."""
    spec = MLPSpec((LayerSpec(16, 32, True, ex.relu()), LayerSpec(32, 8, True, ex.identity())),
                   precision="fp32", io_dtype="f32")
    lib = build_plugin([spec], with_cuda=True, cache_dir=tmp_path)
    assert lib.with_cuda and not lib.cache_hit and lib.path.is_file()
    assert (lib.sources_dir / f"{spec.name}_cuda.cu").is_file()
    nm = shutil.which("nm")
    if nm:
        syms = subprocess.run([nm, "-D", "--defined-only", str(lib.path)], capture_output=True, text=True).stdout
        assert "RegisterCustomOps" in syms


def test_units_are_cached_on_their_own_so_a_new_library_compiles_only_what_differs(tmp_path, monkeypatch):
    """A second library that shares translation units with the first (same chain, another chain beside
    it) compiles only its new units, links, and works; the shared objects come from <cache>/objects."""
    compiled = []
    real = build_mod._compile

    def counting(args, cwd):
        if "-c" in args:
            compiled.append(Path(args[args.index("-c") + 1]).name)
        return real(args, cwd)

    monkeypatch.setattr(build_mod, "_compile", counting)
    build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path)
    first = sorted(compiled)
    assert f"{SPEC.name}_cpu.cc" in first and "plugin.cc" in first and "registry.cc" in first
    compiled.clear()
    other = MLPSpec((LayerSpec(8, 16, True, ex.tanh()), LayerSpec(16, 3, True, ex.identity())), io_dtype="f32")
    lines = []
    both = build_plugin([SPEC, other], with_cuda=False, cache_dir=tmp_path, progress=lines.append)
    assert sorted(compiled) == sorted([f"{other.name}_cpu.cc", "registry.cc"])  # the rest came from the cache
    assert any("2 of 4 translation units; 2 from the object cache" in x for x in lines), lines
    assert not both.cache_hit and len(list((tmp_path / "objects").glob("*.o"))) == 5
    import ctypes
    ctypes.CDLL(str(both.path))  # it loads: linked with -z defs, every symbol the registry names is defined
