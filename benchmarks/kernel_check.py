"""Build the generated CUDA kernel of a few specs on their own, check them against a float64 reference
and time them with CUDA events (no ONNX Runtime involved): the fast loop for kernel work on the GPU host.

    python benchmarks/kernel_check.py [--out DIR] [--only NAME] [--no-time]

Each case prints: max rel-L2 error over the checked batch sizes (a block with a residual: of the output
less the input), kernel time at the case's batch,
effective TFLOP/s and the floor (max of bytes / 3.0 TB/s and flops / 665 TFLOP/s, NOTES.md).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnx2fused import codegen, targets  # noqa: E402
from onnx2fused import expr as ex  # noqa: E402
from onnx2fused.plan.choose import make_plan  # noqa: E402
from onnx2fused.plan.options import PlanOptions, ResidentOptions, StreamedOptions, WgmmaOptions  # noqa: E402
from onnx2fused.spec import SKIP_ALIGN, LayerSpec, MLPSpec, NormSpec  # noqa: E402

BW = 3.0e12       # measured device-to-device copy, bytes/s (read + write)
TC = 665e12       # measured fp16 matmul rate, flop/s


def mlp(widths, acts, precision="fp16", io="f32", bias=True, norm=None, residual=False, gated=(), skip=0):
    """`norm`, `residual`: a transformer block (MLPSpec.norm, .residual); `gated`: the gated layers; `skip`:
    the layer(s) that read x beside the layer before's output (MLPSpec.skip)."""
    if not isinstance(acts, (list, tuple)):
        acts = [acts] * (len(widths) - 2) + [ex.identity()]
    x_part = -(-widths[0] // SKIP_ALIGN) * SKIP_ALIGN
    skips = (skip,) if isinstance(skip, int) else tuple(skip)
    layers = tuple(LayerSpec(a + (x_part if i in skips and i else 0), b, bias, f, gated=i in gated)
                   for i, (a, b, f) in enumerate(zip(widths, widths[1:], acts)))
    return MLPSpec(layers, precision, io, norm=norm, residual=residual, skip=skip)


LN, LN_NOBIAS, RMS = NormSpec("layernorm", 1e-5, True), NormSpec("layernorm", 1e-3, False), NormSpec("rmsnorm", 1e-6)


CASES = {
    "nerf64": (mlp([32, 64, 64, 64, 64, 16], ex.relu()), 2**21),
    "w128gelu": (mlp([64, 128, 128, 128, 128, 64], ex.gelu_erf()), 2**20),
    "w256silu": (mlp([256, 256, 256, 256, 256], ex.silu()), 2**18),
    "mnist": (mlp([784, 512, 512, 10], ex.relu()), 4096),
    "odd": (mlp([3, 37, 129, 5], [ex.tanh(), ex.mish(), ex.sigmoid()]), 100003),
    "odd4": (mlp([36, 37, 129, 5], [ex.tanh(), ex.mish(), ex.sigmoid()]), 100003),   # K0 % 4 == 0, K0 % 16 != 0
    "odd_bf16": (mlp([17, 200, 1], [ex.gelu_tanh(), ex.identity()], "bf16"), 4099),
    "f16io": (mlp([32, 64, 64, 16], ex.silu(), io="f16"), 65536),
    "fp32": (mlp([19, 40, 40, 3], ex.softplus(), "fp32"), 3001),
    "nobias": (mlp([16, 32, 32, 8], ex.relu(), bias=False), 1000),
    "nerf64_tf32": (mlp([32, 64, 64, 64, 64, 16], ex.relu(), "tf32"), 2**21),
    "w256silu_tf32": (mlp([256, 256, 256, 256, 256], ex.silu(), "tf32"), 2**18),
    "w256silu_f16io": (mlp([256, 256, 256, 256, 256], ex.silu(), io="f16"), 2**18),   # half the input bytes
    # the issue-15 shapes with ReLU: what the kernels take with (nearly) no activation work
    "w256relu": (mlp([256, 256, 256, 256, 256], ex.relu()), 2**18),
    "w128relu": (mlp([64, 128, 128, 128, 128, 64], ex.relu()), 2**20),
    "w128gelu_f16io": (mlp([64, 128, 128, 128, 128, 64], ex.gelu_erf(), io="f16"), 2**20),
    # SwiGLU pairs (silu(x Wg + bg) * (x Wu + bu)): the zoo's 64 -> 256 -> 64 shape at 2^20 rows, and a
    # 256-wide one whose weights stream (wgmma by the cost model)
    "glu64": (mlp([64, 256, 64], [ex.silu(), ex.identity()], gated={0}), 2**20),
    "glu256": (mlp([256, 256, 256], [ex.silu(), ex.identity()], gated={0}), 2**18),
    "geglu128": (mlp([64, 128, 64], [ex.gelu_erf(), ex.identity()], gated={0}), 2**20),   # the zoo's geglu
    # bf16 operands: the wgmma kernel on Hopper (its mma.sync fallback with ONNX2FUSED_WGMMA_RUN=off)
    "w128gelu_bf16": (mlp([64, 128, 128, 128, 128, 64], ex.gelu_erf(), "bf16"), 2**20),
    "w256silu_bf16": (mlp([256, 256, 256, 256, 256], ex.silu(), "bf16"), 2**18),
    "odd_tf32": (mlp([3, 37, 129, 5], [ex.tanh(), ex.mish(), ex.sigmoid()], "tf32"), 100003),
    "sdf_tf32": (mlp([3, 128, 128, 128, 128, 1], ex.tanh(), "tf32"), 65536),
    "sdf": (mlp([3, 128, 128, 128, 128, 1], ex.tanh()), 65536),
    "sdf1m": (mlp([3, 128, 128, 128, 128, 1], ex.tanh()), 2**20),   # issue 15's batch
    # transformer blocks (issue 16): a norm prologue and a residual epilogue; ffn64 is preln's layers alone
    "ffn64": (mlp([64, 256, 64], ex.gelu_erf()), 2**20),
    "ffn128": (mlp([64, 128, 64], ex.gelu_erf()), 2**20),   # one 128-wide hidden layer: wgmma since the thirty-second run
    "preln": (mlp([64, 256, 64], ex.gelu_erf(), norm=LN, residual=True), 2**20),
    "preln_bf16": (mlp([64, 256, 64], ex.gelu_erf(), "bf16", norm=LN, residual=True), 2**20),
    "preln_tf32": (mlp([64, 256, 64], ex.gelu_erf(), "tf32", norm=LN, residual=True), 2**20),
    "preln_fp32": (mlp([64, 256, 64], ex.gelu_erf(), "fp32", norm=LN, residual=True), 65536),
    "preln_f16io": (mlp([64, 256, 64], ex.gelu_erf(), io="f16", norm=LN, residual=True), 2**20),
    "llama": (mlp([64, 128, 64], [ex.silu(), ex.identity()], bias=False, norm=RMS, residual=True, gated={0}), 2**20),
    "llama_tf32": (mlp([64, 128, 64], [ex.silu(), ex.identity()], "tf32", bias=False, norm=RMS, residual=True,
                       gated={0}), 2**20),
    "block40": (mlp([40, 100, 40], ex.relu(), norm=LN_NOBIAS, residual=True), 100003),
    "block72_rms": (mlp([72, 120, 72], ex.silu(), "bf16", norm=RMS, residual=True), 100003),
    "block30_f16io": (mlp([30, 37, 30], ex.tanh(), io="f16", norm=LN, residual=False), 100003),
    "block37_res": (mlp([37, 64, 37], ex.relu(), residual=True), 100003),
    "res64": (mlp([64, 256, 64], ex.gelu_erf(), residual=True), 2**20),   # ffn64 with a residual, no norm
    # too wide for two staged tiles a warpgroup: one, with k-steps prefetched, the residual from global memory
    "res200": (mlp([200, 256, 200], ex.gelu_erf(), residual=True), 2**19),
    "ffn200": (mlp([200, 256, 200], ex.gelu_erf()), 2**19),   # res200 without its residual
    "ffn192": (mlp([192, 256, 192], ex.gelu_erf()), 2**19),   # ... at widths of whole 64-column chunks
    "block72_rms_1m": (mlp([72, 120, 72], ex.silu(), "bf16", norm=RMS, residual=True), 2**20),   # ... whole rows
    "block48_gres": (mlp([48, 96, 48], [ex.relu(), ex.silu()], "bf16", norm=RMS, residual=True, gated={1}), 100003),
    # NeRF's MLP past its skip Concat (319 = 256 + 63 input features: a first layer wider than WIDTH_MAX,
    # rows not 16-byte aligned) and its view head (283 = 256 + 27), and a 320-wide first layer (staged rows)
    "nerf_skip": (mlp([319, 256, 256, 256], ex.relu()), 2**20),
    "nerf_skip320": (mlp([320, 256, 256, 256], ex.relu()), 2**20),
    # the whole NeRF trunk with its skip Concat (x into layer 5: 64 + 256 inputs; wgmma only)
    "nerf_trunk": (mlp([63] + [256] * 8, [ex.relu()] * 8, skip=5), 2**20),
    "nerf_trunk_f16io": (mlp([63] + [256] * 8, [ex.relu()] * 8, io="f16", skip=5), 2**20),
    # odd widths around a skip: x of 21 features (element loads), hidden 100 (padded), tanh, into layer 2
    "skip_odd": (mlp([21, 100, 100, 72, 5], ex.tanh(), skip=2), 100003),
    # a last layer wider than the hidden ones (plan.wgmma LAST_WIDTH_MAX), and NeuS's SDF network (its 1 + 256
    # outputs, x into layer 5 scaled by 1/sqrt(2); ReLU here for its softplus)
    "last257": (mlp([64, 256, 257], ex.relu()), 2**20),
    "neus_trunk": (mlp([39, 256, 256, 256, 217, 256, 256, 256, 256, 257], ex.relu(), skip=4), 2**18),
    # x of 64 features: the wgmma kernel stages the input tile in shared memory; the skip reloads from global
    "skip64": (mlp([64, 128, 128, 128, 64], ex.gelu_erf(), skip=2), 2**20),
    # a streamed chain with an FFN pair (1000 wide into 64) reading the input tile X and a skip after it
    # (not yet run on a GPU)
    "skip_pair": (mlp([32, 1000, 64, 64, 64, 4], ex.relu(), skip=3), 2**18),
    "skip_odd_tf32": (mlp([21, 100, 100, 72, 5], ex.tanh(), "tf32", skip=2), 100003),
    "skip_odd_bf16": (mlp([21, 100, 100, 72, 5], ex.tanh(), "bf16", skip=2), 100003),
    "nerf_views": (mlp([283, 128, 3], ex.relu()), 2**20),
    "nerf_skip_f16io": (mlp([319, 256, 256, 256], ex.relu(), io="f16"), 2**20),
    "w256relu3": (mlp([256, 256, 256, 256], ex.relu()), 2**20),   # three 256-wide layers (12 chunks: 4 a slot)
    # a pass of 24 ring chunks, 8 a slot (before the ring's opaque positions ptxas spilled 192 bytes there)
    "w256relu6": (mlp([64] + [256] * 6, ex.relu()), 2**20),
    # Tancik's Fourier-feature MLP (benchmarks/fourier_mlp.py): sin(x [W, W] + [b, b + pi/2]) then 256 x 4 ReLU
    "fourier": (mlp([2, 256, 256, 256, 256, 256, 3], [ex.sin()] + [ex.relu()] * 4 + [ex.sigmoid()]), 2**20),
    # the whole NeRF MLP as one chain (passes/skip_merge.py): x (90) into layers 5 and 8, the density riding
    # the view layer (130 = 128 + [a, -a]), y = [rgb, alpha]
    "nerf_mlp": (mlp([90] + [256] * 8 + [130, 4], [ex.relu()] * 9 + [ex.identity()], skip=(5, 8)), 2**20),
    # two skips in a narrow odd chain (each design below)
    "skip2_odd": (mlp([21, 100, 100, 72, 40, 5], ex.tanh(), skip=(2, 4)), 100003),
    "skip2_odd_fp32": (mlp([21, 100, 100, 72, 40, 5], ex.tanh(), "fp32", skip=(2, 4)), 100003),
}

# Alternatives of the default plan, timed beside it: case -> (base case, the designs' overrides).
VARIANTS = {
    "nerf64_noprefetch": ("nerf64", ResidentOptions(prefetch=False)),
    "nerf64_w16": ("nerf64", ResidentOptions(warp_choices=(16,))),
    "nerf64_smem": ("nerf64", ResidentOptions(register_activations=False)),
    "w128gelu_noprefetch": ("w128gelu", ResidentOptions(prefetch=False)),
    "w128gelu_w16": ("w128gelu", ResidentOptions(warp_choices=(16,))),
    "w128gelu_w8": ("w128gelu", ResidentOptions(warp_choices=(8,))),
    "w128gelu_smem": ("w128gelu", ResidentOptions(register_activations=False)),
    # streamed: 64-row tiles of 32-deep chunks fit two blocks per SM, so one block's epilogue can
    # overlap the other's tensor-core work
    "w256silu_kc32_bm64": ("w256silu", StreamedOptions(kc_max=32, tall_rows=(64,), stages_choices=(2,))),
    # wgmma: warpgroups a CTA against input k-steps prefetched into registers (gelu's 3 x 1 by default)
    "w128gelu_wg2_pf4": ("w128gelu", WgmmaOptions(nwg=2, prefetch=4)),
    "w128gelu_wg2_pf2": ("w128gelu", WgmmaOptions(nwg=2, prefetch=2, staged_input=False)),
    "w128gelu_wg3_pf0": ("w128gelu", WgmmaOptions(nwg=3, prefetch=0)),
    "w128gelu_wg3_pf4": ("w128gelu", WgmmaOptions(nwg=3, prefetch=4)),
    "sdf1m_wg2": ("sdf1m", WgmmaOptions(nwg=2)),
    # 32-column chunks: half the accumulator registers, so 4 warpgroups fit the 128-register cap
    "w128gelu_wg4_c32": ("w128gelu", WgmmaOptions(nwg=4, prefetch=0, chunk_max=32)),
    "w128gelu_wg3_c32": ("w128gelu", WgmmaOptions(nwg=3, chunk_max=32)),
    "sdf1m_wg4_c32": ("sdf1m", WgmmaOptions(nwg=4, prefetch=0, chunk_max=32)),
    "nerf64_wg": ("nerf64", WgmmaOptions()),
    # the next tile's input staged in shared memory by cp.async (plan/wgmma.py, STAGED_INPUT: silu's and
    # gelu's default) against the register prefetch alone (_pf), and where the default does not stage (_si)
    "w256silu_pf": ("w256silu", WgmmaOptions(staged_input=False)),
    "w128gelu_pf": ("w128gelu", WgmmaOptions(staged_input=False)),
    "nerf64_wg_si": ("nerf64", WgmmaOptions(staged_input=True)),
    "odd4_si": ("odd4", WgmmaOptions(staged_input=True)),
    # the staged rows copied in 16-byte cp.async pieces against one cp.async.bulk a row (BULK_INPUT, the default)
    "w256silu_pieces": ("w256silu", WgmmaOptions(bulk_input=False)),
    "w128gelu_pieces": ("w128gelu", WgmmaOptions(bulk_input=False)),
    "odd4_si_pieces": ("odd4", WgmmaOptions(staged_input=True, bulk_input=False)),
    # the last layer's outputs stored in pairs against QUAD_STORES (4 adjacent ones a store, the default)
    "w256silu_pairs": ("w256silu", WgmmaOptions(quad_stores=False)),
    "w128gelu_pairs": ("w128gelu", WgmmaOptions(quad_stores=False)),
    "nerf64_wg_pairs": ("nerf64", WgmmaOptions(quad_stores=False)),
    "f16io_wg": ("f16io", WgmmaOptions()),   # fp16 outputs stored 4 at a time
    # the next tile's input rows copied in parts spread over a pass (silu's default: 12) or all at its start
    # (resident plans' default)
    "w256silu_ip1": ("w256silu", WgmmaOptions(input_parts=1)),
    "w256silu_ip8": ("w256silu", WgmmaOptions(input_parts=8)),
    "w256silu_ip16": ("w256silu", WgmmaOptions(input_parts=16)),
    "w128gelu_ip4": ("w128gelu", WgmmaOptions(input_parts=4)),
    "w128gelu_ip9": ("w128gelu", WgmmaOptions(input_parts=9)),
    # packed activations of accumulators as they are, against halved ones (PRESCALE, the default: silu's
    # and gelu's weights and bias packed times 1/2, one HMUL2 a pair fewer)
    "w128gelu_nops": ("w128gelu", WgmmaOptions(prescale=False)),
    "w256silu_nops": ("w256silu", WgmmaOptions(prescale=False)),
    # quads stored from per-tile row pointers (STORE_ROWS, the default) against each store's own address
    # and alignment branch
    "w256silu_rowsoff": ("w256silu", WgmmaOptions(store_rows=False)),
    "w128gelu_rowsoff": ("w128gelu", WgmmaOptions(store_rows=False)),
    "f16io_wg_rowsoff": ("f16io", WgmmaOptions(store_rows=False)),
    # the bias added in fp32 before the packed activations (two FADDs a pair) against BIAS16, the default
    # (an fp16 copy added after rounding, one HADD2 a pair)
    "w128gelu_b32": ("w128gelu", WgmmaOptions(bias16=False)),
    "w256silu_b32": ("w256silu", WgmmaOptions(bias16=False)),
    "sdf1m_b32": ("sdf1m", WgmmaOptions(bias16=False)),
    # 3 warpgroups where FOUR_WARPGROUP_FRAGMENTS gives 4
    "w128gelu_wg3": ("w128gelu", WgmmaOptions(nwg=3)),
    "w128gelu_f16io_wg3": ("w128gelu_f16io", WgmmaOptions(nwg=3)),
    "sdf1m_wg3": ("sdf1m", WgmmaOptions(nwg=3)),
    "nerf64_wg6": ("nerf64", WgmmaOptions(nwg=6, prefetch=0)),
    "nerf64_wg5": ("nerf64", WgmmaOptions(nwg=5, prefetch=0)),
    # wgmma with streamed weights: clusters of 2 and 4 CTAs sharing each chunk's copy (multicast) against
    # each CTA copying its own (the default); input prefetch depth
    "w256silu_c2": ("w256silu", WgmmaOptions(cluster=2)),
    "w256silu_c4": ("w256silu", WgmmaOptions(cluster=4)),
    "w256silu_pf0": ("w256silu", WgmmaOptions(prefetch=0)),
    "w256silu_st6": ("w256silu", WgmmaOptions(stages=6)),
    "w256silu_st4": ("w256silu", WgmmaOptions(stages=4)),
    # 32-column chunks: half a slot each, so 6 slots fit where 3 did (more time for each copy to land);
    # H100, twenty-second run: 0.349 (6 slots) and 0.434 ms (4) against 0.297, ring waits 8.4 % still
    "w256silu_c32_st6": ("w256silu", WgmmaOptions(chunk_max=32, stages=6)),
    "w256silu_c32_st4": ("w256silu", WgmmaOptions(chunk_max=32, stages=4)),
    # 3 warpgroups for silu: chunks of 16 columns leave 166 registers, no spills (ptxas -v; 32: spills), but
    # 16-column chunks through the ring took 0.84-0.90 ms against 0.33 (H100, twenty-first run): not a way
    "w256silu_wg3_c16": ("w256silu", WgmmaOptions(nwg=3, chunk_max=16)),
    "w256silu_wg3_c16_st6": ("w256silu", WgmmaOptions(nwg=3, chunk_max=16, stages=6)),
    "w256silu_c16": ("w256silu", WgmmaOptions(chunk_max=16)),
    # gated layers in the wgmma design (the cost model's choice on Hopper since the fourteenth run)
    "glu64_wg": ("glu64", WgmmaOptions()),
    "glu256_wg": ("glu256", WgmmaOptions()),
    "geglu128_res": ("geglu128", ResidentOptions()),
    # weights that fit shared memory streamed anyway (the ring's coupling of the warpgroups)
    "w128gelu_st3": ("w128gelu", WgmmaOptions(stages=3)),
    "sdf1m_st3": ("sdf1m", WgmmaOptions(stages=3)),
    "w128gelu_st6": ("w128gelu", WgmmaOptions(stages=6)),
    # blocks in the other fused design (an empty override forces it)
    "ffn64_res": ("ffn64", ResidentOptions()),   # the zoo's ffn3d (preln's widths, no block) on mma.sync
    # transformer blocks in the wgmma design (its norm prologue, residual epilogue: plan.wgmma.BLOCKS)
    **{f"{c}_wg": (c, WgmmaOptions(blocks=True)) for c in ("preln", "preln_bf16", "llama", "block40", "block37_res",
                                                         "block72_rms", "res64", "res200", "block72_rms_1m")},
    # ... with the tile loaded straight into registers and the residual read from global memory (no staging)
    **{f"{c}_wg_regs": (c, WgmmaOptions(blocks=True, staged_input=False)) for c in ("preln", "llama", "res64", "res200",
                                                                                "block72_rms_1m")},
    # the two chains whose next tile sits in registers (4 k-steps, 2 warpgroups), staged in shared memory instead
    "ffn64_staged": ("ffn64", WgmmaOptions(staged_input=True)),
    "glu64_staged": ("glu64", WgmmaOptions(staged_input=True)),
    "ffn128_res": ("ffn128", ResidentOptions()),
    "res200_st": ("res200", StreamedOptions()),
    "ffn200_st": ("ffn200", StreamedOptions()),
    "preln_streamed": ("preln", StreamedOptions()),
    "preln_tf32_streamed": ("preln_tf32", StreamedOptions()),
    "preln_f16io_streamed": ("preln_f16io", StreamedOptions()),
    "llama_streamed": ("llama", StreamedOptions()),
    "block40_streamed": ("block40", StreamedOptions()),
    "block72_rms_streamed": ("block72_rms", StreamedOptions()),
    "block37_res_streamed": ("block37_res", StreamedOptions()),
    "block48_gres_streamed": ("block48_gres", StreamedOptions()),
    # the same on the mma.sync kernels (what runs them without the wide first layer in wgmma)
    "nerf_skip_streamed": ("nerf_skip", StreamedOptions()),
    "nerf_skip320_streamed": ("nerf_skip320", StreamedOptions()),
    "nerf_views_resident": ("nerf_views", ResidentOptions()),
    "nerf_skip_f16io_streamed": ("nerf_skip_f16io", StreamedOptions()),
    "w256relu3_streamed": ("w256relu3", StreamedOptions()),
    # a skip connection in each design (the default for skip_odd is resident; nerf_trunk's wgmma)
    "skip_odd_wg": ("skip_odd", WgmmaOptions()),
    "skip_odd_streamed": ("skip_odd", StreamedOptions()),
    "skip2_odd_wg": ("skip2_odd", WgmmaOptions()),
    "skip2_odd_streamed": ("skip2_odd", StreamedOptions()),
    "nerf_mlp_streamed": ("nerf_mlp", StreamedOptions()),
    "nerf_trunk_streamed": ("nerf_trunk", StreamedOptions()),
    "last257_streamed": ("last257", StreamedOptions()),
    "skip64_resident": ("skip64", ResidentOptions()),
    "neus_trunk_streamed": ("neus_trunk", StreamedOptions()),
}
SAMPLE_ABOVE = 200000        # larger checks compare a sample of the rows (Case.check)
BLOCK_BATCHES = (1000003,)   # blocks: a large odd batch too (every tile and lane group, past the last row)


def all_cases(base: PlanOptions, a32: bool = False) -> dict:
    """name -> (spec, batch, plan options): the cases with `base`, the variants with their overrides;
    `a32`: beside every fp16 case with packed activations, `<case>_a32` with act_math "fp32"."""
    cases = {name: (spec, batch, base) for name, (spec, batch) in CASES.items()}
    for name, (case, override) in VARIANTS.items():   # an override times its own design, whatever the cost model says
        if isinstance(override, WgmmaOptions):
            cases[name] = (CASES[case][0], CASES[case][1], replace(base, design="wgmma", wgmma_overrides=override))
            continue
        design = "resident" if isinstance(override, ResidentOptions) else "streamed"
        cases[name] = (CASES[case][0], CASES[case][1], replace(base, design=design, **{design: override}))
    if a32:
        for name, (spec, batch, opts) in list(cases.items()):
            if spec.packed_layers:
                cases[f"{name}_a32"] = (replace(spec, act_math="fp32"), batch, opts)
    return cases


def diag_cases(items: list[str], cases: dict) -> dict:
    """--diag NAME=BASE:MACRO[+MACRO...]: case BASE built with O2F_DIAG_<MACRO> defined (templates: NO_FILL,
    no weight copies through the ring; NO_LOAD, no input copies; NO_STORE, no output stores; STORE_WB,
    stores without the evict-first hint; ST_FREE, stores that do not order memory (loads move ahead of
    them); NO_BIAS, no bias loaded or added; NO_MUFU, packed tanh as the
    identity; CLOCKS, the warps' waits counted), timed but not checked (its outputs are wrong by design):
    what a cost would be if it were gone, or where the warps wait. name -> (base, defines)."""
    out = {}
    for item in items:
        name, _, rest = item.partition("=")
        base, _, macros = rest.partition(":")
        if not name or base not in cases or not macros:
            raise SystemExit(f"--diag {item!r}: expected NAME=BASE:MACRO[+MACRO], BASE a case")
        out[name] = (base, [f"-DO2F_DIAG_{m.upper()}" for m in macros.split("+")])
    return out


def compile_case(name: str, spec: MLPSpec, options: PlanOptions, out: Path, arch: str, defines=()) -> Path:
    folder = out / name   # the kernel's sources and the headers they include
    folder.mkdir(parents=True, exist_ok=True)
    sources = codegen.cuda_sources(make_plan(spec, options))
    for file, text in sources.items():
        (folder / file).write_text(text)
    units = [folder / f for f in sorted(sources) if f.endswith(".cu")]   # a wgmma plan: its mma.sync fallback too
    lib = out / f"lib{name}.so"
    # SASS for the arch and its PTX: a GPU of a newer arch JIT-compiles the PTX at load, so the H100 runs
    # an sm_80 build (`--arch 80`: what an A100 would run, the mma.sync kernels, no wgmma)
    gencode = ["-gencode", f"arch=compute_{arch},code=sm_{arch}" if arch == "90" else
               f"arch=compute_{arch},code=[sm_{arch},compute_{arch}]"]
    if any(targets.needs_sm90a(t) for t in sources.values()):   # the wgmma design: sm_90a, as build.py compiles it
        gencode = targets.wgmma_nvcc_flags(gencode)
    cmd = ["nvcc", "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-lineinfo", *gencode, *defines,
           "-Xptxas", "-v", *map(str, units), "-o", str(lib)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    (out / f"{name}.ptxas.txt").write_text(r.stdout + r.stderr)
    if r.returncode:
        raise RuntimeError(f"nvcc failed for {name}:\n{r.stderr[-4000:]}")
    return lib


def load(spec: MLPSpec, lib: Path) -> ctypes.CDLL:
    so = ctypes.CDLL(str(lib))
    for fn, res, args in [("cuda_workspace_bytes", ctypes.c_size_t, []),
                          ("cuda_pack", ctypes.c_int, [ctypes.c_void_p] * 4),
                          ("cuda_run", ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p])]:
        f = getattr(so, f"{spec.name}_{fn}")
        f.restype, f.argtypes = res, args
    return so


def reference(spec: MLPSpec, ws, bs, x: np.ndarray, norm_params=()) -> np.ndarray:
    """float64 products; activations in fp32; a block's norm (its scale, bias in `norm_params`) in float64
    (fp16 I/O with a layer norm: rounded to fp16, as the kernels and ORT's fp16 kernel do) and its residual."""
    h = x.astype(np.float64)
    if spec.norm is not None:
        ms = (h * h).mean(-1, keepdims=True)
        if spec.norm.kind == "layernorm":
            mean = h.mean(-1, keepdims=True)
            h = (h - mean) / np.sqrt(ms - mean * mean + spec.norm.eps) * norm_params[0]
            if spec.norm.has_bias:
                h = h + norm_params[1]
            if spec.io_dtype == "f16":
                h = h.astype(np.float16).astype(np.float64)
        else:
            h = h / np.sqrt(ms + spec.norm.eps) * norm_params[0]
    for i, (l, w, b) in enumerate(zip(spec.layers, ws, bs)):
        if i in spec.skip:   # [x zero-padded to skip_width, the layer before's output]
            pad = np.zeros((h.shape[0], spec.skip_width - x.shape[-1]))
            h = np.concatenate([x.astype(np.float64), pad, h], axis=-1)
        h = h @ w.astype(np.float64) + b.astype(np.float64)
        if l.gated:   # act(gate) * up: the gate's columns first
            n = l.out_features
            h = ex.evaluate(l.activation, h[:, :n].astype(np.float32)).astype(np.float64) * h[:, n:]
        else:
            h = ex.evaluate(l.activation, h.astype(np.float32)).astype(np.float64)
    return h + x.astype(np.float64) if spec.residual else h


class Case:
    def __init__(self, name, spec, so, torch):
        self.name, self.spec, self.so, self.torch = name, spec, so, torch
        rng = np.random.default_rng(0)
        self.ws, self.bs = [], []
        for l in spec.layers:
            bound = 1 / np.sqrt(l.in_features)
            cols = l.weight_columns   # a gated layer's [K, 2N]: gate columns, then up
            self.ws.append(rng.uniform(-bound, bound, (l.in_features, cols)).astype(np.float32) * 1.7)
            self.bs.append(rng.uniform(-bound, bound, cols).astype(np.float32) if l.has_bias
                           else np.zeros(cols, np.float32))
        k0 = spec.widths[0]   # a block's norm: scale NS = w[L], bias NB = b[L] (none for an RMS norm)
        self.norm = [] if spec.norm is None else [(1 + 0.2 * rng.standard_normal(k0)).astype(np.float32),
                                                  (0.2 * rng.standard_normal(k0)).astype(np.float32)]
        dev = torch.device("cuda")
        self.dw = [torch.from_numpy(w).to(dev) for w in self.ws + self.norm[:1]]
        self.db = [torch.from_numpy(b).to(dev) for b in self.bs + self.norm[1:]]
        self.ws_buf = torch.empty(so_call(so, spec, "cuda_workspace_bytes"), dtype=torch.uint8, device=dev)
        wp = (ctypes.c_void_p * len(self.dw))(*[t.data_ptr() for t in self.dw])
        bp = (ctypes.c_void_p * len(self.dw))(*[t.data_ptr() for t in self.db])   # NB nullptr for an RMS norm
        stream = torch.cuda.current_stream().cuda_stream
        check(so_call(so, spec, "cuda_pack", wp, bp, self.ws_buf.data_ptr(), stream), "pack")
        torch.cuda.synchronize()
        self.io_dtype = torch.float16 if spec.io_dtype == "f16" else torch.float32

    def run(self, x, y):
        stream = self.torch.cuda.current_stream().cuda_stream
        return so_call(self.so, self.spec, "cuda_run", x.data_ptr(), y.data_ptr(), x.shape[0], self.ws_buf.data_ptr(), stream)

    def check(self, batch: int) -> float:
        """Relative L2 error of the output; with a residual, of the output less the input (the block's
        layers' part, which the residual would otherwise drown)."""
        torch = self.torch
        gen = torch.Generator(device="cuda").manual_seed(batch)  # the same inputs in every run
        x = torch.randn(batch, self.spec.widths[0], device="cuda", generator=gen)
        if self.spec.norm is not None:   # off-centre rows of a larger scale: a norm skipped or wrong shows
            x = x * 2 + 0.5
        x = x.to(self.io_dtype)
        y = torch.full((batch, self.spec.widths[-1]), float("nan"), device="cuda", dtype=self.io_dtype)
        check(self.run(x, y), "run")
        torch.cuda.synchronize()
        got = y.float().cpu().numpy().astype(np.float64)
        xs = x.float().cpu().numpy()
        if batch == 0:
            return 0.0
        if not np.isfinite(got).all():   # every row: the outputs were NaN-poisoned
            bad = np.argwhere(~np.isfinite(got))
            raise AssertionError(f"{self.name} batch {batch}: {len(bad)} unwritten/NaN outputs, first at {bad[:3].tolist()}")
        if batch > SAMPLE_ABOVE:   # the float64 reference of a million rows takes ~30 s: the first and last
            # rows (the partial tile) and every 61st between (each tile position and lane group over the run)
            keep = np.unique(np.concatenate([np.arange(4096), np.arange(batch - 4096, batch),
                                             np.arange(4096, batch - 4096, 61)]))
            got, xs = got[keep], xs[keep]
        ref = reference(self.spec, self.ws, self.bs, xs, self.norm)
        assert np.abs(ref).max() > 0, "reference is all zeros"
        if self.spec.residual:
            got, ref = got - xs, ref - xs
        return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

    def timing_buffers(self, batch: int) -> tuple[list, object]:
        """Inputs (4 rotated where they would fit in L2) and an output for timed launches, warmed up."""
        torch = self.torch
        nbuf = 4 if batch * self.spec.widths[0] * 4 < 64e6 else 1
        xs = [torch.randn(batch, self.spec.widths[0], device="cuda").to(self.io_dtype) for _ in range(nbuf)]
        y = torch.empty(batch, self.spec.widths[-1], device="cuda", dtype=self.io_dtype)
        for i in range(10):
            check(self.run(xs[i % nbuf], y), "run")
        torch.cuda.synchronize()
        return xs, y

    def launches(self, bufs: tuple[list, object], n: int) -> list[float]:
        """ms of each of n launches back to back (CUDA events around each)."""
        torch, (xs, y) = self.torch, bufs
        times = []
        for i in range(n):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); self.run(xs[i % len(xs)], y); e.record()
            times.append((s, e))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in times]

    def time(self, batch: int, reps: int = 200) -> float:
        return float(np.median(self.launches(self.timing_buffers(batch), reps)))


