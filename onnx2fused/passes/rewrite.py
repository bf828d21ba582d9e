"""Replace each chain by one custom node, with a model-local function as its stock-ONNX fallback.

For a chain x -> f_1(x W_1 + b_1) -> ... -> y found by `find_chains` and its spec S:

    nodes(chain)  ->  y = onnx2fused.S(x, W_1, B_1, ..., W_n, B_n; widths, activations)
    function onnx2fused.S(X, W_1, B_1, ...) := Y = f_n(... f_1(Cast_f32(X) @ W_1 + B_1) ... @ W_n + B_n)

with W_i float32 [K_i, N_i] and B_i float32 [N_i] (zeros without a bias) as new initializers (a gated
layer: [K_i, 2 N_i] and [2 N_i], gate columns first, and in the function f_i(Slice(h, 0, N_i)) *
Slice(h, N_i, 2 N_i) of h = . W_i + B_i), the
activations emitted from their `expr` trees with stock ops (Relu-free: max/min/where/... exactly as
the tree says, so the fallback computes what the kernels compute). A transformer block (spec.norm,
spec.residual) adds the norm's inputs NS [K0] (and NB [K0] for a layer norm) after the layers', and in
the function normalises Cast_f32(X) first (LayerNormalization, below opset 17 its ops: ReduceMean,
Sub, then the RMS norm of that, Mul, Add; or the RMS norm's Pow, ReduceMean, Add, Sqrt, Reciprocal,
Mul, Mul) and adds Cast_f32(X) to the last layer's output. The fused node sits where the chain's last
node was; all other nodes are kept byte for byte; initializers and folded constant
producers that only the chain used are dropped; the IR version is never raised.
"""
from __future__ import annotations

import base64

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .. import expr as ex
from ..errors import ConversionError
from ..spec import DOMAIN, MLPSpec, NormSpec
from .chains import FusionPlan
from .constants import LAYERNORM_OPSET, GraphIndex, default_opset, node_reads
from .pool import POOL_NODE

STOCK_MODEL_ATTR = "stock_model"  # the node's fallback body as a serialized model, base64 (make_stock_model)
STOCK_DATA_LOCATION = "onnx2fused:node-inputs"  # its weights' external data: the plugin fills them in
FUNCTION_MIN_IR = 3  # checker and onnxruntime 1.31 accept model-local functions at IR 7 too (checked)

_UNARY_OPS = {"neg": "Neg", "abs": "Abs", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "tanh": "Tanh",
              "erf": "Erf", "sin": "Sin", "cos": "Cos", "sigmoid": "Sigmoid", "softplus": "Softplus",
              "reciprocal": "Reciprocal", "sinh": "Sinh", "cosh": "Cosh", "tan": "Tan", "asin": "Asin",
              "acos": "Acos", "atan": "Atan", "asinh": "Asinh", "acosh": "Acosh", "atanh": "Atanh",
              "floor": "Floor", "ceil": "Ceil", "round": "Round", "sign": "Sign"}
_BINARY_OPS = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "max": "Max", "min": "Min",
               "pow": "Pow"}
_CMP_OPS = {"gt": "Greater", "lt": "Less", "ge": "GreaterOrEqual", "le": "LessOrEqual"}


