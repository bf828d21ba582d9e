"""`onnx2fused bench`: time stock ONNX Runtime against the fused model.

GPU mode (default; needs onnxruntime's CUDAExecutionProvider), all in one process on one GPU, for each
batch size of a sweep:

  ort_fp32       stock ORT CUDA EP on the original model
  ort_fp16       stock ORT CUDA EP on an fp16 copy of the model (`to_fp16`)
  fused          the model converted by `onnx2fused.convert` (validated), plugin registered
  fused_graph    the same with ORT's CUDA graphs (enable_cuda_graph=1): no per-run ORT overhead
  torch_eager    torch fp16 eager   (zoo models, or --torch-module)
  torch_compile  torch.compile fp16 (same)

Inputs and outputs stay on the device (IOBinding on torch-allocated buffers); each case is warmed up
and then timed `--reps` times with CUDA events; the median is reported. The floor of a case is
max(bytes / BW, flops / TC) with BW (device-to-device copy) and TC (fp16 matmul) measured once in the
same process.

CPU mode (`--cpu`): stock ORT CPU EP on the original model vs the fused model with the CPU plugin,
same thread count, the two interleaved run by run (shared hosts drift), median of `--reps` runs
(default 15). Where the CPU policy (cpu_policy.py) does not register the fused kernel, the fused model
runs its stock-op fallback, and the table says so.

Both modes print a table and write `<out>/bench.json` and `<out>/bench.png`.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import itertools
import importlib
import importlib.util
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

NO_GPU_MESSAGE = "no GPU: onnxruntime has no CUDAExecutionProvider; use --cpu"

DEFAULT_GPU_BATCHES = [2 ** k for k in range(10, 23, 2)]   # 2^10 ... 2^22, x4
DEFAULT_GPU_REPS = 100
DEFAULT_CPU_REPS = 15
DEFAULT_THREADS = 2
FALLBACK_BW = 3.0e12      # bytes/s, H100 SXM device-to-device copy (read + write)
FALLBACK_TC = 665e12      # flop/s, H100 SXM dense fp16 matmul
L2_ROTATE_BYTES = 50 * 2 ** 20   # inputs smaller than this are rotated over several buffers
ROTATE_BUFFERS = 4
MEM_FRACTION = 0.6        # a batch is kept when its estimated footprint fits this fraction of GPU memory
MAX_ELEMENTS = 2 ** 31 - 1  # per tensor (32-bit indexing in some kernels)
ORT_DEVICE = "cuda"       # where ORT-side buffers live in GPU mode ("cpu" only for a smoke test of the flow)

GPU_VARIANTS = ["ort_fp32", "ort_fp16", "fused", "fused_graph", "torch_eager", "torch_compile"]
CPU_VARIANTS = ["ort_cpu", "fused_cpu"]
LABELS = {
    "ort_fp32": "ORT CUDA fp32", "ort_fp16": "ORT CUDA fp16", "fused": "onnx2fused",
    "fused_graph": "onnx2fused CUDA graph",
    "torch_eager": "torch eager fp16", "torch_compile": "torch.compile fp16",
    "ort_cpu": "ORT CPU", "fused_cpu": "onnx2fused CPU",
}

_ELEM_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
            "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
            "tensor(bfloat16)": None}


# ----------------------------------------------------------------------------------------------- CLI

def _batch_value(part: str) -> int:
    if "^" in part:
        base, exp = part.split("^", 1)
        return int(base) ** int(exp)
    return int(part)


def _batches(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = _batch_value(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad batch size {part!r} (use e.g. 1024,4096 or 2^20)") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {v}")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("no batch sizes given")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the ONNX model to benchmark (the original, not a fused one)")
    parser.add_argument("--cpu", action="store_true",
                        help="CPU mode: stock ORT CPU EP vs the fused model with the CPU plugin")
    parser.add_argument("--batches", type=_batches, default=None,
                        help="comma-separated batch sizes (2^20 allowed); GPU default 2^10..2^22 by 4x "
                             "(capped to fit memory), CPU default 65536 (less for wide models)")
    parser.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "tf32", "fp32"],
                        help="compute precision of the fused model (default fp16)")
    parser.add_argument("--out", default=None,
                        help="output folder for bench.json, bench.png and the converted models "
                             "(default build/bench/<model>[-cpu])")
    parser.add_argument("--reps", type=int, default=None,
                        help=f"timed runs per case (GPU default {DEFAULT_GPU_REPS}, CPU default {DEFAULT_CPU_REPS})")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs per case (GPU 10, CPU 2)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=f"CPU mode: intra_op_num_threads of both sessions (default {DEFAULT_THREADS})")
    parser.add_argument("--torch-module", default=None, metavar="PATH:CALLABLE",
                        help="torch rows: 'file.py:fn' or 'pkg.mod:fn' returning an nn.Module equivalent to the "
                             "model (or naming one); default: built from models/zoo.json when it describes the model")
    parser.add_argument("--no-torch", action="store_true", help="GPU mode: skip the torch rows")


def main(args) -> int:
    if args.reps is not None and args.reps < 1:
        print("bench: --reps must be >= 1", file=sys.stderr)
        return 2
    model = Path(args.model)
    if not model.is_file():
        print(f"bench: {model}: no such file", file=sys.stderr)
        return 2
    if args.cpu:
        return run_cpu(args)
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print(NO_GPU_MESSAGE)
        return 0
    return run_gpu(args)


# ------------------------------------------------------------------------------------- model helpers

@dataclass
class Layer:
    k: int
    n: int
    bias: bool


@dataclass
class ModelInfo:
    path: Path
    inputs: list            # [(name, elem type string, dims)] (dims: int or str/None)
    outputs: list           # [(name, elem type string, dims)]
    layers: list[Layer] = field(default_factory=list)

    @property
    def flops_per_row(self) -> int:
        return sum(2 * l.k * l.n for l in self.layers)

    @property
    def weight_params(self) -> int:
        return sum(l.k * l.n + (l.n if l.bias else 0) for l in self.layers)

    @property
    def max_width(self) -> int:
        ws = [l.k for l in self.layers] + [l.n for l in self.layers]
        return max(ws) if ws else max((_features(d) for _, _, d in self.inputs), default=1)

    @property
    def sum_widths(self) -> int:
        return sum(l.n for l in self.layers) or self.max_width


def _features(dims) -> int:
    """Elements per row: the product of the non-leading dims (symbolic ones count as 1)."""
    f = 1
    for d in list(dims)[1:]:
        f *= d if isinstance(d, int) and d > 0 else 1
    return f


def _dims(vi) -> list:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return ["batch", 1]
    out = []
    for d in t.shape.dim:
        out.append(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None))
    return out


def model_info(path) -> ModelInfo:
    """Inputs, outputs and the linear layers (Gemm / MatMul with a constant 2-D weight) of a model."""
    import onnx
    from onnx import TensorProto, helper
    m = onnx.load(str(path), load_external_data=False)
    g = m.graph
    inits = {t.name: list(t.dims) for t in g.initializer}
    for node in g.node:
        if node.op_type == "Constant" and node.output:
            for a in node.attribute:
                if a.name == "value" and a.type == onnx.AttributeProto.TENSOR:
                    inits[node.output[0]] = list(a.t.dims)

    def tname(elem):
        return "tensor(" + {TensorProto.FLOAT: "float", TensorProto.FLOAT16: "float16",
                            TensorProto.DOUBLE: "double", TensorProto.INT64: "int64",
                            TensorProto.INT32: "int32", TensorProto.BOOL: "bool",
                            TensorProto.BFLOAT16: "bfloat16"}.get(elem, helper.tensor_dtype_to_np_dtype(elem).name) + ")"

    ins = [(vi.name, tname(vi.type.tensor_type.elem_type), _dims(vi)) for vi in g.input if vi.name not in inits]
    outs = [(vi.name, tname(vi.type.tensor_type.elem_type), _dims(vi)) for vi in g.output]
    layers = []
    for node in g.node:
        if node.op_type not in ("Gemm", "MatMul") or len(node.input) < 2:
            continue
        w = inits.get(node.input[1])
        if w is None or len(w) != 2:
            continue
        k, n = w
        if node.op_type == "Gemm":
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            if trans_b:
                k, n = n, k
            has_bias = len(node.input) > 2 and bool(node.input[2])
        else:
            has_bias = False
        layers.append(Layer(int(k), int(n), has_bias))
    return ModelInfo(Path(path), ins, outs, layers)


def to_fp16(model):
    """A float16 copy of a float32 model: float initializers / Constant values / graph inputs and outputs
    become FLOAT16, Cast-to-float becomes Cast-to-float16, value_info is dropped (ORT re-infers it).
    Raises ValueError when the result does not pass the ONNX checker."""
    import onnx
    from onnx import TensorProto, numpy_helper
    m = onnx.ModelProto()
    m.CopyFrom(model)
    f16max = float(np.finfo(np.float16).max)

    def conv_tensor(t):
        if t.data_type != TensorProto.FLOAT:
            return t
        arr = numpy_helper.to_array(t)
        new = numpy_helper.from_array(np.clip(arr, -f16max, f16max).astype(np.float16), t.name)
        return new

    def conv_graph(g):
        for i, t in enumerate(list(g.initializer)):
            if t.data_type == TensorProto.FLOAT:
                g.initializer[i].CopyFrom(conv_tensor(t))
        for vi in list(g.input) + list(g.output):
            tt = vi.type.tensor_type
            if tt.elem_type == TensorProto.FLOAT:
                tt.elem_type = TensorProto.FLOAT16
        del g.value_info[:]
        for node in g.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                    a.t.CopyFrom(conv_tensor(a.t))
                elif a.type == onnx.AttributeProto.GRAPH:
                    conv_graph(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sg in a.graphs:
                        conv_graph(sg)
            if node.op_type == "Cast":
                for a in node.attribute:
                    if a.name == "to" and a.i == TensorProto.FLOAT:
                        a.i = TensorProto.FLOAT16
            if node.op_type in ("ConstantOfShape", "EyeLike", "RandomNormal", "RandomUniform",
                                "RandomNormalLike", "RandomUniformLike"):
                for a in node.attribute:
                    if a.name == "dtype" and a.i == TensorProto.FLOAT:
                        a.i = TensorProto.FLOAT16

    conv_graph(m.graph)
    try:
        if m.ByteSize() < 2 ** 31 - 2 ** 20:
            onnx.checker.check_model(m)
    except Exception as e:
        raise ValueError(f"fp16 model fails the ONNX checker: {str(e).splitlines()[0] if str(e) else e}") from None
    return m


def fp16_model_file(src: Path, dst: Path) -> Path:
    """Write the fp16 copy of `src` to `dst` (external data when large) and return `dst`."""
    import onnx
    m = to_fp16(onnx.load(str(src)))
    dst.parent.mkdir(parents=True, exist_ok=True)
    if m.ByteSize() > 1.5 * 2 ** 30:
        onnx.save_model(m, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dst.name + ".data")
    else:
        onnx.save_model(m, str(dst))
    return dst


def _convert_fn():
    mod = importlib.import_module("onnx2fused.convert")
    return getattr(mod, "convert")


def convert_model(model: Path, out_dir: Path, precision: str, with_cuda: bool, plans: list | None = None):
    """(fused model path, plugin path); `plans` (if given) receives (chain name, plan text) per chain."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / (model.name[:-5] if model.name.endswith(".onnx") else model.name)
    dst = dst.with_name(dst.name + ".fused.onnx")
    res = _convert_fn()(str(model), str(dst), precision=precision, validate=True, with_cuda=with_cuda)
    if plans is not None:
        plans.extend((c.name, c.cuda_plan) for c in getattr(res, "chains", []) if getattr(c, "cuda_plan", None))
    out = Path(getattr(res, "output_path", None) or dst)
    lib = getattr(res, "library_path", None)
    return out, (Path(lib) if lib else None)


