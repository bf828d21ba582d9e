"""Two chains joined where the second one's first layer reads Concat(the first one's output, a piece of the
first one's input), the first one's output read nowhere else once both are fused: one chain, whose layer at
the join is a skip layer (spec.MLPSpec.skip) reading the input it shares.

NeRF, as nerf-pytorch writes it: x = [pts | views] is cut by a Split (or by Slices: x[..., :63]); the trunk
reads pts (and joins pts into its sixth layer: a skip); the view head reads Concat(feature_linear(h), views),
feature_linear folding into it (concat_fold.py) and the density head riding it (head_fold.py), so that the
trunk's output h is read only through that Concat. Joined, the chain reads x itself: its first layer's weight gets zero rows for the views'
columns, the trunk's skip layer reads [x padded, h] with the views' rows zero, and the view layer reads
[x padded, h] with the points' rows zero. The Split, the Concat and the two ops' traffic between them go
(h is 1 GB of fp32 at 2^20 rows, the Concat's output 1.13 GB).

Only chains without a norm, residual or input map, whose parts are not gated, where the second chain has no
skip of its own and the library did not refuse the join (skip_refused under `join_key` of the first chain's
key: no CUDA design plans the joined chain; the first chain keeps its own skips then, which the library
judges under its plain key).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..spec import SKIP_ALIGN, SKIP_LAYERS_MAX
from .constants import GraphIndex, default_opset
from .head_fold import input_parts
from .regroup import reads_removed
from .skip import MIN_OPSET


def join_key(key: int) -> int:
    """The key under which a library refuses the join of the chain keyed `key` with the one after it
    (library.skip_refusal; a chain's own skips are refused under `key` itself, node indices >= 0)."""
    return -1 - key


def piece_of(ix: GraphIndex, t: str) -> tuple[str, int, int] | None:
    """(the tensor, first column, columns) where `t` is a piece of a tensor's last axis: an output of a Split
    into pieces of known widths (torch.split), or a Slice with constant bounds and step 1 (x[..., a:b]);
    else None."""
    node = ix.producer.get(t)
    if node is not None and ix.node(node).op_type == "Slice":
        return _slice_piece(ix, node)
    if node is None or ix.node(node).op_type != "Split":
        return None
    n = ix.node(node)
    src = n.input[0]
    width = (ix.shapes.get(src) or [None])[-1]
    if not isinstance(width, int) or not ix.last_axis(src, ix.attr(node, "axis", 0)):
        return None
    sizes = ix.const(n.input[1]) if len(n.input) > 1 and n.input[1] else ix.attr(node, "split")
    if sizes is None:
        if width % len(n.output):
            return None
        sizes = [width // len(n.output)] * len(n.output)
    sizes = [int(v) for v in np.asarray(sizes).reshape(-1)]
    if len(sizes) != len(n.output) or sum(sizes) != width:
        return None
    k = list(n.output).index(t)
    return src, sum(sizes[:k]), sizes[k]


def _slice_piece(ix: GraphIndex, node: int) -> tuple[str, int, int] | None:
    """piece_of for a Slice: its bounds as inputs (opset >= 10) or attributes, one axis, the last."""
    n = ix.node(node)
    src = n.input[0]
    width = (ix.shapes.get(src) or [None])[-1]
    if not isinstance(width, int):
        return None
    if len(n.input) >= 3:
        bounds = [ix.const(n.input[i]) if len(n.input) > i and n.input[i] else None for i in range(1, 5)]
        if bounds[0] is None or bounds[1] is None or (len(n.input) > 3 and n.input[3] and bounds[2] is None):
            return None
        starts, ends, axes, steps = bounds
    else:
        starts, ends, axes, steps = ix.attr(node, "starts"), ix.attr(node, "ends"), ix.attr(node, "axes"), None
        if starts is None or ends is None:
            return None
    starts, ends = np.asarray(starts).reshape(-1), np.asarray(ends).reshape(-1)
    axes = np.asarray([0] if axes is None else axes, np.int64).reshape(-1)   # (omitted: the first axes)
    if len(starts) != 1 or len(ends) != 1 or len(axes) != 1 or not ix.last_axis(src, int(axes[0])):
        return None
    if steps is not None and np.asarray(steps).reshape(-1).tolist() != [1]:
        return None
    lo, hi = (int(v) + width if int(v) < 0 else min(int(v), width) for v in (starts[0], ends[0]))
    if not 0 <= lo < hi <= width:
        return None
    return src, lo, hi - lo


def _concat_parts(ix: GraphIndex, chain) -> tuple[int, list[tuple[str, int]]] | None:
    """(the Concat node, its inputs as (tensor, columns)) where the chain's first layer reads a last-axis
    Concat of two inputs (its Concat edit applied: a folded layer's input in its place); else None."""
    t = chain.input
    node = ix.producer.get(t)
    if node is None or ix.node(node).op_type != "Concat" or t in ix.graph_outputs:
        return None
    n = ix.node(node)
    if len(n.input) != 2 or n.input[0] == n.input[1]:
        return None
    edit, k = chain.concat_edit, chain.layers[0].linear.in_features
    replaced = None if edit is None else (edit.position, edit.tensor, (ix.shapes.get(edit.tensor) or [None])[-1])
    pieces = input_parts(ix, t, k, replaced)[1:]   # (none where the widths are unknown or do not add up)
    if len(pieces) != 2:
        return None
    (t0, o0), (t1, o1) = pieces
    parts = [(t0, o1 - o0), (t1, k - o1)]
    return (node, parts) if all(w >= 1 for _, w in parts) else None


def _x_rows(rows: np.ndarray, offset: int, k_x: int) -> np.ndarray:
    """A skip layer's x part for the chain's input of k_x columns: `rows` (a piece's rows) placed at the
    piece's first column, zeros elsewhere, padded to SKIP_ALIGN."""
    out = np.zeros((-(-k_x // SKIP_ALIGN) * SKIP_ALIGN, rows.shape[1]), np.float32)
    out[offset:offset + rows.shape[0]] = rows
    return out


def merge_skips(ix: GraphIndex, chains: list, skip_refused: Mapping[int, str] | None, key
                ) -> tuple[dict[int, int], dict[int, int], dict[int, str]]:
    """Join, in place, every pair of `chains` the module docstring describes (the second one dropped from the
    list, the first one widened). Returns ({old index: new index} (the second of a pair maps to its first's),
    {second's old index: first's old index}, {old index of a first chain whose join the library refused:
    why, as a note on where it ends}). `key(chain)`: the chain's block_key (library refusals)."""
    declined: dict[int, str] = {}
    if default_opset(ix.model, MIN_OPSET) < MIN_OPSET:
        return {i: i for i in range(len(chains))}, {}, declined
    by_output = {c.output: i for i, c in enumerate(chains)}
    gone: dict[int, int] = {}
    for ib, b in enumerate(chains):
        found = _concat_parts(ix, b) if not (b.norm or b.residual or b.input_map or b.skip) else None
        if found is None:
            continue
        concat, parts = found
        ia = next((by_output[t] for t, _ in parts if t in by_output), None)
        if ia is None or ia == ib or ia in gone or ib in gone:
            continue
        a = chains[ia]
        if (a.norm or a.residual or a.input_map or a.head or a.input_edit or a.pool or b.pool
                or any(l.gated for l in a.layers + b.layers)
                or a.input_dtype != b.input_dtype or len(a.layers) >= SKIP_LAYERS_MAX):
            continue
        if skip_refused and join_key(key(a)) in skip_refused:
            declined[ia] = (f"its output and a piece of its input feed {ix.describe(concat)} into the next chain, "
                            f"which stays apart: {skip_refused[join_key(key(a))]}")
            continue
        joined = _joined_input(ix, a, parts)
        if joined is None or (joined[0] == a.input and skip_refused and key(a) in skip_refused):
            continue   # (the second: a skip of a's own input that the library cut: skip.skip_cut says why)
        x, k_x, a_offset, other_offset, cutters = joined
        # a's output read only by b's nodes (the folded layer, a riding head) and the Concat, the Concat's
        # only by b's first layer
        inside = set(b.nodes) | {ix.keys[concat]}
        if (any(ix.keys[u] not in inside for u in ix.users(a.output)) or a.output in ix.graph_outputs
                or any(ix.keys[u] not in b.nodes for u in ix.users(b.input))):
            continue
        # the Split (or Slices) go with the chain where nothing else reads their pieces
        inside |= set(a.nodes) | {ix.keys[j] for j in cutters}
        extra = [ix.keys[j] for j in cutters
                 if not any(o in ix.graph_outputs or any(ix.keys[u] not in inside for u in ix.users(o))
                            for o in ix.node(j).output if o)]
        nodes = a.nodes + b.nodes + [ix.keys[concat]] + extra
        if reads_removed(ix, {ix.index_of[k] for k in nodes}, {b.output}) is not None:
            continue   # (what the checks above mean to rule out; the rewrite must not leave a reader behind)
        _lay_out(a, b, parts, k_x, a_offset, other_offset)
        a.skip = tuple(a.skip) + (len(a.layers),)
        a.layers = a.layers + b.layers
        a.nodes = nodes
        by_output.pop(a.output, None)
        a.input, a.output, a.head, a.joined = x, b.output, b.head, True
        by_output[a.output] = ia   # (a chain after it may join the joined one in turn)
        gone[ib] = ia
    kept = [i for i in range(len(chains)) if i not in gone]
    new = {old: k for k, old in enumerate(kept)}
    mapping = {i: new[i] if i in new else new[gone[i]] for i in range(len(chains))}
    chains[:] = [chains[i] for i in kept]
    return mapping, gone, declined


def _joined_input(ix: GraphIndex, a, parts: list[tuple[str, int]]):
    """(x, its columns, a's input's first column in x, the other piece's first column in x, the nodes that
    cut the pieces (a Split, Slices)) where the Concat's other piece and a's input are both x or pieces of x
    (piece_of); else None."""
    other = next(t for t, _ in parts if t != a.output)
    if other == a.input:
        k = a.layers[0].linear.in_features
        return a.input, k, 0, 0, []
    po, pa = piece_of(ix, other), piece_of(ix, a.input)
    if po is None:
        return None
    x, o_off, _ = po
    if pa is not None and pa[0] == x:
        a_off = pa[1]
    elif a.input == x:
        a_off = 0
    else:
        return None
    k_x = (ix.shapes.get(x) or [None])[-1]
    if ix.types.get(x) != ix.types.get(a.input):
        return None
    cutters = {ix.producer[other]} | ({ix.producer[a.input]} if pa is not None else set())
    return x, k_x, a_off, o_off, sorted(cutters)


def _lay_out(a, b, parts, k_x: int, a_offset: int, other_offset: int) -> None:
    """The weights of a's first layer, a's skip layers and b's first layer for the joined chain reading x."""
    first = a.layers[0].linear
    k_a = first.in_features
    if k_x != k_a or a_offset:
        w = np.zeros((k_x, first.out_features), np.float32)
        w[a_offset:a_offset + k_a] = first.weight
        first.weight = w
    pad_a = -(-k_a // SKIP_ALIGN) * SKIP_ALIGN
    for j in a.skip:   # [a's input padded, h] -> [x padded, h]
        lin = a.layers[j].linear
        lin.weight = np.ascontiguousarray(np.concatenate([_x_rows(lin.weight[:k_a], a_offset, k_x),
                                                          lin.weight[pad_a:]]))
    lin = b.layers[0].linear   # its rows over the Concat's parts: the other piece's, then h's (either order)
    rows, at = {}, 0
    for t, w in parts:
        rows[t == a.output] = lin.weight[at:at + w]
        at += w
    lin.weight = np.ascontiguousarray(np.concatenate([_x_rows(rows[False], other_offset, k_x), rows[True]]))
