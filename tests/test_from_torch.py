"""`onnx2fused.from_torch`: dynamo export, convert, validate, ready session; outputs equal torch's. CPU only."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnx2fused
from onnx2fused.validate import CPU_TOLERANCE

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("o2f-torch-cache")


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.SiLU(),
                               torch.nn.Linear(32, 5))


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_sequential_matches_torch(cache, tmp_path):
    m = mlp().train()
    fused = onnx2fused.from_torch(m, torch.randn(8, 12), tmp_path / "mlp.fused.onnx", cache_dir=cache, with_cuda=False)
    assert m.training, "the module's mode was not restored"
    assert fused.path == tmp_path / "mlp.fused.onnx" and fused.path.is_file()
    assert fused.exported_path == tmp_path / "mlp.exported.onnx" and fused.exported_path.is_file()
    assert isinstance(fused.session, onnx2fused.InferenceSession)
    assert fused.session.plugin_path == (tmp_path / "mlp.fused.onnx2fused.so").resolve()
    r = fused.result
    assert len(r.chains) == 1 and r.chains[0].widths == [12, 32, 32, 5] and r.validation.passed
    assert r.chains[0].activations[:2] == ["relu", "silu"]

    exported = onnx.load(str(fused.exported_path), load_external_data=False)
    assert exported.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic batch
    f = onnx.load(str(fused.path))
    assert [n.domain for n in f.graph.node].count("onnx2fused") == 1

    # another batch size than the example's: the batch dimension is dynamic; inputs not seen at export
    m.eval()
    for rows in (1, 37):
        x = torch.randn(rows, 12)
        with torch.no_grad():
            want = m(x).numpy()
        assert np.abs(want).max() > 0
        got = fused.run(x)[0]
        assert got.shape == want.shape and got.dtype == np.float32
        assert rel_l2(got, want) <= 2 * CPU_TOLERANCE
    assert set(fused.torch_error) == set(fused.output_names) and max(fused.torch_error.values()) <= 2 * CPU_TOLERANCE


def test_static_batch_and_default_path(cache):
    m = mlp(1)
    fused = onnx2fused.from_torch(m, torch.randn(4, 12), dynamic_batch=False, cache_dir=cache, with_cuda=False,
                                  precision="fp32")
    assert fused.path.name == "model.fused.onnx" and fused.path.is_file()
    dim0 = onnx.load(str(fused.path)).graph.input[0].type.tensor_type.shape.dim[0]
    assert dim0.dim_value == 4
    with torch.no_grad():
        want = m(torch.ones(4, 12)).numpy()
    assert rel_l2(fused.run(np.ones((4, 12), np.float32))[0], want) <= 2 * CPU_TOLERANCE
    assert fused.result.precision == "fp32"


def test_refusals_write_nothing(tmp_path):
    with pytest.raises(onnx2fused.ConversionError, match="fp8"):
        onnx2fused.from_torch(mlp(), torch.randn(2, 12), tmp_path / "a.fused.onnx", precision="fp8")
    with pytest.raises(onnx2fused.ConversionError, match="nn.Module"):
        onnx2fused.from_torch(lambda x: x, torch.randn(2, 12), tmp_path / "a.fused.onnx")
    with pytest.raises(onnx2fused.ConversionError, match="tensor"):
        onnx2fused.from_torch(mlp(), [1.0, 2.0], tmp_path / "a.fused.onnx")
    with pytest.raises(onnx2fused.ConversionError, match="does not exist"):
        onnx2fused.from_torch(mlp(), torch.randn(2, 12), tmp_path / "no" / "a.fused.onnx")
    assert list(tmp_path.iterdir()) == []


def test_import_does_not_import_torch():
    code = ("import sys, onnx2fused; assert 'torch' not in sys.modules, 'torch imported';"
            "assert 'onnxruntime' not in sys.modules;"
            "from onnx2fused.torch_export import from_torch; assert onnx2fused.from_torch is from_torch")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr


def test_missing_onnxscript_is_one_clear_error(tmp_path):
    """Without onnxscript the dynamo exporter cannot run: a ConversionError naming the extra, before any
    export, and nothing written."""
    code = ("import sys; sys.modules['onnxscript'] = None\n"
            "import torch, onnx2fused\n"
            "m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
            "try:\n"
            "    onnx2fused.from_torch(m, torch.randn(3, 4), sys.argv[1])\n"
            "except onnx2fused.ConversionError as e:\n"
            "    print(e)\n"
            "else:\n"
            "    sys.exit('no error')\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.fused.onnx")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "onnxscript" in p.stdout and 'pip install "onnx2fused[torch]"' in p.stdout
    assert "torch and" not in p.stdout          # torch itself is there
    assert list(tmp_path.iterdir()) == []


def test_torch_extra_has_the_exporter_dependencies():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {d.split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip() for d in extras["torch"]}
    assert {"torch", "onnxscript"} <= names
