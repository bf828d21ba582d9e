"""The Hopper wgmma design (issue 15; plan/wgmma.py, templates/cuda_wgmma.cu.j2) on the host: when the plan
takes it and why not, its numbers, the rendered sources (deterministic, complete, the mma.sync fallback
unit beside), the descriptors against the packing (emulated as the hardware reads them), the build flags.
Numerical checks need an H100: tests/test_gpu.py::test_wgmma_zoo_on_cuda_ep; compile checks:
tests/test_wgmma_build.py."""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest

from onnx2fused import codegen, targets
from onnx2fused import expr as ex
from onnx2fused.plan import choose, cost, wgmma
from onnx2fused.plan.padding import round_up
from onnx2fused.plan.options import DESIGN_ENV, WGMMA_ENV, PlanOptions, WgmmaOptions
from onnx2fused.convert import plan_text
from onnx2fused.spec import LayerSpec, MLPSpec, SpecError
from onnx2fused.wgmma_params import fallback_symbol, wgmma_params


def _spec(widths, act=ex.relu(), precision="fp16", io="f32", last=None):
    n = len(widths) - 1
    return MLPSpec(tuple(LayerSpec(a, b, True, act if i < n - 1 else (last or ex.identity()))
                         for i, (a, b) in enumerate(zip(widths, widths[1:]))), precision, io)


# the issue's cases (benchmarks/sm90: measured on an H100 with the prototype)
NERF = _spec([32, 64, 64, 64, 64, 16])
GELU = _spec([64, 128, 128, 128, 128, 64], ex.gelu_erf())
SILU = _spec([256, 256, 256, 256, 256], ex.silu())
SDF = _spec([3, 128, 128, 128, 128, 1], ex.tanh())
# SwiGLU pairs: silu(x Wg + bg) * (x Wu + bu); an odd hidden width, and two gated layers in a row (streamed)
GATED = MLPSpec((LayerSpec(64, 200, True, ex.silu(), gated=True), LayerSpec(200, 40, True, ex.identity())), "fp16", "f32")
GATED2 = MLPSpec((LayerSpec(256, 256, True, ex.silu(), gated=True), LayerSpec(256, 256, True, ex.gelu_erf(), gated=True),
                  LayerSpec(256, 256, True, ex.identity())), "fp16", "f32")
WGMMA = PlanOptions(design="wgmma")
AUTO_WGMMA = PlanOptions(wgmma=True)     # auto (the default), wgmma allowed


@pytest.mark.parametrize("spec,nwg,prefetch,staged,chunks", [
    (NERF, 4, 0, True, (64, 64, 64, 64, 16)),    # its 2 input k-steps would fit the registers: staged (STAGED_WHOLE)
    (GELU, 4, 0, True, (64, 64, 64, 64, 64)),    # 4 do not: the next tile's input waits in shared memory
    (SDF, 4, 0, False, (64, 64, 64, 64, 8)),     # K0 = 3: no 16-byte copies of its rows
    (_spec([3, 128, 128, 128, 128, 1], ex.tanh(), io="f16"), 4, 0, False, (64, 64, 64, 64, 8)),
], ids=["nerf", "gelu", "sdf", "sdf_f16"])
def test_issue_cases_take_wgmma_with_the_prototype_shapes(spec, nwg, prefetch, staged, chunks):
    auto = choose.make_plan(spec, AUTO_WGMMA)        # nerf's 64-wide layers: mma.sync was faster there
    assert (auto.design == "wgmma" and "chosen" in auto.reason) == (spec is not NERF)
    plan = choose.make_plan(spec, WGMMA)
    assert plan.design == "wgmma"
    assert (plan.nwg, plan.prefetch, plan.staged_input, tuple(l.nc for l in plan.layers)) == (nwg, prefetch, staged, chunks)
    assert plan.fallback.design == "resident" and plan.uses_scratch is False
    assert plan.smem_bytes <= wgmma.SMEM_LIMIT and plan.image_bytes % wgmma.LAYER_ALIGN == 0
    # the estimate is within the cap, or the fragments are (FOUR_WARPGROUP_FRAGMENTS)
    assert (plan.registers <= dict(wgmma.REGISTER_CAPS)[plan.nwg]
            or wgmma._registers(list(plan.layers)) <= wgmma.FOUR_WARPGROUP_FRAGMENTS == dict(wgmma.REGISTER_CAPS)[plan.nwg])
    # workspace: [the fallback's packed weights][image (1024-aligned)][bias]
    assert plan.image_offset >= plan.fallback.workspace_bytes and plan.image_offset % 1024 == 0
    assert plan.workspace_bytes == plan.image_offset + plan.image_bytes + 4 * sum(l.np_ for l in plan.layers)
    text = plan.describe()
    assert text.startswith("wgmma (sm_90a)") and "other GPUs: resident" in text


def test_bf16_chains_take_wgmma_too():
    """bf16 operands: the same plan as fp16 (2-byte elements: same chunks, descriptors, image), its fallback
    the bf16 resident/streamed kernel; the packed fp16x2 activations do not apply (fp32 forms)."""
    for spec in (GELU, SILU):
        bf = _spec(spec.widths, spec.layers[0].activation, precision="bf16")
        plan, ref = choose.make_plan(bf), choose.make_plan(spec)
        assert plan.design == "wgmma" and plan.fallback.spec.precision == "bf16"
        assert [(l.kp, l.np_, l.nc, l.atom, l.offset) for l in plan.layers] == \
               [(l.kp, l.np_, l.nc, l.atom, l.offset) for l in ref.layers]
        assert (plan.stages, plan.image_bytes) == (ref.stages, ref.image_bytes) and "bf16 image" in plan.describe()
        src = _render(bf)[0][f"{bf.name}_cuda.cu"]
        assert '#define O2F_WGMMA_AB "bf16"' in src and "wgmma_pack_layer<elem_t>" in src
        assert "using elem_t = __nv_bfloat16;" in src and "o2f_h2_" not in src.split("#include \"o2f_packed_act.cuh\"")[1]


def test_silu_256_streams_its_weights_through_a_ring():
    """silu's 512 KB of weights do not stay resident: they pass through a ring of 3 chunk slots (up to 6 fit)."""
    assert choose.wgmma_refused(SILU) is None
    plan = choose.make_plan(SILU)
    assert plan.design == "wgmma" and plan.fallback.design == "streamed"
    assert (plan.streamed, plan.stages, plan.slot_bytes, plan.image_bytes) == (True, 3, 32768, 512 * 1024)
    assert plan.nwg == 2 and plan.registers <= 255 and plan.smem_bytes <= wgmma.SMEM_LIMIT
    # one (offset, bytes) per chunk of a pass, layer by layer, and they tile the image
    chunks = plan.stream_chunks
    assert len(chunks) == 16 and chunks[0] == (0, 32768)
    assert all(o + b == nxt for (o, b), (nxt, _) in zip(chunks, chunks[1:])) and sum(b for _, b in chunks) == plan.image_bytes
    assert "streamed from L2 through a ring of 3 x 32 KB slots" in plan.describe()
    assert wgmma.make_wgmma_plan(SILU, plan.fallback, stages=6).stages == 6
    # the resident plans keep their image in shared memory
    assert not choose.make_plan(GELU).streamed