def sustained(case: Case, batch: int, seconds: float) -> dict:
    """--sustain: the case's launches back to back for `seconds` while nvidia-smi samples the GPU
    (onnx2fused.bench.clocks): ms a launch, the SM clock and power, and how often the power limit held the
    clock down (a kernel at the power limit runs at a lower clock: its time is its energy, not the overlap
    of its pipes)."""
    from onnx2fused.bench.clocks import ClockProbe
    bufs = case.timing_buffers(batch)
    launches = 0
    with ClockProbe() as probe:
        t0 = time.time()
        while time.time() - t0 < seconds:
            case.launches(bufs, 50)
            launches += 50
        case.torch.cuda.synchronize()
        elapsed = time.time() - t0
    return {"ms_per_launch": elapsed / launches * 1e3, **(probe.summary or {})}


def interleaved_rounds(names: list[str], rounds: int) -> list[list[str]]:
    """--interleave: the order the cases are timed in, round by round: every case once a round, the order
    reversed every other round, so that the GPU's drift within a call (clocks, temperature: up to ~5 %
    between calls on one H100) falls on every case alike instead of on whichever ran late."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def case_watchdog(name: str, seconds: float) -> threading.Timer:
    """A timer that ends the process with the case's name when a case runs past `seconds` (0: never): a hung
    kernel blocks the synchronising thread, so only another thread can say which case it was."""
    def expire():
        print(f"{name}: TIMED OUT after {seconds:.0f} s (a hung kernel, or a reference too slow)", flush=True)
        os._exit(124)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    if seconds > 0:
        timer.start()
    return timer


def so_call(so, spec, fn, *args):
    return getattr(so, f"{spec.name}_{fn}")(*args)


def check(code, what):
    if code:
        raise RuntimeError(f"{what} failed with CUDA error {code}")


def floor_ms(spec: MLPSpec, batch: int) -> tuple[float, float]:
    eb = 2 if spec.io_dtype == "f16" else 4
    bytes_ = batch * (spec.widths[0] + spec.widths[-1]) * eb + spec.num_parameters * 4
    flops = batch * spec.flops_per_row
    return max(bytes_ / BW, flops / TC) * 1e3, flops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/kcheck"))
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--no-time", action="store_true")
    ap.add_argument("--arch", default="90", help="80: an sm_80 build (its PTX is JIT-compiled on a newer GPU)")
    ap.add_argument("--profile", action="store_true", help="one launch at the case's batch, no checks (for ncu)")
    ap.add_argument("--quick", action="store_true", help="blocks: skip the 1000003-row check")
    ap.add_argument("--a32", action="store_true", help="also each packed fp16 case with fp32 activations (<case>_a32)")
    ap.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                    help="time the cases after every check, in ROUNDS rounds of 200/ROUNDS launches each, taking "
                         "turns (interleaved_rounds): for A/B comparisons within one call")
    ap.add_argument("--diag", nargs="*", default=[], metavar="NAME=BASE:MACRO",
                    help="also BASE built with O2F_DIAG_MACRO (NO_FILL, NO_LOAD, NO_STORE, STORE_WB, ST_FREE, NO_BIAS, NO_MUFU; CLOCKS: "
                         "the warps' waits counted; + joins several), "
                         "timed unchecked as NAME: what the kernel would take without that work")
    ap.add_argument("--sustain", type=float, default=0, metavar="SECONDS",
                    help="after timing, run each case back to back this long while nvidia-smi samples the SM clock, "
                         "power and throttle reasons (sustained)")
    ap.add_argument("--case-timeout", type=float, default=0,
                    help="seconds a case may take to check and time before the run stops with its name (a hung kernel)")
    a = ap.parse_args()
    import torch
    out = Path(a.out) / "kernels"
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    every = all_cases(PlanOptions.from_env(), a.a32)
    cases = {n: c for n, c in every.items()
             if not a.only or n in a.only or (n.endswith("_a32") and n[:-4] in a.only)}
    diags = diag_cases(a.diag, every)
    cases.update({n: every[b] for n, (b, _) in diags.items()})
    t0 = time.time()
    # nvcc runs are independent: compile every case at once, then check and time one by one.
    with concurrent.futures.ThreadPoolExecutor(max(1, (os.cpu_count() or 2) // 2)) as pool:
        libs = {n: pool.submit(compile_case, n, spec, opts, out, a.arch, diags.get(n, (None, ()))[1])
                for n, (spec, _, opts) in cases.items()}
    print(f"compiled {len(cases)} cases in {time.time() - t0:.0f} s", flush=True)
    watchdog = case_watchdog("", 0)
    loaded = {}   # name -> its Case
    deferred = {}   # --interleave: name -> (case, its timing buffers), timed once every case is checked
    for name, (spec, batch, options) in cases.items():
        t0 = time.time()
        watchdog.cancel()   # the last case's, whether it ended in a row or a failure
        watchdog = case_watchdog(name, a.case_timeout)
        try:
            so = load(spec, libs[name].result())
        except Exception as e:  # report and go on with the other cases
            print(f"{name}: BUILD FAILED {e}", flush=True)
            continue
        c = Case(name, spec, so, torch)
        loaded[name] = c
        if a.profile:
            x = torch.randn(batch, spec.widths[0], device="cuda").to(c.io_dtype)
            y = torch.empty(batch, spec.widths[-1], device="cuda", dtype=c.io_dtype)
            check(c.run(x, y), "run")
            torch.cuda.synchronize()
            continue
        plan = "fp32" if spec.precision == "fp32" else make_plan(spec, options).describe()
        try:
            errs = [float("nan")] if name in diags else [c.check(b) for b in (0, 1, 127, 129, 1000, min(batch, 70001))
                    + (BLOCK_BATCHES if spec.has_block and not a.quick else ())]
            err = max(errs)
        except Exception as e:
            print(f"{name}: CHECK FAILED {e}", flush=True)
            continue
        if a.interleave and not a.no_time:
            deferred[name] = (c, c.timing_buffers(batch))
            ms = float("nan")
        else:
            ms = float("nan") if a.no_time else c.time(batch)
        if a.sustain:
            sus = sustained(c, batch, a.sustain)
            print(f"{name}: sustained {json.dumps(sus)}", flush=True)
        fl_ms, flops = floor_ms(spec, batch)
        row = dict(case=name, spec=spec.name, plan=plan, batch=batch, relerr=err, ms=ms, floor_ms=fl_ms,
                   tflops=flops / (ms * 1e-3) / 1e12 if ms == ms else None, build_s=time.time() - t0)
        rows.append(row)
        print(json.dumps(row), flush=True)
    watchdog.cancel()
    if deferred:
        times = {n: [] for n in deferred}
        for order in interleaved_rounds(list(deferred), a.interleave):
            for n in order:
                c, bufs = deferred[n]
                times[n] += c.launches(bufs, max(1, 200 // a.interleave))
        for r in rows:
            if r["case"] in times:
                ts = times[r["case"]]
                r["ms"] = float(np.median(ts))
                r["p10_ms"], r["p90_ms"] = (float(v) for v in np.percentile(ts, [10, 90]))
                r["tflops"] = floor_ms(cases[r["case"]][0], r["batch"])[1] / (r["ms"] * 1e-3) / 1e12
        print(f"timed in {a.interleave} interleaved rounds (p10..p90 in kernel_check.json)", flush=True)
    for r in rows:   # --diag NAME=BASE:CLOCKS: the warps' waits, as shares of their time over the timed launches
        if "-DO2F_DIAG_CLOCKS" in diags.get(r["case"], (None, ()))[1]:
            c, buf = loaded[r["case"]], (ctypes.c_ulonglong * 4)()
            check(so_call(c.so, c.spec, "diag_clocks", buf), "diag_clocks")
            r["waits"] = {k: buf[i] / max(1, buf[3]) for i, k in enumerate(("input", "ring", "wgmma"))}
            print(f"{r['case']}: share of the warps' time waiting: "
                  + ", ".join(f"{k} {v:.1%}" for k, v in r["waits"].items()), flush=True)
    (Path(a.out) / "kernel_check.json").write_text(json.dumps(rows, indent=1))
    print(f"{'case':20} {'plan':9} {'batch':>8} {'relerr':>8} {'ms':>8} {'floor':>7} {'x floor':>7} {'TFLOP/s':>7}")
    for r in rows:
        print(f"{r['case']:20} {r['plan'][:9]:9} {r['batch']:8d} {r['relerr']:8.1e} {r['ms']:8.4f} {r['floor_ms']:7.4f} "
              f"{r['ms'] / r['floor_ms']:7.2f} {r['tflops'] or 0:7.1f}")


if __name__ == "__main__":
    main()
