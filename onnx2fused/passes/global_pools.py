"""Global pools as the Reduce they are, so that passes/pointwise_conv.py can move them to channels-last rows
(and passes/pool.py take a max into the fused op):

    GlobalMaxPool(x) / GlobalAveragePool(x)          -> ReduceMax / ReduceMean(x, spatial axes, keepdims=1)
    MaxPool(x, kernel = x's whole static length)     -> ReduceMax(x, spatial axes, keepdims=1)
                                                        (TorchScript's AdaptiveMaxPool1d(1), MaxPool1d(num_points))
    Squeeze(ReduceMax(Unsqueeze(x, a), axes A + a, keepdims=1), a) -> ReduceMax(x, A, keepdims=1)
                                                        (the dynamo exporter's AdaptiveMaxPool1d(1))

The same values and shapes: stock ORT on the result matches the original exactly.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .constants import GraphIndex, default_opset, written_axes


_GLOBAL_POOLS = {"GlobalMaxPool": "ReduceMax", "GlobalAveragePool": "ReduceMean", "MaxPool": "ReduceMax"}
REDUCE_POOLS = ("ReduceMax", "ReduceMin", "ReduceMean", "ReduceSum")   # what counts as a pool reading a run


def pooled_only(ix: GraphIndex, t: str, ops=REDUCE_POOLS) -> bool:
    """Whether reductions (`ops`, default REDUCE_POOLS: a global pool) are all that read tensor t, as their
    data input, and t is no graph output."""
    users = ix.users(t)
    return bool(users) and t not in ix.graph_outputs and all(
        ix.node(u).op_type in ops and ix.node(u).input[0] == t for u in users)


def axes_of(ix: GraphIndex, i: int, rank: int | None) -> list[int] | None:
    """The axes node i names (written_axes), normalised for a tensor of `rank`; None where it names none or
    they are not known."""
    axes, known = written_axes(ix.node(i), ix.const)
    if not known or axes is None or rank is None:
        return None
    return sorted({a % rank for a in axes})


def _unsqueezed_max(ix: GraphIndex, i: int) -> tuple[int, int, list[int]] | None:
    """Unsqueeze(t, a) -> ReduceMax(axes including a, keepdims=1) -> Squeeze(a), as the dynamo exporter
    writes AdaptiveMaxPool1d(1): (the ReduceMax, the Squeeze, t's own reduced axes), else None."""
    n = ix.node(i)
    r = ix.rank(n.input[0])
    users = ix.users(n.output[0])
    if n.op_type != "Unsqueeze" or r is None or len(users) != 1 or n.output[0] in ix.graph_outputs:
        return None
    added = axes_of(ix, i, r + 1)
    red = users[0]
    if added is None or len(added) != 1 or ix.node(red).op_type != "ReduceMax" or not ix.attr(red, "keepdims", 1):
        return None
    reduced = axes_of(ix, red, r + 1)
    sq = ix.users(ix.node(red).output[0])
    if (reduced is None or added[0] not in reduced or len(sq) != 1 or ix.node(sq[0]).op_type != "Squeeze"
            or axes_of(ix, sq[0], r + 1) != added or ix.node(red).output[0] in ix.graph_outputs):
        return None
    a = added[0]
    return red, sq[0], [b if b < a else b - 1 for b in reduced if b != a]


def global_pools_as_reduces(model: onnx.ModelProto, reading: set[str] | None = None) -> onnx.ModelProto | None:
    """A copy of `model` with its global pools as the Reduce they are, or None where it has none:
    GlobalMaxPool / GlobalAveragePool over every spatial axis, a MaxPool whose kernel covers the whole of
    its input's static spatial dims (torch's TorchScript export of AdaptiveMaxPool1d(1) and of PointNet's
    MaxPool1d(num_points)): ReduceMax / ReduceMean over those axes, keepdims=1, the same values and shape;
    and the dynamo export of AdaptiveMaxPool1d(1), Unsqueeze -> ReduceMax -> Squeeze, as one ReduceMax.
    `reading`: only the pools of these tensors (the pointwise runs' outputs; a CNN's other pools stay)."""
    ix = GraphIndex(model)
    found: dict[int, tuple[str, list[int], str, str]] = {}   # node -> (op, axes, input, output)
    drop: set[int] = set()
    for i, n in enumerate(model.graph.node):
        if n.domain not in ("", "ai.onnx") or not n.input or (reading is not None and n.input[0] not in reading):
            continue
        triple = _unsqueezed_max(ix, i)
        if triple is not None:
            red, sq, axes = triple
            found[red] = ("ReduceMax", axes, n.input[0], ix.node(sq).output[0])
            drop |= {i, sq}
            continue
        rank = ix.rank(n.input[0])
        if n.op_type not in _GLOBAL_POOLS or rank is None or rank < 3:
            continue
        if n.op_type == "MaxPool":
            dims = ix.shapes.get(n.input[0]) or []
            if (len([o for o in n.output if o]) != 1 or list(ix.attr(i, "kernel_shape") or []) != dims[2:]
                    or any(isinstance(d, str) or d is None for d in dims[2:]) or any(ix.attr(i, "pads") or [])
                    or any(d != 1 for d in (ix.attr(i, "dilations") or [])) or ix.attr(i, "auto_pad", b"NOTSET")
                    not in (b"NOTSET", "NOTSET", b"VALID", "VALID")):
                continue
        found[i] = (_GLOBAL_POOLS[n.op_type], list(range(2, rank)), n.input[0], n.output[0])
    if not found:
        return None
    out = onnx.ModelProto()
    out.CopyFrom(model)
    as_input = default_opset(model) >= 18
    nodes = []
    for i, n in enumerate(out.graph.node):
        if i in drop:
            continue
        if i in found:
            op, axes, x, y = found[i]
            ins = [x]
            if as_input:
                ins.append(f"{y}_pool_axes")
                out.graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), ins[1]))
            attrs = {"keepdims": 1} | ({} if as_input else {"axes": axes})
            n = helper.make_node(op, ins, [y], name=n.name, **attrs)
        nodes.append(n)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out