def fused_session(path: Path, library: Path | None, so, providers):
    """A session on the fused model with its plugin: onnx2fused.InferenceSession when it gives a plain
    onnxruntime session (IOBinding needed), else the recorded plugin registered by hand."""
    import onnxruntime as ort
    try:
        sess_mod = importlib.import_module("onnx2fused.session")
        sess = sess_mod.InferenceSession(str(path), sess_options=so, providers=providers)
        if hasattr(sess, "io_binding") and hasattr(sess, "run_with_iobinding"):
            return sess
        inner = getattr(sess, "session", None) or getattr(sess, "_sess", None)
        if inner is not None and hasattr(inner, "io_binding"):
            return inner
    except ImportError:
        pass
    import onnx
    if library is None:
        meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
        library = path.resolve().parent / meta["onnx2fused.plugin"]
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(str(path), so, providers=providers)


# ----------------------------------------------------------------------------------------- metadata

def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict:
    v = {"python": platform.python_version()}
    for mod in ("onnx2fused", "onnxruntime", "onnx", "numpy", "torch"):
        try:
            v[mod] = importlib.import_module(mod).__version__
        except Exception:
            v[mod] = None
    try:
        import torch
        v["torch_cuda"] = torch.version.cuda
    except Exception:
        pass
    return v


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command_line() -> str:
    if not sys.argv:
        return ""
    prog = Path(sys.argv[0]).name
    if prog == "__main__.py":
        prog = f"python -m {Path(sys.argv[0]).resolve().parent.name}"
    return " ".join([prog] + [shlex.quote(a) for a in sys.argv[1:]])


