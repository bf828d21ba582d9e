"""`onnx2fused export-triton`: the repository layout, config.pbtxt against Triton's ModelConfig schema,
batching rules, library path, and refusals (one line, exit 2, nothing written). CPU-only builds."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

import onnx2fused
from onnx2fused.triton import LIBRARY_FILE, export_triton, render_config
from cli_support import run_cli
from onnx_builders import G

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


def cli(*args, cwd=None):
    return run_cli(*args, cwd=cwd, timeout=600)


def parse_config(path: Path):
    """config.pbtxt parsed into Triton's ModelConfig (fails on any field or value the schema lacks)."""
    mc = pytest.importorskip("tritonclient.grpc.model_config_pb2",
                             reason="tritonclient[grpc] (Triton's model-config schema) is not installed")
    from google.protobuf import text_format
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def _tree(d: Path) -> dict:
    return {p.relative_to(d): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("o2f-triton-cache")


@pytest.fixture(scope="module")
def fused_nerf(tmp_path_factory, cache):
    d = tmp_path_factory.mktemp("fused")
    out = d / "nerf.fused.onnx"
    onnx2fused.convert(MODELS / "nerf.opset17.onnx", out, cache_dir=cache, with_cuda=False)
    return out


def test_fused_model_repository(fused_nerf, tmp_path):
    entry = export_triton(fused_nerf, tmp_path / "repo")
    assert entry == tmp_path / "repo" / "nerf"
    assert sorted(str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file()) == \
        ["1/model.onnx", f"1/{LIBRARY_FILE}", "config.pbtxt"]
    src_lib = fused_nerf.with_name("nerf.fused.onnx2fused.so")
    assert (entry / "1" / LIBRARY_FILE).read_bytes() == src_lib.read_bytes()
    assert not [p for p in (tmp_path / "repo").iterdir() if p.name.startswith(".")], "temp folder left behind"

    c = parse_config(entry / "config.pbtxt")
    assert c.name == "nerf" and c.backend == "onnxruntime" and c.platform == "onnxruntime_onnx"
    assert c.max_batch_size > 0 and c.dynamic_batching.max_queue_delay_microseconds == 100
    assert [(i.name, i.data_type, list(i.dims)) for i in c.input] == [("x", 11, [32])]   # 11 = TYPE_FP32
    assert [(o.name, o.data_type, list(o.dims)) for o in c.output] == [("y", 11, [16])]
    (group,) = c.instance_group
    assert group.kind == 1 and group.count == 1 and list(group.gpus) == []          # 1 = KIND_GPU
    assert list(c.model_operations.op_library_filename) == [f"/models/nerf/1/{LIBRARY_FILE}"]

    # the copied model still names its library (relative), so onnx2fused's own session opens it there
    x = np.random.default_rng(0).standard_normal((7, 32)).astype(np.float32)
    a = onnx2fused.InferenceSession(entry / "1" / "model.onnx", providers=["CPUExecutionProvider"])
    b = onnx2fused.InferenceSession(fused_nerf, providers=["CPUExecutionProvider"])
    assert a.plugin_path == (entry / "1" / LIBRARY_FILE).resolve()
    np.testing.assert_array_equal(a.run(None, {"x": x})[0], b.run(None, {"x": x})[0])


def test_original_model_is_converted_first(cache, tmp_path):
    """ffn3d: rank 3 ([B, S, 64]), weights in external data: dims keep the symbolic sequence as -1."""
    entry = export_triton(MODELS / "ffn3d.dynamo.onnx", tmp_path / "repo", name="ffn", cache_dir=cache,
                          with_cuda=False, kind="KIND_CPU", repository_root="/srv/triton/")
    c = parse_config(entry / "config.pbtxt")
    assert [list(i.dims) for i in c.input] == [[-1, 64]] and [list(o.dims) for o in c.output] == [[-1, 64]]
    assert c.instance_group[0].kind == 2                                            # 2 = KIND_CPU
    assert list(c.model_operations.op_library_filename) == [f"/srv/triton/ffn/1/{LIBRARY_FILE}"]
    m = onnx.load(str(entry / "1" / "model.onnx"), load_external_data=False)
    assert any(n.domain == "onnx2fused" for n in m.graph.node)
    assert {p.key: p.value for p in m.metadata_props}["onnx2fused.plugin"] == LIBRARY_FILE
    assert (entry / "1" / LIBRARY_FILE).is_file()


def test_static_batch_gets_no_batching(cache, tmp_path):
    g = G()
    g.op("Relu", [g.linear("x", 8, 16, name="fc0")], name="r", outputs=["h"])
    g.linear("h", 16, 4, name="fc1")
    g.nodes[-1].output[0] = "y"
    src = tmp_path / "static.onnx"
    onnx.save(g.model([("x", [4, 8])], [("y", [4, 4])]), str(src))
    entry = export_triton(src, tmp_path / "repo", cache_dir=cache, with_cuda=False)
    c = parse_config(entry / "config.pbtxt")
    assert c.max_batch_size == 0 and not c.HasField("dynamic_batching")
    assert list(c.input[0].dims) == [4, 8] and list(c.output[0].dims) == [4, 4]


def test_nothing_to_fuse_has_no_op_library(cache, tmp_path):
    g = G()
    g.op("Softmax", ["x"], name="sm", outputs=["y"])
    src = tmp_path / "plain.onnx"
    onnx.save(g.model([("x", ["B", 8])], [("y", ["B", 8])]), str(src))
    entry = export_triton(src, tmp_path / "repo", cache_dir=cache, with_cuda=False)
    c = parse_config(entry / "config.pbtxt")
    assert not c.HasField("model_operations")
    assert sorted(p.name for p in (entry / "1").iterdir()) == ["model.onnx"]


def test_render_config_options_and_fp16():
    ins = [("x", "TYPE_FP16", [None, 3]), ("mask", "TYPE_BOOL", [None])]
    outs = [("y", "TYPE_FP16", [None, 2])]
    text = render_config("m", ins, outs, library="/opt/lib/model.onnx2fused.so", gpus=[0, 2], instances=3,
                         max_batch_size=64, max_queue_delay_us=0)
    c = parse_config_text(text)
    assert c.max_batch_size == 64 and list(c.instance_group[0].gpus) == [0, 2] and c.instance_group[0].count == 3
    assert c.input[0].data_type == 10 and list(c.input[0].dims) == [3]             # 10 = TYPE_FP16
    # a tensor that is only [batch] becomes dims [1] reshaped to a scalar per batch row
    assert list(c.input[1].dims) == [1] and list(c.input[1].reshape.shape) == [] and c.input[1].HasField("reshape")
    assert list(c.model_operations.op_library_filename) == ["/opt/lib/model.onnx2fused.so"]


def parse_config_text(text: str):
    mc = pytest.importorskip("tritonclient.grpc.model_config_pb2",
                             reason="tritonclient[grpc] (Triton's model-config schema) is not installed")
    from google.protobuf import text_format
    return text_format.Parse(text, mc.ModelConfig())


def test_cli_options_and_force(fused_nerf, tmp_path):
    repo = tmp_path / "repo"
    p = cli("export-triton", fused_nerf, repo, "--cpu", "--library-dir", "/opt/o2f", "--name", "n1",
            "--max-batch-size", "256")
    assert p.returncode == 0, p.stderr
    c = parse_config(repo / "n1" / "config.pbtxt")
    assert c.instance_group[0].kind == 2 and c.max_batch_size == 256
    assert list(c.model_operations.op_library_filename) == [f"/opt/o2f/{LIBRARY_FILE}"]

    before = _tree(repo)
    p = cli("export-triton", fused_nerf, repo, "--name", "n1", "--gpus", "1")
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1 and "--force" in p.stderr
    assert _tree(repo) == before
    p = cli("export-triton", fused_nerf, repo, "--name", "n1", "--gpus", "1", "--force")
    assert p.returncode == 0, p.stderr
    c = parse_config(repo / "n1" / "config.pbtxt")
    assert c.instance_group[0].kind == 1 and list(c.instance_group[0].gpus) == [1]
    assert sorted(x.name for x in repo.iterdir()) == ["n1"]     # the old entry and the stage are gone


@pytest.mark.parametrize("case", ["not_onnx", "missing", "relative_library_dir", "relative_root", "bad_gpus", "gpus_with_cpu",
                                  "bad_name", "parent_missing", "missing_library"])
def test_bad_input_one_line_exit_2(case, fused_nerf, tmp_path):
    model, extra, repo = fused_nerf, [], tmp_path / "repo"
    if case == "not_onnx":
        model = tmp_path / "junk.onnx"
        model.write_text("not a model\n")
    elif case == "missing":
        model = tmp_path / "nope.onnx"
    elif case == "relative_library_dir":
        extra = ["--library-dir", "lib"]
    elif case == "relative_root":
        extra = ["--repository-root", "models"]
    elif case == "bad_gpus":
        extra = ["--gpus", "0,a"]
    elif case == "gpus_with_cpu":
        extra = ["--gpus", "0", "--cpu"]
    elif case == "bad_name":
        extra = ["--name", "a/b"]
    elif case == "parent_missing":
        repo = tmp_path / "no" / "repo"
    elif case == "missing_library":   # a fused model whose library was not copied along
        model = tmp_path / "lonely.fused.onnx"
        shutil.copyfile(fused_nerf, model)
    before = _tree(tmp_path)
    p = cli("export-triton", model, repo, *extra)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnx2fused: error: "), p.stderr
    assert _tree(tmp_path) == before, "something was written"


def test_failed_conversion_leaves_nothing(monkeypatch, tmp_path):
    """A conversion failing half-way (after writing into the stage) leaves no OUT_DIR and no temp folder."""
    convert_mod = sys.modules["onnx2fused.convert"]    # (the package's name `convert` is the function)

    def failing_convert(src, dest, **kw):
        Path(dest).write_bytes(b"half a model")
        raise onnx2fused.ValidationError("validation failed: output 'y': relative L2 error 1 exceeds 0.002")
    monkeypatch.setattr(convert_mod, "convert", failing_convert)
    with pytest.raises(onnx2fused.ValidationError):
        export_triton(MODELS / "nerf.opset17.onnx", tmp_path / "repo")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "repo").mkdir()           # an OUT_DIR that existed before is kept, empty as it was
    with pytest.raises(onnx2fused.ValidationError):
        export_triton(MODELS / "nerf.opset17.onnx", tmp_path / "repo")
    assert list(tmp_path.iterdir()) == [tmp_path / "repo"] and list((tmp_path / "repo").iterdir()) == []


