"""convert() at the API level: validation failures and force, user inputs, fp16 overflow, output layout,
InferenceSession. CPU-only builds, one shared build cache."""
from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

ort = pytest.importorskip("onnxruntime")

import onnx2fused  # noqa: E402
from onnx2fused.passes import find_chains  # noqa: E402
from onnx2fused import validate as val  # noqa: E402
from onnx2fused.convert import PLUGIN_KEY  # noqa: E402
from onnx2fused.errors import ConversionError, ValidationError  # noqa: E402
from onnx2fused.session import PluginNotFoundError  # noqa: E402

from onnx_builders import mlp, run  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "models"


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("o2f-api-cache")


@pytest.fixture
def nerf(tmp_path):
    src = tmp_path / "nerf.onnx"
    shutil.copyfile(MODELS / "nerf.opset17.onnx", src)
    return src


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_validation_error_writes_nothing_then_force(nerf, cache, monkeypatch):
    monkeypatch.setattr(val, "CPU_TOLERANCE", 0.0)   # and no allowance for the chain's conditioning:
    monkeypatch.setattr(val, "NOISE_FACTOR", 0.0)    # a tolerance of 0, which the fused model cannot meet
    before = nerf.read_bytes()
    with pytest.raises(ValidationError, match="relative L2 error .* exceeds the tolerance 0"):
        onnx2fused.convert(nerf, cache_dir=cache, with_cuda=False)
    assert names(nerf.parent) == ["nerf.onnx"] and nerf.read_bytes() == before
    res = onnx2fused.convert(nerf, cache_dir=cache, with_cuda=False, force=True)
    assert not res.validation.passed
    assert any(w.startswith("written anyway (force)") for w in res.warnings)
    assert names(nerf.parent) == ["nerf.fused.onnx", "nerf.fused.onnx2fused.so", "nerf.onnx"]
    assert "NO" in res.format()


def test_user_inputs_npz_and_dict(nerf, cache, tmp_path):
    x = np.random.default_rng(5).standard_normal((3, 32)).astype(np.float64)  # cast to float32 by validate
    npz = tmp_path / "in.npz"
    np.savez(npz, x=x)
    res = onnx2fused.convert(nerf, tmp_path / "a.onnx", inputs=npz, cache_dir=cache, with_cuda=False)
    assert res.validation.cases[-1] == "user inputs" and res.validation.passed
    res = onnx2fused.convert(nerf, tmp_path / "b.onnx", inputs={"x": x[:1]}, cache_dir=cache, with_cuda=False)
    assert res.validation.cases[-1] == "user inputs"
    assert res.cache_hit
    np.savez(tmp_path / "bad.npz", z=x)
    with pytest.raises(ConversionError, match="'z' not among the model's inputs"):
        onnx2fused.convert(nerf, tmp_path / "c.onnx", inputs=tmp_path / "bad.npz", cache_dir=cache, with_cuda=False)
    with pytest.raises(ConversionError, match="dimension 1 must be 32"):
        onnx2fused.convert(nerf, tmp_path / "c.onnx", inputs={"x": x[:, :5]}, cache_dir=cache, with_cuda=False)
    (tmp_path / "notes.txt").write_text("x = 1, 2, 3\n")   # np.load would try it as a pickle
    with pytest.raises(ConversionError, match="not an .npz file"):
        onnx2fused.convert(nerf, tmp_path / "c.onnx", inputs=tmp_path / "notes.txt", cache_dir=cache, with_cuda=False)
    assert not (tmp_path / "c.onnx").exists()


def _scaled_model(peak_target: float) -> onnx.ModelProto:
    """x -> fc0 -> relu -> fc1 -> y with fc0 scaled so that max |relu output| on the validation inputs = target."""
    m = mlp([8, 16, 4], act="Relu")
    fc0 = next(n for n in m.graph.node if n.name == "fc0")
    inits = {t.name: t for t in m.graph.initializer}
    h = None
    for case, feeds in val.random_inputs(m):
        probe = onnx.ModelProto()
        probe.CopyFrom(m)
        relu_out = next(n for n in probe.graph.node if n.name == "act0").output[0]
        probe.graph.output.append(onnx.helper.make_tensor_value_info(relu_out, onnx.TensorProto.FLOAT, None))
        v = float(np.abs(run(probe, feeds)[1]).max())
        h = max(h or 0.0, v)
    s = peak_target / h
    for name in fc0.input[1:]:
        t = inits[name]
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t) * np.float32(s), name))
    return m


