"""Issue 5's three wide-layer cases on the GPU: stock ORT CUDA EP on the fp32 model and on its fp16 copy,
and the fused model (onnx2fused convert, fp16), all through ORT with device-resident I/O (IOBinding).

    python benchmarks/wide_cases.py [--out build/bench/wide] [--reps 100] [--cases ffn,head,dlrm]
                                    [--design auto|wide|streamed] [--kernels both|sm90|sm80] [--tail auto|off]

Cases (issue 5 targets, H100):
    ffn   768 -> 3072 -> 768, GELU,  input [64, 256, 768] (16384 rows)   >= 1.3x ORT fp16, >= 4x ORT fp32
    head  9216 -> 4096 -> 4096 -> 1000, ReLU, batch 256                  >= 1.2x ORT fp16
    dlrm  512 -> 256 -> 64 -> 1, ReLU, batch 65536                       >= 2x ORT fp16
and, without targets, two FFN-shaped pairs for the streamed kernel's two-layer fusion vs the wide design:
    pair256  256 -> 4096 -> 256, GELU, input [256, 256, 256] (65536 rows)
    pair64   64 -> 1000 -> 48, GELU, batch 262144
and issue 16's wide gated block (no bias, as LLaMA's MLP: down(silu(gate(x)) * up(x))):
    llama7b  4096 -> SwiGLU 11008 -> 4096, batch 4096 (also --batch 1, 16, 256)   >= 1.3x ORT fp16 at 256
             and 4096 rows, >= 1.0x at 1 and 16
and issue 16's pre-LN transformer block (LayerNormalization, the GELU FFN, + x):
    vitb_block  768 -> 3072 -> 768, input [64, 256, 768] (16384 rows)           >= 1.5x ORT fp16
`--fp16-model` also converts the fp16 copy that ORT fp16 runs (fp16 I/O, as ORT fp16 reads and writes)
and times it ("fused_fp16"): the like-for-like comparison with ORT fp16 (`onnx2fused bench --fp16-model`
does the same for whole models). The default "fused" is the fp32 model converted, which reads and writes
fp32 rows: twice ORT fp16's I/O bytes. Where it ran, the table shows both ratios and the targets are
judged on each.
`--interleave` opens the variants without a run-time switch (ORT fp32, ORT fp16, fused, fused_fp16)
together and times them in turns, one run each per repetition (the order reversed every other one);
those with a switch (`fused_sm80`, `--env`) are timed after, one by one. Through ORT a case's times drift
by several percent between calls on one machine (ORT fp16 0.44-0.50 ms on the ViT-B block), so variants
timed one after another can disagree on their ratio by more than a target's margin.
Every variant also runs once on the same seeded rows, untimed: the table's last column is the fused
model's relative L2 distance from ORT fp32 on them (NaN if any output is not finite).
A two-layer case on Hopper runs as one kernel from 96 rows per SM (plan/ffn.py): `--env ONNX2FUSED_WIDE_FFN=0`
times its GEMMs beside it, `=1` the kernel at every batch.
`--batch N[,N...]` replaces a case's batch (N = 1: the per-run overhead of each path); several batches
time each case at each, building its models and converting once.
The models are built here with onnx.helper (random weights, seed 0; the FFN as MatMul + Add with GELU in
the erf form torch's opset-17 export writes). `--design` sets ONNX2FUSED_CUDA_DESIGN for the fused
model, to compare the cost model's choice with the alternatives. `--kernels both` (default) times the
fused session twice on a Hopper GPU: with its CUTLASS 3.x sm_90a kernels ("fused") and with
ONNX2FUSED_WIDE_KERNELS=sm80 ("fused_sm80": the CUTLASS 2.x kernels of the same library, chosen per run),
so one run compares both; it only matters for wide plans (build with ONNX2FUSED_CUDA_ARCHS=90). Timing and the fp16 copy come from
onnx2fused/bench.py (median of --reps runs after warm-up; CUDA events when torch sees the GPU).
Results go to <out>/wide_cases.json and a table on stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnx2fused import bench  # noqa: E402
from onnx2fused.plan.options import DESIGN_ENV, TAIL_ENV  # noqa: E402
from onnx2fused.plan.wide import SM80_ENV  # noqa: E402

# name: (widths, activation, input shape with the batch first, batch, targets {variant: speed-up})
CASES = {
    "ffn": ([768, 3072, 768], "gelu", ["batch", 256, 768], 64, {"ort_fp16": 1.3, "ort_fp32": 4.0}),
    "head": ([9216, 4096, 4096, 1000], "relu", ["batch", 9216], 256, {"ort_fp16": 1.2}),
    "dlrm": ([512, 256, 64, 1], "relu", ["batch", 512], 65536, {"ort_fp16": 2.0}),
    # FFN-shaped pairs narrow enough for the streamed kernel's two-layer fusion (no targets: the
    # comparison of the designs, with --design streamed / wide)
    "pair256": ([256, 4096, 256], "gelu", ["batch", 256, 256], 256, {}),
    "pair64": ([64, 1000, 48], "gelu", ["batch", 64], 262144, {}),
    "llama7b": ([4096, 11008, 4096], "swiglu", ["batch", 4096], 4096, {"ort_fp16": 1.3}),
    # issue 16's small SwiGLU block at 2^18 rows (the cost model picks its design: narrow enough for the
    # fused kernels)
    "swiglu256": ([256, 1024, 256], "swiglu", ["batch", 256], 262144, {"ort_fp16": 3.0}),
    # issue 16's ViT-B / BERT-base block: pre-LN, the FFN, the residual (BLOCK_CASES), 16384 rows
    "vitb_block": ([768, 3072, 768], "gelu", ["batch", 256, 768], 64, {"ort_fp16": 1.5}),
    # ViT-tiny's block (197 tokens, 12608 rows at batch 64), and both blocks with ReLU in place of GELU:
    # what the GELU epilogue costs the first GEMM (no targets)
    "vitt_block": ([192, 768, 192], "gelu", ["batch", 197, 192], 64, {}),
    "vitt_block_relu": ([192, 768, 192], "relu", ["batch", 197, 192], 64, {}),
    "vitb_block_relu": ([768, 3072, 768], "relu", ["batch", 256, 768], 64, {}),
}
BLOCK_CASES = {"vitb_block", "vitt_block", "vitt_block_relu", "vitb_block_relu"}   # a LayerNormalization in front and the residual Add of x behind
# Targets that depend on the rows: (case, at most this many rows) -> targets. LLaMA's MLP at 1 and 16 rows
# is bound by the weight read, where stock ORT's GEMMs are too: parity is the target there.
FEW_ROW_TARGETS = {("llama7b", 16): {"ort_fp16": 1.0}}
CHECK_SEED = 7   # the rows every variant of a case runs once, untimed, for the agreement check


def _gelu_nodes(x: str, prefix: str, inits: list) -> tuple[list, str]:
    """0.5 * x * (1 + erf(x / sqrt(2))): the node sequence of torch's opset-17 nn.GELU export."""
    for name, v in ((f"{prefix}_sqrt2", math.sqrt(2.0)), (f"{prefix}_one", 1.0), (f"{prefix}_half", 0.5)):
        inits.append(numpy_helper.from_array(np.array(v, np.float32), name))
    nodes = [
        helper.make_node("Div", [x, f"{prefix}_sqrt2"], [f"{prefix}_d"]),
        helper.make_node("Erf", [f"{prefix}_d"], [f"{prefix}_e"]),
        helper.make_node("Add", [f"{prefix}_e", f"{prefix}_one"], [f"{prefix}_a"]),
        helper.make_node("Mul", [x, f"{prefix}_a"], [f"{prefix}_m"]),
        helper.make_node("Mul", [f"{prefix}_m", f"{prefix}_half"], [f"{prefix}_g"]),
    ]
    return nodes, f"{prefix}_g"


