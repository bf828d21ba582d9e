"""bench: the model side: inputs, outputs and linear layers of a model (ModelInfo), the fp16 copy for ORT's
fp16 rows, input shapes and feeds, the batch sizes that fit a GPU, and the torch modules of the torch rows."""
from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

L2_ROTATE_BYTES = 50 * 2 ** 20   # inputs smaller than this are rotated over several buffers
ROTATE_BUFFERS = 4
MEM_FRACTION = 0.6        # a batch is kept when its estimated footprint fits this fraction of GPU memory
MAX_ELEMENTS = 2 ** 31 - 1  # per tensor (32-bit indexing in some kernels)

_ELEM_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
            "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_,
            "tensor(bfloat16)": None}
REPO_ROOT = Path(__file__).resolve().parents[2]   # the checkout (models/zoo.json), when run from one


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
    conv_params: int = 0    # weights and biases of the Conv nodes with constant weights
    _flops: dict = field(default_factory=dict, repr=False)   # batch_flops' results by batch

    @property
    def flops_per_row(self) -> int:
        """Flops of one row of the first input's last axis through the layers."""
        return sum(2 * l.k * l.n for l in self.layers)

    def batch_flops(self, batch: int) -> int:
        """Flops of a run at `batch` (linear_flops: every MatMul, Gemm and Conv with a constant weight, at
        the shapes the model's own shape inference gives); where shapes stay unknown, the layers' flops
        per row times the rows of the first input (flops_per_row * rows_per_item * batch)."""
        if batch not in self._flops:
            counted = linear_flops(self.path, self.inputs, batch) if self.path.is_file() else None
            self._flops[batch] = counted if counted is not None else self.flops_per_row * self.rows_per_item * batch
        return self._flops[batch]

    @property
    def rows_per_item(self) -> int:
        """Rows of the last axis per batch item: the first input's middle dims (197 tokens of a ViT's
        [batch, 197, 384]; symbolic ones count as 1), for the flops of a batch."""
        r = 1
        for d in list(self.inputs[0][2])[1:-1] if self.inputs else []:
            r *= d if isinstance(d, int) and d > 0 else 1
        return r

    @property
    def weight_params(self) -> int:
        return sum(l.k * l.n + (l.n if l.bias else 0) for l in self.layers) + self.conv_params

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
    conv_params = 0
    for node in g.node:
        if node.op_type == "Conv" and len(node.input) > 1 and node.input[1] in inits:
            conv_params += math.prod(inits[node.input[1]])
            if len(node.input) > 2 and node.input[2] in inits:
                conv_params += math.prod(inits[node.input[2]])
    return ModelInfo(Path(path), ins, outs, layers, conv_params)


def linear_flops(path, inputs, batch: int) -> int | None:
    """2 x output elements x reduction length, summed over the MatMul, Gemm and Conv nodes whose weight (the
    second input) is an initializer, with every input shaped as the bench feeds it (_input_shape) and the
    other shapes from ONNX shape inference: PointNet's pointwise Conv1d over [B, C, points] counts its points,
    which a per-row count of the first input's last axis cannot. None where a counted node's shapes stay
    unknown (the caller counts per row then)."""
    import onnx
    from onnx import shape_inference
    m = onnx.load(str(path), load_external_data=False)
    g = m.graph
    shapes = {t.name: list(t.dims) for t in g.initializer}
    given = {name: _input_shape(dims, batch) for name, _, dims in inputs}
    for vi in g.input:
        if vi.name in given:
            dims = vi.type.tensor_type.shape.dim
            for d, v in zip(dims, given[vi.name]):
                d.ClearField("dim_param")
                d.dim_value = v
    del g.value_info[:]
    try:
        g = shape_inference.infer_shapes(m, data_prop=True).graph
    except Exception:
        return None
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        t = vi.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes.setdefault(vi.name, [d.dim_value for d in t.shape.dim])
    weights = {t.name for t in g.initializer}
    total = 0
    for node in g.node:
        if node.op_type not in ("MatMul", "Gemm", "Conv") or len(node.input) < 2:
            continue
        w = node.input[1]
        if w not in weights:
            continue
        out = shapes.get(node.output[0])
        wdims = shapes.get(w)
        if out is None or wdims is None:
            return None
        if node.op_type == "Conv":
            reduction = math.prod(wdims[1:])            # C_in / group x the kernel's extent
        elif node.op_type == "Gemm":
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            reduction = wdims[1] if trans_b else wdims[0]
        else:
            reduction = wdims[-2] if len(wdims) >= 2 else wdims[0]
        total += 2 * math.prod(out) * reduction
    return total


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


def dim_sizes(args) -> dict[str, int]:
    """--dim NAME=SIZE arguments as {name: size}; ValueError (one line) for a malformed one."""
    sizes: dict[str, int] = {}
    for item in getattr(args, "dim", None) or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--dim {item}: expected NAME=SIZE with a size >= 1 (e.g. --dim h=7)")
        sizes[name.strip()] = int(value)
    return sizes


def with_dim_sizes(info: ModelInfo, sizes: dict[str, int]) -> ModelInfo:
    """`info` with its inputs' named dynamic dimensions past the batch axis (a CNN's map height and width)
    at the given sizes (bench --dim NAME=SIZE); dimensions left unnamed here stay 1, as _input_shape makes
    them. ConversionError (one line) for a name that is the batch axis or no input's dimension."""
    from ..errors import ConversionError
    batch_axes = {d[0] for _, _, d in info.inputs if d and isinstance(d[0], str)}
    named = {x for _, _, d in info.inputs for x in list(d)[1:] if isinstance(x, str)}
    for name in sizes:
        if name in batch_axes:
            raise ConversionError(f"--dim {name}: that is the batch axis (give its sizes with --batches)")
        if name not in named:
            have = ", ".join(sorted(named)) or "none"
            raise ConversionError(f"--dim {name}: no input has a dynamic dimension of that name "
                                  f"(the named ones past the batch axis: {have})")
    inputs = [(n, t, list(d)[:1] + [sizes.get(x, x) if isinstance(x, str) else x for x in list(d)[1:]])
              for n, t, d in info.inputs]
    return replace(info, inputs=inputs, _flops={})


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


# ---------------------------------------------------------------------------------------- GPU mode

def _reason(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    msg = s[0] if s else ""
    return f"{type(e).__name__}: {msg}"[:300]


def _find_zoo_entry(model: Path):
    """The models/zoo.json entry whose files include this model's file name (zoo.json next to the model,
    else the repository's models/zoo.json)."""
    for zoo in (model.resolve().parent / "zoo.json", REPO_ROOT / "models" / "zoo.json"):
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
    # A gated FFN or a transformer block (issue 16) is no Sequential: the builder's own module is. A tabular
    # model's BatchNorms fold into its chain's layers, whose weights the Sequential takes below.
    if entry.get("block") not in (None, "tabular"):
        raise ValueError(f"the zoo's {entry['block']} block is no nn.Sequential; give "
                         f"--torch-module with the module (models/build_zoo.py builds it)")
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
        from ..loader import load_model
        from ..passes.chains import find_chains
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
