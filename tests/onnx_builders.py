"""Small hand-built ONNX models for the pass tests (onnx.helper only) and a stock-ORT runner."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


class G:
    """A tiny graph builder: g.init(array), g.op("Relu", [x]) -> output name, g.model(...)."""

    def __init__(self, opset: int = 17, ir: int = 8, seed: int = 0):
        self.opset, self.ir = opset, ir
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self._n = 0

    def name(self, base: str) -> str:
        self._n += 1
        return f"{base}{self._n}"

    def init(self, arr, name: str | None = None) -> str:
        name = name or self.name("c")
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def const_node(self, arr, name: str | None = None) -> str:
        out = name or self.name("k")
        self.nodes.append(helper.make_node("Constant", [], [out], name=self.name("Constant_"),
                                           value=numpy_helper.from_array(np.asarray(arr), out)))
        return out

    def op(self, op: str, inputs: list[str], name: str | None = None, outputs: int | list[str] = 1,
           domain: str = "", **attrs):
        outs = outputs if isinstance(outputs, list) else [self.name(op.lower() + "_out") for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=name or self.name(op + "_"), domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def weight(self, k: int, n: int, dtype=np.float32, name: str | None = None) -> str:
        return self.init((self.rng.standard_normal((k, n)) / np.sqrt(k)).astype(dtype), name or self.name("w"))

    def vec(self, n: int, dtype=np.float32, name: str | None = None) -> str:
        return self.init(self.rng.standard_normal(n).astype(dtype), name or self.name("b"))

    def model(self, inputs: list[tuple[str, list]], outputs: list[tuple[str, list]], elem=F32,
              check: bool = True) -> onnx.ModelProto:
        g = helper.make_graph(
            self.nodes, "g",
            [helper.make_tensor_value_info(n, elem, s) for n, s in inputs],
            [helper.make_tensor_value_info(o, elem, s) for o, s in outputs],
            initializer=self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        m.ir_version = self.ir
        if check:
            onnx.checker.check_model(m)
        return m

    # -- layers ------------------------------------------------------------------------------------
    def linear(self, x: str, k: int, n: int, kind: str = "gemm", bias: bool = True, name: str | None = None,
               dtype=np.float32) -> str:
        """kind: gemm (transB=1 like torch), gemm_plain, matmul (bias Add on the right), matmul_left."""
        if kind.startswith("gemm"):
            if kind == "gemm":
                w = self.init((self.rng.standard_normal((n, k)) / np.sqrt(k)).astype(dtype), self.name("w"))
                ins = [x, w] + ([self.vec(n, dtype)] if bias else [])
                return self.op("Gemm", ins, name=name, transB=1)
            w = self.weight(k, n, dtype)
            return self.op("Gemm", [x, w] + ([self.vec(n, dtype)] if bias else []), name=name)
        y = self.op("MatMul", [x, self.weight(k, n, dtype)], name=name)
        if not bias:
            return y
        b = self.vec(n, dtype)
        return self.op("Add", [b, y] if kind == "matmul_left" else [y, b])


def mlp(widths, act: str | None = "Relu", kind: str = "gemm", rank: int = 2, opset: int = 17, ir: int = 8,
        bias: bool = True, last_act: bool = False, elem=F32, **act_attrs) -> onnx.ModelProto:
    """x -> [linear -> act] * (len(widths) - 1) -> y, the last layer without activation unless last_act."""
    g = G(opset, ir)
    dtype = np.float16 if elem == F16 else np.float32
    h = "x"
    n = len(widths) - 1
    for i in range(n):
        h = g.linear(h, widths[i], widths[i + 1], kind=kind, bias=bias, name=f"fc{i}", dtype=dtype)
        if act and (i < n - 1 or last_act):
            h = g.op(act, [h], name=f"act{i}", **act_attrs)
    g.nodes[-1].output[0] = "y"  # nothing consumes the last node's output
    lead = ["B", "S", "T", "U"][: rank - 1]
    return g.model([("x", lead + [widths[0]])], [("y", lead + [widths[-1]])], elem=elem)


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """Stock ONNX Runtime (CPU, graph optimisations off: the plain ops)."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def rand(shape, seed: int = 1, scale: float = 3.0, dtype=np.float32) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(dtype)
