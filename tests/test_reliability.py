"""Reliability and security of `convert` (issue 6): hostile names, odd paths, a full or read-only cache,
concurrent conversions, fp16 range with calibration inputs, and the plugin at run time on the CPU EP
(bad inputs, batch 0, NaN/Inf against stock ORT, threads, several sessions and libraries in one process).

Everything is CPU-only. Module-wide build cache (its path holds spaces, quotes and non-ASCII itself), so
the few distinct kernels here compile once.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

ort = pytest.importorskip("onnxruntime")

import onnx2fused  # noqa: E402
from onnx2fused import build as build_mod  # noqa: E402
from onnx2fused import cli  # noqa: E402
from onnx2fused import validate as val  # noqa: E402
from onnx2fused.errors import ValidationError  # noqa: E402
from onnx2fused.passes import find_chains  # noqa: E402

from onnx_builders import G, mlp, run  # noqa: E402
from thread_support import run_threads  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
ODD = "d ir 'q\" ü日本 $(touch pwned) `touch pwned`"   # a folder name no shell could pass through intact
HOSTILE = ['q"uote', "back\\slash", "new\nline", "end*/comment", "#include <stdlib.h>", "ünï©ødé 日本",
           "'single'", "${HOME}", "/* open"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("o2f-rel") / ODD / "cache"


def cli_in_process(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def one_error_line(rc: int, err: str) -> str:
    lines = err.splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("onnx2fused: error: "), (rc, err)
    return lines[0]


def stock(model_path, feeds):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"]).run(None, feeds)


# ------------------------------------------------------------------------------------------ hostile names
def hostile_model() -> onnx.ModelProto:
    """x -> fc0 -> relu -> fc1 -> y where every name and string the model carries is hostile."""
    all_of_them = "|".join(HOSTILE)
    g = G()
    x, h0, r0, y = "x" + HOSTILE[0] + HOSTILE[5], "h" + HOSTILE[2], "r" + HOSTILE[4], "y" + HOSTILE[3] + HOSTILE[5]
    g.linear(x, 8, 16, name="fc0" + HOSTILE[1])
    g.nodes[-1].output[0] = h0
    g.op("Relu", [h0], name="relu" + HOSTILE[3], outputs=[r0])
    g.linear(r0, 16, 4, name="fc1" + HOSTILE[8])
    g.nodes[-1].output[0] = y
    for k, t in enumerate(g.inits):  # weight names too
        old, t.name = t.name, f"w{k}{HOSTILE[k % len(HOSTILE)]}"
        for n in g.nodes:
            n.input[:] = [t.name if i == old else i for i in n.input]
    m = g.model([(x, ["B" + HOSTILE[6], 8])], [(y, ["B" + HOSTILE[6], 4])])
    m.graph.name = "graph" + all_of_them
    m.doc_string = m.graph.doc_string = all_of_them
    for n in m.graph.node:
        n.doc_string = all_of_them
    m.producer_name, m.producer_version, m.domain = all_of_them, all_of_them, all_of_them
    m.metadata_props.add(key="key" + all_of_them, value="value" + all_of_them)
    onnx.checker.check_model(m)
    return m


def test_hostile_names_never_reach_the_generated_sources(tmp_path, cache):
    src = tmp_path / "hostile.onnx"
    model = hostile_model()
    onnx.save(model, str(src))
    res = onnx2fused.convert(src, tmp_path / "out.onnx", cache_dir=cache, with_cuda=False)
    assert res.validation.passed and len(res.chains) == 1

    sources = Path(res.cached_library).parent / "sources"
    texts = {p.name: p.read_text(encoding="utf-8") for p in sources.iterdir()}
    assert any(name.endswith("_cpu.cc") for name in texts) and "registry.cc" in texts
    generated = {n: t for n, t in texts.items() if n not in {p.name for p in (ROOT / "ort_plugin").iterdir()}}
    for name, text in generated.items():
        assert text.isascii(), name
        for s in HOSTILE:
            assert s not in text, f"{s!r} in {name}"
        for n in model.graph.node:
            assert n.name not in text, f"node name {n.name!r} in {name}"
        for t in model.graph.initializer:
            assert t.name not in text, f"tensor name {t.name!r} in {name}"

    # the fused model keeps the names and strings exactly, and runs with its plugin
    fused = onnx.load(str(tmp_path / "out.onnx"))
    assert fused.graph.input[0].name == model.graph.input[0].name
    assert fused.graph.output[0].name == model.graph.output[0].name
    assert fused.doc_string == model.doc_string and fused.graph.name == model.graph.name
    meta = {p.key: p.value for p in fused.metadata_props}
    assert meta["key" + "|".join(HOSTILE)] == "value" + "|".join(HOSTILE)
    x = np.random.default_rng(3).standard_normal((5, 8)).astype(np.float32)
    sess = onnx2fused.InferenceSession(tmp_path / "out.onnx", providers=["CPUExecutionProvider"])
    got = sess.run(None, {model.graph.input[0].name: x})[0]
    ref = stock(src, {model.graph.input[0].name: x})[0]
    assert np.abs(ref).max() > 0
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)
    # the CLI report survives a name with a newline: the error/report lines stay lines of their own
    rc, out, err = cli_in_process(["inspect", src])
    assert rc == 0 and err == "" and "1 chain(s)" in out


# ------------------------------------------------------------------------------------------ odd paths
def test_paths_with_spaces_quotes_and_non_ascii_and_no_shell(tmp_path, monkeypatch):
    """Input, output and cache under odd names; the compilers run from argument lists, never a shell."""
    base = tmp_path / ODD
    src_dir, out_dir, fresh_cache = base / "in put", base / "out 'é'", base / "ca che"
    src_dir.mkdir(parents=True)
    out_dir.mkdir()
    src = src_dir / "m $(touch pwned) ü.onnx"
    onnx.save(mlp([8, 12, 4]), str(src))  # a fresh cache: the compilers really run here
    out = out_dir / "fü sed \"1\".onnx"
    calls = []
    real = subprocess.run

    def spy(args, *a, **kw):
        calls.append((args, kw.get("shell", False)))
        return real(args, *a, **kw)

    monkeypatch.setattr(build_mod.subprocess, "run", spy)
    monkeypatch.chdir(base)
    rc, stdout, err = cli_in_process(["convert", src, "-o", out, "--cpu-only", "--cache-dir", fresh_cache, "--json"])
    assert rc == 0, err
    r = json.loads(stdout)
    assert r["validation"]["passed"] and not r["cache_hit"]
    assert Path(r["cached_library"]).is_relative_to(fresh_cache)
    assert out.is_file() and Path(r["library_path"]) == out_dir / 'fü sed "1".onnx2fused.so'
    compiles = [a for a, _ in calls if "-c" in a or "-shared" in a]
    assert compiles and all(isinstance(a, list) and not shell for a, shell in calls), calls
    assert any(str(fresh_cache) in arg for a in compiles for arg in a)  # the odd path went through intact
    # a shell would have run `touch pwned` in some working directory: nothing of the kind exists
    assert not list(tmp_path.rglob("pwned")) and not (Path.cwd() / "pwned").exists()
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    got = onnx2fused.InferenceSession(out, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, stock(src, {"x": x})[0], rtol=1e-4, atol=1e-5)


def test_an_onnxruntime_failure_is_still_one_stderr_line(tmp_path, cache):
    """ORT logs kernel failures straight to fd 2: validation must keep them off, so that the command's
    stderr stays the one error line (checked in a real process, where fd 2 is the terminal)."""
    model = mlp([8, 16, 4], act="Relu")
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "K"  # validation feeds K = 5: Gemm fails
    src = tmp_path / "m.onnx"
    onnx.save(model, str(src))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "onnx2fused", "convert", str(src), "--cpu-only", "--quiet",
                        "--cache-dir", str(cache)], env=env, capture_output=True, text=True, timeout=300)
    line = one_error_line(p.returncode, p.stderr)
    assert "stock onnxruntime fails on the original model" in line
    assert sorted(q.name for q in tmp_path.iterdir()) == ["m.onnx"]


# ------------------------------------------------------------------------------------------ the cache
def test_concurrent_conversions_of_one_model_share_one_library(tmp_path):
    """Three processes convert the same model into an empty cache at once."""
    fresh = tmp_path / "cache"
    onnx.save(mlp([8, 12, 4]), str(tmp_path / "m.onnx"))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-m", "onnx2fused", "convert", str(tmp_path / "m.onnx"),
                               "-o", str(tmp_path / f"out{k}.onnx"), "--cpu-only", "--quiet", "--json",
                               "--cache-dir", str(fresh)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1] for o in outs]
    reports = [json.loads(o[0]) for o in outs]
    assert len({r["cached_library"] for r in reports}) == 1
    assert sorted(r["cache_hit"] for r in reports) == [False, True, True]  # one built, two waited for it
    entries = [p for p in fresh.iterdir() if p.is_dir() and p.name not in ("headers", "failed", "objects")]
    assert len(entries) == 1 and build_mod._valid_entry(entries[0]) == Path(reports[0]["cached_library"])
    assert not [p for p in fresh.iterdir() if p.name.startswith((".build-", ".trash-"))]
    libs = {(tmp_path / f"out{k}.onnx2fused.so").read_bytes() for k in range(3)}
    assert len(libs) == 1 and libs == {Path(reports[0]["cached_library"]).read_bytes()}


def _enospc(*a, **kw):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_cache_is_one_clear_error_line(tmp_path, monkeypatch):
    """The disk fills up while the sources are written: exit 2, one line, no entry or temp folder left."""
    monkeypatch.setattr(Path, "write_text", _enospc)
    fresh = tmp_path / "cache"
    rc, out, err = cli_in_process(["convert", MODELS / "nobias.opset17.onnx", "-o", tmp_path / "o.onnx",
                                   "--cpu-only", "--cache-dir", fresh, "--quiet"])
    line = one_error_line(rc, err)
    assert "build cache" in line and "it is full" in line and "ONNX2FUSED_CACHE" in line
    assert not list(tmp_path.glob("o.*"))
    assert not [p for p in fresh.iterdir() if p.name not in ("headers",) and not p.name.endswith(".lock")]


def test_read_only_cache_is_one_clear_error_line(tmp_path, monkeypatch):
    """A read-only file system (simulated: the tests may run as root, which ignores permission bits)."""
    def erofs(*a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "ro"))

    monkeypatch.setattr(build_mod.tempfile, "mkstemp", erofs)
    rc, out, err = cli_in_process(["convert", MODELS / "nobias.opset17.onnx", "-o", tmp_path / "o.onnx",
                                   "--cpu-only", "--cache-dir", tmp_path / "ro", "--quiet"])
    line = one_error_line(rc, err)
    assert "cannot write the onnx2fused build cache" in line and "Read-only file system" in line
    assert not list(tmp_path.glob("o.*"))


# ------------------------------------------------------------------------------------------ numerics
def _calibration_model() -> tuple[onnx.ModelProto, float]:
    """x -> fc0 -> relu -> fc1 -> y whose hidden peak on the random validation inputs is ~1e3 (fine in fp16);
    returns the model and that peak's scale factor to 1e5 (beyond fp16) for calibration inputs."""
    m = mlp([8, 16, 4], act="Relu")
    inits = {t.name: t for t in m.graph.initializer}
    fc0 = next(n for n in m.graph.node if n.name == "fc0")
    for name in fc0.input[1:]:  # bias-free scaling of layer 0: the relu output scales linearly with x
        t = inits[name]
        scale = np.float32(250.0) if name == fc0.input[1] else np.float32(0.0)
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * scale, name))
    return m, 1e5