def _swiglu_nodes(x: str, k: int, n: int, i: int, rng, inits: list) -> tuple[list, str]:
    """silu(x Wg) * (x Wu), no bias: LLaMA's gate and up projections as torch exports them (Gemm with
    transB=1 of nn.Linear weights [N, K], Sigmoid, Mul, Mul)."""
    nodes = []
    for part in ("gate", "up"):
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}_{part}"))
        nodes.append(helper.make_node("Gemm", [x, f"w{i}_{part}"], [f"{part}{i}"], transB=1))
    nodes += [helper.make_node("Sigmoid", [f"gate{i}"], [f"sig{i}"]),
              helper.make_node("Mul", [f"gate{i}", f"sig{i}"], [f"silu{i}"]),
              helper.make_node("Mul", [f"silu{i}", f"up{i}"], [f"glu{i}"])]
    return nodes, f"glu{i}"


def build_model(widths, act: str, in_shape, path: Path, seed: int = 0, block: bool = False) -> Path:
    """An MLP as ONNX: Gemm(transB=1) per layer on 2-D input, MatMul + Add on 3-D (as exporters write);
    act "swiglu": every hidden layer a SwiGLU pair, and no biases (2-D input only). `block`: a
    LayerNormalization of x in front (scale and bias near 1 and 0) and x added to the output (a pre-LN
    transformer's FFN block)."""
    rng = np.random.default_rng(seed)
    three_d = len(in_shape) == 3
    nodes, inits, h = [], [], "x"
    if block:
        k = widths[0]
        inits += [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(k)).astype(np.float32), "ln_scale"),
                  numpy_helper.from_array((0.1 * rng.standard_normal(k)).astype(np.float32), "ln_bias")]
        nodes.append(helper.make_node("LayerNormalization", ["x", "ln_scale", "ln_bias"], ["ln"], axis=-1, epsilon=1e-5))
        h = "ln"
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        if act == "swiglu":
            if i < len(widths) - 2:
                more, h = _swiglu_nodes(h, k, n, i, rng, inits)
                nodes += more
            else:
                inits.append(numpy_helper.from_array((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32), f"w{i}"))
                nodes.append(helper.make_node("Gemm", [h, f"w{i}"], [f"l{i}"], transB=1))
                h = f"l{i}"
            continue
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)  # MatMul layout [K, N]
        b = (rng.standard_normal(n) * 0.1).astype(np.float32)
        inits += [numpy_helper.from_array(w if three_d else np.ascontiguousarray(w.T), f"w{i}"),
                  numpy_helper.from_array(b, f"b{i}")]
        if three_d:
            nodes += [helper.make_node("MatMul", [h, f"w{i}"], [f"mm{i}"]),
                      helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"l{i}"])]
        else:
            nodes.append(helper.make_node("Gemm", [h, f"w{i}", f"b{i}"], [f"l{i}"], transB=1))
        h = f"l{i}"
        if i < len(widths) - 2:
            if act == "relu":
                nodes.append(helper.make_node("Relu", [h], [f"r{i}"]))
                h = f"r{i}"
            else:
                more, h = _gelu_nodes(h, f"gelu{i}", inits)
                nodes += more
    nodes.append(helper.make_node("Add", [h, "x"], ["y"]) if block else helper.make_node("Identity", [h], ["y"]))
    out_shape = list(in_shape[:-1]) + [widths[-1]]
    g = helper.make_graph(nodes, path.stem, [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(path))
    return path


def plan_text(model: Path) -> str:
    """What `onnx2fused inspect` says about the model's chains (the CUDA plan and why)."""
    import onnx2fused
    return onnx2fused.inspect(str(model)).format()


_MADE: dict[str, object] = {}   # what this process made once (model files, fp16 copies, fused model and library): other batches reuse them


def _once(key: str, make):
    if key not in _MADE:
        _MADE[key] = make()
    return _MADE[key]


def run_case(name: str, out_dir: Path, reps: int, warmup: int, dev, providers, kernels: str = "both",
             batch: int | None = None, env_variants: tuple[str, ...] = (), fp16_model: bool = False,
             interleave: bool = False, pipelined: bool = False) -> dict:
    import onnxruntime as ort
    widths, act, in_shape, case_batch, targets = CASES[name]
    batch = batch or case_batch
    targets = next((t for (case, most), t in FEW_ROW_TARGETS.items() if case == name and batch <= most), targets)
    model = _once(f"{name}.onnx", lambda: build_model(widths, act, in_shape, out_dir / f"{name}.onnx",
                                                      block=name in BLOCK_CASES))
    info = bench.model_info(model)
    rows = batch * int(np.prod([d for d in in_shape[1:-1]] or [1]))
    result = {"case": name, "widths": widths, "activation": act, "batch": batch, "rows": rows, "ms": {},
              "errors": {}, "rel_l2_vs_ort_fp32": {}, "plan": plan_text(model)}
    check_x = np.random.default_rng(CHECK_SEED).standard_normal([batch] + in_shape[1:]).astype(np.float32)
    outputs = {}
    print(f"== {name}: {' -> '.join(map(str, widths))} {act}, input {[batch] + in_shape[1:]} ({rows} rows)", flush=True)
    print(result["plan"], flush=True)

    def so():
        o = ort.SessionOptions()
        o.log_severity_level = 3
        return o

    def ort_fp32():
        return ort.InferenceSession(str(model), so(), providers=providers)

    def fp16_copy() -> Path:
        return _once(f"{name}.fp16.onnx", lambda: bench.fp16_model_file(model, out_dir / f"{name}.fp16.onnx"))

    def ort_fp16():
        return ort.InferenceSession(str(fp16_copy()), so(), providers=providers)

    def fused():
        p, lib = _once(f"{name}.fused", lambda: bench.convert_model(model, out_dir / name, "fp16", with_cuda=True))
        return bench.fused_session(p, lib, so(), providers)

    def fused_fp16():
        # ORT fp16's own model converted: fp16 rows in and out, every op outside the chain as ORT fp16 runs it
        p, lib = _once(f"{name}.fused_fp16",
                       lambda: bench.convert_model(fp16_copy(), out_dir / f"{name}_fp16", "fp16", with_cuda=True))
        return bench.fused_session(p, lib, so(), providers)

    # (name, session maker, run-time switches of the library set while it runs: the launcher reads them on
    # every run, so one library serves each)
    variants = [("ort_fp32", ort_fp32, {}), ("ort_fp16", ort_fp16, {})]
    if kernels in ("both", "sm90"):
        variants.append(("fused", fused, {}))
    if kernels in ("both", "sm80"):
        variants.append(("fused_sm80" if kernels == "both" else "fused", fused, {SM80_ENV: "sm80"}))
    if fp16_model:
        variants.append(("fused_fp16", fused_fp16, {}))
    for kv in env_variants:   # "NAME=VALUE": the fused session again with that switch
        key, _, value = kv.partition("=")
        variants.append((f"fused {kv}", fused, {key: value}))
    def record(variant: str, ts: list, sess):
        result["ms"][variant] = float(np.median(ts))
        outputs[variant] = _run_once(sess, check_x)
        err = _rel_l2(outputs[variant], outputs.get("ort_fp32"))
        if err is not None:
            result["rel_l2_vs_ort_fp32"][variant] = err
        print(f"  {variant:<10} {result['ms'][variant]:.4f} ms"
              + (f"  (rel. L2 vs ORT fp32 {err:.2e})" if err is not None and variant != "ort_fp32" else ""), flush=True)

    def failed(variant: str, e: Exception):
        result["errors"][variant] = f"{type(e).__name__}: {e}"
        print(f"  {variant:<10} n/a ({result['errors'][variant][:300]})", flush=True)

    def opened(make):
        sess = make()
        if "CUDAExecutionProvider" not in sess.get_providers():
            raise RuntimeError(f"no CUDA EP in {sess.get_providers()}")
        return sess

    # --interleave: the variants without switches open together and take turns run by run
    together = [(v, make) for v, make, env in variants if not env] if interleave else []
    if together:
        sessions = {}
        with _switches({}):
            for variant, make in together:
                try:
                    sessions[variant] = opened(make)
                except Exception as e:  # noqa: BLE001 - one failed variant must not hide the others
                    failed(variant, e)
            try:
                ts = bench.time_ort_gpu_interleaved(dev, sessions, info, batch, reps, warmup)
                for variant, sess in sessions.items():
                    record(variant, ts[variant], sess)
            except Exception as e:  # noqa: BLE001
                for variant in sessions:
                    failed(variant, e)
        sessions = None
    for variant, make, env in variants:
        if interleave and not env:   # timed in turns above
            continue
        sess = None
        with _switches(env):
            try:
                sess = opened(make)
                ts, _ = bench.time_ort_gpu(dev, sess, info, batch, reps, warmup)
                record(variant, ts, sess)
            except Exception as e:  # noqa: BLE001 - one failed variant must not hide the others
                failed(variant, e)
            else:
                if pipelined and variant in ("ort_fp16", "fused", "fused_fp16"):
                    try:   # a failure here is the pipelined timing's alone
                        ms = float(np.median(bench.time_ort_gpu_pipelined(dev, sess, info, batch, reps, warmup)))
                        result.setdefault("ms_pipelined", {})[variant] = ms
                        print(f"  {variant:<10} {ms:.4f} ms pipelined (runs back to back)", flush=True)
                    except Exception as e:  # noqa: BLE001
                        failed(f"{variant} pipelined", e)
            finally:
                sess = None
    result["speedup"] = speedups(result["ms"], "fused")
    result["speedup_fp16_copy"] = speedups(result["ms"], "fused_fp16")
    result["targets"] = judge_targets(targets, result["speedup"], result["speedup_fp16_copy"])
    return result


@contextlib.contextmanager
def _switches(env: dict):
    """The library's run-time switches as `env` says while the block runs (SM80_ENV unset unless named),
    the process's own values restored after."""
    saved = {k: os.environ.pop(k, None) for k in [SM80_ENV, *env]}
    try:
        os.environ.update(env)
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def speedups(ms: dict, fused: str) -> dict:
    """Stock variant -> its time over the `fused` variant's, for those measured."""
    f = ms.get(fused)
    return {v: ms[v] / f for v in ("ort_fp32", "ort_fp16") if f and v in ms}


def judge_targets(targets: dict, speedup: dict, speedup_fp16_copy: dict) -> dict:
    """Each target against the fp32 model converted ("got", "met") and, where the fp16 copy was converted
    and timed, against that (like for like with ORT fp16: "got_fp16_copy", "met_fp16_copy")."""
    out = {}
    for v, want in targets.items():
        t = {"want": want, "got": speedup.get(v), "met": bool(speedup.get(v) and speedup[v] >= want)}
        if v in speedup_fp16_copy:
            t["got_fp16_copy"] = speedup_fp16_copy[v]
            t["met_fp16_copy"] = speedup_fp16_copy[v] >= want
        out[v] = t
    return out


def target_text(v: str, t: dict) -> str:
    """One target's verdict for the table: the fp32 model's, then the fp16 copy's where it was timed."""
    text = f"{v} >= {t['want']}x: {'met' if t['met'] else 'MISSED'}"
    if "met_fp16_copy" in t:
        text += f" (fp16 copy: {'met' if t['met_fp16_copy'] else 'MISSED'})"
    return text


def _run_once(sess, x: np.ndarray) -> np.ndarray:
    """The session's first output on `x` (cast to the session's input type), as float32."""
    inp = sess.get_inputs()[0]
    feed = x.astype(np.float16) if inp.type == "tensor(float16)" else x
    return np.asarray(sess.run(None, {inp.name: feed})[0], np.float32)


def _rel_l2(got: np.ndarray, ref: np.ndarray | None) -> float | None:
    """||got - ref|| / ||ref||, NaN where got has a non-finite value or the shapes differ (a wrong result
    shows; it does not hide in a norm)."""
    if ref is None:
        return None
    if got.shape != ref.shape or not np.isfinite(got).all():
        return float("nan")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "bench" / "wide"))
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--design", choices=["auto", "wide", "streamed"], default=None,
                    help="force the fused model's CUDA design (sets ONNX2FUSED_CUDA_DESIGN)")
    ap.add_argument("--kernels", choices=["both", "sm90", "sm80"], default="both",
                    help="wide plans on Hopper: time the sm_90a kernels, the sm80 ones (fused_sm80), or both")
    ap.add_argument("--batch", default=None, help="replace every case's batch (first dimension): N or N,N,...")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="also time the fused model with this run-time switch set (repeatable), e.g. "
                         "ONNX2FUSED_WIDE_LAUNCH_CACHE=off")
    ap.add_argument("--fp16-model", action="store_true",
                    help="also convert the fp16 copy ORT fp16 runs and time it (fused_fp16, fp16 I/O): like for like")
    ap.add_argument("--interleave", action="store_true",
                    help="open the variants without switches together and time them in turns, run by run "
                         "(bench.time_ort_gpu_interleaved): their ratios hold where times drift between phases")
    ap.add_argument("--pipelined", action="store_true",
                    help="also time ORT fp16 and the fused variants with runs back to back (bench's *_pipelined; "
                         "not with --interleave's variants)")
    ap.add_argument("--tail", choices=["auto", "off"], default=None,
                    help="off: no segmented wide plans (every layer a GEMM; sets ONNX2FUSED_WIDE_TAIL), to compare")
    args = ap.parse_args(argv)
    bad = [kv for kv in args.env if "=" not in kv or not kv.partition("=")[0]]
    if bad:
        ap.error(f"--env takes NAME=VALUE, got {bad}")
    if args.design:
        os.environ[DESIGN_ENV] = args.design   # read by convert, the entry point
    if args.tail:
        os.environ[TAIL_ENV] = args.tail
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch = bench._cuda_torch()
    dev = bench._Dev(torch)
    providers = bench.gpu_providers()
    batches = [int(b) for b in args.batch.split(",")] if args.batch else [None]
    results = [run_case(n, out_dir, args.reps, args.warmup, dev, providers, args.kernels, b, tuple(args.env),
                        args.fp16_model, args.interleave, args.pipelined)
               for n in names for b in batches]

    print("\n| case | rows | ORT fp32 ms | ORT fp16 ms | fused ms | fused sm80 kernels ms | fused fp16 copy ms | "
          "x fp32 | x fp16 | fp16 copy x fp16 | targets | fused rel. L2 | fp16 copy rel. L2 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ms, sp, sp16, err = r["ms"], r["speedup"], r["speedup_fp16_copy"], r["rel_l2_vs_ort_fp32"]
        cell = lambda d, k, f: f.format(d[k]) if k in d else "n/a"  # noqa: E731
        tgt = ", ".join(target_text(v, t) for v, t in r["targets"].items())
        print(f"| {r['case']} | {r['rows']} | {cell(ms, 'ort_fp32', '{:.3f}')} | {cell(ms, 'ort_fp16', '{:.3f}')} | "
              f"{cell(ms, 'fused', '{:.3f}')} | {cell(ms, 'fused_sm80', '{:.3f}')} | {cell(ms, 'fused_fp16', '{:.3f}')} | "
              f"{cell(sp, 'ort_fp32', '{:.2f}')} | {cell(sp, 'ort_fp16', '{:.2f}')} | {cell(sp16, 'ort_fp16', '{:.2f}')} | "
              f"{tgt} | {cell(err, 'fused', '{:.1e}')} | {cell(err, 'fused_fp16', '{:.1e}')} |")
    for r in results:
        mp = r.get("ms_pipelined", {})
        for v in ("fused", "fused_fp16"):
            if v in mp and "ort_fp16" in mp:
                print(f"{r['case']} at {r['rows']} rows, pipelined: {v} {mp[v]:.4f} ms, ORT fp16 {mp['ort_fp16']:.4f} ms: "
                      f"{mp['ort_fp16'] / mp[v]:.2f}x")
    (out_dir / "wide_cases.json").write_text(json.dumps(results, indent=1))
    for r in results:
        for v, ms in r["ms"].items():
            if v.startswith("fused ") and "fused" in r["ms"]:
                print(f"{r['case']} at {r['rows']} rows, {v}: {ms:.4f} ms (default {r['ms']['fused']:.4f})")
    print(f"\nwrote {out_dir / 'wide_cases.json'}")
    return 0 if all("fused" in r["ms"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
