"""A linear layer without activation whose output is only concatenated into another layer's input folds
into that layer:

    Concat(..., h Wf + bf, ...) W + b   ==   Concat(..., h, ...) W' + b'
        W' = W with the rows of the folded part, W[p:p+Nf], replaced by Wf W[p:p+Nf]   (Kf rows)
        b' = b + bf W[p:p+Nf]

NeRF's view head: feature = feature_linear(h) is only concatenated with the view directions into the view
layers, so its 256 x 256 GEMM and its output's round trip through memory go (RESULTS.md, forty-first run).
The Concat stays a stock op that reads h in place of the feature (the chain's concat_edit; rewrite applies
it); the folded layer's nodes go with the chain of the layer it folds into. Only where the Concat does not
grow (Kf <= Nf), the folded layer is a chain of its own (nothing before it in a chain), and the Concat's
output has that one layer as its only reader.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .constants import GraphIndex
from .linear import LinearLayer


@dataclass(frozen=True)
class ConcatEdit:
    """The Concat `node` (a node key) reads `tensor` as its input `position` (a folded layer's input)."""
    node: str
    position: int
    tensor: str
    folded: str   # the folded layer's first node, for the report

    def describe(self) -> str:
        return f"Concat '{self.node}' reads '{self.tensor}' in place of linear layer '{self.folded}', folded into the next layer"


@dataclass(frozen=True)
class ConcatFold:
    concat: int        # the Concat node
    position: int      # the folded layer's output among its inputs
    offset: int        # its first feature in the Concat's output
    folded: LinearLayer


def match_concat_fold(ix: GraphIndex, linear: LinearLayer, t: str, users: list[int]) -> tuple[ConcatFold, str] | None:
    """(the fold, the Concat's output) where `linear`'s output `t` (no activation after it) is read only by a
    Concat on the last axis whose every input has a known width and that does not grow by the fold; else None."""
    if len(users) != 1 or linear.activation is not None or linear.low_rank or t != linear.output:
        return None
    u = users[0]
    n = ix.node(u)
    if n.op_type != "Concat" or list(n.input).count(t) != 1 or n.output[0] in ix.graph_outputs:
        return None
    rank = ix.rank(t)
    if rank is None or not ix.last_axis(t, ix.attr(u, "axis", 0)):
        return None
    widths = []
    for name in n.input:
        shape = ix.shapes.get(name)
        if not shape or len(shape) != rank or not isinstance(shape[-1], int):
            return None
        widths.append(shape[-1])
    p = list(n.input).index(t)
    if linear.in_features > linear.out_features or widths[p] != linear.out_features:
        return None
    return ConcatFold(u, p, sum(widths[:p]), linear), n.output[0]


def apply_fold(into: LinearLayer, fold: ConcatFold) -> None:
    """`into`'s weight and bias with the folded layer's part multiplied through (float64), in place."""
    f = fold.folded
    w = into.weight.astype(np.float64)
    part = w[fold.offset:fold.offset + f.out_features]
    rows = f.weight.astype(np.float64) @ part
    bias = np.zeros(w.shape[1]) if into.bias is None else into.bias.astype(np.float64)
    if f.bias is not None:
        bias = bias + f.bias.astype(np.float64) @ part
    into.weight = np.ascontiguousarray(np.concatenate([w[:fold.offset], rows, w[fold.offset + f.out_features:]]),
                                       dtype=np.float32)
    if into.bias is not None or f.bias is not None:
        into.bias = bias.astype(np.float32)