def _default_out(model: Path, cpu: bool) -> Path:
    stem = model.name[:-5] if model.name.endswith(".onnx") else model.name
    return Path("build") / "bench" / (stem + ("-cpu" if cpu else ""))


def _input_shape(dims, batch: int) -> list[int]:
    if not dims:
        return []
    return [batch] + [d if isinstance(d, int) and d > 0 else 1 for d in dims[1:]]


# ---------------------------------------------------------------------------------------- CPU mode

def default_cpu_batch(info: ModelInfo) -> int:
    """65536 rows for narrow models (widest layer <= 256), fewer for wide ones (same activation size)."""
    b = 65536 * 256 // max(info.max_width, 256)
    return max(1024, 2 ** int(math.log2(b)))


def _random_feed(info: ModelInfo, batch: int, rng, as_fp16=False) -> dict:
    feed = {}
    for name, t, dims in info.inputs:
        shape = _input_shape(dims, batch)
        dt = _ELEM_NP.get(t) or np.float32
        if np.issubdtype(dt, np.floating):
            arr = rng.standard_normal(shape, dtype=np.float32).astype(np.float16 if as_fp16 else dt)
        else:
            arr = np.zeros(shape, dtype=dt)
        feed[name] = arr
    return feed


def _time_cpu(sess, feed, reps: int, warmup: int) -> list[float]:
    return time_interleaved({"s": sess}, feed, reps, warmup)["s"]


