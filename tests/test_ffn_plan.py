"""The whole FFN in one Hopper kernel (onnx2fused/plan/ffn.py, templates/cuda_wide_ffn.cu.j2): which wide
plans carry it and why not, its workspace regions, the chain unit's dispatch, and its unit compiled as
build.py compiles it (sm_90a alone: no spills, the wgmma forms it needs). No GPU needed; the numbers
against stock ORT: tests/test_gpu_ffn.py."""
from __future__ import annotations

import re
import shutil

import pytest
from nvcc_support import compile_kept, ptxas_entry

from onnx2fused import codegen, targets
from onnx2fused import expr as ex
from onnx2fused.plan import choose, cost, ffn
from onnx2fused.plan.options import WideOptions
from onnx2fused.spec import LayerSpec, MLPSpec, NormSpec
from onnx2fused.wide_params import ffn_symbol, ffn_unit, wide_params

NVCC = shutil.which("nvcc")


def _spec(widths, act=ex.silu(), gated=True, precision="fp16", io="f32", bias=True, last=ex.identity(),
          act_math="packed"):
    """Two layers (or more, for refusals) between `widths`; the first gated (act(x Wg) * (x Wu)) if asked."""
    n = len(widths) - 1
    return MLPSpec(tuple(LayerSpec(a, b, bias, act if i < n - 1 else last, gated=gated and i == 0)
                         for i, (a, b) in enumerate(zip(widths, widths[1:]))), precision, io, act_math=act_math)


