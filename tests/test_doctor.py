"""`onnx2fused doctor`: what it finds on this host, the fix for each gap, and its exit status."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cli_support import run_cli
from onnx2fused import doctor
from onnx2fused.targets import find_nvcc
from onnx2fused.errors import ConversionError

ROOT = Path(__file__).resolve().parent.parent


def cli(*args, env_extra=None):
    return run_cli("doctor", *args, env_extra=env_extra, timeout=300)


def by_name(checks) -> dict:
    return {c["name"] if isinstance(c, dict) else c.name: c for c in checks}


def test_json_reports_this_host(tmp_path):
    p = cli("--json", "--cache-dir", tmp_path / "cache")
    r = json.loads(p.stdout)
    checks = by_name(r["checks"])
    assert set(checks) == {"python", "cxx", "nvcc", "gpu", "onnxruntime", "headers", "cache", "tuning", "targets"}
    assert p.returncode == (0 if r["cpu_conversion_possible"] else 1)
    for c in r["checks"]:
        assert c["status"] in ("ok", "warn", "missing")
        assert (c["fix"] is None) == (c["status"] == "ok"), c

    import onnxruntime as ort
    assert checks["onnxruntime"]["data"]["version"] == ort.__version__
    assert checks["onnxruntime"]["data"]["providers"] == ort.get_available_providers()
    assert checks["cache"]["data"] == {"path": str(tmp_path / "cache"), "exists": False, "writable": True}
    nvcc = find_nvcc()
    assert (checks["nvcc"]["status"] == "ok") == bool(nvcc)
    if nvcc:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
        assert f"release {checks['nvcc']['data']['version']}" in out
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    assert (checks["cxx"]["status"] == "ok") == bool(cxx)
    if not shutil.which("nvidia-smi") and "CUDAExecutionProvider" not in ort.get_available_providers():
        assert checks["gpu"]["summary"].startswith("no GPU") and checks["gpu"]["data"]["gpus"] == []


def test_text_report_has_a_fix_under_each_gap():
    p = cli()
    lines = p.stdout.splitlines()
    assert lines[-1] in ("CPU conversion: possible", "CPU conversion: NOT possible (fix the 'missing' lines above)")
    assert (p.returncode == 0) == (lines[-1] == "CPU conversion: possible")
    for k, line in enumerate(lines[:-1]):
        parts = line.split()
        if parts and parts[0] in ("python", "cxx", "nvcc", "gpu", "onnxruntime", "headers", "cache") \
                and parts[1] in ("warn", "missing"):
            assert lines[k + 1].strip().startswith("fix: "), line


def run_main(capsys, *argv) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    rc = doctor.main(parser.parse_args(["--json", *map(str, argv)]))
    return rc, json.loads(capsys.readouterr().out)


def test_no_compiler_means_no_conversion(monkeypatch, capsys):
    from onnx2fused import targets

    def no_cxx():
        raise ConversionError("no C++ compiler found")
    monkeypatch.setattr(targets, "find_cxx", no_cxx)
    rc, r = run_main(capsys)
    c = by_name(r["checks"])["cxx"]
    assert rc == 1 and not r["cpu_conversion_possible"]
    assert c["status"] == "missing" and "g++" in c["fix"]


def test_bad_header_dir_is_missing_with_the_fix(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("ONNXRUNTIME_INCLUDE_DIR", str(tmp_path))    # holds no onnxruntime_cxx_api.h
    rc, r = run_main(capsys)
    h = by_name(r["checks"])["headers"]
    assert rc == 1 and h["status"] == "missing"
    assert str(tmp_path) in h["summary"] and "ONNXRUNTIME_INCLUDE_DIR" in h["fix"]


def test_headers_found_from_env(monkeypatch, capsys, tmp_path):
    (tmp_path / "onnxruntime_cxx_api.h").write_text("// stub\n")
    (tmp_path / "onnxruntime_c_api.h").write_text("#define ORT_API_VERSION 23\n")
    monkeypatch.setenv("ONNXRUNTIME_INCLUDE_DIR", str(tmp_path))
    rc, r = run_main(capsys)
    h = by_name(r["checks"])["headers"]
    assert h["status"] == "ok" and h["data"] == {"path": str(tmp_path.resolve()), "version": "api23", "source": "env"}


@pytest.mark.parametrize("has_apt", [True, False])
def test_headers_absent_fetchable_or_not(monkeypatch, capsys, tmp_path, has_apt):
    from onnx2fused import headers
    monkeypatch.delenv("ONNXRUNTIME_INCLUDE_DIR", raising=False)

    def not_found(cache_dir=None, fetch=True, progress=None):
        assert fetch is False, "doctor must never fetch"
        raise ConversionError("no ONNX Runtime headers found")
    monkeypatch.setattr(headers, "locate_ort_headers", not_found)
    real_which = shutil.which
    monkeypatch.setattr(doctor.shutil, "which",
                        lambda n: (f"/usr/bin/{n}" if has_apt else None) if n in ("apt-get", "dpkg") else real_which(n))
    rc, r = run_main(capsys, "--cache-dir", tmp_path)
    h = by_name(r["checks"])["headers"]
    if has_apt:
        assert h["status"] == "warn" and "will fetch" in h["summary"] and "ONNXRUNTIME_INCLUDE_DIR" in h["fix"]
    else:
        assert h["status"] == "missing" and rc == 1 and "ONNXRUNTIME_INCLUDE_DIR" in h["fix"]


def test_unwritable_cache(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    rc, r = run_main(capsys, "--cache-dir", blocker / "cache")   # a folder can never be made under a file
    c = by_name(r["checks"])["cache"]
    assert rc == 1 and c["status"] == "missing" and "ONNX2FUSED_CACHE" in c["fix"]
    assert not (blocker.is_dir())


def test_gpu_from_nvidia_smi(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 9.0, 580.65, 81559 MiB'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    c = doctor.check_gpu()
    assert c.status == "ok" and "NVIDIA H100 80GB HBM3 (compute capability 9.0)" in c.summary
    smi.write_text("#!/bin/sh\necho 'Tesla T4, 7.5, 535.0, 15360 MiB'\n")
    c = doctor.check_gpu()
    assert c.status == "warn" and "8.0" in c.summary and c.fix


@pytest.mark.parametrize("gpu,env,want", [
    (("NVIDIA H100 80GB HBM3", 90), None, "on: wide chains are tuned on NVIDIA H100 80GB HBM3"),
    (("NVIDIA H100 80GB HBM3", 90), "0", "off (ONNX2FUSED_TUNE=0)"),
    (("NVIDIA A100-SXM4-80GB", 80), None, "not applicable (NVIDIA A100-SXM4-80GB is not a Hopper GPU)"),
    (None, None, "not applicable (no GPU)"),
])
def test_tuning_line(monkeypatch, tmp_path, gpu, env, want):
    from onnx2fused import wide_tune
    monkeypatch.setattr(wide_tune, "current_gpu", lambda: wide_tune.Gpu(*gpu) if gpu else None)
    if env is None:
        monkeypatch.delenv(wide_tune.TUNE_ENV, raising=False)
    else:
        monkeypatch.setenv(wide_tune.TUNE_ENV, env)
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "FusedMLP_x-NVIDIA-H100-sm90.json").write_text("{}")
    c = doctor.check_tuning(tmp_path)
    assert c.status == "ok" and c.summary.startswith(want), c.summary
    assert c.summary.endswith(f"1 choice(s) cached in {tmp_path / 'tune'}") and c.data["cached"] == 1
