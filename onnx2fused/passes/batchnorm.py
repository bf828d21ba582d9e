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
from typing import Callable

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

    def mul_add(self, unique: Callable[[str], str], node_name: str) -> tuple[list, list]:
        """(the initializers, the nodes) that replace the BatchNorm: x * s + t into its output, their tensor
        names from `unique` (rewrite's, which also drops the parameters nothing reads any more)."""
        scale, shift, scaled = (unique(f"{self.output}_bn_{w}") for w in ("scale", "shift", "scaled"))
        inits = [numpy_helper.from_array(self.scale, scale), numpy_helper.from_array(self.shift, shift)]
        nodes = [helper.make_node("Mul", [self.input, scale], [scaled], name=f"{node_name}_scale"),
                 helper.make_node("Add", [scaled, shift], [self.output], name=f"{node_name}_shift")]
        return inits, nodes


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


__all__ = ["BatchNormRewrite", "WHY", "find_batchnorms"]
