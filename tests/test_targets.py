"""Build targets, for a library that is served elsewhere: the C++ kernels' -march (ONNX2FUSED_CPU_ARCH /
--cpu-arch, default native), the CUDA archs (ONNX2FUSED_CUDA_ARCHS / --cuda-archs) and the PTX embedded
for newer GPUs (ONNX2FUSED_CUDA_PTX / --cuda-ptx). No nvcc build here: the nvcc flags are checked as
lists; the CPU target by real (small) g++ builds."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from onnx2fused import build, cli as cli_mod, targets
from onnx2fused.errors import ConversionError
from cli_support import run_cli

ROOT = Path(__file__).resolve().parent.parent
NERF = ROOT / "models" / "nerf.opset17.onnx"
ENV = ("ONNX2FUSED_CPU_ARCH", "ONNX2FUSED_CUDA_ARCHS", "ONNX2FUSED_CUDA_PTX")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in ENV:
        monkeypatch.delenv(k, raising=False)


def gencodes(flags: list[str]) -> list[str]:
    return [flags[i + 1] for i, f in enumerate(flags) if f == "-gencode"]


def test_default_cuda_targets_embed_ptx_of_the_highest_arch():
    assert gencodes(targets.nvcc_flags()) == ["arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90",
                                            "arch=compute_90,code=compute_90"]


@pytest.mark.parametrize("archs, ptx, want", [
    ("80,86,89", None, "89"),                          # the highest listed
    ("sm_75, 80", None, "80"),
    ("80,90a", None, "80"),                           # PTX of 90a runs on 9.0 only: not a portable target
    ("90a", None, None),
    ("80,90", "off", None),
    ("80,90", "75", "75"),
    ("80,90", "compute_86", "86"),
])
def test_ptx_arch(monkeypatch, archs, ptx, want):
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", archs)
    if ptx is not None:
        monkeypatch.setenv("ONNX2FUSED_CUDA_PTX", ptx)
    assert targets.cuda_ptx_arch() == want
    codes = gencodes(targets.nvcc_flags())
    sass = [c for c in codes if ",code=sm_" in c]
    assert len(sass) == len(targets.cuda_archs())
    assert [c for c in codes if ",code=compute_" in c] == ([f"arch=compute_{want},code=compute_{want}"] if want else [])


def test_bad_ptx_value(monkeypatch):
    monkeypatch.setenv("ONNX2FUSED_CUDA_PTX", "newest")
    with pytest.raises(ConversionError, match="ONNX2FUSED_CUDA_PTX"):
        targets.nvcc_flags()


def test_wide_sources_keep_one_front_end_pass_per_arch():
    """Wide sources compile sm_90a instead of sm_90: their PTX is then the older listed arch's (whose pass
    runs anyway; newer GPUs run the sm80 kernels there) instead of a compute_90 pass of its own."""
    wide = gencodes(targets.wide_nvcc_flags(targets.nvcc_flags()))
    assert wide == ["arch=compute_80,code=sm_80", "arch=compute_90a,code=sm_90a", "arch=compute_80,code=compute_80"]
    only90 = ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]
    assert gencodes(targets.wide_nvcc_flags(only90)) == ["arch=compute_90a,code=sm_90a", "arch=compute_90,code=compute_90"]


def test_cpu_arch_in_the_host_flags(monkeypatch):
    assert "-march=native" in targets.cpu_host_flags()
    monkeypatch.setenv("ONNX2FUSED_CPU_ARCH", "x86-64-v3")
    flags = targets.cpu_host_flags()
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags
    assert targets.HOST_FLAGS.count("-march=native") == 1          # the module's list is untouched
    monkeypatch.setenv("ONNX2FUSED_CPU_ARCH", "x86-64; rm -rf /")
    with pytest.raises(ConversionError, match="ONNX2FUSED_CPU_ARCH"):
        targets.cpu_host_flags()


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 -march names")
def test_cli_cpu_arch_builds_another_library(tmp_path):
    """--cpu-arch x86-64-v3: a library of its own (the cache key covers the target), whose compile commands
    carry that -march; the command's environment is left as it was."""
    cache = tmp_path / "cache"
    libs = {}
    for arch in (None, "x86-64-v3"):
        out = tmp_path / f"{arch or 'native'}.fused.onnx"
        extra = ["--cpu-arch", arch] if arch else []
        p = run_cli("convert", NERF, "-o", out, "--cpu-only", "--cache-dir", cache, "--json", "-q",
                    "--precision", "fp16", *extra)
        assert p.returncode == 0, p.stderr
        libs[arch] = json.loads(p.stdout)["cached_library"]
    assert libs[None] != libs["x86-64-v3"]
    manifests = {a: json.loads((Path(lib).parent / "manifest.json").read_text()) for a, lib in libs.items()}
    assert manifests["x86-64-v3"]["key_parts"]["toolchain"]["native"][0] == "-march=x86-64-v3"
    assert manifests[None]["key_parts"]["toolchain"]["native"][0] != "-march=x86-64-v3"


