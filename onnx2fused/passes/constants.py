"""Graph facts for the passes: node keys, producers/consumers, element types, shapes, and constants.

Constant folding (for matching only; the graph itself is not changed here):

    Constant() -> c                          value(c) = the attribute tensor
    ConstantOfShape(s; value=v) -> c         value(c) = full(s, v)  (v defaults to float32 0), s constant
    initializer w (not an overridable input) value(w) = w
    Identity(c) -> y                         value(y) = value(c)
    Cast(c, to=T) -> y                       value(y) = value(c).astype(T)
    Transpose(c, perm) -> y                  value(y) = value(c).transpose(perm)
    Reshape(c, s) / Squeeze / Unsqueeze      value(y) = value(c) reshaped, when s (axes) is constant
    Add/Sub/Mul/Div/Pow/MatMul(a, b),        value(y) = numpy's, for floating a and b of one type: weights
    Sqrt/Neg/Reciprocal/Abs(a), ReduceL2/    computed from parameters in the graph (torch's weight_norm and
    ReduceSum/ReduceSumSquare/ReduceMean     spectral_norm parametrizations as the dynamo exporter writes
    (a, axes)                                them: g * v / ||v||, W / (u . W v))

`GraphIndex.const_producers` names the nodes whose outputs were folded, so that `rewrite` can drop them
once the fused node no longer needs them (and only then).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import ConversionError

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
               onnx.TensorProto.DOUBLE}
MAX_FOLD_ELEMENTS = 1 << 28  # ConstantOfShape outputs larger than this (1 GiB of float32) are not folded
MAX_FOLD_FLOPS = 1 << 32     # MatMuls of constants costing more multiply-adds than this are not folded
ELEM_NAMES = {v: k.lower() for k, v in onnx.TensorProto.DataType.items()}


def elem_name(t: int | None) -> str:
    return "unknown" if t is None else ELEM_NAMES.get(t, str(t))


def node_keys(graph: onnx.GraphProto) -> list[str]:
    """A unique, stable key per node: its name when that is non-empty and unique, else `<Op #i>`."""
    counts: dict[str, int] = {}
    for n in graph.node:
        counts[n.name] = counts.get(n.name, 0) + 1
    return [n.name if n.name and counts[n.name] == 1 else f"<{n.op_type} #{i}>"
            for i, n in enumerate(graph.node)]


def _subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs (If/Loop/Scan bodies) read, including outer-scope references."""
    names: set[str] = set()
    for a in node.attribute:
        graphs = list(a.graphs) + ([a.g] if a.HasField("g") else [])
        for g in graphs:
            for n in g.node:
                names.update(i for i in n.input if i)
                names |= _subgraph_inputs(n)
            names.update(o.name for o in g.output)
    return names


def node_reads(node: onnx.NodeProto) -> set[str]:
    return {i for i in node.input if i} | _subgraph_inputs(node)


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def written_axes(node: onnx.NodeProto, const) -> tuple[list[int] | None, bool]:
    """The axes a Reduce*, Squeeze or Unsqueeze node names, as written (its second input from opset 13 / 18
    on, else its `axes` attribute), and whether they are known: (None, True) where it names none (a Reduce
    over every axis), ([], False) where the input is computed at run time. `const(name)`: a tensor's constant
    value or None (GraphIndex.const, or a lookup of initializers)."""
    if len(node.input) > 1 and node.input[1]:
        value = const(node.input[1])
        return ([], False) if value is None else ([int(a) for a in np.asarray(value).reshape(-1)], True)
    axes = _attr(node, "axes")
    return (None if axes is None else [int(a) for a in axes]), True


_BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
           "MatMul": np.matmul}
_UNARY = {"Sqrt": np.sqrt, "Neg": np.negative, "Reciprocal": np.reciprocal, "Abs": np.abs}
_REDUCE = {"ReduceL2": lambda x, ax, k: np.sqrt(np.sum(x * x, axis=ax, keepdims=k)),
           "ReduceSum": lambda x, ax, k: np.sum(x, axis=ax, keepdims=k),
           "ReduceSumSquare": lambda x, ax, k: np.sum(x * x, axis=ax, keepdims=k),
           "ReduceMean": lambda x, ax, k: np.mean(x, axis=ax, keepdims=k)}


