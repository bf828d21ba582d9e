"""Inference BatchNormalization on rank-2 rows left outside every chain, as Mul + Add.

    y = (x - mean) / sqrt(var + eps) * scale + B   ->   y = x * s + t,  s = scale / sqrt(var + eps),
                                                                         t = B - mean * s

A BatchNorm1d on [N, C] rows that no chain takes in (RTDL's ResNet head: BatchNorm, ReLU, then the head's
layer; one between a residual Add and the next block) stays a stock op. ONNX Runtime's CUDA kernel for it
is cuDNN's batch norm, whose path for rank-2 rows took ~1.5 ms at 4096 rows of 192 features on an H200 and
fails from 65536 rows (CUDNN_STATUS_NOT_SUPPORTED), in the original model as in a fused one. As a Mul and
an Add of its folded scale and shift (computed in float64, stored as float32) it is two elementwise
kernels at the copy rate, on every provider and batch size; validation compares the result with the
original like the rest. Only float32 rows with constant parameters, in inference form (one output, no
training_mode), and only in models with CUDA kernels: on the CPU the stock op is as fast.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .constants import GraphIndex

WHY = ("ONNX Runtime's CUDA BatchNormalization runs cuDNN's slow path on rank-2 rows and fails from 65536 "
       "rows")


@dataclass
class BatchNormRewrite:
    output: str            # the BatchNormalization's output (the Add's in the rewritten model)
    input: str
    name: str              # the node's name, for the report
    scale: np.ndarray      # float32 [C]
    shift: np.ndarray      # float32 [C]

    def describe(self) -> str:
        return f"BatchNormalization '{self.name}' on [N, {self.scale.size}] rows: as Mul + Add ({WHY})"


def find_batchnorms(ix: GraphIndex, taken: set[str]) -> list[BatchNormRewrite]:
    """The inference BatchNormalization nodes on float32 rank-2 rows with constant parameters that no chain
    takes (`taken`: the chains' node keys)."""
    out = []
    for i, n in enumerate(ix.graph.node):
        if (n.op_type != "BatchNormalization" or n.domain not in ("", "ai.onnx") or ix.keys[i] in taken
                or len(n.input) != 5 or len([o for o in n.output if o]) != 1 or not n.output[0]
                or ix.attr(i, "training_mode", 0) or ix.types.get(n.input[0]) != onnx.TensorProto.FLOAT
                or ix.rank(n.input[0]) != 2):
            continue
        params = [ix.const(p) for p in n.input[1:]]
        if any(p is None or p.ndim != 1 or p.dtype != np.float32 for p in params):
            continue
        gamma, beta, mean, var = (p.astype(np.float64) for p in params)
        s = gamma / np.sqrt(var + float(ix.attr(i, "epsilon", 1e-5)))
        t = beta - mean * s
        if not (np.isfinite(s).all() and np.isfinite(t).all()):
            continue
        out.append(BatchNormRewrite(n.output[0], n.input[0], ix.keys[i], s.astype(np.float32), t.astype(np.float32)))
    return out


def apply_batchnorms(model: onnx.ModelProto, rewrites: list[BatchNormRewrite]) -> None:
    """Replaces each of `rewrites`' nodes in `model` (the fused model: the same tensor names) by a Mul and
    an Add, in place; drops the parameters nothing reads any more."""
    if not rewrites:
        return
    g = model.graph
    by_output = {r.output: r for r in rewrites}
    taken = {t.name for t in g.initializer} | {o for n in g.node for o in n.output} | {i.name for i in g.input}
    nodes, params = [], set()
    for n in g.node:
        r = by_output.get(n.output[0]) if n.op_type == "BatchNormalization" and n.output else None
        if r is None:
            nodes.append(n)
            continue
        params |= set(n.input[1:])
        names = []
        for what in ("scale", "shift", "scaled"):
            name, k = f"{r.output}_bn_{what}", 0
            while name in taken:
                k += 1
                name = f"{r.output}_bn_{what}{k}"
            taken.add(name)
            names.append(name)
        g.initializer.extend([numpy_helper.from_array(r.scale, names[0]), numpy_helper.from_array(r.shift, names[1])])
        nodes.append(helper.make_node("Mul", [r.input, names[0]], [names[2]], name=f"{n.name or r.output}_scale"))
        nodes.append(helper.make_node("Add", [names[2], names[1]], [r.output], name=f"{n.name or r.output}_shift"))
    del g.node[:]
    g.node.extend(nodes)
    reads = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    unused = {p for p in params if p not in reads}
    if unused:
        kept = [t for t in g.initializer if t.name not in unused]
        del g.initializer[:]
        g.initializer.extend(kept)
        ins = [i for i in g.input if i.name not in unused]
        del g.input[:]
        g.input.extend(ins)


__all__ = ["BatchNormRewrite", "WHY", "apply_batchnorms", "find_batchnorms"]
