"""The wgmma design's source compiles as build.py compiles it (sm_80 + sm_90a, ONNX2FUSED_SM90A), uses
warpgroup MMA on sm_90a (PTX; SASS HGMMA where cuobjdump exists), nothing on sm_80, and ptxas spills
nothing. Two nvcc compiles; no GPU needed. Numerical checks: tests/test_gpu.py::test_wgmma_zoo_on_cuda_ep."""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from onnx2fused import codegen, targets
from onnx2fused import expr as ex
from onnx2fused.plan import choose
from onnx2fused.plan.options import PlanOptions, WgmmaOptions
from onnx2fused.spec import LayerSpec, MLPSpec, NormSpec
from onnx2fused.wgmma_params import fallback_symbol
from nvcc_support import compile_kept, ptxas_entry

pytestmark = pytest.mark.cuda_build
NVCC = shutil.which("nvcc")
GENCODES = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
            "-gencode", "arch=compute_90,code=compute_90"]   # what nvcc_flags gives for the default archs 80,90


def _prelu(n):
    slope = ex.Chan(tuple(np.linspace(0.01, 0.3, n)))
    return ex.Op("select", (ex.Op("lt", (ex.X, ex.Const(0.0))), ex.X * slope, ex.X))


SDF_F16 = MLPSpec(tuple(LayerSpec(a, b, True, ex.tanh() if b != 1 else ex.identity())
                        for a, b in ((3, 128), (128, 128), (128, 128), (128, 128), (128, 1))), "fp16", "f16")
# every swizzle width (K 32, 80, 176), partial padding blocks, per-channel constants, an odd last width
ODD = MLPSpec((LayerSpec(30, 80, True, _prelu(80)), LayerSpec(80, 176, True, ex.gelu_erf()),
               LayerSpec(176, 7, True, ex.sigmoid())), "fp16", "f32")
# bf16 operands (wgmma .bf16, cvt.rn.bf16x2 fragments, the image packed in bf16), resident
BF16 = MLPSpec(tuple(LayerSpec(a, b, True, ex.gelu_erf() if b != 64 else ex.identity())
                     for a, b in ((64, 128), (128, 128), (128, 64))), "bf16", "f32")
# weights streamed through the ring (1.1 MB: not resident), chunks of 56 and 40 columns, 64- and 128-byte swizzles
STREAMED = MLPSpec(tuple(LayerSpec(a, b, True, ex.silu() if i < 4 else ex.identity())
                         for i, (a, b) in enumerate(zip((96, 256, 224, 256, 256), (256, 224, 256, 256, 40))))
                   , "fp16", "f32")

# gated layers (SwiGLU: silu(x Wg + bg) * (x Wu + bu)): a resident one with an odd hidden width, and two
# in a row with their weights streamed
GATED = MLPSpec((LayerSpec(64, 200, True, ex.silu(), gated=True), LayerSpec(200, 40, True, ex.identity())), "fp16", "f32")
# transformer blocks in the wgmma kernel (plan.wgmma.BLOCKS, off by default): models/preln's LayerNorm + GELU
# FFN + residual, and a padded-K0 RMS-normed SwiGLU block with its residual (K0 40, an odd hidden width)
PRELN = MLPSpec((LayerSpec(64, 256, True, ex.gelu_erf()), LayerSpec(256, 64, True, ex.identity())), "fp16", "f32",
                norm=NormSpec("layernorm", 1e-5, True), residual=True)
RMS_GLU = MLPSpec((LayerSpec(40, 100, True, ex.silu(), gated=True), LayerSpec(100, 40, True, ex.identity())), "fp16", "f32",
                  norm=NormSpec("rmsnorm", 1e-6), residual=True)
GATED_STREAMED = MLPSpec((LayerSpec(256, 256, True, ex.silu(), gated=True), LayerSpec(256, 256, True, ex.gelu_erf(), gated=True),
                          LayerSpec(256, 256, True, ex.identity())), "fp16", "f32")