def time_interleaved(sessions: dict, feed, reps: int, warmup: int) -> dict[str, list[float]]:
    """ms per run of each session, the sessions taking turns (in alternating order) within every
    repetition, so that a slow phase of a shared host (other processes, frequency changes) hits them
    all alike instead of whichever happened to run then. A session that fails is left out."""
    names = list(sessions)
    for _ in range(warmup):
        for n in names:
            sessions[n].run(None, feed)
    ts: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        for n in (names if i % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            sessions[n].run(None, feed)
            ts[n].append((time.perf_counter() - t0) * 1e3)
    return ts


def run_cpu(args) -> int:
    import onnxruntime as ort
    model = Path(args.model)
    out_dir = Path(args.out) if args.out else _default_out(model, True)
    out_dir.mkdir(parents=True, exist_ok=True)
    reps = args.reps or DEFAULT_CPU_REPS
    warmup = 2 if args.warmup is None else args.warmup
    info = model_info(model)
    batches = args.batches or [default_cpu_batch(info)]
    notes: list[str] = []

    def so():
        o = ort.SessionOptions()
        o.intra_op_num_threads = args.threads
        o.inter_op_num_threads = 1
        return o

    stock = ort.InferenceSession(str(model), so(), providers=["CPUExecutionProvider"])
    fused, fused_err = None, None
    t0 = time.perf_counter()
    try:
        plans: list[str] = []
        fpath, lib = convert_model(model, out_dir, args.precision, with_cuda=False, plans=plans)
        fused = fused_session(fpath, lib, so(), ["CPUExecutionProvider"])
        notes.append(f"fused model: {fpath} (converted and validated in {time.perf_counter() - t0:.1f} s)")
        # which chains run the generated kernel and which their stock-op fallback (cpu_policy.py)
        notes += [f"{n}: {p[p.find('CPU:'):] if 'CPU:' in p else p}" for n, p in plans]
    except Exception as e:
        fused_err = _reason(e)
        notes.append(f"fused: n/a: {fused_err}")

    rng = np.random.default_rng(0)
    rows = []
    for b in batches:
        feed = _random_feed(info, b, rng)
        row = {"batch": b, "ms": {}, "na": {}, "rep_ms": {}}
        sessions = {}
        for name, sess, err in (("ort_cpu", stock, None), ("fused_cpu", fused, fused_err)):
            if sess is None:
                row["na"][name] = err
                continue
            try:
                sess.run(None, feed)  # a failing variant is reported, the other still timed
                sessions[name] = sess
            except Exception as e:
                row["na"][name] = _reason(e)
        for name, ts in (time_interleaved(sessions, feed, reps, warmup) if sessions else {}).items():
            row["ms"][name] = float(np.median(ts))
            row["rep_ms"][name] = [round(t, 5) for t in ts]
        s, f = row["ms"].get("ort_cpu"), row["ms"].get("fused_cpu")
        row["speedup_vs_ort_cpu"] = s / f if s and f else None
        fl = info.flops_per_row * b
        row["flops"] = fl
        row["fused_gflops"] = fl / (f * 1e-3) / 1e9 if f and fl else None
        rows.append(row)

    result = {
        "mode": "cpu", "model": str(model), "device": _cpu_name(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(), "commit": _git_commit(), "command": _command_line(),
        "argv": sys.argv[:], "precision": args.precision, "threads": args.threads, "reps": reps,
        "warmup": warmup, "variants": CPU_VARIANTS, "notes": notes,
        "layers": [[l.k, l.n] for l in info.layers], "rows": rows,
    }
    print(f"onnx2fused bench --cpu: {model}  ({_cpu_name()}, {args.threads} threads, median of {reps})")
    print(format_table(result))
    for n in notes:
        print("note:", n)
    _write_outputs(result, out_dir)
    return 0


# ---------------------------------------------------------------------------------------- GPU mode

def _reason(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    msg = s[0] if s else ""
    return f"{type(e).__name__}: {msg}"[:300]


def measure_peaks(torch) -> tuple[float, float, list[str]]:
    """(bytes/s of a large device-to-device copy counted as read + write, flop/s of a large fp16 matmul)."""
    notes = []
    dev = torch.device("cuda")

    def best_ms(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        return min(ts)

    try:
        nbytes = 1 << 30
        free, _ = torch.cuda.mem_get_info()
        while nbytes > (1 << 24) and 2 * nbytes > 0.5 * free:
            nbytes //= 2
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        ms = best_ms(lambda: dst.copy_(src))
        bw = 2 * nbytes / (ms * 1e-3)
        del src, dst
    except Exception as e:
        bw = FALLBACK_BW
        notes.append(f"bandwidth measurement failed ({_reason(e)}); using {FALLBACK_BW:.3g} B/s")
    try:
        n = 8192
        a = torch.randn(n, n, device=dev, dtype=torch.float16)
        b = torch.randn(n, n, device=dev, dtype=torch.float16)
        c = torch.empty(n, n, device=dev, dtype=torch.float16)
        ms = best_ms(lambda: torch.matmul(a, b, out=c))
        tc = 2 * n ** 3 / (ms * 1e-3)
        del a, b, c
    except Exception as e:
        tc = FALLBACK_TC
        notes.append(f"matmul measurement failed ({_reason(e)}); using {FALLBACK_TC:.3g} flop/s")
    torch.cuda.empty_cache()
    return bw, tc, notes


def _torch_dtype(torch, t: str):
    return {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(double)": torch.float64,
            "tensor(int64)": torch.int64, "tensor(int32)": torch.int32, "tensor(bool)": torch.bool,
            "tensor(bfloat16)": torch.bfloat16}[t]


def _np_dtype_of_torch(torch, dt):
    return {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
            torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_}[dt]


class _Dev:
    """Device buffers and timing: torch (CUDA tensors, CUDA events) when torch has CUDA, else ORT OrtValues
    on the device and host timers around each (synchronous) ORT run."""

    def __init__(self, torch):
        self.torch = torch
        if torch is not None:
            self.gen = torch.Generator(device="cuda")
            self.gen.manual_seed(0)
        self.rng = np.random.default_rng(0)

    def sync(self):
        if self.torch is not None:
            self.torch.cuda.synchronize()

    def empty(self, shape, t: str):
        if self.torch is not None:
            return self.torch.empty(shape, device="cuda", dtype=_torch_dtype(self.torch, t))
        import onnxruntime as ort
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), _ELEM_NP[t], ORT_DEVICE, 0)

    def random(self, shape, t: str):
        if self.torch is not None:
            torch = self.torch
            dt = _torch_dtype(torch, t)
            if dt.is_floating_point:
                return torch.randn(shape, device="cuda", dtype=torch.float32, generator=self.gen).to(dt)
            return torch.zeros(shape, device="cuda", dtype=dt)
        import onnxruntime as ort
        dt = _ELEM_NP[t]
        arr = (self.rng.standard_normal(shape, dtype=np.float32).astype(dt) if np.issubdtype(dt, np.floating)
               else np.zeros(shape, dtype=dt))
        return ort.OrtValue.ortvalue_from_numpy(arr, ORT_DEVICE, 0)

    def nbytes(self, buf) -> int:
        if self.torch is not None:
            return buf.numel() * buf.element_size()
        return int(np.prod(buf.shape())) * np.dtype(_ELEM_NP[buf.data_type()]).itemsize

    def bind(self, io, name, buf, output=False):
        if self.torch is None:
            (io.bind_ortvalue_output if output else io.bind_ortvalue_input)(name, buf)
            return
        args = (name, "cuda", 0, _np_dtype_of_torch(self.torch, buf.dtype), list(buf.shape), buf.data_ptr())
        (io.bind_output if output else io.bind_input)(*args)

    def time(self, step, reps: int, warmup: int) -> list[float]:
        """Per-run times (ms); the device is idle before each run. torch: CUDA events on the current
        stream (a synchronous ORT run ends after its work, so the end event follows it); else host timer."""
        for i in range(warmup):
            step(i)
        self.sync()
        if self.torch is None:
            ts = []
            for i in range(reps):
                t0 = time.perf_counter()
                step(i)
                ts.append((time.perf_counter() - t0) * 1e3)
            return ts
        ev = self.torch.cuda.Event
        starts = [ev(enable_timing=True) for _ in range(reps)]
        ends = [ev(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            step(i)
            ends[i].record()
            ends[i].synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def _make_inputs(dev: _Dev, sess, info: ModelInfo, batch: int, nbuf: int) -> list[dict]:
    """nbuf sets of device inputs {name: buffer} for the session's inputs."""
    dims = {n: d for n, _, d in info.inputs}
    return [{i.name: dev.random(_input_shape(dims.get(i.name, i.shape), batch), i.type) for i in sess.get_inputs()}
            for _ in range(nbuf)]


def _bind(dev: _Dev, sess, inputs: dict, outputs: dict | None):
    io = sess.io_binding()
    for name, buf in inputs.items():
        dev.bind(io, name, buf)
    for o in sess.get_outputs():
        if outputs is None:
            io.bind_output(o.name, ORT_DEVICE, 0)
        else:
            dev.bind(io, o.name, outputs[o.name], output=True)
    return io


_graph_ids = itertools.count(1)  # CUDA graphs captured by ORT in this process, one per binding


def _new_graph_options():
    """Run options that make a CUDA-graph session capture (then replay) a graph of its own."""
    import onnxruntime as ort
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(next(_graph_ids)))
    return options


def time_ort_gpu(dev: _Dev, sess, info: ModelInfo, batch: int, reps: int, warmup: int,
                 cuda_graph: bool = False) -> tuple[list[float], int]:
    """Time one ORT CUDA session at one batch size with device-resident inputs/outputs (IOBinding).
    cuda_graph: the session was made with enable_cuda_graph=1; each binding (fixed buffer addresses)
    gets its own captured graph (run option gpu_graph_id), replayed on every later run.
    Returns (per-run ms, output features per row)."""
    sets = _make_inputs(dev, sess, info, batch, 1)
    in_bytes = sum(dev.nbytes(b) for b in sets[0].values())
    if in_bytes < L2_ROTATE_BYTES:   # small enough to stay in L2 between runs: rotate buffers
        sets += _make_inputs(dev, sess, info, batch, ROTATE_BUFFERS - 1)
    # One run with ORT-allocated outputs gives their shapes.
    io0 = _bind(dev, sess, sets[0], None)
    # With CUDA graphs this run needs a graph of its own: the default one was captured at another batch.
    sess.run_with_iobinding(io0, _new_graph_options() if cuda_graph else None)
    outs, out_feat = {}, 0
    for o, v in zip(sess.get_outputs(), io0.get_outputs()):
        shape = list(v.shape())
        outs[o.name] = dev.empty(shape, o.type)
        out_feat += int(np.prod(shape[1:])) if len(shape) > 1 else 1
    del io0
    dev.sync()
    bindings = [_bind(dev, sess, s, outs) for s in sets]
    run_options = [_new_graph_options() if cuda_graph else None for _ in bindings]
    if cuda_graph:
        warmup = max(warmup, len(bindings))  # every graph is captured before the timed runs
    ts = dev.time(lambda i: sess.run_with_iobinding(bindings[i % len(bindings)], run_options[i % len(bindings)]),
                  reps, warmup)
    del bindings, sets, outs
    return ts, out_feat


def time_torch(dev: _Dev, fn, in_shape, reps, warmup) -> list[float]:
    torch = dev.torch
    x0 = dev.random(in_shape, "tensor(float16)")
    nbuf = ROTATE_BUFFERS if x0.numel() * 2 < L2_ROTATE_BYTES else 1
    xs = [x0] + [dev.random(in_shape, "tensor(float16)") for _ in range(nbuf - 1)]
    with torch.inference_mode():
        return dev.time(lambda i: fn(xs[i % nbuf]), reps, warmup)


def _find_zoo_entry(model: Path):
    """The models/zoo.json entry whose files include this model's file name (zoo.json next to the model,
    else the repository's models/zoo.json)."""
    for zoo in (model.resolve().parent / "zoo.json", Path(__file__).resolve().parent.parent / "models" / "zoo.json"):
        try:
            z = json.loads(zoo.read_text())
        except (OSError, ValueError):
            continue
        for m in z.get("models", []):
            if any(f.get("file") == model.name for f in m.get("files", {}).values()):
                return m
    return None


_TORCH_ACTS = {"relu": "ReLU", "gelu": "GELU", "silu": "SiLU", "swish": "SiLU", "tanh": "Tanh",
               "sigmoid": "Sigmoid", "elu": "ELU", "softplus": "Softplus", "mish": "Mish",
               "leakyrelu": "LeakyReLU", "leaky_relu": "LeakyReLU", "hardswish": "Hardswish",
               "gelutanh": "GELU(tanh)", "gelu_tanh": "GELU(tanh)", "identity": "Identity"}


def zoo_torch_module(torch, model: Path, entry: dict):
    """nn.Sequential of the zoo entry (Linear + activation modules). Weights: the original model's chain
    when it matches the widths (exact), else random (timing does not depend on the values).
    Returns (module, note)."""
    nn = torch.nn
    widths, acts = entry["widths"], list(entry.get("activations") or [])
    if len(acts) < len(widths) - 2:
        acts += [entry.get("activation", "Relu")] * (len(widths) - 2 - len(acts))
    bias = entry.get("bias", True)
    layers = []
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(k, n, bias=bias))
        if i < len(widths) - 2:
            key = acts[i].lower()
            if key not in _TORCH_ACTS:
                raise ValueError(f"no torch module for the zoo activation {acts[i]!r}")
            name = _TORCH_ACTS[key]
            layers.append(nn.GELU(approximate="tanh") if name == "GELU(tanh)" else getattr(nn, name)())
    seq = nn.Sequential(*layers)
    note = "torch rows: nn.Sequential from zoo.json"
    try:
        from .loader import load_model
        from .passes.chains import find_chains
        plan = find_chains(load_model(model))
        chain = plan.chains[0] if len(plan.chains) == 1 else None
        if chain is None or list(chain.widths) != list(widths):
            raise ValueError("the model is not one chain of the zoo widths")
        lins = [m for m in seq if isinstance(m, nn.Linear)]
        with torch.no_grad():
            for lin, cl in zip(lins, chain.layers):
                lin.weight.copy_(torch.from_numpy(np.ascontiguousarray(cl.linear.weight.T)))
                if lin.bias is not None:
                    b = cl.linear.bias if cl.linear.bias is not None else np.zeros(lin.out_features, np.float32)
                    lin.bias.copy_(torch.from_numpy(np.asarray(b, np.float32).reshape(-1)))
        note += " with the ONNX model's weights"
    except Exception as e:
        note += f" with random weights (timing does not depend on the values; weights not copied: {_reason(e)})"
    return seq, note


def load_torch_module(spec: str):
    """'path/to/file.py:name' or 'pkg.module:name' -> nn.Module (name may be a module or a callable
    returning one)."""
    if ":" not in spec:
        raise ValueError(f"--torch-module {spec!r}: expected PATH:CALLABLE")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py") or os.sep in where:
        p = Path(where).resolve()
        s = importlib.util.spec_from_file_location(f"_bench_torch_{p.stem}", p)
        if s is None or s.loader is None:
            raise ValueError(f"--torch-module: cannot import {p}")
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
    else:
        mod = importlib.import_module(where)
    obj = getattr(mod, name)
    import torch
    if isinstance(obj, torch.nn.Module):
        return obj
    m = obj()
    if not isinstance(m, torch.nn.Module):
        raise ValueError(f"--torch-module {spec!r} returned {type(m).__name__}, not an nn.Module")
    return m


def _set_dynamo_limits(torch):
    try:
        import torch._dynamo as dynamo
        for attr in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(dynamo.config, attr):
                setattr(dynamo.config, attr, max(64, getattr(dynamo.config, attr)))
    except Exception:
        pass


def gpu_batches(info: ModelInfo, requested, total_mem: int) -> tuple[list[int], list[str]]:
    """Keep the batch sizes whose estimated footprint fits memory (fp32 activations of every layer alive
    plus one more, the input buffers (rotated when small), the output buffer and ORT's own output) and whose
    tensors stay below 2^31 elements."""
    notes = []
    in_f = sum(_features(d) for _, _, d in info.inputs) or 1
    out_f = max(sum(_features(d) for _, _, d in info.outputs), 1)
    kept = []
    for b in requested:
        nbuf = ROTATE_BUFFERS if b * in_f * 4 < L2_ROTATE_BYTES else 1
        need = b * 4 * (info.sum_widths + info.max_width + in_f * nbuf + 2 * out_f)
        biggest = b * max(info.max_width, in_f, out_f)
        if need > MEM_FRACTION * total_mem:
            notes.append(f"batch {b} skipped: ~{need / 2**30:.1f} GiB estimated, over {MEM_FRACTION:.0%} of "
                         f"the GPU's {total_mem / 2**30:.0f} GiB")
            continue
        if biggest > MAX_ELEMENTS:
            notes.append(f"batch {b} skipped: a tensor of {biggest} elements (over 2^31)")
            continue
        kept.append(b)
    return kept, notes


def _empty_cache(torch):
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _nvidia_smi(field: str) -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip().splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _nvidia_smi_name() -> str:
    return _nvidia_smi("name") or "CUDA device 0"


def _nvidia_smi_memory() -> int:
    v = _nvidia_smi("memory.total")   # MiB
    try:
        return int(float(v)) * 2 ** 20
    except (TypeError, ValueError):
        return 16 * 2 ** 30


def _cuda_torch():
    """torch when it sees a CUDA device, else None."""
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def gpu_providers() -> list:
    return [("CUDAExecutionProvider", {"device_id": 0, "arena_extend_strategy": "kSameAsRequested"}),
            "CPUExecutionProvider"]


def run_gpu(args) -> int:
    import onnxruntime as ort
    model = Path(args.model)
    out_dir = Path(args.out) if args.out else _default_out(model, False)
    out_dir.mkdir(parents=True, exist_ok=True)
    reps = args.reps or DEFAULT_GPU_REPS
    warmup = 10 if args.warmup is None else args.warmup
    info = model_info(model)
    notes: list[str] = []
    torch = _cuda_torch()
    if torch is not None:
        device = torch.cuda.get_device_name(0)
        total_mem = torch.cuda.get_device_properties(0).total_memory
        bw, tc, peak_notes = measure_peaks(torch)
        notes += peak_notes
    else:
        device, total_mem = _nvidia_smi_name(), _nvidia_smi_memory()
        bw, tc = FALLBACK_BW, FALLBACK_TC
        notes.append(f"torch has no CUDA: floor uses the fallback peaks {FALLBACK_BW:.3g} B/s and "
                     f"{FALLBACK_TC:.3g} flop/s (not measured); ORT buffers are OrtValues, times are host "
                     "timers around each synchronous run; no torch rows")
    dev = _Dev(torch)
    batches, cap_notes = gpu_batches(info, args.batches or DEFAULT_GPU_BATCHES, total_mem)
    notes += cap_notes
    print(f"onnx2fused bench: {model} on {device}; measured {bw / 1e12:.2f} TB/s copy, "
          f"{tc / 1e12:.0f} TFLOP/s fp16 matmul; median of {reps} runs", flush=True)

    providers = gpu_providers()

    def so():
        o = ort.SessionOptions()
        o.log_severity_level = 3
        return o

    # Sessions are made one variant at a time (and dropped after its sweep) so that arenas do not pile up.
    def make_ort_fp32():
        return ort.InferenceSession(str(model), so(), providers=providers), None

    def make_ort_fp16():
        p = fp16_model_file(model, out_dir / (model.stem + ".fp16.onnx"))
        return ort.InferenceSession(str(p), so(), providers=providers), f"ort_fp16 model: {p}"

    def make_fused():
        t0 = time.perf_counter()
        p, lib = convert_model(model, out_dir, args.precision, with_cuda=True)
        s = fused_session(p, lib, so(), providers)
        return s, f"fused model: {p} (precision {args.precision}; converted and validated in {time.perf_counter() - t0:.1f} s)"

    def make_fused_graph():
        # The same fused model with ORT's CUDA graphs: shows the op without ORT's per-run overhead.
        p, lib = convert_model(model, out_dir, args.precision, with_cuda=True)
        cuda, *rest = providers
        graph_providers = [(cuda[0], {**cuda[1], "enable_cuda_graph": "1"})] + rest
        return fused_session(p, lib, so(), graph_providers), "fused_graph: enable_cuda_graph=1, one graph per IOBinding"

    rows = {b: {"batch": b, "ms": {}, "na": {}, "rep_ms": {}} for b in batches}
    out_features = {}

    for name, make in (("ort_fp32", make_ort_fp32), ("ort_fp16", make_ort_fp16), ("fused", make_fused),
                       ("fused_graph", make_fused_graph)):
        try:
            sess, note = make()
            if note:
                notes.append(note)
            if "CUDAExecutionProvider" not in sess.get_providers():
                notes.append(f"{name}: session has no CUDA EP ({sess.get_providers()})")
        except Exception as e:
            reason = _reason(e)
            notes.append(f"{name}: n/a: {reason}")
            for r in rows.values():
                r["na"][name] = reason
            continue
        failed = None
        for b in batches:
            if failed:
                rows[b]["na"][name] = f"skipped after a failure at a smaller batch: {failed}"
                continue
            try:
                ts, of = time_ort_gpu(dev, sess, info, b, reps, warmup, cuda_graph=name == "fused_graph")
                rows[b]["ms"][name] = float(np.median(ts))
                rows[b]["rep_ms"][name] = [round(t, 5) for t in ts]
                out_features.setdefault(b, of)
                print(f"  {name:<14} batch {b:>8}: {rows[b]['ms'][name]:.4f} ms", flush=True)
            except Exception as e:
                failed = _reason(e)
                rows[b]["na"][name] = failed
                print(f"  {name:<14} batch {b:>8}: n/a ({failed})", flush=True)
            gc.collect()
            _empty_cache(torch)
        del sess
        gc.collect()
        _empty_cache(torch)

    # torch rows
    tmod, tnote = None, None
    if args.no_torch:
        tnote = "torch rows skipped (--no-torch)"
    elif torch is None:
        tnote = "torch rows skipped: torch has no CUDA"
    else:
        try:
            if args.torch_module:
                tmod, tnote = load_torch_module(args.torch_module), f"torch rows: --torch-module {args.torch_module}"
            else:
                entry = _find_zoo_entry(model)
                if entry is None:
                    tnote = "torch rows skipped: the model is not in models/zoo.json and no --torch-module was given"
                else:
                    tmod, tnote = zoo_torch_module(torch, model, entry)
        except Exception as e:
            tmod, tnote = None, f"torch rows n/a: {_reason(e)}"
    notes.append(tnote)
    if tmod is None:
        for r in rows.values():
            r["na"]["torch_eager"] = r["na"]["torch_compile"] = tnote
    else:
        tmod = tmod.to("cuda").half().eval()
        _set_dynamo_limits(torch)
        try:
            compiled = torch.compile(tmod, dynamic=False)
            compile_err = None
        except Exception as e:
            compiled, compile_err = None, _reason(e)
        in_dims = info.inputs[0][2] if info.inputs else ["batch"]
        for name, fn in (("torch_eager", tmod), ("torch_compile", compiled)):
            failed = compile_err if fn is None else None
            for b in batches:
                if failed:
                    rows[b]["na"][name] = failed
                    continue
                try:
                    ts = time_torch(dev, fn, _input_shape(in_dims, b), reps, max(warmup, 3))
                    rows[b]["ms"][name] = float(np.median(ts))
                    rows[b]["rep_ms"][name] = [round(t, 5) for t in ts]
                    print(f"  {name:<14} batch {b:>8}: {rows[b]['ms'][name]:.4f} ms", flush=True)
                except Exception as e:
                    failed = _reason(e)
                    rows[b]["na"][name] = failed
                    print(f"  {name:<14} batch {b:>8}: n/a ({failed})", flush=True)
                gc.collect()
                _empty_cache(torch)

    # derived columns
    in_f = sum(_features(d) for _, _, d in info.inputs)
    io_bytes = _ELEM_NP.get(info.inputs[0][1], np.float32) if info.inputs else np.float32
    elem = np.dtype(io_bytes or np.float32).itemsize
    wbytes_per = 2 if args.precision in ("fp16", "bf16") else 4
    for b, r in rows.items():
        out_f = out_features.get(b) or sum(_features(d) for _, _, d in info.outputs)
        r["flops"] = info.flops_per_row * b
        r["bytes"] = b * (in_f + out_f) * elem + info.weight_params * wbytes_per
        r["floor_ms"] = max(r["bytes"] / bw, r["flops"] / tc) * 1e3
        f = r["ms"].get("fused")
        s32, s16 = r["ms"].get("ort_fp32"), r["ms"].get("ort_fp16")
        r["speedup_vs_ort_fp32"] = s32 / f if f and s32 else None
        r["speedup_vs_ort_fp16"] = s16 / f if f and s16 else None
        r["fused_tflops"] = r["flops"] / (f * 1e-3) / 1e12 if f and r["flops"] else None
        r["fused_over_floor"] = f / r["floor_ms"] if f and r["floor_ms"] else None

    result = {
        "mode": "gpu", "model": str(model), "device": device,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(), "commit": _git_commit(), "command": _command_line(), "argv": sys.argv[:],
        "precision": args.precision, "reps": reps, "warmup": warmup, "variants": GPU_VARIANTS,
        "measured": {"copy_bytes_per_s": bw, "fp16_matmul_flops_per_s": tc},
        "timing": ("CUDA events" if torch is not None else "host timers") +
                  " around each run (ORT: run_with_iobinding, synchronous; torch: forward + event sync), "
                  "device-resident inputs/outputs, inputs < 50 MB rotated over 4 buffers; median",
        "notes": notes, "layers": [[l.k, l.n] for l in info.layers],
        "rows": [rows[b] for b in batches],
    }
    print(format_table(result))
    for n in notes:
        print("note:", n)
    _write_outputs(result, out_dir)
    return 0


# ------------------------------------------------------------------------------------------ output

def _fmt(v, spec="{:.4f}") -> str:
    return "n/a" if v is None else spec.format(v)


def format_table(result: dict) -> str:
    if result["mode"] == "cpu":
        cols = [("batch", lambda r: str(r["batch"])),
                ("ORT CPU ms", lambda r: _fmt(r["ms"].get("ort_cpu"))),
                ("fused CPU ms", lambda r: _fmt(r["ms"].get("fused_cpu"))),
                ("speed-up", lambda r: _fmt(r.get("speedup_vs_ort_cpu"), "{:.2f}x")),
                ("fused GFLOP/s", lambda r: _fmt(r.get("fused_gflops"), "{:.1f}"))]
    else:
        cols = [("batch", lambda r: str(r["batch"]))]
        for v in GPU_VARIANTS:
            cols.append((LABELS[v] + " ms", lambda r, v=v: _fmt(r["ms"].get(v))))
        cols += [("fused/fp32 x", lambda r: _fmt(r.get("speedup_vs_ort_fp32"), "{:.2f}")),
                 ("fused/fp16 x", lambda r: _fmt(r.get("speedup_vs_ort_fp16"), "{:.2f}")),
                 ("fused TFLOP/s", lambda r: _fmt(r.get("fused_tflops"), "{:.2f}")),
                 ("floor ms", lambda r: _fmt(r.get("floor_ms"))),
                 ("fused/floor", lambda r: _fmt(r.get("fused_over_floor"), "{:.2f}"))]
    table = [[h for h, _ in cols]] + [[f(r) for _, f in cols] for r in result["rows"]]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    na = {}
    for r in result["rows"]:
        for v, why in r.get("na", {}).items():
            na.setdefault(v, why)
    lines += [f"n/a {v}: {why}" for v, why in na.items()]
    return "\n".join(lines)


def _jsonable(o):
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def _write_outputs(result: dict, out_dir: Path) -> None:
    jp = out_dir / "bench.json"
    jp.write_text(json.dumps(_jsonable(result), indent=1) + "\n")
    print(f"wrote {jp}")
    try:
        pp = plot(result, out_dir / "bench.png")
        print(f"wrote {pp}")
    except Exception as e:  # the numbers are in the JSON; a plotting problem must not lose them
        print(f"bench: no plot ({_reason(e)})", file=sys.stderr)
        traceback.print_exc()


def plot(result: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for v in result["variants"]:
        pts = [(r["batch"], r["ms"][v]) for r in rows if r["ms"].get(v)]
        if pts:
            ax1.plot(*zip(*pts), marker="o", label=LABELS.get(v, v))
    if result["mode"] == "gpu":
        pts = [(r["batch"], r["floor_ms"]) for r in rows if r.get("floor_ms")]
        if pts:
            ax1.plot(*zip(*pts), "k--", label="floor (measured BW / TC)")
        sp = [("speedup_vs_ort_fp32", "fused vs ORT fp32"), ("speedup_vs_ort_fp16", "fused vs ORT fp16")]
    else:
        sp = [("speedup_vs_ort_cpu", "fused vs ORT CPU")]
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("batch")
    ax1.set_ylabel("time per run (ms, median)")
    ax1.set_title(f"{Path(result['model']).name} on {result['device']}", fontsize=9)
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    for key, label in sp:
        pts = [(r["batch"], r[key]) for r in rows if r.get(key)]
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=label)
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("batch")
    ax2.set_ylabel("speed-up (x)")
    ax2.set_title("speed-up of the fused model", fontsize=9)
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":  # python -m onnx2fused.bench MODEL ...
    p = argparse.ArgumentParser(prog="onnx2fused bench")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
