"""A pool over the rows behind a chain, taken into its fused op (PointNet's max over its points, Deep Sets'
sum over a set's elements, a global average pool over 1x1-conv features).

    ReduceMax(chain output [..., M, N], axes=[-2], keepdims=0) -> [..., N]       (spec.pool "max")
    ReduceMax(chain output [..., M, N], axes=[-2], keepdims=1) -> [..., 1, N]    ("maxk": fxia22's PointNet)
    ReduceSum / ReduceMean, the same                                             ("sum", "sumk", "mean", "meank")

A chain whose output only such a Reduce over its second-to-last axis reads (after passes/pointwise_conv.py,
PointNet's shared MLP over [B, N points, C] rows followed by its global max pool) writes the pooled
[..., N] directly: the widest tensor of such models (B x N x 1024) is never stored. The op's output is
then the Reduce's (spec.pool; the kernels raise or add into each group's entries, templates/o2f_pool.cuh).
Anything else (another axis, other readers, ReduceMin, a ReduceSum that does nothing for empty axes)
stays a stock op after the chain.
"""
from __future__ import annotations

from dataclasses import dataclass

from .constants import GraphIndex, written_axes
from .global_pools import pooled_only

POOL_REDUCES = {"ReduceMax": "max", "ReduceSum": "sum", "ReduceMean": "mean"}   # op -> spec.POOL_OPS
POOL_NODE = {kind: op for op, kind in POOL_REDUCES.items()}   # spec.POOL_OPS -> the op: "sum" -> "ReduceSum"


def describe_pool(kind: str) -> str:
    """What a chain takes in with pool `kind` (spec.POOLS), as reports say it."""
    op = kind.removesuffix("k")
    return f"the {POOL_NODE[op]} behind it ({op} over the rows, axis -2{', kept' if kind.endswith('k') else ''})"


@dataclass
class PoolMatch:
    node: int        # the Reduce
    output: str      # its output: the fused op's
    kind: str = "max"   # spec.POOLS: "max", "sum" or "mean", with "k" where keepdims=1


def match_pool(ix: GraphIndex, t: str) -> PoolMatch | str | None:
    """The ReduceMax / ReduceSum / ReduceMean over axis -2 of `t` that is t's only reader; a one-line reason
    where t's only reader is such a Reduce that does not qualify, or where several read it; None where no
    such Reduce reads it."""
    users = ix.users(t)
    if len(users) > 1 and pooled_only(ix, t, POOL_REDUCES):
        # (DGCNN's max and mean of one tensor: the op writes one pool, and the rows both need)
        return (f"{' and '.join(ix.describe(u) for u in users)}: {len(users)} pools of one output; the op takes "
                f"one pool only, so they stay stock ops")
    if len(users) != 1 or t in ix.graph_outputs:
        return None
    i = users[0]
    n = ix.node(i)
    if n.op_type not in POOL_REDUCES or n.domain not in ("", "ai.onnx") or n.input[0] != t:
        return None
    rank = ix.rank(t)
    if rank is None or rank < 3:
        return f"{ix.describe(i)}: the rank of '{t}' is {rank or 'unknown'}; a pool over rows needs [..., rows, features]"
    axes, known = written_axes(n, ix.const)
    if not known:
        return f"{ix.describe(i)}: its axes are computed at run time"
    if not axes and ix.attr(i, "noop_with_empty_axes", 0):
        return f"{ix.describe(i)}: no axes with noop_with_empty_axes=1 (an identity, not a pool)"
    if not axes or [a % rank for a in axes] != [rank - 2]:
        return f"{ix.describe(i)}: pools axes {axes if axes else 'all'}, not the rows' axis {rank - 2} alone"
    return PoolMatch(i, n.output[0], POOL_REDUCES[n.op_type] + ("k" if ix.attr(i, "keepdims", 1) else ""))