def test_warpgroup_override_is_held_to_the_estimate_without_its_per_chunk_term():
    """An nwg override is refused only where the register estimate, less the per-chunk term (which
    over-counts narrow chunks: silu in 16-column chunks used 166 registers with 3 warpgroups, estimated
    ~232), is far over the cap; the plan keeps what was asked."""
    fallback = choose.make_plan(SILU).fallback
    plan = wgmma.make_wgmma_plan(SILU, fallback, nwg=3, chunk_max=16)
    assert (plan.nwg, plan.threads, plan.layers[0].nc) == (3, 384, 16)
    with pytest.raises(SpecError, match="no wgmma plan with 4 warpgroups"):   # 128 A registers alone at 4
        wgmma.make_wgmma_plan(SILU, fallback, nwg=4, chunk_max=16)


def test_ring_size_follows_the_shared_memory_limit():
    """Fewer slots where less shared memory is left; refused, with the reason, where 3 do not fit."""
    # slots, the fp32 bias, the hidden layers' fp16 bias (BIAS16), mbarriers, release counters, slack
    smem = lambda stages, halves=768: stages * 32768 + 1024 * 4 + halves * 2 + 8 * stages + 4 * stages + wgmma.SLACK
    assert wgmma.make_wgmma_plan(SILU, choose.make_plan(SILU).fallback, smem_limit=smem(4), stages=4).stages == 4
    assert wgmma.make_wgmma_plan(SILU, choose.make_plan(SILU).fallback, stages=3).stages == 3   # an override
    with pytest.raises(SpecError, match="3 to 6 fit"):
        wgmma.make_wgmma_plan(SILU, choose.make_plan(SILU).fallback, stages=7)
    why = wgmma.wgmma_reason_refused(SILU, smem(3, halves=0) - 1)   # (the fp16 bias copy gives way first)
    assert "512 KB" in why and "ring of 3" in why and "32 KB chunks" in why


def test_the_fp16_bias_copy_gives_way_where_it_would_cost_a_ring_slot():
    """BIAS16 holds the hidden layers' bias in fp16 beside the fp32 one (silu: 768 halves); where those
    bytes would leave one ring slot fewer, the plan adds the bias in fp32 instead, and an override still
    asks for it."""
    fallback = choose.make_plan(SILU).fallback
    base = 3 * 32768 + 1024 * 4 + 8 * 3 + 4 * 3 + wgmma.SLACK   # 3 slots, fp32 bias, mbarriers, counters
    assert wgmma.make_wgmma_plan(SILU, fallback, smem_limit=base + 768 * 2).bias16
    tight = wgmma.make_wgmma_plan(SILU, fallback, smem_limit=base + 768)
    assert not tight.bias16 and tight.stages == 3 and tight.bias_halves == 0
    with pytest.raises(SpecError, match="does not fit|3 to"):
        wgmma.make_wgmma_plan(SILU, fallback, smem_limit=base + 768, bias16=True, stages=3)
    relu = MLPSpec([LayerSpec(64, 128, True, ex.relu()), LayerSpec(128, 64, True, ex.identity())])
    assert not choose.make_plan(relu, WGMMA).bias16   # no packed layer: nothing to add in fp16


def test_the_fp16_bias_copy_gives_way_where_it_would_cost_a_staged_input_k_step():
    """256 -> 128 x 3 -> 16: the copy's bytes would move the first staged input k-step of the next tile into
    registers (prefetch one more: ~8 registers a thread); the default plan adds the bias in fp32 there,
    with the plan it would have without BIAS16."""
    spec = _spec([256, 128, 128, 128, 16], ex.silu())
    plan = choose.make_plan(spec, WGMMA)
    forced = wgmma.make_wgmma_plan(spec, plan.fallback, bias16=True)
    assert plan.staged_input and forced.staged_input and forced.bias16
    assert not plan.bias16 and forced.prefetch == plan.prefetch + 1
    assert wgmma.make_wgmma_plan(spec, plan.fallback, plan.reason, bias16=False) == plan


def test_clusters_are_an_override_of_streamed_plans():
    """Each CTA copies its own chunks by default (clusters sharing the copies measured slower); a cluster
    of 2 or 4 on request, streamed plans only."""
    fallback = choose.make_plan(SILU).fallback
    assert choose.make_plan(SILU).cluster == 1
    plan = wgmma.make_wgmma_plan(SILU, fallback, cluster=2)
    assert plan.cluster == 2 and "copied once per cluster of 2 CTAs" in plan.describe()
    assert all(b % (16 * 4) == 0 for _, b in plan.stream_chunks)   # slices of 1/4 stay multiples of 16 bytes
    with pytest.raises(SpecError, match="1, 2 or 4"):
        wgmma.make_wgmma_plan(SILU, fallback, cluster=3)
    assert wgmma.make_wgmma_plan(GELU, choose.make_plan(GELU).fallback, cluster=2).cluster == 1   # resident
    # a slot's "the other CTAs are done" mbarriers, one a slot, between the input tiles' and the counters
    assert plan.smem.cnt_offset == plan.smem.peer_bar_offset + 8 * plan.stages
    assert choose.make_plan(SILU).smem.cnt_offset == choose.make_plan(SILU).smem.peer_bar_offset
    src = codegen.cuda_sources(plan)[f"{SILU.name}_cuda.cu"]
    assert f"constexpr int kPeerBarSmem = {plan.smem.peer_bar_offset};" in src
    assert "mbar_init(base + kPeerBarSmem + 8 * s, kCluster - 1);" in src and src.count("cluster_sync();") == 2


def _accumulator_column(j: int, t: int, e: int) -> int:
    """The column an n8 block j's accumulator pair (e = 0, 1) holds for lane quad position t (wgmma's
    m64nN fp32 layout: rows g and g + 8, columns 8j + 2t + e)."""
    return 8 * j + 2 * t + e


def _quad_output(n: int) -> int:
    """o2f_wgmma_pack.cuh's QUAD_STORES permutation: packed column 16m + 8h + 2t + e holds output
    16m + 4t + 2h + e."""
    return (n & ~15) + 4 * ((n >> 1) & 3) + 2 * ((n >> 3) & 1) + (n & 1)


@pytest.mark.parametrize("widths", [[256, 256, 256, 256, 256], [64, 128, 128, 128, 128, 64], [32, 64, 64, 16],
                                    [64, 128, 40]])