class OnnxEmitter:
    """Emit stock ONNX nodes (float32 math) that compute an `expr.Expr` of a tensor."""

    def __init__(self, prefix: str, opset: int):
        self.prefix, self.opset = prefix, opset
        self.nodes: list[onnx.NodeProto] = []
        self._n = 0

    def fresh(self) -> str:
        self._n += 1
        return f"{self.prefix}{self._n}"

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.fresh()
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def const(self, v: float) -> str:
        t = helper.make_tensor("value", TensorProto.FLOAT, [], [float(np.float32(v))])
        return self.node("Constant", [], value=t)

    def const_vector(self, values: tuple) -> str:
        """A per-channel constant as a float32 [N] tensor: it broadcasts over the last axis."""
        t = numpy_helper.from_array(np.asarray(values, dtype=np.float32), "value")
        return self.node("Constant", [], value=t)

    def emit(self, e: ex.Expr, x: str, memo: dict | None = None) -> str:
        memo = {} if memo is None else memo
        if e in memo:
            return memo[e]
        if isinstance(e, ex.Var):
            out = x
        elif isinstance(e, ex.Const):
            out = self.const(e.value)
        elif isinstance(e, ex.Chan):
            out = self.const_vector(e.values)
        elif e.name in _UNARY_OPS:
            out = self.node(_UNARY_OPS[e.name], [self.emit(e.args[0], x, memo)])
        elif e.name in _BINARY_OPS:
            out = self.node(_BINARY_OPS[e.name], [self.emit(a, x, memo) for a in e.args])
        elif e.name in _CMP_OPS:
            out = self.node("Cast", [self.emit_bool(e, x, memo)], to=TensorProto.FLOAT)
        elif e.name == "select":
            c, a, b = e.args
            cond = self.emit_bool(c, x, memo)
            out = self.node("Where", [cond, self.emit(a, x, memo), self.emit(b, x, memo)])
        else:  # pragma: no cover - every primitive is handled above
            raise ConversionError(f"cannot emit expression primitive {e.name!r} as ONNX")
        memo[e] = out
        return out

    def emit_bool(self, e: ex.Expr, x: str, memo: dict) -> str:
        key = ("bool", e)
        if key in memo:
            return memo[key]
        if isinstance(e, ex.Op) and e.name in _CMP_OPS:
            a, b = (self.emit(v, x, memo) for v in e.args)
            if e.name in ("ge", "le") and self.opset < 12:
                strict = self.node("Greater" if e.name == "ge" else "Less", [a, b])
                out = self.node("Or", [strict, self.node("Equal", [a, b])])
            else:
                out = self.node(_CMP_OPS[e.name], [a, b])
        else:  # c != 0, NaN counts as true like C's `c != 0.0f`
            out = self.node("Cast", [self.emit(e, x, memo)], to=TensorProto.BOOL)
        memo[key] = out
        return out


def make_fallback_function(spec: MLPSpec, opset: int, with_pool: bool = True) -> onnx.FunctionProto:
    """The stock-ONNX body of the fused op `spec.name` (float32 math, like the kernels). `with_pool`
    False: a pooled spec's rows before the pool (the plugin's CPU path pools them itself)."""
    em = OnnxEmitter("t", opset)
    inputs = op_input_names(spec)
    h = "X"
    if spec.io_dtype == "f16":
        h = em.node("Cast", [h], to=TensorProto.FLOAT)
    block_in = h
    if spec.norm is not None:
        h = _emit_norm(em, spec.norm, h)
        if spec.io_dtype == "f16" and spec.norm.kind == "layernorm":  # ORT's fp16 kernel writes fp16
            h = em.node("Cast", [em.node("Cast", [h], to=TensorProto.FLOAT16)], to=TensorProto.FLOAT)
    for i, layer in enumerate(spec.layers):
        w = f"W{i}"
        if i in spec.skip:
            # [x, h] times W's x rows (less the zero rows that pad them to skip_width) and its h rows
            k0, pad = spec.widths[0], spec.skip_width
            h = em.node("Concat", [block_in, h], axis=-1)
            w = em.node("Concat", [_axis_slice(em, w, 0, k0, 0), _axis_slice(em, w, pad, pad + spec.layer_input(i), 0)],
                        axis=0)
        m = em.node("MatMul", [h, w])
        a = em.node("Add", [m, f"B{i}"])
        if layer.gated:
            n_out = layer.out_features
            gate = em.emit(layer.activation, _last_axis_slice(em, a, 0, n_out))
            h = em.node("Mul", [gate, _last_axis_slice(em, a, n_out, 2 * n_out)])
        else:
            h = em.emit(layer.activation, a)
    if spec.residual:
        h = em.node("Add", [h, block_in])
    if spec.pool and with_pool:   # the pool over axis -2 (pool.py) in float, before the output's rounding
        op = POOL_NODE[spec.pool_op]
        if opset >= (13 if op == "ReduceSum" else 18):   # (ReduceSum took its axes as an input first)
            axes = em.node("Constant", [], value=numpy_helper.from_array(np.array([-2], np.int64), "value"))
            h = em.node(op, [h, axes], keepdims=int(spec.pool_keeps_axis))
        else:
            h = em.node(op, [h], axes=[-2], keepdims=int(spec.pool_keeps_axis))
    if spec.io_dtype == "f16":
        em.nodes.append(helper.make_node("Cast", [h], ["Y"], name="cast_out", to=TensorProto.FLOAT16))
    else:
        em.nodes.append(helper.make_node("Identity", [h], ["Y"], name="out"))
    return helper.make_function(DOMAIN, spec.name, inputs, ["Y"], em.nodes,
                                [helper.make_opsetid("", opset)], attributes=list(NODE_ATTRIBUTES))


