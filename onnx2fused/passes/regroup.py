"""Reshapes that only regroup rows, and the nodes that compute their shapes.

A Reshape whose input and output both end in the same N features keeps every element where it was in
row-major order: it changes how the rows are grouped ([B*T, N] <-> [B, T, N]), never a row. HF's
Conv1D (GPT-2's MLP) writes each linear layer that way,

    x.view(-1, x.size(-1)) -> addmm -> .view(x.size()[:-1] + (n,))

so its activations run between two such Reshapes and a transformer block's norm and residual sit
outside them. The activation walk (activations.py) takes the Reshapes inside an activation; here are
the ones at a chain's ends (`regroup_ends`): with them a chain reads the block's [B, T, K0] input and
writes [B, T, N], so its norm in front and residual behind can join it (block.py).

The exporters compute such a Reshape's shape in the graph (Shape -> Gather / Slice -> Unsqueeze ->
Concat); `shape_feeders` names the nodes that compute nothing else, which go with the fused node, since
a Shape among them may read a tensor the fused node removes. `reads_removed` checks that nothing left
behind reads one.
"""
from __future__ import annotations

from dataclasses import dataclass

from .constants import GraphIndex


def _is_reshape(ix: GraphIndex, i: int) -> bool:
    n = ix.node(i)
    return n.op_type == "Reshape" and n.domain in ("", "ai.onnx") and len(n.input) > 1


def ends_in(ix: GraphIndex, t: str, width: int | None) -> bool:
    """Whether t's inferred shape is known to end in `width` features."""
    s = ix.shapes.get(t)
    return width is not None and bool(s) and s[-1] == width


def shape_feeders(ix: GraphIndex, nodes: set[int]) -> set[int]:
    """The nodes outside `nodes` that compute nothing but the shape inputs of its Reshapes (and each
    other's inputs): a node of them whose output anything else reads, or that is a graph output, is
    not one."""
    slots = {ix.node(i).input[1] for i in nodes if _is_reshape(ix, i) and ix.node(i).input[1]}
    found: set[int] = set()
    seen: set[int] = set()
    stack = [ix.producer[s] for s in slots if s in ix.producer]
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        if p not in nodes:
            found.add(p)
        if ix.node(p).op_type not in ("Shape", "Size"):   # (what a Shape reads is data, not a shape)
            stack.extend(ix.producer[n] for n in ix.node(p).input if n in ix.producer)

    def feeds_only_shapes(p: int) -> bool:
        for o in ix.node(p).output:
            if not o:
                continue
            if o in ix.graph_outputs:
                return False
            # (a reader in `nodes` reads it as a shape: the nodes of an activation read only its own
            # tensors and constants as data)
            if any(j not in found and j not in nodes for j in ix.users(o)):
                return False
        return True

    while True:
        drop = {p for p in found if not feeds_only_shapes(p)}
        if not drop:
            return found
        found -= drop


# What a shape computation does between a Shape and the Reshape it feeds.
_SHAPE_ARITHMETIC = ("Gather", "Slice", "Squeeze", "Unsqueeze", "Concat", "Cast", "Identity", "Add", "Sub", "Mul",
                     "Div", "ReduceProd")


def shape_reader(ix: GraphIndex, i: int) -> bool:
    """Whether node i is a Shape (it reads no values) whose outputs, through shape arithmetic only, end as
    Reshape shapes and nowhere else."""
    if ix.node(i).op_type != "Shape":
        return False
    stack, seen = [i], set()
    while stack:
        j = stack.pop()
        if j in seen:
            continue
        seen.add(j)
        for o in ix.node(j).output:
            if o in ix.graph_outputs:
                return False
            for u in ix.users(o):
                n = ix.node(u)
                if _is_reshape(ix, u) and o not in n.input[:1]:
                    continue
                if n.op_type not in _SHAPE_ARITHMETIC or n.domain not in ("", "ai.onnx"):
                    return False
                stack.append(u)
    return True


def reads_removed(ix: GraphIndex, removed: set[int], kept_outputs: set[str]) -> str | None:
    """A node left in the graph (or a graph output) that reads a tensor the removed nodes produce, other
    than `kept_outputs` (the fused node writes those), described; None when there is none."""
    gone = {o for i in removed for o in ix.node(i).output if o} - kept_outputs
    for t in sorted(gone):
        if t in ix.graph_outputs:
            return f"'{t}' is a graph output"
        readers = [j for j in ix.users(t) if j not in removed]
        if readers:
            return f"{ix.describe(readers[0])} reads '{t}'"
    return None


@dataclass
class RegroupEnds:
    input: str               # the tensor of rows the chain can read instead of its first layer's input
    output: str              # the tensor its last layer's rows become, of the input's leading shape
    node_indices: list[int]  # the two Reshapes


def regroup_ends(ix: GraphIndex, first_input: str, entries: set[int], out: str, k0: int,
                 n_last: int) -> RegroupEnds | None:
    """A chain between two row-regrouping Reshapes: its first layer reads Reshape(src) ([R, K0] of src's
    [..., K0]) and nothing else reads that, and its output's only reader is a Reshape to src's leading
    shape and N_last features. None otherwise."""
    p = ix.producer.get(first_input)
    users = ix.users(out)
    if (p is None or not _is_reshape(ix, p) or first_input in ix.graph_outputs
            or set(ix.users(first_input)) != set(entries) or out in ix.graph_outputs or len(users) != 1):
        return None
    q = users[0]
    if not _is_reshape(ix, q) or ix.node(q).input[0] != out:
        return None
    src, back = ix.node(p).input[0], ix.node(q).output[0]
    if not (ends_in(ix, src, k0) and ends_in(ix, first_input, k0) and ix.rank(first_input) == 2
            and ends_in(ix, back, n_last)):
        return None
    lead, back_lead = ix.shapes[src][:-1], ix.shapes[back][:-1]
    if not lead or lead != back_lead or any(d in (None, "") for d in lead):
        return None
    return RegroupEnds(src, back, [p, q])


__all__ = ["RegroupEnds", "ends_in", "reads_removed", "regroup_ends", "shape_feeders", "shape_reader"]
