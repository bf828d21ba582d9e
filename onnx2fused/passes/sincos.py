"""Fourier features (Tancik et al. 2020; random Fourier features in PINNs): a linear layer's output z read
only by a Sin and a Cos whose outputs are concatenated (last axis) into the next layer,

    Concat(sin(z), cos(z)) = sin([z, z] + [0, pi/2])   (cos z = sin(z + pi/2)),

is one layer of twice the width: weight [W, W], bias [b, b + pi/2] (in the Concat's order), activation sin.
The chain then runs from the layer before the Sin and Cos through the layers after the Concat, where the
pair ended the chain ("has 2 consumers"). The shifted argument is rounded once more in fp32 (|z| of a few
hundred: ~1e-5), which the numerics model and validation see like any other rounding.
"""
from __future__ import annotations

import math

import numpy as np

from .. import expr as ex
from .activations import Activation
from .constants import GraphIndex
from .linear import LinearLayer


def match_sincos(ix: GraphIndex, t: str, users: list[int]) -> tuple[list[int], str, bool] | None:
    """([Sin, Cos, Concat] node indices, the Concat's output, sin first) where `t`'s readers are exactly a
    Sin and a Cos concatenated (two inputs, the last axis) and read by nothing else; else None."""
    if len(users) != 2:
        return None
    ops = {ix.node(u).op_type: u for u in users}
    if set(ops) != {"Sin", "Cos"}:
        return None
    outs = [ix.node(ops[op]).output[0] for op in ("Sin", "Cos")]
    readers = [ix.users(o) for o in outs]
    if any(len(r) != 1 or o in ix.graph_outputs for r, o in zip(readers, outs)) or readers[0] != readers[1]:
        return None
    c = readers[0][0]
    n = ix.node(c)
    rank = ix.rank(t)
    if (n.op_type != "Concat" or sorted(n.input) != sorted(outs) or n.output[0] in ix.graph_outputs
            or rank is None or not ix.last_axis(t, ix.attr(c, "axis", 0))):
        return None
    return [ops["Sin"], ops["Cos"], c], n.output[0], n.input[0] == outs[0]


def widen(linear: LinearLayer, sin_first: bool) -> None:
    """`linear` as the pair's one layer: its columns twice, the cos half's bias shifted by pi/2, in place."""
    w, n = linear.weight, linear.out_features
    b = np.zeros(n, np.float64) if linear.bias is None else linear.bias.astype(np.float64)
    halves = [b, b + math.pi / 2] if sin_first else [b + math.pi / 2, b]
    linear.weight = np.ascontiguousarray(np.concatenate([w, w], axis=1), dtype=np.float32)
    linear.bias = np.concatenate(halves).astype(np.float32)


def sincos_activation(ix: GraphIndex, nodes: list[int], output: str) -> Activation:
    """The pair's activation: sin over the widened layer, its nodes the Sin, the Cos and the Concat."""
    return Activation(ex.sin(), list(nodes), [ix.keys[j] for j in nodes], output)