def norm_input_names(spec: MLPSpec) -> list[str]:
    return [] if spec.norm is None else list(spec.norm.input_names)


def op_input_names(spec: MLPSpec) -> list[str]:
    """The fused op's inputs: X, W_i, B_i of each layer, then the norm's (norm_input_names)."""
    return ["X"] + [f"{p}{i}" for i in range(len(spec.layers)) for p in ("W", "B")] + norm_input_names(spec)


def _emit_norm(em: OnnxEmitter, norm: NormSpec, x: str) -> str:
    """The norm of x's rows in stock ops: LayerNormalization itself from opset 17, below it the ops the
    exporters write there (x - mean, the RMS of that, then NS and NB); the RMS norm as the exporters
    write it, x * (1 / sqrt(mean(x^2) + eps)) * NS."""
    if norm.kind == "layernorm" and em.opset >= LAYERNORM_OPSET:
        return em.node("LayerNormalization", [x, "NS", "NB"], axis=-1, epsilon=float(norm.eps))
    if norm.kind == "layernorm":
        d = em.node("Sub", [x, _row_mean(em, x)])
        return em.node("Add", [em.node("Mul", [_rms_scaled(em, d, norm.eps), "NS"]), "NB"])
    return em.node("Mul", [_rms_scaled(em, x, norm.eps), "NS"])


def _row_mean(em: OnnxEmitter, x: str) -> str:
    if em.opset >= 18:
        axes = em.node("Constant", [], value=numpy_helper.from_array(np.array([-1], np.int64), "value"))
        return em.node("ReduceMean", [x, axes], keepdims=1)
    return em.node("ReduceMean", [x], axes=[-1], keepdims=1)


def _rms_scaled(em: OnnxEmitter, x: str, eps: float) -> str:
    """x * (1 / sqrt(mean(x^2) + eps)) over the last axis."""
    mean = _row_mean(em, em.node("Pow", [x, em.const(2.0)]))
    return em.node("Mul", [x, em.node("Reciprocal", [em.node("Sqrt", [em.node("Add", [mean, em.const(eps)])])])])


def _last_axis_slice(em: OnnxEmitter, x: str, start: int, end: int) -> str:
    """x[..., start:end] in stock ops (Slice with input bounds: opset >= 10, which gated.py requires)."""
    return _axis_slice(em, x, start, end, -1)


def _axis_slice(em: OnnxEmitter, x: str, start: int, end: int, axis: int) -> str:
    """x's start:end along `axis` in stock ops (Slice with input bounds: opset >= 10)."""
    ints = [em.node("Constant", [], value=numpy_helper.from_array(np.array([v], np.int64), "value"))
            for v in (start, end, axis)]
    return em.node("Slice", [x] + ints)


NODE_ATTRIBUTES = ("widths", "activations", STOCK_MODEL_ATTR)


