"""A global pool of a 2-D or 3-D map behind a run of pointwise Convs, over the run's rows with the map's
positions flattened into one axis (for passes/pointwise_conv.py):

    Conv(k=1) ... -> ReduceMean(y [B, M, H, W], axes=[2, 3])       (AdaptiveAvgPool2d(1), x.mean((2, 3)))
      ->  Reshape(Transpose(x, [0, 2, 3, 1]), [B, H W, C]) -> MatMul ... -> ReduceMean(rows, axes=[1])
          (keepdims=1: -> Reshape to [B, M, 1, 1])

so that the pool is over the rows' axis -2 and passes/pool.py takes it into the fused op: a CNN head's 1x1
convs and its global average pool become one op that never writes the [B, M, H, W] map. The same values:
the reduction runs over the same elements (stock ORT on the rewritten model matches the original).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .constants import GraphIndex, node_reads
from .global_pools import axes_of, pooled_only


def pools_whole_map(ix: GraphIndex, y: str, rank: int) -> bool:
    """Whether every reduction reading channels-first `y` [B, C, *positions] (a pointwise run's output, of
    `rank`) pools all of its spatial axes and nothing else: a global pool of a 2-D or 3-D map."""
    if rank < 4 or not pooled_only(ix, y):
        return False
    return all(axes_of(ix, u, rank) == list(range(2, rank)) for u in ix.users(y))


def flatten_positions(ix: GraphIndex, g: onnx.GraphProto, x: str, rank: int, x_last: str, channels: int,
                      key: str, fresh) -> list[onnx.NodeProto]:
    """Nodes that reshape `x_last` [B, *positions, C] (channels-first `x` of `rank`, transposed) to
    [B, prod(positions), C] (the rows: their last node's output): one Reshape by a constant shape where the
    positions are static; else the shape computed from x's (Shape, Gather, ReduceProd, Concat: a -1 could not
    be inferred for an empty batch). `key` names the nodes (the run's first Conv), `fresh` makes unused
    tensor names."""
    x_dims = ix.shapes.get(x) or [None] * rank
    dims = x_dims[2:]
    shape, out = fresh(f"{x}_rows_shape"), fresh(f"{x}_rows")
    name = fresh(f"{key}_flatten_positions")
    if len(dims) == rank - 2 and all(isinstance(d, int) and d >= 1 for d in dims):
        g.initializer.append(numpy_helper.from_array(np.array([0, int(np.prod(dims)), channels], np.int64), shape))
        return [helper.make_node("Reshape", [x_last, shape], [out], name=name)]
    # the rows' shape as far as it is known, recorded: ONNX's shape inference gives a Reshape by a computed
    # shape none at all, and pool.py needs the rows' rank
    g.value_info.append(helper.make_tensor_value_info(out, ix.types[x], [x_dims[0], None, channels]))
    consts = {}
    for what, v in (("first", [0]), ("spatial", list(range(1, rank - 1))), ("channels", [channels])):
        consts[what] = fresh(f"{name}_{what}")
        g.initializer.append(numpy_helper.from_array(np.array(v, np.int64), consts[what]))
    full, batch, positions, count = (fresh(f"{name}_{t}") for t in ("shape", "batch", "positions", "count"))
    return [helper.make_node("Shape", [x_last], [full], name=fresh(f"{name}_shape")),
            helper.make_node("Gather", [full, consts["first"]], [batch], axis=0, name=fresh(f"{name}_batch")),
            helper.make_node("Gather", [full, consts["spatial"]], [positions], axis=0, name=fresh(f"{name}_positions")),
            helper.make_node("ReduceProd", [positions], [count], keepdims=1, name=fresh(f"{name}_count")),
            helper.make_node("Concat", [batch, count, consts["channels"]], [shape], axis=0,
                             name=fresh(f"{name}_concat")),
            helper.make_node("Reshape", [x_last, shape], [out], name=name)]


def pools_read_flat_rows(model: onnx.ModelProto, y: str, rows: str, channels: int, rank: int,
                          fresh) -> tuple[set[str], list[str]]:
    """The Reduce nodes reading `y` (a run's channels-first output, every spatial axis pooled: pools_whole_map)
    read its flattened channels-last rows [B, positions, channels] instead, over axis 1; keepdims=1 gives
    [B, 1, channels], reshaped to the original [B, channels, 1, ...]. Returns (the axes inputs replaced, the
    Reduce ops)."""
    g = model.graph
    ops = []
    old_axes = set()
    for n in [n for n in g.node if y in node_reads(n)]:   # all Reduces over the spatial axes (pools_whole_map)
        n.input[0] = rows
        if len(n.input) > 1 and n.input[1]:
            old_axes.add(n.input[1])
            name = fresh(f"{n.name or n.output[0]}_axes_rows")
            g.initializer.append(numpy_helper.from_array(np.array([1], dtype=np.int64), name))
            n.input[1] = name
        else:
            for a in n.attribute:
                if a.name == "axes":
                    del a.ints[:]
                    a.ints.append(1)
        ops.append(n.op_type)
        if next((a.i for a in n.attribute if a.name == "keepdims"), 1):
            pooled, shape = fresh(f"{n.output[0]}_rows"), fresh(f"{n.output[0]}_shape")
            g.initializer.append(numpy_helper.from_array(np.array([0, channels] + [1] * (rank - 2), np.int64), shape))
            reshape = helper.make_node("Reshape", [pooled, shape], [n.output[0]],
                                       name=fresh(f"{n.name or n.output[0]}_to_channels_first"))
            n.output[0] = pooled
            g.node.insert(list(g.node).index(n) + 1, reshape)
    return old_axes, list(dict.fromkeys(ops))