def _hidden_peak(model, x) -> float:
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    relu_out = next(n for n in probe.graph.node if n.op_type == "Relu").output[0]
    probe.graph.output.append(onnx.helper.make_tensor_value_info(relu_out, onnx.TensorProto.FLOAT, None))
    return float(np.abs(run(probe, {"x": x})[1]).max())


def test_fp16_range_uses_the_calibration_inputs(tmp_path, cache):
    """Automatic precision judges the fp16 range of a GPU build on the user's inputs too: random inputs
    alone see no risk, calibration data with larger values moves the chain to bf16, naming the peak."""
    import importlib
    conv = importlib.import_module("onnx2fused.convert")
    model, target = _calibration_model()
    random_peak = max(_hidden_peak(model, f["x"]) for _, f in val.random_inputs(model))
    assert 100 < random_peak < val.FP16_WARN  # random inputs alone see no risk ...
    chains = find_chains(model).chains
    cases, _ = val.validation_cases(model)
    assert [c.precision for c in conv.initial_precisions(model, chains, cases, True, lambda s: None)] == ["fp16"]

    # ... calibration data with larger values does: the measured peak is the calibration one
    x = np.random.default_rng(9).standard_normal((64, 8)).astype(np.float32)
    x *= np.float32(target / _hidden_peak(model, x))
    peak = _hidden_peak(model, x)
    assert peak > val.FP16_MAX
    cases, _ = val.validation_cases(model, {"x": x})
    (choice,) = conv.initial_precisions(model, chains, cases, True, lambda s: None)
    assert choice.precision == "bf16" and "overflow" in choice.why
    assert float(choice.why.split("reach ")[1].split(" >")[0]) == pytest.approx(peak, rel=1e-3)
    # a CPU-only library computes in fp32: the calibration data passes there, fp16 label and all
    src = tmp_path / "m.onnx"
    onnx.save(model, str(src))
    res = onnx2fused.convert(src, tmp_path / "b.onnx", inputs={"x": x}, cache_dir=cache, with_cuda=False)
    assert res.validation.passed and res.chains[0].precision == "fp16" and not res.warnings