def test_fp16_range_check_is_for_gpu_libraries_only(tmp_path, cache):
    """A CPU-only library computes in fp32: intermediates beyond the fp16 range are no reason to refuse
    fp16 (nor to warn) there."""
    src = tmp_path / "big.onnx"
    onnx.save(_scaled_model(1.0e5), str(src))
    res = onnx2fused.convert(src, precision="fp16", cache_dir=cache, with_cuda=False)
    assert res.validation.passed and not res.warnings and not res.validation.max_activation


def test_auto_precision_moves_an_overflowing_chain_to_bf16_before_building(tmp_path):
    """The numerics model sees the fp16 overflow of a GPU build and picks bf16, saying why."""
    conv = importlib.import_module("onnx2fused.convert")
    for peak, want in ((1.0e5, "bf16"), (4.5e4, "fp16")):
        m = _scaled_model(peak)
        plan = find_chains(m)
        cases, vacuous = val.validation_cases(m)
        (choice,) = conv.initial_precisions(m, plan.chains, cases, True, lambda s: None)
        assert choice.precision == want and not vacuous
        if want == "bf16":
            assert re.search(r"fp16: intermediate values reach (9\.99\d*e\+04|1e\+05) > 65504 \(overflow\)", choice.why)
    (cpu,) = conv.initial_precisions(m, plan.chains, cases, False, lambda s: None)
    assert cpu.precision == "fp16" and "CPU-only library" in cpu.why


