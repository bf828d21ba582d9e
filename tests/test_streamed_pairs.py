"""Two-layer fusion of FFN-shaped pairs in the streamed design (plan/fused.py _hidden_blocks): which pairs
are fused, what that buys in tile height, the shared-memory and register accounting, and the chunk
sequence of the generated kernel (its chunk_offset/chunk_elems compiled for the host and run over every
id). Numerical checks need a GPU: tests/test_gpu.py::test_streamed_pairs_on_cuda_ep."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from onnx2fused import codegen
from onnx2fused import expr as ex
from onnx2fused.plan import choose, fused
from onnx2fused.plan.options import PlanOptions, StreamedOptions
from onnx2fused.spec import LayerSpec, MLPSpec, SpecError

STREAMED = PlanOptions(design="streamed")
PAIRED = PlanOptions(design="streamed", streamed=StreamedOptions(pair_hidden=True))

CXX = shutil.which("g++") or shutil.which("c++")
NVCC = shutil.which("nvcc")


def _spec(widths, precision="fp16", act=None):
    act = act or ex.gelu_erf()
    return MLPSpec(tuple(LayerSpec(a, b, True, act if i < len(widths) - 2 else ex.identity())
                         for i, (a, b) in enumerate(zip(widths, widths[1:]))), precision, "f32")


def _id(v):
    return "x".join(map(str, v)) if isinstance(v, list) else None


def _plan(widths, precision="fp16", **options):
    return fused.streamed_plan(_spec(widths, precision), fused.SMEM_LIMIT, **options)


# widths -> {first layer of a pair: HC}, where pairs are forced (pair_hidden=True). A pair needs layer i
# over 256 columns and layer i+1 within 256; HC is 64 when layer i+1 is over 128 wide (its accumulators
# take most of the registers), else 128.
PAIRS = [
    ([256, 4096, 256], {0: 64}),             # FFN
    ([256, 4096, 128], {0: 128}),
    ([64, 1000, 48], {0: 128}),              # hidden width off 16 and off the block
    ([128, 2048, 2048, 64], {1: 128}),       # two wide layers back to back: only the second pairs
    ([64, 320, 512, 64], {1: 128}),
    ([64, 512, 64, 520, 9], {0: 128, 2: 128}),  # two pairs, one H buffer
    ([300, 272, 9], {0: 128}),               # just over one chunk
    ([64, 64, 1000], {}),                    # the wide layer is the last one
    ([768, 3072, 768], {}),                  # layer i+1 is wider than one chunk
    ([256, 256, 256, 256], {}),              # nothing wide
]


@pytest.mark.parametrize("widths,blocks", PAIRS, ids=_id)
@pytest.mark.parametrize("precision", ["fp16", "bf16", "tf32"])
def test_pairs_are_fused_where_the_rule_holds(widths, blocks, precision):
    try:
        plan = _plan(widths, precision, pair_hidden=True)
    except SpecError:
        assert precision == "tf32", "only tf32's 4-byte operands may leave a chain without a tile"
        return
    assert plan.pairs == tuple(sorted(blocks))
    seconds = {i + 1 for i in plan.pairs}
    for l in plan.layers:
        if l.index in blocks:
            assert l.nc == blocks[l.index] and l.n_nchunks > 1 and l.np_ % l.nc == 0
        elif l.index in seconds:  # one chunk of columns, k-chunks each within one hidden block
            prev = plan.layers[l.index - 1]
            assert l.n_nchunks == 1 and prev.nc % l.kc == 0 and l.kp == prev.np_
        else:
            assert l.nc == fused._streamed_nc(l.n)
    try:  # without the pair, a wide hidden layer may leave no tile at all
        unpaired = _plan(widths, precision, pair_hidden=False)
    except SpecError:
        assert blocks
        return
    assert unpaired.pairs == () and all(l.nc == fused._streamed_nc(l.n) for l in unpaired.layers)
    # by default, pairs only where they make the tallest tile taller (at equal tiles they only cost)
    auto = _plan(widths, precision)
    assert auto.pairs == (plan.pairs if plan.tallest_rows > unpaired.tallest_rows else ())


def test_default_pairs_only_for_taller_tiles():
    assert _plan([256, 4096, 256]).pairs == (0,)
    assert _plan([64, 320, 512, 64]).pairs == (1,)  # 128-row tiles paired, 64 without
    # 16-row tiles either way: the 128-column hidden blocks would only add chunk steps (measured 1.4x slower)
    assert _plan([128, 2048, 2048, 64]).pairs == ()
    assert _plan([128, 2048, 2048, 64], pair_hidden=True).pairs == (1,)
    # tf32: without the pair nothing fits at all
    assert _plan([256, 4096, 256], "tf32").pairs == (0,)
    with pytest.raises(SpecError):
        _plan([256, 4096, 256], "tf32", pair_hidden=False)


def test_tall_tiles_fit_only_with_the_pair():
    """256 -> 4096 -> 256: the 4096-wide hidden tile alone needs 1 MB at 128 rows; through H it never
    exists, and the tall variant fits where before only short tiles did."""
    fused, plain = _plan([256, 4096, 256]), _plan([256, 4096, 256], pair_hidden=False)
    assert max(v.bm for v in fused.variants) == 128
    assert max(v.bm for v in plain.variants) <= 32
    assert "hidden 4096 in 64-column blocks straight into layer 2" in fused.describe()
    assert "hidden" not in plain.describe()
    # the A/B buffers no longer hold the hidden layer
    assert (fused.width_a, fused.width_b, fused.hidden_ld) == (256, 0, 64)
    assert plain.width_b == 4096


# tf32 (4-byte operands) needs twice the shared memory: 128 -> 2048 -> 2048 -> 64 has no tf32 plan at all
NO_TF32_PLAN = [128, 2048, 2048, 64]


def test_a_chain_without_any_tile_that_fits_is_refused_with_the_bytes():
    with pytest.raises(SpecError, match="even a 16-row tile needs .* KB of shared memory"):
        _plan(NO_TF32_PLAN, "tf32", pair_hidden=True)


@pytest.mark.parametrize("widths,precision", [(w, p) for w, b in PAIRS if b for p in ("fp16", "tf32")
                                              if (w, p) != (NO_TF32_PLAN, "tf32")],
                         ids=_id)
def test_shared_memory_and_register_accounting(widths, precision):
    plan = _plan(widths, precision, pair_hidden=True)
    eb, pad = fused.elem_bytes(plan.spec), fused.row_pad(plan.spec)
    seconds = {i + 1 for i in plan.pairs}
    # A/B: the inputs of even/odd layers (which hold what the layer before wrote); H: one hidden block
    width = {"A": 0, "B": 0, "H": 0}
    for l in plan.layers:
        if l.index in seconds:
            width["H"] = max(width["H"], plan.layers[l.index - 1].nc)  # a block, not the whole kp
        else:
            width["AB"[l.index % 2]] = max(width["AB"[l.index % 2]], l.kp)
    assert (plan.width_a, plan.width_b, plan.hidden_ld) == (width["A"], width["B"], width["H"])
    bias = sum(l.np_ for l in plan.layers) * 4
    slot = max(l.nc * (l.kc + pad) for l in plan.layers) * eb
    for v in plan.variants:
        rows = sum(w + pad for w in width.values() if w)
        assert v.smem_bytes == bias + v.stages * slot + v.bm * rows * eb <= fused.SMEM_LIMIT
        for i in plan.pairs:  # both accumulators live at once
            t1, t2 = v.tilings[i], v.tilings[i + 1]
            assert t1.mt * t1.nt8 * 4 + t2.mt * t2.nt8 * 4 <= fused.PAIR_ACC_MAX
            assert 16 * t1.mt * t1.wm == v.bm and 8 * t1.nt8 * t1.wn == plan.layers[i].nc
            assert 16 * t2.mt * t2.wm == v.bm and 8 * t2.nt8 * t2.wn == plan.layers[i + 1].np_


def test_nothing_fits_still_raises():
    with pytest.raises(SpecError, match="even a 16-row tile needs"):
        fused.streamed_plan(_spec([256, 4096, 256]), 40 * 1024)


def test_make_plan_passes_the_option():
    spec = _spec([256, 4096, 256])
    assert choose.make_plan(spec, STREAMED).pairs == (0,)
    unpaired = PlanOptions(design="streamed", streamed=StreamedOptions(pair_hidden=False))
    assert choose.make_plan(spec, unpaired).pairs == ()
    text = codegen.cuda_params(choose.make_plan(spec, STREAMED))["plan_text"]
    assert "hidden 4096 in 64-column blocks straight into layer 2" in text


def _consumption_order(plan):
    """(layer, n-chunk, k-chunk) in the order the kernel's loops read the ring's chunks in one tile."""
    out, skip = [], {i + 1 for i in plan.pairs}
    for l in plan.layers:
        if l.index in skip:
            continue
        if l.index in plan.pairs:
            m = plan.layers[l.index + 1]
            per = l.nc // m.kc  # layer i+1's k-chunks per hidden block
            for hb in range(l.n_nchunks):
                out += [(l.index, hb, kc) for kc in range(l.n_kchunks)]
                out += [(m.index, 0, hb * per + j) for j in range(per)]
        else:
            out += [(l.index, nc, kc) for nc in range(l.n_nchunks) for kc in range(l.n_kchunks)]
    return out


def _host_chunk_map(src: str, total: int, tmp_path) -> list[tuple[int, int]]:
    """The generated chunk_offset/chunk_elems, compiled for the host and run for ids 0..total-1."""
    start = src.index("__device__ __forceinline__ int chunk_offset")
    body = src[start:src.index("__device__ __forceinline__ void issue_chunk")]
    main = (f"int main() {{ for (int i = 0; i < {total}; ++i) "
            "std::printf(\"%d %d\\n\", chunk_offset(i), chunk_elems(i)); }\n")
    (tmp_path / "chunks.cc").write_text("#include <cstdio>\n#define __device__\n#define __forceinline__ inline\n"
                                        + body + main)
    exe = tmp_path / "chunks"
    r = subprocess.run([CXX, "-std=c++17", "-O0", str(tmp_path / "chunks.cc"), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return [tuple(map(int, line.split())) for line in out.splitlines()]


@pytest.mark.skipif(CXX is None, reason="no C++ compiler")
@pytest.mark.parametrize("widths,precision", [([256, 4096, 256], "fp16"), ([128, 2048, 2048, 64], "bf16"),
                                              ([64, 512, 64, 520, 9], "tf32"), ([64, 1000, 48], "fp16")], ids=_id)
def test_generated_chunk_sequence_reads_every_packed_chunk_once(widths, precision, tmp_path):
    """Id k of the ring's sequence must be the k-th chunk the kernel's loops consume, at its packed
    offset (pack_weights: per layer, n-chunk major, then k-chunk), and a tile's sequence covers every
    packed chunk exactly once."""
    spec = _spec(widths, precision)
    plan = choose.make_plan(spec, PAIRED)
    assert plan.pairs and plan.design == "streamed"
    src = codegen.cuda_sources(plan)[f"{spec.name}_cuda.cu"]
    got = _host_chunk_map(src, plan.total_chunks, tmp_path)
    packed = {}
    for l in plan.layers:
        for nc in range(l.n_nchunks):
            for kc in range(l.n_kchunks):
                packed[(l.index, nc, kc)] = (l.w_offset + (nc * l.n_kchunks + kc) * l.chunk_elems, l.chunk_elems)
    order = _consumption_order(plan)
    assert sorted(order) == sorted(packed)  # each packed chunk consumed once
    assert got == [packed[c] for c in order]
    spans = sorted(got)  # and the chunks tile the packed weights without gaps or overlaps
    assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert spans[-1][0] + spans[-1][1] == plan.weight_elems


def test_rendered_pair_uses_h_and_the_destination_shift():
    spec = _spec([64, 1000, 48])
    src = codegen.cuda_sources(choose.make_plan(spec, STREAMED))[f"{spec.name}_cuda.cu"]
    # the hidden block goes to H at its local column; the activation sees the global column
    assert "store_hidden<0, 1000>(acc, col0, H + wm * (16 * MT) * kLdH, kLdH, lane, hb * HC);" in src
    assert "mma_tile<MT2, NT82, 4>(acc2, H + wm2 * (16 * MT2) * kLdH + j * KC2, kLdH," in src
    assert "store_output<1, 48>(acc2, col2, y, rows" in src
    assert re.search(r"\bB\b", src.split("streamed design")[1]) is None  # no B buffer: nothing reads one


@pytest.mark.cuda_build
@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("widths,precision", [([256, 4096, 256], "fp16"), ([64, 1000, 48], "tf32")], ids=_id)
def test_tall_pair_kernel_does_not_spill(widths, precision, tmp_path):
    """Both accumulators of a pair live in registers (up to PAIR_ACC_MAX a lane in the tall variant):
    ptxas must keep them there on sm_90."""
    spec = _spec(widths, precision)
    plan = choose.make_plan(spec, STREAMED)
    assert plan.pairs and plan.variants[0].bm >= 64
    for name, text in codegen.render([spec], True, {spec.name: False}, {spec.name: plan}).items():
        (tmp_path / name).write_text(text)   # the source and the headers it includes
    r = subprocess.run([NVCC, "-cubin", "-std=c++17", "-arch=sm_90", "-Xptxas", "-v",
                        str(tmp_path / f"{spec.name}_cuda.cu"), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    info = r.stdout + r.stderr
    tall = info[info.index("tall_tiles6kernel"):]
    assert re.search(r"0 bytes spill stores, 0 bytes spill loads", tall.split("Compiling entry")[0]), tall[:600]