def tanh_model() -> onnx.ModelProto:
    """9 -> 24 -> 16 -> 5 with Tanh: widths <= 64, so the plugin's CPU kernel (not the fallback) runs it."""
    return mlp([9, 24, 16, 5], act="Tanh")


@pytest.fixture(scope="module")
def converted(tmp_path_factory, cache):
    """A ReLU and a Tanh MLP converted CPU-only (two libraries): {name: (original path, fused path)}.
    The ReLU one has the kernel of the hostile-names model: a cache hit when that test ran first."""
    d = tmp_path_factory.mktemp("converted")
    onnx.save(mlp([8, 16, 4], act="Relu"), str(d / "relu.onnx"))
    onnx.save(tanh_model(), str(d / "tanh.onnx"))
    out = {}
    for name in ("relu", "tanh"):
        src = d / f"{name}.onnx"
        res = onnx2fused.convert(src, d / f"{name}.fused.onnx", cache_dir=cache, with_cuda=False)
        assert res.validation.passed and "fused CPU kernel" in res.chains[0].cuda_plan
        out[name] = (src, d / f"{name}.fused.onnx")
    return out


def fused_session(path, threads=2, lib=None):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if lib is not None:
        so.register_custom_ops_library(str(lib))
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return onnx2fused.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def assert_plugin_ran(path, k):
    """The fused node must run the plugin's kernel, not the stock-op fallback: checked via the profiler."""
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(path).parent / "prof")
    sess = onnx2fused.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    sess.run(None, {"x": np.zeros((2, k), np.float32)})
    trace = json.loads(Path(sess.end_profiling()).read_text())
    ops = {e["args"].get("op_name") for e in trace if e.get("cat") == "Node"}
    assert any(o and o.startswith("FusedMLP_") for o in ops), ops