def make_stock_model(spec: MLPSpec, opset: int, ir_version: int) -> bytes:
    """The fallback body as a standalone model (input X, output Y; rows symbolic), serialized.

    The plugin's CPU kernel for a chain whose generated C++ kernel the cost model declines (cpu_policy)
    runs this model in an inner ORT session: when a library registers any kernel for an op type, ORT
    gives the node that op's schema and no longer inlines the model-local function, so a CPU-EP node
    without a registered CPU kernel would fail to load (docs/DESIGN.md, "the CPU path").
    W_i, B_i (and NS, NB) are initializers whose data is external and never written: the plugin supplies
    the node's constant inputs for them when it opens the session (AddExternalInitializers), so the outer
    model holds the weights once, and the inner session optimises and prepacks them as constants.
    """
    fn = make_fallback_function(spec, opset, with_pool=False)   # rows in, rows out: the plugin pools
    io = TensorProto.FLOAT16 if spec.io_dtype == "f16" else TensorProto.FLOAT
    params = []
    for i, layer in enumerate(spec.layers):
        params += [(f"W{i}", [layer.in_features, layer.weight_columns]), (f"B{i}", [layer.weight_columns])]
    params += [(name, [spec.widths[0]]) for name in norm_input_names(spec)]
    inits = []
    for name, dims in params:   # float32, data supplied by the plugin (the location is never read)
        t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=dims, data_location=TensorProto.EXTERNAL)
        for key, value in (("location", STOCK_DATA_LOCATION), ("offset", "0"), ("length", str(4 * int(np.prod(dims))))):
            t.external_data.add(key=key, value=value)
        inits.append(t)
    ins = [helper.make_tensor_value_info("X", io, ["rows", spec.widths[0]])]
    out = helper.make_tensor_value_info("Y", io, ["rows", spec.widths[-1]])
    graph = helper.make_graph(list(fn.node), spec.name, ins, [out], initializer=inits)
    model = helper.make_model(graph, opset_imports=list(fn.opset_import), producer_name="onnx2fused")
    model.ir_version = min(max(ir_version, 4), model.ir_version)  # initializers that are not inputs: IR >= 4
    return model.SerializeToString()


def _unique(base: str, taken: set[str]) -> str:
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name


def _all_names(g: onnx.GraphProto) -> set[str]:
    names = {i.name for i in g.input} | {o.name for o in g.output} | {t.name for t in g.initializer}
    names |= {v.name for v in g.value_info}
    for n in g.node:
        names.update(n.input)
        names.update(n.output)
        names |= node_reads(n)
        if n.name:
            names.add(n.name)
    return names