# a first layer wider than the hidden ones' WIDTH_MAX (plan.wgmma.FIRST_WIDTH_MAX): NeRF's second half after
# its skip Concat (319 = 256 + 63: rows not 16-byte aligned, so loaded into registers in REST_GROUP groups,
# weights streamed) and its view head (283 -> 128 -> 3, resident)
NERF_SKIP = MLPSpec(tuple(LayerSpec(a, b, True, ex.relu() if i < 2 else ex.identity())
                          for i, (a, b) in enumerate(((319, 256), (256, 256), (256, 256))))
                    , "fp16", "f32")
NERF_VIEWS = MLPSpec((LayerSpec(283, 128, True, ex.relu()), LayerSpec(128, 3, True, ex.identity())), "fp16", "f32")
# the whole NeRF trunk with its skip Concat (plan.wgmma SKIP: layer 5 reads [x padded to 64, h], x re-read
# from global memory; streamed weights)
NERF_TRUNK = MLPSpec(tuple(LayerSpec(k + (64 if i == 5 else 0), 256, True, ex.relu() if i < 7 else ex.identity())
                           for i, k in enumerate([63] + [256] * 7)), "fp16", "f32", skip=5)
# a pooled chain (spec.pool, PointNet's shared MLP before its max over the points): a 1024-wide last layer in 16
# chunks, each n8 block's maxima over the warp's rows raising the group's float entries; fp16 I/O
POINTNET = MLPSpec(tuple(LayerSpec(a, b, True, ex.relu() if b != 1024 else ex.identity())
                         for a, b in ((3, 64), (64, 64), (64, 64), (64, 128), (128, 1024))), "fp16", "f16", pool="max")
# the same with a mean pool and float32 I/O (Deep Sets' mean over a set): the n8 blocks' sums added to the
# group's float entries, scaled by 1 / rows at the end
POINTNET_MEAN = MLPSpec(POINTNET.layers, "fp16", "f32", pool="mean")
# a CNN head's pointwise conv before its global average pool (MobileNetV2: 320 -> 1280 + ReLU6, kept dims):
# one pooled layer, 20 chunks, its first layer's 320 inputs staged a tile ahead
CNN_HEAD = MLPSpec((LayerSpec(320, 1280, True, ex.clip(0.0, 6.0)),), "fp16", "f32",
                   pool="meank")
# Spills ptxas makes that were measured and kept (NERF_SKIP spilled 320 bytes until the ring's positions were
# made opaque where a pass's 12 chunks fill its 3 slots alike, Ring::opaque; POINTNET 16 bytes at 128 registers
# until the pool's row-by-row path for warps across two groups went, o2f_wgmma_pool.cuh). More is a regression.
# Keys: "<spec name>:<kernel instance>". POINTNET's instance for groups of rows not a multiple of 16 (kStraddle:
# the second part's epilogue keeps the chunk's accumulators alive) spills ~800 bytes at its 4 warpgroups' 128
# registers, and was kept: PointNet at 1000 points a cloud, 256 clouds, on an H200 through ORT 0.33-0.34 ms
# against 0.53 on the mma.sync fallback it ran before (its kernel 236 us, 180 at 1024 points); the second part
# raised by each lane at once (no spills) took 380 us (RESULTS.md fifty-second run).
SPILL_BYTES: dict[str, int] = {f"{POINTNET.name}:fused_wgmmaILb1E": 800, f"{POINTNET_MEAN.name}:fused_wgmmaILb1E": 800}


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("spec,with_sm80,overrides", [(SDF_F16, True, {}), (ODD, False, {}), (STREAMED, False, {}),
                                                      (STREAMED, True, {"cluster": 2}), (BF16, False, {}),
                                                      (GATED, False, {}), (GATED_STREAMED, False, {}),
                                                      (PRELN, False, {"blocks": True}), (RMS_GLU, False, {"blocks": True}),
                                                      (NERF_SKIP, False, {}), (NERF_VIEWS, False, {}),
                                                      (NERF_TRUNK, False, {}), (POINTNET, True, {}),
                                                      (POINTNET_MEAN, True, {}), (CNN_HEAD, False, {})],
                         ids=["sdf_f16", "odd_widths", "streamed", "streamed_cluster2", "bf16", "gated", "gated_streamed",
                              "preln_block", "rms_glu_block", "nerf_skip_319", "nerf_views_283", "nerf_trunk_skip", "pointnet_pooled",
                              "pointnet_mean_pooled", "cnn_head_pooled"])