@pytest.mark.parametrize("opt, value, says", [("--cpu-arch", "bogus99", "bogus99"),
                                              ("--cuda-archs", "hopper", "ONNX2FUSED_CUDA_ARCHS"),
                                              ("--cuda-ptx", "newest", "ONNX2FUSED_CUDA_PTX")])
def test_bad_target_is_one_line_and_writes_nothing(opt, value, says, tmp_path):
    out = tmp_path / "o" / "m.fused.onnx"
    out.parent.mkdir()
    p = run_cli("convert", NERF, "-o", out, "--cpu-only", "--cache-dir", tmp_path / "cache", opt, value)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnx2fused: error: ") and says in lines[0], p.stderr
    assert list(out.parent.iterdir()) == []


def test_targets_apply_to_the_command_only(monkeypatch):
    args = type("A", (), {"cpu_arch": "x86-64-v2", "cuda_archs": None, "cuda_ptx": "off"})()
    monkeypatch.setenv("ONNX2FUSED_CUDA_PTX", "80")
    with cli_mod.build_targets(args):
        assert targets.cpu_arch() == "x86-64-v2" and targets.cuda_ptx_arch() is None
    assert "ONNX2FUSED_CPU_ARCH" not in os.environ and os.environ["ONNX2FUSED_CUDA_PTX"] == "80"


def test_doctor_reports_the_targets(monkeypatch):
    from onnx2fused.doctor import check_targets
    c = check_targets()
    assert c.status == "ok" and c.data == {"cpu_arch": "native", "cuda_archs": ["80", "90"], "cuda_ptx": "90"}
    assert "-march=native" in c.summary and "PTX compute_90" in c.summary
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", "hopper")
    assert check_targets().status == "warn"


def test_export_triton_records_the_targets(tmp_path):
    p = run_cli("export-triton", NERF, tmp_path / "repo", "--cpu", "--cpu-arch", "x86-64-v3", "--json", "-q",
                "--cache-dir", tmp_path / "cache", "--precision", "fp16")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["targets"] == {"cpu_arch": "x86-64-v3"} and r["library_has_cuda"] is False
    p = run_cli("export-triton", NERF, tmp_path / "repo", "--cpu", "--force", "-q",
                "--cache-dir", tmp_path / "cache", "--precision", "fp16")
    assert p.returncode == 0 and "--cpu-arch" in p.stdout and "-march=native" in p.stdout   # the portability note


def test_native_flags_of_a_compiler_without_gcc_s_cc1_line(monkeypatch):
    """clang's -v output names no cc1 line with -march: the flags are the arch and a hash of that output,
    different for different outputs (so that two CPUs do not share a cache entry)."""
    outputs = iter(['clang -cc1 -triple x86_64 -target-cpu znver3 ...', 'clang -cc1 -target-cpu skylake ...'])
    monkeypatch.setattr(targets, "_tool_output", lambda args: next(outputs))
    a, b = targets.native_flags("clang++"), targets.native_flags("clang++")
    assert a[0].startswith("-march=native:") and b[0].startswith("-march=native:") and a != b