def test_quad_stores_give_each_thread_four_adjacent_outputs(widths):
    """With the last layer's columns packed in QUAD_STORES order, the accumulators a quad's store names for
    lane position t are outputs col + 4t .. col + 4t + 3, in order, for rows g and g + 8; every true output
    is stored once; the packing is a permutation within each 16 columns. Plans whose last layer is not in
    16s (40 -> 40 columns: chunks of 40) store pairs."""
    spec = _spec(widths)
    plan = choose.make_plan(spec, WGMMA)
    last = plan.layers[-1]
    if last.np_ % 16 or last.nc % 16:
        assert not plan.quad_stores and all(not c["quads"] for c in wgmma_params(plan)["layers"][-1]["chunks"])
        return
    assert plan.quad_stores and not wgmma.make_wgmma_plan(spec, plan.fallback, quad_stores=False).quad_stores
    assert sorted(_quad_output(n) for n in range(last.np_)) == list(range(last.np_))
    assert all(_quad_output(n) // 16 == n // 16 for n in range(last.np_))
    stored = []
    params = wgmma_params(plan)["layers"][-1]
    assert params["quads"] and all(c["blocks"] for c in params["chunks"])
    for c, chunk in enumerate(params["chunks"]):
        for q in chunk["quads"]:
            for t in range(4):
                for row in q["rows"]:
                    outs = []
                    for d in row["d"]:   # d = 4 j + 2 hi + e within the chunk's accumulators
                        j, rest = divmod(d, 4)
                        assert rest // 2 == row["hi"]
                        outs.append(_quad_output(c * last.nc + _accumulator_column(j, t, rest % 2)))
                    assert outs == [q["col"] + 4 * t + i for i in range(4)]
                    stored += outs if not row["hi"] else []
    assert sorted(o for o in stored if o < last.n) == list(range(last.n))
    src = codegen.cuda_sources(plan)[f"{spec.name}_cuda.cu"]
    # every width here is a multiple of 4: quads from per-tile row pointers (STORE_ROWS), y checked at launch
    assert plan.store_rows and "store_row4<false, kNOut>(yrow0 + " in src and "store_out4<kNOut>(" not in src
    assert "% (4 * sizeof(io_t)) != 0) return" in src
    unrowed = wgmma.make_wgmma_plan(spec, plan.fallback, store_rows=False)
    assert "store_out4<kNOut>(" in codegen.cuda_sources(unrowed)[f"{spec.name}_cuda.cu"]
    # the pack kernels permute the last layer's weights and bias (their quads argument), no other layer's
    calls = re.findall(r"wgmma_pack_(?:layer<elem_t>|bias)<<<[^;]*, (\d), \S+f\);", src)
    assert calls == ["0"] * 2 * (len(plan.layers) - 1) + ["1", "1"]


def test_store_rows_check_the_columns_of_a_quad_past_the_width():
    """A last layer of 44 outputs (packed to 48, in quads): the third quad's 16 columns run past the 44,
    so its stores check the lane's column (store_row4<true>); the others need not. A width that is not a
    multiple of 4 keeps the per-store path (its rows' quads are not aligned)."""
    spec = _spec([64, 128, 44])
    plan = choose.make_plan(spec, WGMMA)
    assert plan.quad_stores and plan.store_rows
    src = codegen.cuda_sources(plan)[f"{spec.name}_cuda.cu"]
    assert "store_row4<false, kNOut>(yrow0 + 16," in src and "store_row4<true, kNOut>(yrow0 + 32," in src
    assert "store_row4<true, kNOut>(yrow0 + 16," not in src
    odd = _spec([64, 128, 46])
    oplan = choose.make_plan(odd, WGMMA)
    assert oplan.quad_stores and not oplan.store_rows
    assert "store_out4<kNOut>(" in codegen.cuda_sources(oplan)[f"{odd.name}_cuda.cu"]


def test_staged_input_where_registers_cannot_hold_the_next_tile():
    """The next tile's fp32 rows wait in a shared-memory buffer per warpgroup, placed after the ring's
    counters, where the register prefetch cannot hold them all; the k-steps that do not fit stay prefetched
    into registers (silu's 256-wide rows beside its 96 KB ring: 1 of 16). By default (BULK_INPUT) each row
    is one cp.async.bulk into a row BULK_ROW_PAD bytes longer than its values, completing on the warpgroup's
    mbarrier; bulk_input=False copies 16-byte pieces by cp.async into swizzled rows. Either way the tile is
    read back as A fragments before a warpgroup barrier, and a call whose x is not 16-byte aligned runs the
    fallback. staged_input=False keeps the register prefetch; True is refused for fp16 rows and for rows
    of K0 % 4 != 0 (16-byte copies). Where the registers could hold the whole tile, a chain without a gated
    layer stages it too (STAGED_WHOLE), a gated one keeps it in registers."""
    assert choose.make_plan(SILU).staged_input and choose.make_plan(NERF, WGMMA).staged_input
    glu64 = MLPSpec((LayerSpec(64, 256, True, ex.silu(), gated=True), LayerSpec(256, 64, True, ex.identity())), "fp16", "f32")
    regs = choose.make_plan(glu64, WGMMA)
    assert regs.design == "wgmma" and not regs.staged_input and regs.prefetch == regs.layers[0].k_steps == 4
    nerf_regs = wgmma.make_wgmma_plan(NERF, choose.make_plan(NERF), staged_input=False)   # (auto: mma.sync, the fallback)
    assert not nerf_regs.staged_input and nerf_regs.prefetch == 2
    fallback = choose.make_plan(SILU).fallback
    silu = wgmma.make_wgmma_plan(SILU, fallback)
    row = 240 * 4 + wgmma.BULK_ROW_PAD
    assert silu.bulk_input and silu.prefetch == 1 and silu.staged_cols == 240 and silu.input_bytes == 2 * 64 * row
    assert silu.smem.cnt_offset == silu.smem.input_bar_offset + 8 * silu.nwg   # an mbarrier a warpgroup
    assert silu.smem.input_offset >= silu.smem.cnt_offset + 4 * silu.stages and silu.smem.input_offset % 128 == 0
    assert silu.smem_bytes == silu.smem.input_offset + silu.input_bytes + wgmma.SLACK <= wgmma.SMEM_LIMIT
    assert "input tiles staged in shared memory a tile ahead (the first 1 k-step(s) in registers)" in silu.describe()
    gelu = wgmma.make_wgmma_plan(GELU, choose.make_plan(GELU).fallback)
    assert gelu.nwg == 4 and gelu.prefetch == 0 and gelu.staged_cols == 64 and gelu.input_bytes == 4 * 64 * (256 + 32)
    src = codegen.cuda_sources(silu)[f"{SILU.name}_cuda.cu"]
    assert "constexpr int kStageCol0 = 16;" in src and "constexpr int kStageCols = 240;" in src
    assert f"constexpr int kInSmem = {silu.smem.input_offset};" in src and f"constexpr int kInRowBytes = {row};" in src
    body = src[src.index("fused_wgmma(const"):src.index("std::atomic<int> g_mode")]
    assert body.count("bulk_stage_tile<kK0, kStageCol0, kInRowBytes>(") == 1 and body.count("wg_sync(wg);") == 1
    # the next tile's rows in a part after each of the 12 chunks before the last layer's (the first arms)
    parts = re.findall(r"bulk_stage_tile<kK0, kStageCol0, kInRowBytes, (\d+), (\d+), (true|false)>", body)
    assert silu.input_parts == 12 and len(parts) == 12 and [p[2] for p in parts] == ["true"] + ["false"] * 11
    assert [(int(a), int(b)) for a, b, _ in parts] == [(64 * i // 12, 64 * (i + 1) // 12) for i in range(12)]
    assert gelu.input_parts == 1   # resident: at the tile's start
    one = codegen.cuda_sources(wgmma.make_wgmma_plan(SILU, fallback, input_parts=1))[f"{SILU.name}_cuda.cu"]
    assert one.count("bulk_stage_tile<kK0, kStageCol0, kInRowBytes>(") == 2 and "kInRowBytes, 0, " not in one
    assert "bulk_staged_ks<kInRowBytes>(a0[ks], inb, rin, ks - 1, t2)" in body and "load_ks<kK0>(v[" not in body
    assert body.count("mbar_wait(inbar, in_phase)") == 2   # each tile's copies, and the last ones before leaving
    assert "cp_async_wait" not in body and "stage_tile<kK0, kStageCol0, kStageCols>" not in body
    assert "% 16 != 0) return " in src[src.index("_cuda_run("):]
    pieces = wgmma.make_wgmma_plan(SILU, fallback, bulk_input=False)
    assert not pieces.bulk_input and pieces.input_bytes == 2 * 64 * 240 * 4 and pieces.smem_bytes < silu.smem_bytes
    body = codegen.cuda_sources(pieces)[f"{SILU.name}_cuda.cu"]
    body = body[body.index("fused_wgmma(const"):body.index("std::atomic<int> g_mode")]
    assert body.count("stage_tile<kK0, kStageCol0, kStageCols>(") == 2 and body.count("wg_sync(wg);") == 2
    assert "staged_ks<kStageCols>(a0[ks], inbuf, rin, ks - 1, t2)" in body and "bulk_" not in body
    assert body.count("cp_async_wait<0>();") == 2
    kept = wgmma.make_wgmma_plan(SILU, fallback, staged_input=False)
    assert kept.prefetch == 2 and kept.input_bytes == 0 and not kept.bulk_input and "input prefetch 2 k-steps" in kept.describe()
    plain = codegen.cuda_sources(kept)[f"{SILU.name}_cuda.cu"]
    assert "stage_tile<" not in plain[plain.index("fused_wgmma(const"):] and "kStageCols" not in plain
    for spec, words in ((_spec([64, 128, 128, 64], io="f16"), "fp32 rows"), (_spec([66, 128, 128, 64]), "multiple of 4")):
        with pytest.raises(SpecError, match=words):
            wgmma.make_wgmma_plan(spec, choose.make_plan(spec).fallback, staged_input=True)


@pytest.mark.parametrize("spec,words", [
    (_spec([64, 128, 64], precision="tf32"), "takes fp16 and bf16"),
    (_spec([64, 300, 64]), "up to 256"),
    (_spec([64, 128, 64], precision="fp32"), "no tensor-core kernel"),
])
def test_refusal_reasons(spec, words):
    assert words in choose.wgmma_refused(spec)
    assert choose.make_plan(spec, WGMMA).design != "wgmma"   # forced where possible only


def test_a_first_layer_may_be_wider_than_the_hidden_ones():
    """The first layer's A fragments come from the chain's input, not a layer's registers: up to
    FIRST_WIDTH_MAX features (NeRF past its skip Concat: 319; its view head: 283), while hidden layers and
    outputs stay within WIDTH_MAX. A row not 16-byte aligned is loaded into registers in groups of REST_GROUP
    k-steps; plans whose input fits one group render as before (one group)."""
    skip = _spec([319, 256, 256, 256])
    plan = choose.make_plan(skip)
    assert plan.design == "wgmma" and not plan.staged_input and plan.prefetch == 0, plan.describe()
    steps = plan.layers[0].k_steps
    assert steps == 20 > wgmma.REST_GROUP
    assert wgmma_params(plan)["rest_groups"] == [(0, wgmma.REST_GROUP), (wgmma.REST_GROUP, steps)]
    src = codegen.cuda_sources(plan)[f"{skip.name}_cuda.cu"]
    assert "(k-steps 0..15)" in src and "(k-steps 16..19)" in src
    assert choose.make_plan(_spec([283, 128, 3])).design == "wgmma"
    one = choose.make_plan(_spec([250, 128, 128, 10]), WGMMA)
    assert len(wgmma_params(one)["rest_groups"]) <= 1
    assert "(k-steps" not in codegen.cuda_sources(one)[f"{one.spec.name}_cuda.cu"]
    for spec, words in ((_spec([64, 300, 64]), "up to 256"), (_spec([513, 128, 16]), "up to 512"),
                        (_spec([319, 256, 600]), "the last layer's output up to 512")):
        assert words in choose.wgmma_refused(spec), spec.describe()
    # the last layer's outputs go to memory, not into A fragments: it may be wider (plan.wgmma LAST_WIDTH_MAX)
    wide_last = choose.make_plan(_spec([39, 256, 257]), WGMMA)
    assert wide_last.design == "wgmma" and wide_last.layers[-1].np_ == 320 and wide_last.layers[-1].chunks == 5


def test_pooled_chains_take_wgmma_with_a_last_layer_up_to_2048():
    """A pooled chain (spec.pool: PointNet's 3 -> 64 -> 64 -> 64 -> 128 -> 1024 before its max over the points)
    stores no rows: its last layer may be 2048 wide (plan.wgmma POOLED_LAST_WIDTH_MAX), each n8 block of it
    taking its two rows' maxima (pool_take), each chunk then raising the group's maxima (pool_chunk) in place
    of stores, one part of a warp's rows (one group) at a time, at the most warpgroups (POOL_NWG_MAX); the
    unit's entry point is the pooled run, whose other GPUs run the fallback's pooled run."""
    pooled = replace(_spec([3, 64, 64, 64, 128, 1024]), pool="max")
    plan = choose.make_plan(pooled, AUTO_WGMMA)
    assert plan.design == "wgmma" and plan.fallback.design == "streamed" and plan.nwg == wgmma.POOL_NWG_MAX
    assert plan.layers[-1].chunks == 16 and not plan.quad_stores and not plan.store_rows
    # two copies of a group's 1024 entries a warpgroup, static, within the limit beside the dynamic layout
    assert plan.pool_smem_bytes == 4 * 2 * 4 * 1024 and "+ 32 KB for the pool's copies" in plan.describe()
    assert "; other GPUs and groups of fewer than 16 rows: streamed (" in plan.describe()
    assert plan.smem_bytes + plan.pool_smem_bytes <= wgmma.SMEM_LIMIT
    assert "the last layer's output up to 512" in choose.wgmma_refused(replace(pooled, pool=None))
    assert "up to 2048 with its pool" in choose.wgmma_refused(replace(_spec([3, 64, 128, 2056]), pool="max"))
    files, _ = _render(pooled)
    src, fb = files[f"{pooled.name}_cuda.cu"], fallback_symbol(pooled)
    assert f" {pooled.name}_cuda_run_pool(" in src and f" {fb}_cuda_run_pool(" in src
    assert f"{pooled.name}_cuda_run(" not in src and f"{fb}_cuda_run(" not in src
    assert f" {fb}_cuda_run_pool(" in files[f"{fb}_cuda.cu"] and "o2f_wgmma_pool.cuh" in files
    assert src.count("pool_take<true>(pfirst, pmid, row0,") == src.count("pool_take<false>(pmid, pend, row0,") == 1024 // 8 and src.count("pool_chunk<kNOut, 8>(pshared") == 2 * 16
    # each chunk's epilogue twice: the warp's rows of its first group, then the next's where they straddle two
    # (only in the instance for groups of rows not a multiple of 16, chosen at launch)
    assert src.count("if (kStraddle && pmid < pend) {") == 16 and "template <bool kStraddle>" in src
    assert "group_rows % 16 != 0 ? fused_wgmma<true> : fused_wgmma<false>" in src
    assert src.count("cudaFuncSetAttribute(fused_wgmma<") == 2
    assert "store_out" not in src
    # a warp's rows in one group or two: smaller groups run the fallback's pooled kernel
    assert f"if (group_rows < 16) return {fb}_cuda_run_pool(" in src
    # an odd width: the padding block's columns are left to pool_chunk's column check
    odd = replace(_spec([6, 128, 5]), pool="maxk")
    src = _render(odd, WGMMA)[0][f"{odd.name}_cuda.cu"]
    assert src.count("pool_take<true>(pfirst, pmid, row0,") == 1 and src.count("pool_chunk<kNOut, 1>(pshared") == 2 and "kNOut = 5;" in src


def test_cost_rule_and_the_switches():
    narrow = _spec([32, 64, 16])                              # one layer of >= 64 outputs: mma.sync
    assert not cost.wgmma_wins(narrow) and choose.make_plan(narrow).design == "resident"
    forced = choose.make_plan(narrow, WGMMA)
    assert forced.design == "wgmma" and DESIGN_ENV in forced.reason
    assert choose.make_plan(NERF, PlanOptions(wgmma=False)).design == "resident"
    assert choose.make_plan(GELU).design == "wgmma"          # on by default
    assert choose.make_plan(GELU, PlanOptions(wgmma=False)).design == "resident"
    for other in ("resident", "streamed", "wide"):            # forcing another design forbids wgmma
        assert choose.make_plan(NERF, PlanOptions(design=other)).design != "wgmma"
    assert PlanOptions.from_env({DESIGN_ENV: "wgmma"}).design == "wgmma"
    assert PlanOptions.from_env({WGMMA_ENV: "off"}).wgmma is False
    assert PlanOptions.from_env({}).wgmma is True
    assert PlanOptions.from_env({WGMMA_ENV: "on"}).wgmma is True


def test_a_pooled_last_layer_counts_as_wide_for_the_cost_rule():
    """A CNN head's pointwise conv before its global average pool (MobileNetV2: 320 -> 1280, a mean over
    7 x 7 = 49 positions) is one pooled layer: it writes no rows, so it takes wgmma like a hidden layer
    would, while the same layer unpooled (its outputs stored) stays with mma.sync; its groups of 49 rows
    (not a multiple of 16) run the wgmma kernel's parts, only groups under 16 rows the fallback."""
    head = replace(_spec([320, 1280]), pool="meank")
    assert cost.wgmma_wins(head) and not cost.wgmma_wins(replace(head, pool=None))
    plan = choose.make_plan(head)
    assert plan.design == "wgmma" and "chosen: 1 hidden or pooled layer(s) of >= 128 outputs" in plan.reason
    assert choose.make_plan(replace(head, pool=None)).design != "wgmma"
    assert not cost.wgmma_wins(replace(_spec([320, 64]), pool="meank"))   # a narrow pooled layer: as before
    # its 80 KB fp32 rows would fit staged beside the ring only with 13 of 20 k-steps waiting in registers
    # (~280 with the fragments: spilled): 2 warpgroups (the unstaged load's 16 k-steps in fp32 fit there), unstaged
    assert plan.nwg == 2 and not plan.staged_input and plan.prefetch == 0
    staged = wgmma.make_wgmma_plan(head, plan.fallback, prefetch=13)   # an override is still taken
    assert staged.staged_input and staged.prefetch == 13
    # a longer chain with as wide an input keeps its measured plan (NeRF's second half: 8 k-steps in registers)
    nerf_half = choose.make_plan(_spec([320, 256, 256, 256], ex.relu()), WGMMA)
    assert nerf_half.nwg == 2 and nerf_half.staged_input and nerf_half.prefetch == 8


def test_plan_text_says_why_not_wgmma():
    assert "Hopper wgmma not used: no hidden layer of >= 128" in plan_text(_spec([32, 64, 16]), choose.make_plan(_spec([32, 64, 16])))
    assert "Hopper wgmma not used: layer 0 is 64 -> 300" in plan_text(_spec([64, 300, 64]), choose.make_plan(_spec([64, 300, 64])))
    assert "switched off (ONNX2FUSED_WGMMA=off" in plan_text(GELU, choose.make_plan(GELU, PlanOptions(wgmma=False)))
    text = plan_text(GELU, choose.make_plan(GELU, AUTO_WGMMA))
    assert "GPU: wgmma (sm_90a)" in text and "not used" not in text
    wide = _spec([768, 3072, 768])   # the wide design says itself which CUTLASS kernels run on Hopper
    text = plan_text(wide, choose.make_plan(wide, PlanOptions(design="wide")))
    assert text.startswith("GPU: wide") and "onnx2fused's wgmma/TMA" in text and "not used" not in text


def _render(spec, options=AUTO_WGMMA):
    plans = choose.make_plans([spec], options)
    return codegen.render([spec], True, plans=plans), plans[spec.name]


@pytest.mark.parametrize("spec", [NERF, GELU, SDF, _spec([3, 128, 128, 128, 128, 1], ex.tanh(), io="f16"),
                                  _spec([30, 80, 176, 7], ex.sigmoid(), io="f16", last=ex.relu()), SILU],
                         ids=["nerf", "gelu", "sdf", "sdf_f16", "odd_widths", "silu_streamed"])
def test_rendering_is_deterministic_and_complete(spec):
    files, plan = _render(spec, WGMMA)
    again, _ = _render(spec, WGMMA)
    assert files == again
    name, fb = spec.name, fallback_symbol(spec)
    src = files[f"{name}_cuda.cu"]
    for fname, text in files.items():   # the rendered ones (static headers hold asm operand lists like {%0, %1})
        if not fname.endswith(".cuh"):
            assert not re.search(r"\{\{|\}\}|\{%|%\}|\{#|#\}", text), f"jinja leftovers in {fname}"
    assert src.splitlines()[1] == "// onnx2fused-arch: sm_90a" and targets.needs_sm90a(src)
    assert not targets.needs_sm90a(files[f"{fb}_cuda.cu"])
    for header in ("o2f_wgmma.cuh", "o2f_wgmma_ops.cuh", "o2f_wgmma_pack.cuh"):
        assert header in files
    # the entry points, and the fallback's, which this unit calls on other GPUs
    for fn in ("cuda_workspace_bytes", "cuda_pack", "cuda_run"):
        assert 'extern "C" ' in src and f" {name}_{fn}(" in src
        assert f" {fb}_{fn}(" in src and f" {fb}_{fn}(" in files[f"{fb}_cuda.cu"]
    assert f"return {plan.workspace_bytes}; }}" in src
    assert f"{fb}_cuda_workspace_bytes() != {plan.fallback.workspace_bytes}" in src
    # the fallback unit is the fallback plan's own source under the other symbol
    alone = codegen.render([spec], True, plans={name: plan.fallback})[f"{name}_cuda.cu"]
    assert files[f"{fb}_cuda.cu"] == alone.replace(f"{name}_cuda_", f"{fb}_cuda_")
    # one wgmma per chunk and k-step
    assert src.count("Wgmma<") == sum(l.chunks * l.k_steps for l in plan.layers)
    # streamed: a ring acquire per chunk issued, a release per chunk waited for, the ring header; resident:
    # one bulk copy of the image per CTA
    n_chunks = sum(l.chunks for l in plan.layers)
    assert src.count("ring.acquire()") == src.count("ring.release(lane)") == (n_chunks if plan.streamed else 0)
    assert ("o2f_wgmma_ring.cuh" in files) == plan.streamed
    assert ("mbar_wait(wbar, 0)" in src) != plan.streamed


def test_odd_widths_are_padded_and_chunked():
    plan = choose.make_plan(_spec([30, 80, 176, 7], ex.sigmoid(), io="f16"), WGMMA)
    # 80 = 2 x 40; 176 would be 11 chunks of 16: padded to 192 = 3 x 64
    assert [(l.kp, l.np_, l.nc, l.atom) for l in plan.layers] == [(32, 80, 40, 64), (80, 192, 64, 32), (192, 8, 8, 128)]
    assert [(l.np_, l.nc) for l in choose.make_plan(_spec([64, 200, 64]), WGMMA).layers] == [(256, 64), (64, 64)]


def _swizzle(b, atom):
    return b ^ (((b >> 7) & (atom // 16 - 1)) << 4)


def _pack_address(l, n, k):
    """Where templates/o2f_wgmma_pack.cuh writes (n, k) of layer l, from the shared-memory base."""
    c, nn, kb = n // l.nc, n % l.nc, 2 * k
    off = (nn % 8) * l.atom + (nn // 8) * 8 * l.atom + kb % l.atom + (kb // l.atom) * (l.nc // 8) * 8 * l.atom
    return l.offset + c * l.chunk_bytes + _swizzle(off, l.atom)


@pytest.mark.parametrize("spec", [NERF, GELU, SDF, _spec([30, 80, 176, 7], ex.sigmoid()), SILU,
                                  _spec([96, 256, 224, 256, 256, 40], ex.silu()), GATED, GATED2],
                         ids=["nerf", "gelu", "sdf", "odd_widths", "silu_streamed", "odd_streamed", "gated",
                              "gated_streamed"])
def test_descriptors_read_what_the_packing_wrote(spec):
    """Emulates the addresses wgmma computes from each printed descriptor (PTX ISA canonical K-major
    layouts: row n at (n % 8) * swizzle width + (n / 8) * stride byte offset, 16 k values contiguous from
    the start address, then the swizzle XOR on the address) and checks every (n, k) of every k-step of
    every chunk against the packing's address of that weight. A streamed plan's descriptors are relative
    to the ring slot its chunk was copied into, verbatim from the chunk's bytes in the image (slots are
    1024-aligned, so the swizzle of an address in the slot is that of the byte in the image)."""
    plan = choose.make_plan(spec, WGMMA)
    params = wgmma_params(plan)
    for l, lp in zip(plan.layers, params["layers"]):
        hi = int(lp["desc_hi"].rstrip("u"), 16)
        sbo, mode = (hi & 0x3FFF) << 4, hi >> 30
        width = {1: 128, 2: 64, 3: 32}[mode]
        assert width == l.atom and (hi >> 17) & 7 == 0     # base offset 0
        for c, cp in enumerate(lp["chunks"]):
            assert [k["scale"] for k in cp["ksteps"]] == [0] + [1] * (l.k_steps - 1)
            for kp in cp["ksteps"]:
                start = kp["lo"] << 4
                for n in range(l.nc):
                    for kk in range(16):
                        got = _swizzle(start + (n % 8) * width + (n // 8) * sbo + 2 * kk, width)
                        if plan.streamed:    # the slot holds the chunk's bytes from its image offset on
                            got += l.offset + c * l.chunk_bytes
                        assert got == _pack_address(l, c * l.nc + n, 16 * kp["ks"] + kk)
    # the image fits and its layers do not overlap
    ends = [l.offset + l.chunks * l.chunk_bytes for l in plan.layers]
    assert all(e <= nxt.offset for e, nxt in zip(ends, plan.layers[1:])) and ends[-1] <= plan.image_bytes


def test_fragment_mapping_covers_every_next_layer_register_once():
    plan = choose.make_plan(GELU, AUTO_WGMMA)
    for lp, nxt in zip(wgmma_params(plan)["layers"][:-1], plan.layers[1:]):
        regs = sorted((b["kt"], r) for c in lp["chunks"] for b in c["blocks"] for r in (b["reg"], b["reg_hi"]))
        assert regs == [(kt, r) for kt in range(nxt.k_steps) for r in range(4)]


def _source_column(n: int, cols: int, hidden: int) -> int:
    """templates/o2f_wgmma_pack.cuh's wgmma_source_column: padded column n -> the source weight's column
    (gated: gate columns 0..H-1, then up H..2H-1, interleaved by n8 blocks), -1 for padding."""
    if not hidden:
        return n if n < cols else -1
    b, h = n // 8, 8 * (n // 16) + n % 8
    return h + (b % 2) * hidden if h < hidden else -1


@pytest.mark.parametrize("spec", [GATED, GATED2], ids=["gated", "gated_streamed"])
def test_gated_layers_pair_each_gate_block_with_its_up_block(spec):
    """A gated layer's packed columns interleave gate and up by n8 blocks (the packing's source columns
    cover every gate and up column once); each epilogue block reads a gate block's accumulators and the
    next n8 block's (its up columns) and writes one hidden n8 block; every next-layer register is written
    once; chunk c >= 2's wgmmas depend on every register chunk c - 2's epilogue wrote."""
    plan = choose.make_plan(spec, WGMMA)
    assert plan.design == "wgmma" and DESIGN_ENV in plan.reason
    params = wgmma_params(plan)
    for l, lp, pk in zip(plan.layers, params["layers"], params["pack_layers"]):
        if not l.gated:
            continue
        assert pk["gated"] == l.n and pk["n"] == 2 * l.n and l.np_ == 2 * l.hidden and l.hidden % 16 == 0
        src = [_source_column(n, pk["n"], pk["gated"]) for n in range(l.np_)]
        assert sorted(c for c in src if c >= 0) == list(range(2 * l.n))
        assert all(src[n] < l.n for n in range(l.np_) if (n // 8) % 2 == 0 and src[n] >= 0)   # gate blocks
        regs = []
        for cp in lp["chunks"]:
            for b in cp["blocks"]:
                assert b["ucol"] == b["gcol"] + 8 and b["gcol"] % 16 == 0 and b["col"] == b["gcol"] // 2
                assert src[b["gcol"]] == (b["col"] if b["col"] < l.n else -1)
                assert src[b["ucol"]] == (l.n + b["col"] if b["col"] < l.n else -1)
                assert len(set(b["g"] + b["u"])) == 8 and max(b["g"] + b["u"]) < lp["acc"]
                regs += [(b["kt"], b["reg"]), (b["kt"], b["reg_hi"])]
        assert sorted(regs) == [(kt, r) for kt in range(l.hidden // 16) for r in range(4)]
        for st in lp["steps"]:
            if st["op"] == "issue" and st["chunk"] >= 2:
                want = {f"a{l.index + 1}[{b['kt']}][{b[r]}]" for b in lp["chunks"][st["chunk"] - 2]["blocks"]
                        if b["pad"] != "all" for r in ("reg", "reg_hi")}
                assert set(re.findall(r"a\d+\[\d+\]\[\d+\]", st["dep"])) == want
    src = _render(spec, WGMMA)[0][f"{spec.name}_cuda.cu"]
    assert "glu_pack" in src and "kOpaqueZero" in src and "lo_dep2" in src


def test_gated_chains_take_wgmma_where_it_wins():
    """Measured on the H100 (RESULTS.md, fourteenth and thirty-second runs): the cost model picks wgmma for a
    gated chain as for a plain one, and says why it does or does not; a gated last layer is refused."""
    plan = choose.make_plan(GATED2)
    assert plan.design == "wgmma" and "chosen: 2 hidden layer(s) of >= 128 outputs" in plan.reason
    one = MLPSpec((LayerSpec(64, 256, True, ex.silu(), gated=True), LayerSpec(256, 64, True, ex.identity())), "fp16", "f32")
    assert choose.make_plan(one).design == "wgmma"   # 64 -> SwiGLU 256 -> 64: 0.351 ms vs 0.634 streamed
    # the zoo's geglu shape: through ORT 0.090 ms vs 0.117 for mma.sync at 2^18 rows (thirty-second run; the
    # fourteenth had it the other way round, 0.119 vs 0.105)
    geglu = MLPSpec((LayerSpec(64, 128, True, ex.gelu_erf(), gated=True), LayerSpec(128, 64, True, ex.identity())), "fp16", "f32")
    assert choose.make_plan(geglu).design == "wgmma"
    narrow = MLPSpec((LayerSpec(64, 96, True, ex.gelu_erf(), gated=True), LayerSpec(96, 64, True, ex.identity())), "fp16", "f32")
    plan = choose.make_plan(narrow)
    assert plan.design != "wgmma" and "no hidden layer of >= 128 outputs (mma.sync is as fast there)" in plan_text(narrow, plan)
    last = MLPSpec((LayerSpec(64, 128, True, ex.silu()), LayerSpec(128, 64, True, ex.silu(), gated=True)), "fp16", "f32")
    assert "gated last layer" in choose.wgmma_refused(last)
    assert choose.make_plan(last, WGMMA).design != "wgmma"


def test_last_layer_padding_blocks_are_left_out():
    plan = choose.make_plan(SDF, AUTO_WGMMA)     # N = 1: one n8 block of the 8-wide chunk, its first column only real
    last = wgmma_params(plan)["layers"][-1]
    assert [b["col"] for c in last["chunks"] for b in c["blocks"]] == [0]
    assert "store_out<kNOut>" in _render(SDF)[0][f"{SDF.name}_cuda.cu"]


def test_build_flags_for_the_sm90a_unit():
    flags = ["-O3", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
             "-gencode", "arch=compute_90,code=compute_90"]
    out = targets.wgmma_nvcc_flags(flags)
    assert "arch=compute_90a,code=sm_90a" in out and "arch=compute_80,code=sm_80" in out
    assert targets.SM90A_DEFINE in out and targets.WIDE_SM90A_DEFINE not in out
    only80 = ["-O3", "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_80,code=compute_80"]
    assert targets.wgmma_nvcc_flags(only80) == only80            # no Hopper: the fallback alone, no define


def test_per_channel_constants_are_sized_to_the_padded_columns():
    slope = ex.Chan(tuple(np.linspace(0.01, 0.3, 50)))
    prelu = ex.Op("select", (ex.Op("lt", (ex.X, ex.Const(0.0))), ex.X * slope, ex.X))
    spec = MLPSpec((LayerSpec(32, 50, True, prelu), LayerSpec(50, 50, True, prelu), LayerSpec(50, 7, True, ex.identity())),
                   "fp16", "f32")
    files, plan = _render(spec, WGMMA)
    assert plan.design == "wgmma"
    src = files[f"{spec.name}_cuda.cu"]
    assert f"__device__ const float kChan0_0[64] = {{ {ex.c_array_values(slope, 64)} }};" in src


@pytest.mark.parametrize("spec", [GELU, SILU, GATED], ids=["resident", "streamed", "gated"])
def test_shared_memory_layout_is_the_one_the_plan_sized(spec):
    """The kernel places its bias, mbarriers and release counters where the plan's SmemLayout says, and
    the size the planner fitted into shared memory is the one the launch asks for: one layout, not two sums."""
    plan = choose.make_plan(spec, WGMMA)
    lay = plan.smem
    assert plan.smem_bytes == wgmma._smem(list(plan.layers), plan.stages, plan.input_bytes, bias16=plan.bias16)
    assert lay.bias_offset == (plan.stages * plan.slot_bytes or plan.image_bytes)
    assert lay.bias16_offset - lay.bias_offset == 4 * plan.bias_floats
    hidden = sum(l.np_ for l in plan.layers[:-1])   # BIAS16: the hidden layers' bias again, in fp16
    assert lay.bar_offset - lay.bias16_offset == (round_up(2 * hidden, 8) if plan.bias16 else 0)
    src = _render(spec, WGMMA)[0][f"{spec.name}_cuda.cu"]
    assert f"constexpr int kBiasSmem = {lay.bias_offset};" in src and f"constexpr int kBarSmem = {lay.bar_offset};" in src
    # BIAS16: the fp16 copy where the plan put it, as many halves as it sized, each layer reading its own
    assert (f"constexpr int kBias16Smem = {lay.bias16_offset};" in src) == plan.bias16
    assert (f"constexpr int kBiasHalves = {plan.bias_halves};" in src) == plan.bias16
    reads = set(re.findall(r"O2F_BIAS16\(sbias16 \+ (\d+) \+ col\)", src))
    assert reads == ({str(l.bias_offset) for l in plan.layers[:-1]} if plan.bias16 else set()), reads
    assert (f"constexpr int kCntSmem = {lay.cnt_offset};" in src) == plan.streamed
    assert lay.cnt_offset + 4 * plan.stages <= lay.bytes <= 227 * 1024


def test_one_layer_of_128_outputs_takes_wgmma():
    """The zoo's ffn3d (64 -> GELU 256 -> 64) and any chain with a single hidden layer of >= 128 outputs took
    the resident mma.sync kernel (the rule asked for two): on an H100 wgmma ran ffn3d's kernel at 0.280 ms
    against 0.687 at 2^20 rows (through ORT 0.311 against 0.738), 64 -> GELU 128 -> 64 at 0.209 against 0.231
    (RESULTS.md, thirty-second run). 64-wide chains (nerf) stay on mma.sync, and so does a chain whose only
    wide layer is its last (no measurement had one)."""
    for hidden in (256, 128):
        ffn = MLPSpec((LayerSpec(64, hidden, True, ex.gelu_erf()), LayerSpec(hidden, 64, True, ex.identity())), "fp16", "f32")
        plan = choose.make_plan(ffn)
        assert plan.design == "wgmma" and "chosen: 1 hidden layer(s) of >= 128 outputs" in plan.reason
    for narrow in (_spec([32, 64, 64, 64, 64, 16]), _spec([32, 64, 64, 128])):
        plan = choose.make_plan(narrow)
        assert plan.design == "resident" and "no hidden layer of >= 128 outputs" in plan_text(narrow, plan)


def test_transformer_blocks_take_wgmma():
    """plan.wgmma.BLOCKS (on since an H100 checked it): a norm in front and a residual behind in the wgmma
    kernel, fp32 I/O, a norm over at most BLOCK_K0_MAX features; the norm holds each row's k-steps in
    registers, so no next-tile prefetch: the tile is staged whole (BLOCK_STAGED, bulk copies of rows of
    K0 % 4 == 0), with a residual in two buffers a warpgroup (the residual reads x there), else loaded
    straight into registers. WgmmaOptions(blocks=False) keeps a block on mma.sync."""
    from onnx2fused.spec import NormSpec
    ln = NormSpec("layernorm", 1e-5, True)

    def block(k0, io="f32", norm=ln):
        return MLPSpec((LayerSpec(k0, 256, True, ex.gelu_erf()), LayerSpec(256, k0, True, ex.identity())), "fp16", io,
                       norm=norm, residual=True)
    assert wgmma.BLOCKS and choose.wgmma_refused(block(64)) is None
    plan = choose.make_plan(block(64))
    assert plan.design == "wgmma" and "chosen" in plan.reason
    off = PlanOptions(wgmma_overrides=WgmmaOptions(blocks=False))
    assert "switched off" in wgmma.wgmma_reason_refused(block(64), blocks=False)
    assert choose.make_plan(block(64), off).design == "resident"
    asked = PlanOptions(wgmma_overrides=WgmmaOptions(blocks=True))
    assert choose.make_plan(block(64), asked) == plan
    assert plan.design == "wgmma" and plan.prefetch == 0 and plan.staged_input and plan.bulk_input
    assert plan.in_buffers == 2 and plan.input_bytes == plan.nwg * 2 * 64 * (64 * 4 + wgmma.BULK_ROW_PAD)
    assert plan.smem.input_bars == 2 * plan.nwg and "2 a warpgroup (the residual reads x's rows there)" in plan.describe()
    src = codegen.cuda_sources(plan)[f"{block(64).name}_cuda.cu"]
    assert "constexpr int kInBuffers = 2;" in src and "residual4_staged<kInRowBytes>(inb" in src and "_at(x, rows, row0" not in src
    assert "bulk_staged_vals<kInRowBytes>(v[ks], inb" in src and "load_ks<kK0>(v[ks]" not in src
    # rows of K0 % 4 != 0 cannot be bulk copied: straight into registers, the residual from global memory
    odd = choose.make_plan(block(62), asked)
    assert odd.design == "wgmma" and not odd.staged_input and odd.prefetch == 0
    odd_src = codegen.cuda_sources(odd)[f"{block(62).name}_cuda.cu"]
    assert "_at(x, rows, row0" in odd_src and "load_ks<kK0>(v[ks]" in odd_src
    # cp.async staging (bulk_input=False) cannot take a norm; a residual alone then reads x from global memory
    forced = PlanOptions(wgmma_overrides=WgmmaOptions(blocks=True, bulk_input=False))
    assert not choose.make_plan(block(64), forced).staged_input
    no_norm = choose.make_plan(block(64, norm=None), asked)
    assert no_norm.staged_input and no_norm.in_buffers == 2
    # the residual reads the tile's whole row from two buffers; where those do not fit, one buffer and the
    # residual from global memory, its rows whole only for a norm (a staged tile holds only the columns past
    # the prefetched k-steps, which the residual must not read from there)
    buffers_seen = set()
    for k0, hidden, norm in ((72, 120, ln), (72, 256, ln), (40, 100, ln), (128, 256, ln), (64, 128, ln),
                             (96, 200, ln), (72, 120, None), (96, 200, None), (200, 256, None)):
        spec = MLPSpec((LayerSpec(k0, hidden, True, ex.silu()), LayerSpec(hidden, k0, True, ex.identity())),
                       "fp16", "f32", norm=norm, residual=True)
        p = choose.make_plan(spec, PlanOptions(design="wgmma"))
        assert p.design == "wgmma" and p.staged_input, (k0, hidden, norm)
        src = codegen.cuda_sources(p)[f"{spec.name}_cuda.cu"]
        whole = p.prefetch == 0 and p.staged_cols == p.layers[0].kp
        if p.in_buffers == 2:
            assert whole and "_staged<kInRowBytes>(inb" in src and "_at(x, rows, row0" not in src, (k0, hidden, norm)
        else:
            assert p.in_buffers == 1 and "_at(x, rows, row0" in src and "_staged<kInRowBytes>(inb" not in src, (k0, hidden, norm)
            assert whole or norm is None, (k0, hidden, norm)
            # the one buffer is the fallback: two would not fit
            two_whole = 2 * p.nwg * 64 * wgmma._input_row_bytes(p.layers[0].kp, True)
            assert p.smem_bytes - p.input_bytes + two_whole > wgmma.SMEM_LIMIT, (k0, hidden, norm)
        buffers_seen.add((p.in_buffers, whole))
    assert buffers_seen >= {(2, True), (1, True), (1, False)}   # every form taken by some width

    with pytest.raises(SpecError, match="with a norm, bulk copies"):
        wgmma.make_wgmma_plan(block(64), choose.make_plan(block(64)), staged_input=True, bulk_input=False,
                              blocks=True)
    assert "fp16 I/O" in wgmma.wgmma_reason_refused(block(64, io="f16"), blocks=True)
    assert "normalises rows of up to 128" in wgmma.wgmma_reason_refused(block(144), blocks=True)
    residual_only = choose.make_plan(block(144, norm=None), asked)   # no norm: any K0 the design takes
    assert residual_only.design == "wgmma"


def test_residual_from_global_memory_loads_a_chunk_ahead_of_its_stores():
    """plan.wgmma RESIDUAL_AHEAD_ROOMY: where x's values come from global memory, a chunk's stores have them
    loaded first where registers allow (each store orders memory: a load between two stores waited alone),
    else each store loads its own; the two-buffer residual reads the staged tile instead."""
    import re

    def residual_spec(k0, hidden, norm=None):
        return MLPSpec((LayerSpec(k0, hidden, True, ex.silu()), LayerSpec(hidden, k0, True, ex.identity())),
                       "fp16", "f32", norm=norm, residual=True)

    def last_layer_src(spec, plan):
        src = codegen.cuda_sources(plan)[f"{spec.name}_cuda.cu"]
        return src[src.index(f"// layer {len(spec.layers) - 1}:"):]

    seen = set()
    for k0, hidden in ((200, 256), (37, 64), (72, 120), (64, 256), (62, 256)):
        spec = residual_spec(k0, hidden)
        plan = choose.make_plan(spec, PlanOptions(design="wgmma"))
        src = last_layer_src(spec, plan)
        if plan.in_buffers == 2:
            assert plan.residual_ahead is False and "_at(x, rows" not in src
            continue
        assert isinstance(plan.residual_ahead, bool), (k0, hidden)
        first_store = src.index("store_")
        if plan.residual_ahead:
            # every load of the first chunk's x values comes before its first store
            loads = [m.start() for m in re.finditer(r"residual[24]_at\(x, rows", src)]
            assert loads and loads[len(loads) // plan.layers[-1].chunks - 1] < first_store, (k0, hidden)
            assert "residual_at(x, rows" not in src
        else:
            assert re.search(r"residual[24]_at", src) is None and "residual_at(x, rows" in src
        seen.add((plan.nwg >= 4, plan.residual_ahead))
    # a roomy cap (2 or 3 warpgroups), a tight one with room left (37 -> 64 -> 37) and one without (72 -> 120 -> 72)
    assert seen >= {(False, True), (True, True), (True, False)}, seen