def test_bad_inputs_are_ort_errors_and_the_process_lives(converted, tmp_path):
    src, fused = converted["relu"]
    model = onnx.load(str(fused))
    # make X's declared shape unknown so that only the plugin's own checks stand between bad input and kernel
    model.graph.input[0].type.tensor_type.ClearField("shape")
    loose = fused.parent / "loose.onnx"
    onnx.save(model, str(loose))
    assert_plugin_ran(loose, 8)
    sess = fused_session(loose)
    good = np.random.default_rng(1).standard_normal((7, 8)).astype(np.float32)
    for bad, expect in [(np.ones((4, 9), np.float32), "[4, 9]"), (np.ones((8,), np.float32), "rank >= 2"),
                        (np.array(1.0, np.float32), "rank >= 2"), (np.ones((2, 3, 7), np.float32), "[2, 3, 7]")]:
        with pytest.raises(Exception) as err:
            sess.run(None, {"x": bad})
        assert expect in str(err.value) and "[..., 8]" in str(err.value), str(err.value)
        np.testing.assert_allclose(sess.run(None, {"x": good})[0], stock(src, {"x": good})[0], rtol=1e-4, atol=1e-5)
    for dtype in (np.float64, np.float16, np.int32):  # ORT checks the element type against the graph
        with pytest.raises(Exception) as err:
            sess.run(None, {"x": good.astype(dtype)})
        assert "tensor(float)" in str(err.value) or "float32" in str(err.value), str(err.value)
    np.testing.assert_allclose(sess.run(None, {"x": good})[0], stock(src, {"x": good})[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["relu", "tanh"])
def test_batch_zero_gives_an_empty_output(converted, name):
    src, fused = converted[name]
    sess = fused_session(fused)
    k = sess.get_inputs()[0].shape[-1]
    y = sess.run(None, {"x": np.zeros((0, k), np.float32)})[0]
    assert y.shape == stock(src, {"x": np.zeros((0, k), np.float32)})[0].shape and y.shape[0] == 0


@pytest.mark.parametrize("name", ["relu", "tanh"])
def test_nan_and_inf_propagate_like_stock_ort(converted, name):
    src, fused = converted[name]
    sess = fused_session(fused)
    k = sess.get_inputs()[0].shape[-1]
    x = np.random.default_rng(2).standard_normal((300, k)).astype(np.float32)
    specials = [np.nan, np.inf, -np.inf, 3e38, -3e38]
    for row in range(0, 300, 3):  # one special value in every third row, at varying columns
        x[row, row % k] = specials[row % len(specials)]
    x[299, :] = np.inf
    got, ref = sess.run(None, {"x": x})[0], stock(src, {"x": x})[0]
    assert np.isnan(ref).any() or np.isinf(ref).any(), "the inputs must reach the outputs"
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(ref))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(ref))
    # finite values: relative to each row's largest (rows fed 3e38 cancel at that scale, in any sum order)
    finite = np.isfinite(ref)
    row_scale = np.max(np.where(finite, np.abs(ref), 0), axis=1, keepdims=True) + 1.0
    err = np.abs(np.where(finite, got.astype(np.float64) - ref, 0))
    assert np.all(err <= 1e-4 * row_scale), float(np.max(err / row_scale))