def test_wgmma_source_compiles_to_hgmma_without_spills(spec, with_sm80, overrides, tmp_path):
    plan = choose.make_plan(spec, PlanOptions(design="wgmma", wgmma_overrides=WgmmaOptions(**overrides)))
    assert plan.design == "wgmma"
    assert plan.cluster == overrides.get("cluster", 1)
    files = codegen.render([spec], True, {spec.name: False}, {spec.name: plan})
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    src = files[f"{spec.name}_cuda.cu"]
    assert targets.needs_sm90a(src)
    gencodes = GENCODES if with_sm80 else ["-gencode", "arch=compute_90,code=sm_90"]
    flags = targets.wgmma_nvcc_flags(["-O3", "-std=c++17", *gencodes])
    assert targets.SM90A_DEFINE in flags and "arch=compute_90a,code=sm_90a" in flags
    log, keep = compile_kept(NVCC, flags, tmp_path, src)
    # ptxas on the sm_90a kernel: no spills, no wgmma serialisation (C7510, C7512)
    # (a pooled chain's two instances: kStraddle false, groups of a multiple of 16 rows, and true)
    instances = ("fused_wgmmaILb0E", "fused_wgmmaILb1E") if spec.pool else ("fused_wgmma",)
    for instance in instances:
        entry = ptxas_entry(log, instance, spill_bytes=SPILL_BYTES.get(f"{spec.name}:{instance}", 0))
        regs = int(re.search(r"Used (\d+) registers", entry).group(1))
        assert regs <= dict(((4, 128), (3, 168), (2, 255)))[plan.nwg]
    ptx90 = next((keep / n for n in ("k.compute_90a.ptx", "k.ptx") if (keep / n).exists())).read_text()
    n_wgmma = sum(l.chunks * l.k_steps for l in plan.layers)
    assert ptx90.count("wgmma.mma_async.sync.aligned.m64n") == n_wgmma * len(instances)
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in ptx90
    assert "__assertfail" not in ptx90
    # streamed: each warp counts its release in its own CTA; in a cluster the last one arrives on the other
    # CTAs' peer barriers and waits on its own (no remote atomics) before its CTA copies its slice of the
    # chunk to all (multicast), launched as a cluster
    assert ("mbarrier.arrive.release.cluster.shared::cluster.b64" in ptx90) == (plan.cluster > 1)
    assert ("mbarrier.try_wait.parity.acquire.cluster" in ptx90) == (plan.cluster > 1)
    assert "atom.acq_rel.cluster" not in ptx90
    assert ("multicast::cluster" in ptx90) == (plan.cluster > 1) and ("barrier.cluster.wait" in ptx90) == (plan.cluster > 1)
    assert ("cudaLaunchKernelEx" in src) == (plan.cluster > 1)
    assert ("atom.acq_rel.cta.shared::cta.add.u32" in ptx90) == plan.streamed
    # a pass whose chunks fill every ring slot alike hides the ring's positions from ptxas (Ring::opaque)
    ring_chunks = sum(l.chunks for l in plan.layers)
    assert ("ring.opaque();" in src) == (plan.streamed and ring_chunks % plan.stages == 0)
    # the operand type: every wgmma and every fragment conversion in it
    ab = "bf16" if spec.precision == "bf16" else "f16"
    assert ptx90.count(f"k16.f32.{ab}.{ab} ") == n_wgmma * len(instances) and (f"cvt.rn.{ab}x2.f32" in ptx90)
    assert ("cvt.rn.f16x2.f32" in ptx90) == (ab == "f16")
    # packed fp16x2 activations (sdf's tanh; ODD's gelu): one tanh.approx.f16x2 per pair of hidden values
    assert ("tanh.approx.f16x2" in ptx90) == bool(spec.packed_layers)
    # a block: the norm's row sums across the quad (xor shuffles), one IEEE square root a row, the residual's loads
    assert ("shfl.sync.bfly" in ptx90 and "sqrt.rn.f32" in ptx90) == (spec.norm is not None)
    # (staged rows: x's values read from the tile's buffer, 4 or 2 at a time; else from global memory)
    staged_res = "residual4_staged<kInRowBytes>(inb" in src or "residual2_staged<kInRowBytes>(inb" in src
    assert staged_res == (spec.residual and plan.in_buffers == 2)
    assert ("_at(x, rows, row0" in src) == (spec.residual and plan.in_buffers == 1)
    # a max pool: the warp's maxima by xor shuffles, raised by integer atomics on the float entries' bits; a
    # sum or mean: the sums added by float atomics (the mean scaled by its own kernel at the end)
    assert ("red.global.max.s32" in ptx90 or "atom.global.max.s32" in ptx90) == (spec.pool_op == "max")
    assert ("red.global.add.f32" in ptx90 or "atom.global.add.f32" in ptx90) == (spec.pool_op in ("sum", "mean"))
    assert ("pool_round" in ptx90) == (spec.pool is not None and (spec.io_dtype == "f16" or spec.pool_op == "mean"))
    if with_sm80:   # the sm_80 code has the packing kernels and an empty wgmma kernel
        ptx80 = (keep / "k.compute_80.ptx").read_text()
        assert "wgmma" not in ptx80.replace("wgmma_pack", "").replace("fused_wgmma", "")
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump:
        sass = subprocess.run([cuobjdump, "-sass", str(tmp_path / "k.o")], capture_output=True, text=True).stdout
        assert sass.count("HGMMA") >= n_wgmma
    # the fallback unit (the resident kernel under its own symbol) compiles for the other GPUs
    if with_sm80:
        fb = tmp_path / f"{fallback_symbol(spec)}_cuda.cu"
        r = subprocess.run([NVCC, "-O1", "-std=c++17", "-arch=compute_80", "-ptx", "-I", str(tmp_path), str(fb),
                            "-o", str(tmp_path / "fb.ptx")], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in (tmp_path / "fb.ptx").read_text()


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_packing_index_functions_match_the_plans_model(tmp_path):
    """The packing's column map and swizzle (o2f_wgmma_pack.cuh, compiled for the host and run here)
    against test_wgmma_plan's models of them, which the descriptor, gate/up-pairing and 4-wide store tests
    check the plan against: every column of plain and gated layers (odd hidden widths too) and of last
    layers in QUAD_STORES order, every byte offset of the three swizzle widths."""
    from onnx2fused.resources import templates_dir
    from test_wgmma_plan import _quad_output, _source_column, _swizzle
    cases = [(200, 0, 208), (40, 0, 40), (200, 200, 416), (100, 100, 224), (256, 256, 512)]   # (N, H, NP)
    quads = [(64, 64), (20, 32), (256, 256)]   # last layers in quads: (N, NP)
    main = ["#include <cuda_fp16.h>", "#include <cuda_bf16.h>", "#include <cstdio>", '#include "o2f_wgmma_pack.cuh"',
            "int main() {"]
    for n_src, hidden, np_ in cases:
        cols = 2 * hidden if hidden else n_src
        main.append(f"  for (int n = 0; n < {np_}; ++n) printf(\"%d\\n\", wgmma_source_column(n, {cols}, {hidden}, 0));")
    for n_src, np_ in quads:
        main.append(f"  for (int n = 0; n < {np_}; ++n) printf(\"%d\\n\", wgmma_source_column(n, {n_src}, 0, 1));")
    for atom in (128, 64, 32):
        main.append(f"  for (unsigned b = 0; b < 4096; b += 2) printf(\"%u\\n\", wgmma_swizzle(b, {atom}));")
    main += ["  return 0;", "}"]
    (tmp_path / "t.cu").write_text("\n".join(main) + "\n")
    exe = tmp_path / "t"
    r = subprocess.run([NVCC, "-std=c++17", "-I", str(templates_dir()), str(tmp_path / "t.cu"), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    got = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    want = [_source_column(n, 2 * h if h else n_src, h) for n_src, h, np_ in cases for n in range(np_)]
    want += [_quad_output(n) if _quad_output(n) < n_src else -1 for n_src, np_ in quads for n in range(np_)]
    want += [_swizzle(b, atom) for atom in (128, 64, 32) for b in range(0, 4096, 2)]
    assert got == want