def _fold_arithmetic(n: onnx.NodeProto, ins: list) -> np.ndarray | None:
    """The value of an arithmetic node on floating constants of one type (`ins`: its inputs' values, None
    where not constant), computed by numpy in that type; None for anything else. Integer arithmetic is
    left alone (shape computations: ONNX's integer Div truncates, numpy's floors)."""
    x = ins[0]
    if x.dtype.kind != "f" or x.size > MAX_FOLD_ELEMENTS:
        return None
    with np.errstate(all="ignore"):   # inf and nan come out as ORT's would
        if n.op_type in _BINARY:
            if len(ins) != 2 or ins[1] is None or ins[1].dtype != x.dtype:
                return None
            if n.op_type == "MatMul" and x.size * (ins[1].shape[-1] if ins[1].ndim > 1 else 1) > MAX_FOLD_FLOPS:
                return None   # (a product of two large constants: no weight we fuse is made so)
            return np.asarray(_BINARY[n.op_type](x, ins[1]), dtype=x.dtype)
        if n.op_type in _UNARY and len(ins) == 1:
            return np.asarray(_UNARY[n.op_type](x), dtype=x.dtype)
        if n.op_type in _REDUCE:
            axes = _attr(n, "axes")
            if axes is None and len(ins) > 1 and n.input[1]:
                if ins[1] is None:
                    return None
                axes = [int(a) for a in np.asarray(ins[1]).reshape(-1)]
            if not axes:
                if _attr(n, "noop_with_empty_axes", 0):
                    return x
                axes = list(range(x.ndim))
            keep = bool(_attr(n, "keepdims", 1))
            return np.asarray(_REDUCE[n.op_type](x, tuple(a % x.ndim for a in axes), keep), dtype=x.dtype)
    return None


def constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
    return None


ORT_DOMAIN = "com.microsoft"   # ONNX Runtime's own ops (contrib ops), in models saved by its graph optimisers

# ONNX Runtime's own ops (domain com.microsoft, in models saved by its graph optimiser) that onnx's shape
# inference does not know, and the stock op that gives their first output the same type and shape: with
# them in place, the tensors after them keep known types (else every layer downstream would be refused
# as "element type unknown").
_ORT_STAND_INS = {"Gelu": "Identity", "QuickGelu": "Identity", "FastGelu": "Add", "BiasGelu": "Add",
                  "FusedGemm": "Gemm", "FusedMatMul": "MatMul", "SkipLayerNormalization": "Identity",
                  "SkipSimplifiedLayerNormalization": "Identity", "BiasAdd": "Identity",
                  # BERT's after onnxruntime.transformers: [B, S, hidden] like the input (query) rows, and
                  # the embedding's rows as a Gather of the word embedding by the ids
                  "Attention": "Identity", "MultiHeadAttention": "Identity", "EmbedLayerNormalization": "Gather"}
# The opset that brought LayerNormalization into the standard; from it the fused op's stock body runs the op
# itself (below, its ops: rewrite.py). ONNX Runtime registers it in the default domain at every opset, and
# SimplifiedLayerNormalization too: its optimiser writes them into the models it saves, which the ONNX
# checker rejects and shape inference does not type (the loader and the stand-ins below take them).
LAYERNORM_OPSET = 17
ORT_DEFAULT_DOMAIN_OPS = ("SimplifiedLayerNormalization", "LayerNormalization")


def is_ort_default_domain_op(n: onnx.NodeProto, opset: int) -> bool:
    """Whether n is one of ORT's ops in the default domain that onnx does not know at `opset`."""
    return (n.domain in ("", "ai.onnx") and n.op_type in ORT_DEFAULT_DOMAIN_OPS
            and (n.op_type != "LayerNormalization" or opset < LAYERNORM_OPSET))


def default_opset(model: onnx.ModelProto, missing: int | None = None) -> int:
    """The model's default-domain (ai.onnx) opset; `missing` where it imports none (None: ConversionError)."""
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    if missing is None:
        raise ConversionError("the model imports no default-domain (ai.onnx) opset")
    return missing


# ONNX-ML ops of float output and the input's shape, which onnx's inference leaves untyped (skl2onnx's
# Scaler in front of an MLP: everything after it lost its types and shapes)
_ML_FLOAT_STAND_INS = ("Scaler",)
ML_DOMAIN = "ai.onnx.ml"
_GEMM_ATTRS = ("alpha", "beta", "transA", "transB")
_STAND_IN_DATA_LIMIT = 1 << 16   # initializers larger than this (bytes) lose their data in the stand-in