def test_one_session_eight_threads_two_hundred_runs(converted):
    src, fused = converted["relu"]
    sess = fused_session(fused)
    rng = np.random.default_rng(4)
    xs = [[rng.standard_normal((int(rng.integers(1, 80)) if r % 10 else 400, 8)).astype(np.float32)
           for r in range(200)] for _ in range(8)]
    ref_sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    refs = [[ref_sess.run(None, {"x": x})[0] for x in per] for per in xs]
    bad: list[str] = []

    def work(t):
        for r, x in enumerate(xs[t]):
            y = sess.run(None, {"x": x})[0]
            if y.shape != refs[t][r].shape or not np.allclose(y, refs[t][r], rtol=1e-4, atol=1e-5):
                bad.append(f"thread {t} run {r}")

    run_threads(work, [(t,) for t in range(8)])
    assert not bad, bad[:10]


def test_two_models_two_libraries_one_process_concurrently(converted):
    """Sessions of two converted models (two different plugin libraries) run side by side in threads."""
    sessions = {n: fused_session(converted[n][1]) for n in converted}
    assert len({str(s.plugin_path) for s in sessions.values()}) == 2
    bad: list[str] = []

    def work(name, seed):
        src = converted[name][0]
        k = sessions[name].get_inputs()[0].shape[-1]
        rng = np.random.default_rng(seed)
        for r in range(40):
            x = rng.standard_normal((int(rng.integers(1, 300)), k)).astype(np.float32)
            if not np.allclose(sessions[name].run(None, {"x": x})[0], stock(src, {"x": x})[0], rtol=1e-4, atol=1e-5):
                bad.append(f"{name} run {r}")

    run_threads(work, [(n, s) for s, n in enumerate(["relu", "tanh"] * 2)])
    assert not bad, bad


def test_the_same_library_loaded_twice(converted, tmp_path):
    """One library registered by two sessions, and two copies of it (different paths) in one process."""
    src, fused = converted["relu"]
    lib = fused.parent / "relu.fused.onnx2fused.so"
    copy = tmp_path / "again.so"
    shutil.copyfile(lib, copy)
    sessions = [fused_session(fused, lib=lib), fused_session(fused, lib=lib), fused_session(fused, lib=copy),
                fused_session(fused)]
    x = np.random.default_rng(5).standard_normal((33, 8)).astype(np.float32)
    ref = stock(src, {"x": x})[0]
    for s in sessions:
        np.testing.assert_allclose(s.run(None, {"x": x})[0], ref, rtol=1e-4, atol=1e-5)
    del sessions[0]  # a session going away leaves the others working
    for s in sessions:
        np.testing.assert_allclose(s.run(None, {"x": x})[0], ref, rtol=1e-4, atol=1e-5)