@pytest.mark.cuda_build
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_fp16_overflow_with_cuda_refused_when_asked_moved_up_when_auto(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", "80")
    src = tmp_path / "big.onnx"
    onnx.save(_scaled_model(1.0e5), str(src))
    with pytest.raises(ValidationError, match="beyond the fp16 maximum 65504; use --precision bf16 or fp32"):
        onnx2fused.convert(src, precision="fp16", cache_dir=cache, with_cuda=True)
    assert names(tmp_path) == ["big.onnx"]
    res = onnx2fused.convert(src, precision="fp16", cache_dir=cache, with_cuda=True, force=True)
    assert any("fp16 overflow" in w and "bf16 or fp32" in w for w in res.warnings)
    assert res.validation.max_activation[0] == pytest.approx(1.0e5, rel=1e-4)
    res = onnx2fused.convert(src, tmp_path / "auto.onnx", cache_dir=cache, with_cuda=True)
    assert res.validation.passed and res.chains[0].precision == "bf16" and "overflow" in res.chains[0].precision_why
    assert "_bf16_" in res.chains[0].name and "precision bf16: " in res.format()
    meta = {p.key: p.value for p in onnx.load(str(tmp_path / "auto.onnx")).metadata_props}
    assert json.loads(meta["onnx2fused.chains"])[0]["precision"] == "bf16"
    src2 = tmp_path / "half.onnx"
    onnx.save(_scaled_model(4.5e4), str(src2))
    res = onnx2fused.convert(src2, cache_dir=cache, with_cuda=True)
    assert res.validation.passed and res.chains[0].precision == "fp16"
    assert len(res.warnings) == 1 and "more than half the fp16 maximum" in res.warnings[0]
    assert "warning:" in res.format()


def test_output_rules(nerf, cache, tmp_path):
    with pytest.raises(ConversionError, match="would overwrite the input"):
        onnx2fused.convert(nerf, nerf, cache_dir=cache, with_cuda=False)
    with pytest.raises(ConversionError, match="unknown precision"):
        onnx2fused.convert(nerf, precision="int8")
    res = onnx2fused.convert(nerf, cache_dir=cache, with_cuda=False, validate=False)
    assert res.validation is None and "validation: skipped" in res.format()
    assert res.output_path == str(tmp_path / "nerf.fused.onnx")
    meta = {p.key: p.value for p in onnx.load(res.output_path).metadata_props}
    assert meta[PLUGIN_KEY] == "nerf.fused.onnx2fused.so"


def test_outputs_never_overwrite_the_inputs_external_data(cache, tmp_path):
    """A dynamo export keeps its weights in `<model>.onnx.data`: an output model, saved inputs or outputs
    named like that file are refused as the model's own name is, and the file is left as it was."""
    import hashlib
    src = tmp_path / "nerf.dynamo.onnx"
    for f in ("nerf.dynamo.onnx", "nerf.dynamo.onnx.data"):
        shutil.copy(MODELS / f, tmp_path / f)
    data = tmp_path / "nerf.dynamo.onnx.data"
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    for kwargs in ({"output_path": data}, {"save_inputs": data}, {"save_outputs": data}):
        with pytest.raises(ConversionError, match="would overwrite the input"):
            onnx2fused.convert(src, cache_dir=cache, with_cuda=False, **kwargs)
        assert hashlib.sha256(data.read_bytes()).hexdigest() == digest
    # an output whose own external data file (`<output>.data`) would be the input's data file
    other = tmp_path / "other.onnx"
    shutil.copy(src, other)   # other.onnx's weights: nerf.dynamo.onnx.data too
    with pytest.raises(ConversionError, match="would overwrite the input"):
        onnx2fused.convert(other, tmp_path / "nerf.dynamo.onnx", cache_dir=cache, with_cuda=False)
    res = onnx2fused.convert(src, tmp_path / "fused.onnx", cache_dir=cache, with_cuda=False)
    assert res.validation.passed and hashlib.sha256(data.read_bytes()).hexdigest() == digest


def test_a_fused_model_is_refused(nerf, cache, tmp_path):
    """Converting convert's own output again would write it unchanged without its plugin (nothing left to
    fuse): refused in one line, nothing written."""
    res = onnx2fused.convert(nerf, cache_dir=cache, with_cuda=False, validate=False)
    before = names(tmp_path)
    with pytest.raises(ConversionError, match="is already fused"):
        onnx2fused.convert(res.output_path, tmp_path / "again.onnx", cache_dir=cache, with_cuda=False)
    assert names(tmp_path) == before


@pytest.mark.parametrize("precision", ["auto", "fp16"])
@pytest.mark.parametrize("name", ["reciprocal", "gelu_fp16_io"])
def test_cpu_only_validation_allows_for_the_chains_conditioning(name, precision, cache, tmp_path):
    """A CPU-only library's fp32 kernels are held to what a CUDA build's validation allows on the CPU EP:
    NOISE_FACTOR x the chain's own distance from float64 (a reciprocal's cancellation; fp16 outputs'
    rounding), not the bare fp32 tolerance that valid models of both kinds exceeded."""
    from onnx2fused.precision import chain_block, chain_layers, chain_noise
    from onnx_builders import F16
    model = (mlp([5, 23, 4], act="Reciprocal") if name == "reciprocal"
             else mlp([32, 32, 32, 8], act="Gelu", elem=F16, opset=20))
    src = tmp_path / f"{name}.onnx"
    onnx.save(model, str(src))
    res = onnx2fused.convert(src, cache_dir=cache, with_cuda=False, precision=precision)
    chain = find_chains(onnx.load(str(src))).chains[0]
    cases, _ = val.validation_cases(model)
    ref = val.reference_tensors(model, [chain.input, chain.output], cases)
    noise = chain_noise(chain_layers(chain), ref[chain.input], ref[chain.output], chain_block(chain))
    assert val.NOISE_FACTOR * noise > val.CPU_TOLERANCE   # the case needs the allowance
    assert res.validation.passed and res.validation.tolerance == pytest.approx(val.NOISE_FACTOR * noise)
    assert "ill-conditioned" in res.chains[0].precision_why


def test_sessions_opened_from_threads_with_one_options_object(nerf, cache):
    """Eight threads open sessions of one fused model with one SessionOptions: the plugin is registered on
    it once (a second registration of the op domain would fail every session after it)."""
    from thread_support import run_threads
    res = onnx2fused.convert(nerf, cache_dir=cache, with_cuda=False, validate=False)
    so = ort.SessionOptions()
    x = np.random.default_rng(4).standard_normal((3, 32)).astype(np.float32)
    outs = {}

    def work(t):
        outs[t] = onnx2fused.InferenceSession(res.output_path, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    run_threads(work, [(t,) for t in range(8)])
    assert len(outs) == 8 and all(np.array_equal(outs[0], y) for y in outs.values())


def test_external_data_output(nerf, cache, monkeypatch):
    conv = importlib.import_module("onnx2fused.convert")  # the module (onnx2fused.convert is the function)
    monkeypatch.setattr(conv, "EXTERNAL_DATA_BYTES", 0)
    res = onnx2fused.convert(nerf, cache_dir=cache, with_cuda=False)
    assert res.external_data == "nerf.fused.onnx.data" and res.validation.passed
    assert (nerf.parent / "nerf.fused.onnx.data").is_file()
    x = np.ones((2, 32), np.float32)
    y = onnx2fused.InferenceSession(res.output_path).run(None, {"x": x})[0]
    assert np.allclose(y, run(onnx.load(str(nerf)), {"x": x})[0], atol=1e-5)


def test_dynamo_model_moved_with_its_library(cache, tmp_path):
    """The fused model and its library travel together (relative path); a missing library is a clear error."""
    res = onnx2fused.convert(MODELS / "silu.dynamo.onnx", tmp_path / "s.onnx", cache_dir=cache, with_cuda=False)
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.move(res.output_path, moved / "s.onnx")
    with pytest.raises(PluginNotFoundError, match="s.onnx2fused.so is missing"):
        onnx2fused.InferenceSession(moved / "s.onnx")
    # ORT's optimised copy, saved without the plugin: no fused node left, only the metadata, so it opens as a
    # plain session though the library is not beside it
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(moved / "optimised.onnx")
    ort.InferenceSession(str(moved / "s.onnx"), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(str(moved / "optimised.onnx"))
    assert {p.key for p in opt.metadata_props} >= {PLUGIN_KEY} and all(n.domain != "onnx2fused" for n in opt.graph.node)
    xo = np.random.default_rng(3).standard_normal((2, 256)).astype(np.float32)
    plain = onnx2fused.InferenceSession(moved / "optimised.onnx", providers=["CPUExecutionProvider"])
    assert plain.plugin_path is None and plain.run(None, {"x": xo})[0].shape == (2, 256)
    shutil.move(res.library_path, moved / "s.onnx2fused.so")
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = onnx2fused.InferenceSession(moved / "s.onnx", so)
    assert sess.get_session_options().intra_op_num_threads == 1
    x = np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)
    ref = ort.InferenceSession(str(MODELS / "silu.dynamo.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.linalg.norm(sess.run(None, {"x": x})[0] - ref) <= 1e-4 * np.linalg.norm(ref)
    # the plugin registered on the caller's options keeps them usable for a plain session
    ort.InferenceSession(str(MODELS / "silu.dynamo.onnx"), so, providers=["CPUExecutionProvider"])


def test_session_keeps_the_callers_options_and_shares_them_between_models(cache, tmp_path):
    """onnx2fused.InferenceSession registers the plugin on the caller's own SessionOptions, so what cannot be
    copied counts too (a session config entry, a free dimension override); the same options open the same
    model again, and a second fused model (another plugin of the same op domain) through a copy, with a
    warning; a model whose plugin entry points outside its folder is refused."""
    a = onnx2fused.convert(MODELS / "nerf.opset17.onnx", tmp_path / "a.onnx", cache_dir=cache, with_cuda=False)
    b = onnx2fused.convert(MODELS / "silu.opset17.onnx", tmp_path / "b.onnx", cache_dir=cache, with_cuda=False)
    so = ort.SessionOptions()
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_free_dimension_override_by_name("batch", 4)
    sa = onnx2fused.InferenceSession(a.output_path, so, providers=["CPUExecutionProvider"])
    assert sa.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert sa.get_inputs()[0].shape == [4, 32]
    again = onnx2fused.InferenceSession(a.output_path, so, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    assert np.array_equal(sa.run(None, {"x": x})[0], again.run(None, {"x": x})[0])
    with pytest.warns(UserWarning, match="already hold the plugin a.onnx2fused.so"):
        sb = onnx2fused.InferenceSession(b.output_path, so, providers=["CPUExecutionProvider"])
    xb = np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32)
    ref = run(onnx.load(str(MODELS / "silu.opset17.onnx")), {"x": xb})[0]
    assert np.allclose(sb.run(None, {"x": xb})[0], ref, rtol=1e-4, atol=1e-5)
    # a model file must not choose which library a process loads
    m = onnx.load(a.output_path)
    for entry in (str(tmp_path / "a.onnx2fused.so"), "../a.onnx2fused.so"):
        for p in m.metadata_props:
            if p.key == PLUGIN_KEY:
                p.value = entry
        onnx.save(m, str(tmp_path / "evil.onnx"))
        with pytest.raises(ConversionError, match="not a file name beside the model"):
            onnx2fused.InferenceSession(tmp_path / "evil.onnx")


def test_inspect_api():
    r = onnx2fused.inspect(MODELS / "gelu.opset17.onnx")
    assert [c.widths for c in r.chains] == [[64, 128, 128, 128, 128, 64]]
    assert r.chains[0].activations[:1] == ["gelu_erf"] or r.chains[0].activations[0].startswith("gelu")
    assert "chain" in r.plan


def test_tf32_precision_converts_and_plans_tensor_cores(nerf, cache, tmp_path):
    res = onnx2fused.convert(nerf, tmp_path / "t.onnx", precision="tf32", cache_dir=cache, with_cuda=False)
    assert res.validation.passed and "_tf32_" in res.format()
    r = onnx2fused.inspect(nerf, precision="tf32")
    assert "resident weights" in r.chains[0].cuda_plan and r.chains[0].precision == "tf32"


def test_validation_sets_of_large_items_get_smaller_batches():
    """An image model's 256-image validation set would be 38.5M floats of stock CPU inference: a set's
    batch is cut to val.SET_ELEMENTS (a set equal to another's is dropped); small items keep the batches."""
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3, 224, 224])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 1, 1, 1])
    g = helper.make_graph([helper.make_node("ReduceMax", ["x"], ["y"], keepdims=1)], "img", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    item = 3 * 224 * 224
    batches = [f["x"].shape[0] for _, f in val.random_inputs(m)]
    assert batches == [1, val.SET_ELEMENTS // item] and all(b * item <= val.SET_ELEMENTS for b in batches)
    small = mlp([8, 16, 4], act="Relu")
    assert [f["x"].shape[0] for _, f in val.random_inputs(small)] == list(val.BATCHES)


def test_a_chain_that_fails_every_gpu_validation_climbs_the_whole_ladder(tmp_path, monkeypatch):
    """A packed tanh chain planned wgmma whose CUDA validation always fails is rebuilt at every step:
    fp16 (bias in fp16), fp16b32, fp16a32, bf16, tf32, and last fp32 (the build then kept), not stopped a
    step short with the failed tf32 build."""
    import types

    from onnx2fused.plan.options import PlanOptions
    cv = importlib.import_module("onnx2fused.convert")   # (the package's `convert` is the function)
    src = tmp_path / "m.onnx"
    onnx.save(mlp([64, 128, 128, 64], act="Tanh"), str(src))
    built = []

    class Stop(Exception):
        pass

    def failing(model, inp, out, plan, choices, *args, **kwargs):
        built.append([(c.precision, c.act_math) for c in choices])
        if choices[0].precision == "fp32":
            raise Stop   # the last step: what convert would keep
        report = types.SimpleNamespace(provider="CUDAExecutionProvider", chain_failures=[0], chain_errors=[])
        return types.SimpleNamespace(validation=report)

    monkeypatch.setattr(cv, "_build_and_check", failing)
    with pytest.raises(Stop):
        cv.convert(str(src), str(tmp_path / "out.onnx"), with_cuda=True, plan_options=PlanOptions(design="wgmma"))
    assert [b[0] for b in built] == [("fp16", "packed"), ("fp16", "packed_b32"), ("fp16", "fp32"),
                                     ("bf16", "packed"), ("tf32", "packed"), ("fp32", "packed")]


def _winner_then_loser(loser_first=False):
    """x -> 16 -> ReLU 32 -> 16 (a chain whose CPU kernel wins) -> Softmax -> 16 -> 8 (a lone linear layer,
    whose kernel would lose: cpu_policy) -> y; `loser_first`: x -> 16 -> 16 -> Softmax -> the two layers ->
    Softmax -> 16 -> 8 -> y (three chains, the middle one kept, with a note: where it ends)."""
    from onnx_builders import G
    g = G()

    def winner(h):
        h = g.op("Relu", [g.linear(h, 16, 32, name="fc0")], name="act0")
        return g.linear(h, 32, 16, name="fc1")
    h = g.linear("x", 16, 16, name="fc2") if loser_first else winner("x")
    h = g.op("Softmax", [h], name="soft", axis=-1)
    if loser_first:
        h = g.op("Softmax", [winner(h)], name="soft2", axis=-1)
    g.linear(h, 16, 8, name="fc3" if loser_first else "fc2")
    g.nodes[-1].output[0] = "y"
    return g.model([("x", ["B", 16])], [("y", ["B", 8])])


def test_stock_where_faster_keeps_the_notes_of_the_chains_it_keeps_renumbered():
    """Chains end and start with notes ("chain N ends: ..."): a chain left stock takes its notes with it,
    and the kept chains' notes follow their new numbers."""
    from onnx2fused.library import stock_where_faster
    model = _winner_then_loser(loser_first=True)
    plan = find_chains(model)
    assert len(plan.chains) == 3 and any(r.reason.startswith("chain 1 ends") for r in plan.refusals)
    kept = stock_where_faster(plan, model)
    assert [c.widths for c in kept.chains] == [(16, 32, 16)]
    # the kept chain's one note, renumbered; the first chain's ("... feeds Softmax 'soft'") went with it
    notes = [r.reason for r in kept.refusals if r.chain >= 0]
    assert len(notes) == 1 and notes[0].startswith("chain 0 ends: ") and "Softmax 'soft2'" in notes[0]
    # in graph order: the first lone layer, the note, the last lone layer
    assert ["left" if "left as stock ops" in r.reason else "note" for r in kept.refusals] == ["left", "note", "left"]


def test_stock_where_faster_leaves_the_chains_whose_cpu_kernel_loses(cache, tmp_path):
    """--stock-where-faster (a CPU-only library): the two-layer chain is fused, the lone linear layer after
    the Softmax stays the model's own Gemm, with the reason; mnist (2.6 MiB of weights) is written unchanged.
    Without it both are fused (the lone layer as a node running its stock body)."""
    src = tmp_path / "two.onnx"
    onnx.save(_winner_then_loser(), src)
    res = onnx2fused.convert(src, tmp_path / "a.onnx", cache_dir=cache, with_cuda=False, stock_where_faster=True)
    assert res.validation.passed and len(res.chains) == 1 and res.chains[0].widths == [16, 32, 16]
    assert any("left as stock ops, faster on the CPU (one linear layer" in r for r in res.refusals)
    fused = onnx.load(tmp_path / "a.onnx")
    assert [n.op_type for n in fused.graph.node if n.domain != "onnx2fused"][-2:] == ["Softmax", "Gemm"]
    every = onnx2fused.convert(src, tmp_path / "b.onnx", cache_dir=cache, with_cuda=False)
    assert len(every.chains) == 2
    x = np.random.default_rng(0).standard_normal((37, 16)).astype(np.float32)
    sess = onnx2fused.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], run(_winner_then_loser(), {"x": x})[0], rtol=1e-4,
                               atol=1e-6)

    mnist = tmp_path / "mnist.onnx"
    shutil.copyfile(MODELS / "mnist.opset17.onnx", mnist)
    res = onnx2fused.convert(mnist, tmp_path / "m.onnx", cache_dir=cache, with_cuda=False, stock_where_faster=True)
    assert res.nothing_to_fuse and "weights 2.6 MiB > 1 MiB" in res.format()
    assert onnx.load(tmp_path / "m.onnx").graph == onnx.load(mnist).graph


def test_stock_where_faster_with_cuda_kernels_is_an_error_that_writes_nothing(tmp_path):
    src = tmp_path / "m.onnx"
    shutil.copyfile(MODELS / "mnist.opset17.onnx", src)
    with pytest.raises(ConversionError, match="--stock-where-faster is for CPU-only libraries"):
        onnx2fused.convert(src, tmp_path / "out.onnx", with_cuda=True, stock_where_faster=True)
    assert names(tmp_path) == ["m.onnx"]