def rewrite(model: onnx.ModelProto, plan: FusionPlan, specs: list[MLPSpec]) -> onnx.ModelProto:
    """A new model with each chain of `plan` replaced by its fused node (specs[i] for plan.chains[i])."""
    if len(specs) != len(plan.chains):
        raise ConversionError(f"rewrite got {len(specs)} specs for {len(plan.chains)} chains")
    ix = GraphIndex(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    taken = _all_names(model.graph)
    opset = default_opset(model)

    remove: set[int] = set()
    place: dict[int, onnx.NodeProto] = {}
    new_inits: list[onnx.TensorProto] = []
    fused_outputs: list[str] = []
    stock_models = {s.name: base64.b64encode(make_stock_model(s, opset, model.ir_version)).decode("ascii")
                    for s in specs}
    for k, (chain, spec) in enumerate(zip(plan.chains, specs)):
        if (tuple(spec.widths) != tuple(chain.widths) or spec.io_dtype != chain.input_dtype
                or (spec.norm is None) != (chain.norm is None) or spec.residual != chain.residual):
            raise ConversionError(f"spec {spec.name} does not describe chain {k} "
                                  f"(widths {chain.widths}, {chain.input_dtype})")
        try:
            idx = [ix.index_of[n] for n in chain.nodes]
        except KeyError as e:
            raise ConversionError(f"chain {k} names node {e} that is not in the model") from None
        if remove & set(idx):
            raise ConversionError(f"chain {k} overlaps another chain")
        remove |= set(idx)
        inputs = [chain.input]
        for i, layer in enumerate(chain.layers):
            w = np.ascontiguousarray(layer.linear.weight, dtype=np.float32)
            b = (np.zeros(w.shape[1], np.float32) if layer.linear.bias is None
                 else np.ascontiguousarray(layer.linear.bias, dtype=np.float32))
            for arr, p in ((w, "W"), (b, "B")):
                name = _unique(f"onnx2fused_c{k}_{p}{i}", taken)
                new_inits.append(numpy_helper.from_array(arr, name))
                inputs.append(name)
        if chain.norm is not None:
            scale = np.ascontiguousarray(chain.norm.scale, dtype=np.float32)
            bias = np.zeros_like(scale) if chain.norm.bias is None else np.ascontiguousarray(chain.norm.bias, np.float32)
            for arr, p in zip((scale, bias), norm_input_names(spec)):
                name = _unique(f"onnx2fused_c{k}_{p}", taken)
                new_inits.append(numpy_helper.from_array(arr, name))
                inputs.append(name)
        node = helper.make_node(spec.name, inputs, [chain.output], name=_unique(f"onnx2fused_chain{k}", taken),
                                domain=DOMAIN, widths=list(spec.widths),
                                activations=[ex.to_text(l.activation) for l in spec.layers],
                                **{STOCK_MODEL_ATTR: stock_models[spec.name]})
        place[max(idx)] = node
        fused_outputs.append(chain.output)

    # stock BatchNorms outside the chains as Mul + Add (batchnorm.py); their parameters go below with the
    # other initializers nothing reads any more
    replace: dict[int, list[onnx.NodeProto]] = {}
    for bn in plan.batchnorms:
        i = ix.index_of[bn.name]
        inits, replace[i] = bn.mul_add(lambda base: _unique(base, taken), model.graph.node[i].name or bn.output)
        new_inits.extend(inits)
        remove.add(i)

    # Concats that read a folded layer's input in place of its output (concat_fold.py)
    for e in plan.concat_edits:
        i = ix.index_of[e.node]
        edited = onnx.NodeProto()
        edited.CopyFrom(model.graph.node[i])
        edited.input[e.position] = e.tensor
        replace[i] = [edited]
        remove.add(i)

    kept = []
    for i, n in enumerate(model.graph.node):
        if i in place:
            kept.append((None, place[i]))
        elif i in replace:
            kept.extend((None, r) for r in replace[i])
        elif i not in remove:
            kept.append((i, n))

    # Drop folded constant producers that only the removed nodes used.
    const_nodes = set(ix.const_producers.values())
    while True:
        reads = {o.name for o in g.output}
        for _, n in kept:
            reads |= node_reads(n)
        dead = [j for j, (i, n) in enumerate(kept)
                if i in const_nodes and ix.users(n.output[0]) and n.output[0] not in reads]
        if not dead:
            break
        kept = [x for j, x in enumerate(kept) if j not in set(dead)]
    del g.node[:]
    g.node.extend(n for _, n in kept)

    # Initializers that the removed nodes used and nothing uses now.
    old_reads = set(ix.consumers)
    unused = {t.name for t in model.graph.initializer if t.name in old_reads and t.name not in reads}
    if unused:
        inits = [t for t in g.initializer if t.name not in unused]
        del g.initializer[:]
        g.initializer.extend(inits)
        if any(i.name in unused for i in g.input):
            ins = [i for i in g.input if i.name not in unused]
            del g.input[:]
            g.input.extend(ins)
    g.initializer.extend(new_inits)
    if out.ir_version < 4:  # IR 3: every initializer is also a graph input
        for t in new_inits:
            g.input.append(helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)))

    # value_info: drop tensors that no longer exist, describe the fused outputs.
    alive = {o for _, n in kept for o in n.output} | {i.name for i in g.input} | {t.name for t in g.initializer}
    vis = [v for v in g.value_info if v.name in alive]
    del g.value_info[:]
    g.value_info.extend(vis)
    described = {v.name for v in g.value_info} | {o.name for o in g.output}
    for name in fused_outputs:
        if name not in described and name in ix.types:
            shape = ix.shapes.get(name)
            g.value_info.append(helper.make_tensor_value_info(name, ix.types[name], shape))

    if not any(o.domain == DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    if out.ir_version >= FUNCTION_MIN_IR:
        have = {(f.domain, f.name) for f in out.functions}
        for spec in specs:
            if (DOMAIN, spec.name) not in have:
                out.functions.append(make_fallback_function(spec, opset))
                have.add((DOMAIN, spec.name))
    out.ir_version = model.ir_version
    return out