def test_json_report_matches_what_was_written(cache, tmp_path):
    """--json: the entry, its files, the config's fields and the library path, as written."""
    import json
    repo = tmp_path / "repo"
    p = cli("export-triton", MODELS / "nerf.opset17.onnx", repo, "--cpu-only", "--cache-dir", cache, "--json",
            "-q", "--name", "nj", "--gpus", "0", "--instances", "2")
    assert p.returncode == 0 and p.stderr == "", p.stderr
    r = json.loads(p.stdout)
    entry = repo / "nj"
    assert r["path"] == str(entry) and r["name"] == "nj" and r["version"] == 1 and r["converted"] is True
    assert r["files"] == sorted(str(q.relative_to(entry)) for q in entry.rglob("*") if q.is_file())
    assert r["files"] == ["1/model.onnx", f"1/{LIBRARY_FILE}", "config.pbtxt"]
    assert r["config"] == str(entry / "config.pbtxt") and r["model"] == str(entry / "1" / "model.onnx")
    c = parse_config(entry / "config.pbtxt")
    assert list(c.model_operations.op_library_filename) == [r["op_library_filename"]]
    assert r["kind"] == "KIND_GPU" and r["gpus"] == [0] and r["instances"] == 2 == c.instance_group[0].count
    assert r["max_batch_size"] == c.max_batch_size == 1024 and r["dynamic_batching"] is True
    assert r["inputs"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [32]}]
    assert r["outputs"] == [{"name": "y", "data_type": "TYPE_FP32", "dims": [16]}]
    # a GPU instance group with a CPU-only library: said, in the JSON as on stderr
    assert r["library_has_cuda"] is False and any("KIND_GPU" in w for w in r["warnings"]), r["warnings"]


def test_cpu_instances_build_no_cuda_and_do_not_warn_about_gpus(cache, tmp_path):
    """--cpu (KIND_CPU): ORT's CPU EP runs the model, so no CUDA kernels are built (even with nvcc on
    PATH) and nothing is said about KIND_GPU."""
    import json
    repo = tmp_path / "repo"
    p = cli("export-triton", MODELS / "nerf.opset17.onnx", repo, "--cpu", "--cache-dir", cache, "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["kind"] == "KIND_CPU" and r["gpus"] is None and r["library_has_cuda"] is False
    assert r["warnings"] == [] and "KIND_GPU" not in p.stderr and "warning" not in p.stderr
    assert parse_config(repo / "nerf.opset17" / "config.pbtxt").instance_group[0].kind == 2   # KIND_CPU


def test_fused_model_json(fused_nerf, tmp_path):
    import json
    p = cli("export-triton", fused_nerf, tmp_path / "repo", "--json", "-q")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["converted"] is False and r["library_has_cuda"] is None and r["name"] == "nerf"
    assert r["op_library_filename"] == f"/models/nerf/1/{LIBRARY_FILE}"