def _inference_stand_in(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` itself, or, where it has ORT ops of _ORT_STAND_INS, ONNX-ML ops of _ML_FLOAT_STAND_INS or a
    LayerNormalization below opset 17 (ORT's optimiser writes one), a copy for shape inference only with
    each replaced by its stock stand-in (large weights' data left out: inference reads their shapes)."""
    opset = default_opset(model, 0)

    def has_stand_in(n: onnx.NodeProto) -> bool:
        return ((n.domain == ORT_DOMAIN and n.op_type in _ORT_STAND_INS)
                or (n.domain == ML_DOMAIN and n.op_type in _ML_FLOAT_STAND_INS)
                or is_ort_default_domain_op(n, opset))

    if not any(has_stand_in(n) for n in model.graph.node):
        return model
    src = model.graph
    g = onnx.GraphProto(name=src.name)
    for n in src.node:   # (copies: the user's model is not changed)
        g.node.extend(_stand_in_nodes(n) if has_stand_in(n) else [n])
    for field_name in ("input", "output", "value_info", "sparse_initializer"):
        getattr(g, field_name).extend(getattr(src, field_name))
    for t in src.initializer:
        if t.data_type == onnx.TensorProto.INT64 or t.ByteSize() <= _STAND_IN_DATA_LIMIT:
            g.initializer.append(t)
        else:   # inference reads a weight's type and dims, not its values
            g.initializer.append(onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type))
    stand_in = onnx.ModelProto(ir_version=model.ir_version, graph=g)
    stand_in.opset_import.extend(model.opset_import)
    stand_in.functions.extend(model.functions)
    return stand_in


def _stand_in_nodes(n: onnx.NodeProto) -> list[onnx.NodeProto]:
    """The stock nodes whose first output has the type and shape of ORT or ONNX-ML op n's first output."""
    if n.domain == ML_DOMAIN:
        return [onnx.helper.make_node("Cast", n.input[:1], n.output[:1], to=onnx.TensorProto.FLOAT)]
    if n.op_type in ORT_DEFAULT_DOMAIN_OPS:
        return [onnx.helper.make_node("Identity", n.input[:1], n.output[:1])]
    op = _ORT_STAND_INS[n.op_type]
    ins, out = list(n.input), n.output[0]
    trans = {a.name: a.i for a in n.attribute if a.name.startswith("trans")}
    if n.op_type == "FusedMatMul":
        if trans.get("transA") or trans.get("transBatchA") or trans.get("transBatchB"):
            return [n]   # left unknown: no stock op of a few nodes has its shape
        if trans.get("transB"):
            t = onnx.helper.make_node("Transpose", [ins[1]], [out + "__o2f_bt"], perm=[1, 0])
            return [t, onnx.helper.make_node("MatMul", [ins[0], t.output[0]], [out])]
        return [onnx.helper.make_node("MatMul", ins[:2], [out])]
    if n.op_type == "Attention" and any(a.name == "qkv_hidden_sizes" for a in n.attribute):
        return [n]   # its output's width is the value's, which may differ from the input's
    if op == "Gather":   # EmbedLayerNormalization(input_ids, segment_ids, word_embedding, ...)
        return [onnx.helper.make_node("Gather", [ins[2], ins[0]], [out])] if len(ins) > 2 else [n]
    if op == "Gemm":
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute if a.name in _GEMM_ATTRS}
        return [onnx.helper.make_node("Gemm", ins[:3], [out], **attrs)]
    if op == "Add" and len(ins) > 1 and ins[1]:
        return [onnx.helper.make_node("Add", ins[:2], [out])]
    return [onnx.helper.make_node("Identity", ins[:1], [out])]


@dataclass
class GraphIndex:
    """Read-only index of a model's main graph."""
    model: onnx.ModelProto
    graph: onnx.GraphProto = field(init=False)
    keys: list[str] = field(init=False)
    index_of: dict[str, int] = field(init=False)
    producer: dict[str, int] = field(init=False)
    consumers: dict[str, list[int]] = field(init=False)
    graph_outputs: set[str] = field(init=False)
    consts: dict[str, np.ndarray] = field(init=False)
    not_const: dict[str, str] = field(init=False)     # tensor -> why it is not treated as a constant
    const_producers: dict[str, int] = field(init=False)
    types: dict[str, int] = field(init=False)
    shapes: dict[str, list] = field(init=False)

    def __post_init__(self):
        g = self.graph = self.model.graph
        self.keys = node_keys(g)
        self.index_of = {k: i for i, k in enumerate(self.keys)}
        self.producer, self.consumers = {}, {}
        for i, n in enumerate(g.node):
            for o in n.output:
                if o:
                    self.producer[o] = i
            for t in node_reads(n):
                self.consumers.setdefault(t, [])
                if i not in self.consumers[t]:
                    self.consumers[t].append(i)
        self.graph_outputs = {o.name for o in g.output}
        self._types_and_shapes()
        self._fold_constants()

    # -- types and shapes --------------------------------------------------------------------
    def _types_and_shapes(self):
        self.types, self.shapes = {}, {}
        try:
            inferred = onnx.shape_inference.infer_shapes(_inference_stand_in(self.model), strict_mode=False)
            infos = list(inferred.graph.value_info)
        except Exception:  # shape inference is best effort here; the loader reports real failures
            infos = []
        g = self.graph
        for vi in list(g.input) + list(g.value_info) + infos + list(g.output):
            tt = vi.type.tensor_type
            if not vi.type.HasField("tensor_type"):
                continue
            if tt.elem_type:
                self.types.setdefault(vi.name, tt.elem_type)
            if tt.HasField("shape") and vi.name not in self.shapes:
                self.shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                                        for d in tt.shape.dim]
        for init in g.initializer:
            self.types.setdefault(init.name, init.data_type)
            self.shapes.setdefault(init.name, list(init.dims))

    def rank(self, name: str) -> int | None:
        s = self.shapes.get(name)
        return None if s is None else len(s)

    def last_axis(self, name: str, axis: int) -> bool:
        """Whether `axis` of tensor `name` is its last: -1, or rank - 1 where the rank is known."""
        r = self.rank(name)
        return axis == -1 or (r is not None and axis == r - 1)

    # -- constants ---------------------------------------------------------------------------
    def _fold_constants(self):
        g = self.graph
        self.consts, self.not_const, self.const_producers = {}, {}, {}
        inputs = {i.name for i in g.input}
        for init in g.initializer:
            if init.name in inputs and self.model.ir_version >= 4:
                self.not_const[init.name] = (f"'{init.name}' is a graph input (it can be overridden at run time; "
                                             "torch: export with keep_initializers_as_inputs=False)")
                continue
            try:
                self.consts[init.name] = numpy_helper.to_array(init)
            except Exception as e:  # e.g. external data that was not loaded
                self.not_const[init.name] = f"initializer '{init.name}' cannot be read ({e})"
        for i, n in enumerate(g.node):
            if n.domain not in ("", "ai.onnx") or len(n.output) != 1 or not n.output[0]:
                continue
            v = None
            try:
                v = self._fold(n)
            except Exception:
                v = None
            if v is not None:
                self.consts[n.output[0]] = v
                self.const_producers[n.output[0]] = i

    def _fold(self, n: onnx.NodeProto) -> np.ndarray | None:
        if n.op_type == "Constant":
            return constant_node_value(n)
        if n.op_type == "ConstantOfShape":
            shape = self.consts.get(n.input[0]) if n.input and n.input[0] else None
            if shape is None:
                return None
            a = next((a for a in n.attribute if a.name == "value"), None)
            fill = numpy_helper.to_array(a.t).reshape(-1) if a is not None else np.zeros(1, np.float32)
            dims = [int(d) for d in np.asarray(shape).reshape(-1)]
            if np.prod(dims, dtype=np.float64) > MAX_FOLD_ELEMENTS:  # not a weight we could fuse anyway
                return None
            return np.full(dims, fill[0], dtype=fill.dtype)
        ins = [self.consts.get(x) if x else None for x in n.input]
        if not ins or ins[0] is None:
            return None
        x = ins[0]
        if n.op_type == "Identity":
            return x
        if n.op_type == "Cast":
            to = _attr(n, "to")
            return x.astype(onnx.helper.tensor_dtype_to_np_dtype(to))
        if n.op_type == "Transpose":
            perm = _attr(n, "perm")
            return np.transpose(x, perm) if perm else np.transpose(x)
        if n.op_type == "Reshape" and len(ins) > 1 and ins[1] is not None:
            shape = [int(s) for s in ins[1]]
            if not _attr(n, "allowzero", 0):
                shape = [x.shape[j] if s == 0 else s for j, s in enumerate(shape)]
            return x.reshape(shape)
        if n.op_type in ("Squeeze", "Unsqueeze"):
            axes = _attr(n, "axes")
            if axes is None and len(ins) > 1:
                if ins[1] is None:
                    return None
                axes = [int(a) for a in ins[1]]
            if n.op_type == "Squeeze":
                return np.squeeze(x, axis=tuple(axes)) if axes else np.squeeze(x)
            if axes is None:
                return None
            out_rank = x.ndim + len(axes)
            for a in sorted(a % out_rank for a in axes):
                x = np.expand_dims(x, a)
            return x
        return _fold_arithmetic(n, ins)

    def const(self, name: str) -> np.ndarray | None:
        return self.consts.get(name) if name else None

    # -- helpers -----------------------------------------------------------------------------
    def node(self, i: int) -> onnx.NodeProto:
        return self.graph.node[i]

    def describe(self, i: int) -> str:
        return f"{self.graph.node[i].op_type} '{self.keys[i]}'"

    def users(self, tensor: str) -> list[int]:
        return self.consumers.get(tensor, [])

    def attr(self, i: int, name: str, default=None):
        return _attr(self.graph.node[i], name, default)