@pytest.mark.parametrize("widths,gated", [
    ([256, 1024, 256], True),    # issue 16's SwiGLU block
    ([72, 1000, 50], True),      # every width padded: K0 to 128, the hidden to 1024, the outputs to 64
    ([256, 4096, 256], False),   # a GELU FFN pair
    ([192, 768, 192], False),    # ViT-tiny's FFN
])
def test_a_two_layer_wide_plan_carries_the_ffn_kernel_in_its_own_regions(widths, gated):
    spec = _spec(widths, ex.silu() if gated else ex.gelu_erf(), gated)
    plan = choose.wide_plan(spec, WideOptions())
    f = plan.ffn
    assert f is not None and f.gated == gated and (f.k0, f.h, f.n) == tuple(widths)
    assert f.kp0 % 64 == 0 and f.kp0 >= f.k0 and f.hp % ffn.HC == 0 and f.hp >= f.h and f.np_ % 64 == 0
    # its image and bias after every other region, 1 KB aligned, inside the workspace
    others = max(plan.norm_offset, plan.hg_offset, plan.h_offsets[1], plan.xc_offset, plan.sm90_offset)
    assert others <= f.image_offset and f.image_offset % 1024 == 0 and f.bias_offset % 1024 == 0
    assert f.image_offset + f.image_bytes <= f.bias_offset and f.bias_offset + f.bias_bytes <= plan.workspace_bytes
    assert f.image_bytes == (f.hp // ffn.HC) * f.chunk_bytes
    assert f.bias_bytes == 4 * f.np_   # layer 1's; layer 0's travels with each chunk of the image
    assert f.chunk_bytes == f.l1_cols * f.kp0 * 2 + f.np_ * ffn.HC * 2 + 4 * f.l1_cols
    assert f.smem_bytes <= ffn.SMEM_LIMIT and f.slot_bytes >= f.chunk_bytes
    assert "whole FFN in one kernel" in plan.describe()


@pytest.mark.parametrize("spec,why", [
    (_spec([256, 512, 512, 256]), "3 layers"),
    (_spec([256, 1024, 256], precision="tf32"), "tf32 operands"),
    (_spec([300, 1024, 256]), "300 input features"),
    (_spec([20, 1024, 256]), "20 input features"),
    (_spec([256, 1024, 320]), "320 outputs"),
    (_spec([256, 1024, 255]), "255 outputs"),
    (MLPSpec(_spec([256, 1024, 256]).layers, "fp16", "f32", norm=NormSpec("layernorm", 1e-5, True), residual=True),
     "a norm in front or a residual behind"),
])
def test_the_ffn_kernel_says_why_it_declines(spec, why):
    reason = ffn.ffn_reason_refused(spec)
    assert reason is not None and why in reason
    assert ffn.ffn_pair(spec, 0) is None
    if len(spec.layers) == 2 and spec.precision in ("fp16", "bf16") and not spec.has_block:
        # inspect's plan text says it too
        assert f"no one-kernel FFN: {reason}" in choose.wide_plan(spec, WideOptions()).describe()


def test_the_kernels_shared_memory_does_not_grow_with_the_hidden_width():
    # the largest input and output tiles, gated: three ring slots, two input tiles, within the SM at any H
    small, large = (ffn.ffn_pair(_spec([256, h, 256]), 0) for h in (32, 65536))
    assert small.smem_bytes == large.smem_bytes <= ffn.SMEM_LIMIT
    assert choose.wide_plan(_spec([256, 16384, 256]), WideOptions()).ffn is not None


def test_a_tuning_build_times_the_gemms_without_the_ffn_kernel():
    spec = _spec([256, 1024, 256])
    assert choose.wide_plan(spec, WideOptions(tuning=True)).ffn is None
    assert "_ffn_cuda.cu" not in " ".join(codegen.cuda_sources(choose.wide_plan(spec, WideOptions(tuning=True))))


def test_the_cost_model_counts_the_ffn_kernel_from_a_pass_per_sm(monkeypatch):
    spec = _spec([256, 1024, 256])
    rows = ffn.MIN_ROWS_PER_SM * cost.SMS
    with_ffn = {r: cost.estimate_wide(spec, r) for r in (rows - 1, rows, 2 ** 18)}
    monkeypatch.setattr(cost, "ffn_possible", lambda s: False)
    gemms = {r: cost.estimate_wide(spec, r) for r in with_ffn}
    # below a pass per SM the GEMMs' estimate stands; from there the cheaper of the two
    assert with_ffn[rows - 1] == gemms[rows - 1]
    assert with_ffn[rows] == min(gemms[rows], cost.estimate_ffn(spec, rows))
    # at SwiGLU 256's 2^18 rows one kernel is modelled under the GEMMs and the conversion pass
    assert with_ffn[2 ** 18] == cost.estimate_ffn(spec, 2 ** 18) < gemms[2 ** 18]


def test_the_chain_unit_packs_and_takes_the_ffn_kernel_on_hopper_only():
    spec = _spec([256, 1024, 256])
    plan = choose.wide_plan(spec, WideOptions())
    files = codegen.cuda_sources(plan)
    chain = files[f"{spec.name}_cuda.cu"]
    unit_name, params = ffn_unit(plan)
    assert unit_name in files and targets.sm90a_only(files[unit_name])
    sym = ffn_symbol(spec)
    # declared, packed and run only where the sm_90a units were compiled; run under the env switch, from a
    # pass per SM, on aligned rows; everything else the GEMMs (run_chain)
    run = chain[chain.index(f'extern "C" int {spec.name}_cuda_run'):]
    assert re.search(rf"#ifdef ONNX2FUSED_WIDE_SM90A\s+namespace {sym} ", chain)
    assert f"{sym}::pack(w[0], b[0], w[1], b[1], ws, s)" in chain and "major == 9 && minor == 0" in chain
    call = run.index(f"{sym}::run(")
    assert run.index("#ifdef ONNX2FUSED_WIDE_SM90A") < call < run.index("return run_chain(")
    assert f'getenv("{ffn.FFN_ENV}")' in run and f": {ffn.MIN_ROWS_PER_SM}LL * dev.sms;" in run
    assert "ffn_rows > 0 && dev.sm90 && rows >= ffn_rows" in run
    assert "dev.sm90" in run and "aligned16(x) && aligned16(y)" in run
    assert wide_params(plan)["ffn"]["name"] == sym and params["gated"]


@pytest.mark.cuda_build
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("widths,gated,act,io,bias,precision,act_math", [
    ([256, 1024, 256], True, ex.silu(), "f32", False, "fp16", "packed"),   # issue 16's SwiGLU, LLaMA-style (no bias)
    ([72, 1000, 50], True, ex.silu(), "f16", True, "fp16", "packed"),      # padded widths, fp16 rows, biases
    ([256, 4096, 256], False, ex.gelu_erf(), "f32", True, "fp16", "packed"),  # a GELU pair: the packed GELU
    ([256, 1024, 256], True, ex.silu(), "f32", True, "bf16", "packed"),    # bf16 operands: the glu in fp32
    ([64, 512, 64], False, ex.gelu_erf(), "f16", True, "bf16", "packed"),  # bf16 operands from fp16 rows, fp32 GELU
    ([16, 32, 24], True, ex.silu(), "f32", True, "fp16", "packed"),        # one chunk: the first turn's is the last's
    ([256, 1024, 256], True, ex.silu(), "f32", True, "fp16", "fp32"),      # fp16a32: the glu in fp32
], ids=["swiglu256", "odd_f16", "gelu_pair", "swiglu256_bf16", "gelu_bf16_f16io", "one_chunk", "swiglu256_a32"])
def test_the_ffn_unit_compiles_to_wgmma_without_spills(widths, gated, act, io, bias, precision, act_math, tmp_path,
                                                       monkeypatch):
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", "80,90")
    spec = _spec(widths, act, gated, io=io, bias=bias, precision=precision, act_math=act_math)
    plan = choose.wide_plan(spec, WideOptions())
    name, params = ffn_unit(plan)
    files = codegen._with_headers({name: codegen._render(params["template"], params)})
    for n, text in files.items():
        (tmp_path / n).write_text(text)
    flags = targets.sm90a_nvcc_flags(targets.nvcc_flags())
    assert targets.WIDE_SM90A_DEFINE in flags
    log, keep = compile_kept(NVCC, flags, tmp_path, files[name])
    ptxas_entry(log, "ffn_kernel")   # no spills, no serialized wgmma (nvcc_support checks)
    assert "C7519" not in log, log[-3000:]   # no warpgroup.arrive injected between the wgmmas of a turn
    ptx = next(keep.glob("*.ptx")).read_text()
    # a chunk's layer-0 k-steps (m64n64 gated, m64n32 not) and its layer-1 k-steps (m64n<NP>), each twice:
    # in the chunk loop and in the peeled first (layer 0) or last (layer 1) chunk; once with one chunk (no loop)
    times = 1 if plan.ffn.hp == ffn.HC else 2
    l0n = plan.ffn.l1_cols   # layer 0's N: 64 gated, 32 not
    expected = {l0n: times * (plan.ffn.kp0 // 16)}
    expected[plan.ffn.np_] = expected.get(plan.ffn.np_, 0) + times * (ffn.HC // 16)
    assert "bar.arrive" in ptx   # the warpgroups' turns
    ab = "bf16" if precision == "bf16" else "f16"
    for n, count in expected.items():
        assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab}") == count, n
    # layer 0's first x_reg_steps k-steps with the input's A fragments from registers ({...} operand), loaded by
    # ldmatrix once a pass; the rest from the shared tile (a descriptor)
    l0 = [line for line in ptx.splitlines() if f"wgmma.mma_async.sync.aligned.m64n{l0n}k16" in line]
    layer1_alike = times * (ffn.HC // 16) if plan.ffn.np_ == l0n else 0   # layer 1's (always RS) of the same N
    assert 0 < plan.ffn.x_reg_steps <= plan.ffn.kp0 // 16
    assert sum("}, {" in line for line in l0) == times * plan.ffn.x_reg_steps + layer1_alike
    assert ("ldmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx)
    assert "fence.proxy.async.shared::cta" in ptx and "cp.async.bulk.shared::cluster.global" in ptx
    # the packed GELU or glu (fp16 only; act_math "fp32" keeps fp32): SiLU's form is x/2 + x/2 tanh(x/2),
    # its prescaled form on layer 0's (gate) columns packed halved
    packed = precision == "fp16" and act_math == "packed"
    assert ("tanh.approx.f16x2" in ptx) == packed
    assert f"constexpr float kPrescale = {'0.5f' if packed else '1.0f'};" in files[name]
    assert ("_h(__floats2half2_rn(" in files[name]) == packed
    # fp32 activations: fp16's SiLU (act_math "fp32") by __expf and a division; bf16's SiLU and GELU by the hardware tanh
    assert ("ex2.approx" in ptx) == (gated and precision == "fp16" and act_math != "packed")
    assert ("tanh.approx.f32" in ptx) == (precision == "bf16")
    assert ("cvt.rn.bf16x2.f32" in ptx) == (precision == "bf16")


def test_validation_runs_every_set_again_with_the_kernel_where_a_plan_carries_it(monkeypatch):
    # the validation sets' batches (1, 37, 256) never reach the kernel's threshold: convert asks for a second
    # round with it taken at every batch, where a plan has it and the GPU can run it
    from onnx2fused.convert import _run_variants
    ffn_plan = choose.wide_plan(_spec([256, 1024, 256]), WideOptions())
    three = choose.wide_plan(_spec([256, 512, 512, 256]), WideOptions())
    hopper, ampere = [{"compute_capability": "9.0"}], [{"compute_capability": "8.0"}]
    assert _run_variants({"a": three}, hopper) == ()
    ((var, value, label),) = _run_variants({"a": three, "b": ffn_plan}, hopper)
    assert (var, value) == (ffn.FFN_ENV, "1") and "FFN kernel" in label
    assert _run_variants({"b": ffn_plan}, ampere + hopper) != ()   # some GPU of the host may run it
    assert _run_variants({"b": ffn_plan}, ampere) == ()            # there the round would rerun the GEMMs
    assert _run_variants({"b": ffn_plan}, []) != ()                 # no GPU reported: the round runs
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", "80")              # no sm_90 code in the library
    assert _run_variants({"b": ffn_plan}, hopper) == ()


def test_a_failure_only_the_second_round_shows_is_laid_on_the_chain_that_fails_it(monkeypatch, tmp_path):
    # validate's run_variants on a CUDA session: the fused model here goes wrong only under the switch, and
    # only from its second chain's output on. The per-chain errors run that round too, so automatic
    # precision moves that chain up, not every chain; the element counts say they span both rounds.
    import os

    import numpy as np
    import onnx
    from onnx_builders import mlp

    from onnx2fused import validate as val
    model = mlp([6, 12, 10, 4])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    acts = [n.output[0] for n in model.graph.node if n.op_type == "Relu"]
    downstream = {acts[1], "y"}
    real_session = val._session

    class Switched:
        """The model on the CPU EP, its tensors downstream of the second chain off by 1 under the switch."""
        def __init__(self, sess):
            self.sess = sess

        def get_outputs(self):
            return self.sess.get_outputs()

        def run(self, names, feeds):
            names = names or [o.name for o in self.sess.get_outputs()]
            outs = self.sess.run(names, feeds)
            if os.environ.get("O2F_TEST_SWITCH") == "1":
                outs = [o + np.float32(1) if n in downstream else o for n, o in zip(names, outs)]
            return outs

    def session(model, library=None, providers=("CPUExecutionProvider",), optimize=True):
        s = real_session(model, None, ["CPUExecutionProvider"], optimize)
        return Switched(s) if library is not None else s

    monkeypatch.setattr(val, "_session", session)
    monkeypatch.setattr(val, "choose_providers", lambda with_cuda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    chains = [type("Chain", (), {"output": t})() for t in acts]
    kwargs = dict(original_model=model, chains=chains, with_cuda=True, chain_precisions=["bf16", "bf16"])
    clean = val.validate(str(path), str(path), "lib", "bf16", **kwargs)
    assert clean.passed and clean.chain_failures == []
    switch = [("O2F_TEST_SWITCH", "1", "the test switch")]
    report = val.validate(str(path), str(path), "lib", "bf16", run_variants=switch, **kwargs)
    assert not report.passed and report.chain_failures == [1]
    assert "the test switch" in report.outputs[0].worst_case and "O2F_TEST_SWITCH" not in os.environ
    elementwise = val.validate(str(path), str(path), "lib", "bf16", run_variants=switch, atol=0.5, **kwargs)
    assert elementwise.outputs[0].elements == 2 * clean.outputs[0].elements
    assert "over 2 rounds of the sets" in elementwise.failures[0]


@pytest.mark.cuda_build
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_the_unit_alone_harness_builds_against_the_units_interface(tmp_path, monkeypatch):
    # benchmarks/ffn_unit_check.py times the library's unit without ORT (its pack, run and the constants it
    # reads): it must keep compiling as the unit changes, with and without the turns' diagnostic switch
    import importlib.util
    from pathlib import Path
    monkeypatch.setenv("ONNX2FUSED_CUDA_ARCHS", "90")
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "ffn_unit_check.py"
    spec = importlib.util.spec_from_file_location("ffn_unit_check", path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    for name, defines in (("turns", []), ("in_step", ["-DO2F_DIAG_NO_TURNS"])):
        assert harness.build("swiglu256", tmp_path / name, defines).is_file()
        log = (tmp_path / name / "nvcc.txt").read_text()
        assert "0 bytes spill stores" in log and "C75" not in log, log[-2000:]
