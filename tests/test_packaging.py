"""The wheel carries the templates and plugin sources, and installs into a fresh venv with a working CLI.

Slow: builds the wheel with `make wheel` in a copy of the sources (as the README says: no dev venv),
creates a venv (no system site-packages) and installs the wheel with its `cpu` extra and dependencies
from PyPI (onnx, jinja2, numpy, onnxruntime; no matplotlib, no torch).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# one xdist worker runs the whole module (with `--dist loadgroup`, as `make test` does), so the
# wheel and the venv are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("packaging")]

ROOT = Path(__file__).resolve().parents[1]
# what a source distribution of the project holds (copied so the build never writes into the checkout)
SOURCES = ("pyproject.toml", "setup.py", "README.md", "Makefile", "onnx2fused", "templates", "ort_plugin")
PLUGIN_SUFFIXES = (".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh")


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _sh(cmd, cwd, timeout=900):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=ignore)
        elif p.is_file():
            shutil.copy2(p, src / name)
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # the README's way, with the interpreter running the tests as PYTHON; the dev venv must not be needed
    _sh(["make", "wheel", f"PYTHON={sys.executable}"], cwd=src)
    assert not (src / ".venv").exists(), "make wheel created the dev venv"
    import onnx2fused
    (whl,) = (src / "dist").glob("onnx2fused-*.whl")
    assert whl.name == f"onnx2fused-{onnx2fused.__version__}-py3-none-any.whl"   # the name the README shows
    return whl


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = sorted(p.name for p in (ROOT / "templates").iterdir() if p.suffix in (".j2", ".cuh"))
    plugin = sorted(p.name for p in (ROOT / "ort_plugin").iterdir() if p.suffix in PLUGIN_SUFFIXES)
    assert templates, "templates/*.j2: none in the checkout"
    assert plugin, "ort_plugin/: no sources in the checkout"
    missing = [f"onnx2fused/_data/templates/{n}" for n in templates] + \
              [f"onnx2fused/_data/ort_plugin/{n}" for n in plugin]
    missing = [m for m in missing if m not in names]
    assert not missing, f"not in the wheel: {missing}"
    for pkg in ROOT.joinpath("onnx2fused").rglob("__init__.py"):
        rel = pkg.relative_to(ROOT).as_posix()
        assert rel in names, f"package {rel} not in the wheel"
    assert not any(n.startswith(("tests/", "models/", "templates/", "ort_plugin/")) for n in names)
    ep = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "onnx2fused = onnx2fused.cli:main" in zipfile.ZipFile(wheel).read(ep).decode()


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    v = tmp_path_factory.mktemp("venv") / "v"
    _sh([sys.executable, "-m", "venv", v], cwd=v.parent)  # no --system-site-packages: really fresh
    _sh([v / "bin" / "python", "-m", "pip", "install", "-q", f"{wheel}[cpu]"], cwd=v.parent)
    return v


def test_installed_package_is_self_contained(venv):
    out = _sh([venv / "bin" / "python", "-c",
               "import onnx2fused, pathlib; p = pathlib.Path(onnx2fused.__file__).parent;"
               "print(p); print(sorted(x.name for x in (p / '_data' / 'templates').glob('*.j2')));"
               "print(sorted(x.name for x in (p / '_data' / 'ort_plugin').iterdir()))"], cwd=venv.parent)
    pkg, templates, plugin = out.splitlines()
    assert str(venv) in pkg, f"imported onnx2fused from {pkg}, not from the fresh venv"
    assert templates != "[]" and plugin != "[]"


def test_cli_help(venv):
    out = _sh([venv / "bin" / "onnx2fused", "--help"], cwd=venv.parent)
    for cmd in ("convert", "inspect", "bench", "doctor", "export-triton"):
        assert cmd in out


def test_cli_inspect(venv):
    model = ROOT / "models" / "nerf.opset17.onnx"
    if not model.is_file():
        pytest.skip("models/nerf.opset17.onnx missing: run `make zoo`")
    out = _sh([venv / "bin" / "onnx2fused", "inspect", model], cwd=venv.parent)
    # the installed package finds nerf's one chain, its widths and activations
    assert "1 chain(s) to fuse" in out and "32->64->64->64->64->16" in out and "relu, relu, relu, relu, id" in out


def _sh_rc(cmd, cwd, timeout=900):
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr


def test_cli_doctor(venv):
    import json
    rc, out, err = _sh_rc([venv / "bin" / "onnx2fused", "doctor", "--json"], cwd=venv.parent)
    r = json.loads(out)
    assert rc == (0 if r["cpu_conversion_possible"] else 1), err
    checks = {c["name"]: c for c in r["checks"]}
    assert str(venv) in checks["python"]["data"]["executable"]
    assert checks["onnxruntime"]["data"]["distributions"] == ["onnxruntime"]   # the [cpu] extra, and only it
    if not shutil.which("nvidia-smi"):   # and no torch in the fresh venv: nothing can see a GPU
        assert checks["gpu"]["summary"].startswith("no GPU")


def test_cli_convert_bench_export_triton(venv, tmp_path):
    """The README's flow in the fresh venv: convert, bench (CPU-only onnxruntime: says there is no GPU),
    export-triton of the fused model."""
    model = ROOT / "models" / "nerf.opset17.onnx"
    if not model.is_file():
        pytest.skip("models/nerf.opset17.onnx missing: run `make zoo`")
    exe = venv / "bin" / "onnx2fused"
    src = tmp_path / "my_mlp.onnx"
    shutil.copyfile(model, src)
    out = _sh([exe, "convert", src, "--cpu-only", "--cache-dir", tmp_path / "cache", "-q"], cwd=tmp_path)
    assert "1 chain(s) fused" in out and (tmp_path / "my_mlp.fused.onnx2fused.so").is_file()

    rc, out, err = _sh_rc([exe, "bench", src, "--out", tmp_path / "bench"], cwd=tmp_path)
    assert rc == 2 and out == "", (rc, out, err)    # the [cpu] extra's onnxruntime has no CUDA EP: says so
    assert err.startswith("onnx2fused: error: no GPU") and "--cpu" in err and len(err.splitlines()) == 1
    # --cpu runs; no matplotlib in this venv: bench.json, and one line instead of the plot
    rc, out, err = _sh_rc([exe, "bench", src, "--cpu", "--batches", "256", "--reps", "2", "-q",
                           "--out", tmp_path / "bench"], cwd=tmp_path)
    assert rc == 0, err
    assert err.splitlines() == ['onnx2fused: no plot: matplotlib is not installed (pip install matplotlib, or '
                                'the "bench" extra)'], err
    assert (tmp_path / "bench" / "bench.json").is_file() and not (tmp_path / "bench" / "bench.png").exists()

    _sh([exe, "export-triton", tmp_path / "my_mlp.fused.onnx", tmp_path / "repo", "-q"], cwd=tmp_path)
    entry = tmp_path / "repo" / "my_mlp"
    assert (entry / "1" / "model.onnx").is_file() and (entry / "1" / "model.onnx2fused.so").is_file()
    config = (entry / "config.pbtxt").read_text()
    assert 'backend: "onnxruntime"' in config and 'op_library_filename: "/models/my_mlp/1/model.onnx2fused.so"' in config
    rc, out, err = _sh_rc([exe, "export-triton", tmp_path / "my_mlp.fused.onnx", tmp_path / "repo"], cwd=tmp_path)
    assert rc == 2 and err.startswith("onnx2fused: error: ") and "--force" in err
