"""Pointwise convolutions as linear layers over channels-last rows.

A Conv whose kernel is 1 in every spatial dimension, with stride 1, no padding and one group, is a linear
layer applied to each position's channel vector: PointNet's shared MLP (Conv1d(k=1) on [B, C, N]), 1x1
Conv2d heads on feature maps. Its tensors are channels-first, where one position's channels (a row of the
fused op) are not contiguous. Each run of such Convs, joined through activations (elementwise nodes whose
other inputs are one-element constants), is rewritten over channels-last rows:

    Conv(x, W [M, C, 1...], b) -> act -> Conv(., W2, b2) ...
      ->  Transpose(x, [0, 2.., 1]) -> MatMul(W^T) -> Add(b) -> act -> MatMul(W2^T) -> Add(b2) ...
          -> Transpose(., [0, r-1, 1..r-2])

so that find_chains sees an ordinary chain on [B, *positions, C]. A lone Conv (ResNet's and MobileNet's
1x1 Convs between 3x3 ones) stays a Conv unless a pool reads it: cuDNN runs one layer as well as a fused op
would, and the Transposes would cost more than they save. The Transpose behind moves past the
reductions over positions that read it (PointNet's max pool, a global average pool):

    ReduceMax(Transpose(y, p), axes A)  ->  ReduceMax(y, axes p[A])     (keepdims=0, kept axes in order)
                                        ->  Transpose(ReduceMax(y, p[A], keepdims=1), p)   (keepdims=1)

so the widest tensor is never transposed (global pools count as the Reduce they are: global_pools.py); a
pool over one spatial axis (PointNet++'s max over each centre's samples, [B, C, samples, centres]) puts that
axis last among the rows' axes, so that its rows lie together and pool.py takes the pool into the fused
op. A global pool over every spatial axis of a 2-D or 3-D map (a CNN head's 1x1 convs before
`AdaptiveAvgPool2d(1)` or `x.mean((2, 3))`) reads the rows with those axes flattened into one, [B, H W, C]
(a Reshape after the Transpose in front, by a constant shape where the map's size is static, else one
computed from x's; the pool over axis 1, and for keepdims a Reshape of the small [B, 1, M] to
[B, M, 1, 1]; map_pools.py), so that pool.py takes it into the op too. The math is the same products and sums (a Conv of kernel 1 is that matrix product); validation compares
the fused model with the original file as always.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .activations import ELEMENTWISE_OPS, match_activation
from .constants import GraphIndex, node_reads, written_axes
from .global_pools import REDUCE_POOLS, axes_of, global_pools_as_reduces, pooled_only
from .map_pools import flatten_positions, pools_read_flat_rows, pools_whole_map

# activations that move to channels-last: elementwise, with no axis of their own (BatchNormalization and
# PRelu have per-channel parameters on axis 1)
_REGION_OPS = ELEMENTWISE_OPS - {"BatchNormalization", "PRelu"}
_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


@dataclass
class ConvRun:
    """Pointwise Convs joined through activations: convs[k]'s output feeds regions[k] (node indices, may
    be empty), whose last tensor feeds convs[k + 1]; the last region's last tensor is the run's output."""
    convs: list[int]
    regions: list[list[int]]
    input: str
    output: str
    rank: int
    weights: list[tuple[np.ndarray, np.ndarray | None]] = field(repr=False)   # W [C, M], b [M] per conv

    def describe(self, ix: GraphIndex, pools: list[str], flat: bool = False) -> str:
        """`pools`: the Reduce ops that read the run's channels-last output in place of a Transpose back;
        `flat`: over its positions flattened into one axis (map_pools.py)."""
        widths = [self.weights[0][0].shape[0]] + [w.shape[1] for w, _ in self.weights]
        kind = {3: "Conv1d", 4: "Conv2d", 5: "Conv3d"}.get(self.rank, f"rank-{self.rank} Conv")
        behind = (f"{' and '.join(pools)} over the channels-last rows" if pools else "a Transpose back")
        return (f"{len(self.convs)} pointwise {kind} ({ix.describe(self.convs[0])}"
                f"{' ...' if len(self.convs) > 1 else ''}; {' -> '.join(map(str, widths))} channels) as MatMuls "
                f"over channels-last rows{', the positions flattened into one axis' if flat else ''}: "
                f"a Transpose in front, {behind}")


def _ints(ix: GraphIndex, i: int, name: str, default: int, n: int) -> list[int]:
    v = ix.attr(i, name)
    return [default] * n if v is None else [int(a) for a in v]


def pointwise_weight(ix: GraphIndex, i: int) -> tuple[np.ndarray, np.ndarray | None] | str | None:
    """(W [C, M] float32, b [M] float32 or None) of Conv node i when it is a per-position linear layer;
    a one-line reason when it has a kernel of 1 but is not; None for any other node."""
    n = ix.node(i)
    if n.op_type != "Conv" or n.domain not in ("", "ai.onnx") or len(n.input) < 2:
        return None
    w = ix.const(n.input[1])
    if w is None or w.ndim < 3 or any(d != 1 for d in w.shape[2:]):
        return None   # a real convolution (or weights computed at run time): not a layer here
    spatial = w.ndim - 2
    what = f"{ix.describe(i)} (kernel 1)"
    if int(ix.attr(i, "group", 1)) != 1:
        return f"{what}: {ix.attr(i, 'group')} groups, not one linear layer over the channels"
    strides = _ints(ix, i, "strides", 1, spatial)
    if any(s != 1 for s in strides):
        return f"{what}: strides {strides} skip positions"
    pads = _ints(ix, i, "pads", 0, 2 * spatial)
    auto_pad = ix.attr(i, "auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else str(auto_pad)
    if any(pads) and auto_pad == "NOTSET":
        return f"{what}: pads {pads} add positions"
    if ix.types.get(n.input[0]) not in _FLOAT_TYPES or str(w.dtype) not in ("float32", "float16"):
        return f"{what}: only float32/float16 tensors are fused"
    b = None
    if len(n.input) > 2 and n.input[2]:
        b = ix.const(n.input[2])
        if b is None:
            return f"{what}: its bias '{n.input[2]}' is computed at run time"
        b = b.reshape(-1).astype(np.float32)
    return np.ascontiguousarray(w.reshape(w.shape[0], w.shape[1]).T.astype(np.float32)), b


def _region(ix: GraphIndex, t: str) -> tuple[list[int], str]:
    """The activation applied to channels-first tensor t that can move to channels-last: (its nodes,
    its last tensor); ([], t) where t feeds none (or one with per-channel constants, shape reads, other
    readers of its inner tensors)."""
    act = match_activation(ix, t, width=0)
    nodes = sorted(act.node_indices)
    if not nodes:
        return [], t
    inner = {t} | {o for i in nodes for o in ix.node(i).output if o}
    for i in nodes:
        n = ix.node(i)
        if n.op_type not in _REGION_OPS or n.domain not in ("", "ai.onnx"):
            return [], t
        for x in n.input:
            if x and x not in inner and (ix.const(x) is None or ix.const(x).size != 1):
                return [], t
    for u in inner - {act.output}:
        if u in ix.graph_outputs or any(j not in nodes for j in ix.users(u)):
            return [], t
    return nodes, act.output


def find_conv_runs(ix: GraphIndex) -> tuple[list[ConvRun], list[tuple[int, str]]]:
    """The runs of pointwise Convs, and (node, reason) for the Convs of kernel 1 that are not pointwise."""
    weights: dict[int, tuple] = {}
    refused: list[tuple[int, str]] = []
    for i in range(len(ix.graph.node)):
        w = pointwise_weight(ix, i)
        if isinstance(w, str):
            refused.append((i, w))
        elif w is not None:
            weights[i] = w
    runs, taken = [], set()
    for i in sorted(weights):
        if i in taken:
            continue
        convs, regions = [i], []
        while True:
            nodes, end = _region(ix, ix.node(convs[-1]).output[0])
            regions.append(nodes)
            users = ix.users(end)
            nxt = users[0] if len(users) == 1 else None
            if (nxt is None or nxt not in weights or nxt in taken or end in ix.graph_outputs
                    or ix.node(nxt).input[0] != end
                    or weights[nxt][0].shape[0] != weights[convs[-1]][0].shape[1]):
                break
            convs.append(nxt)
        taken.update(convs)
        if len(convs) == 1 and not pooled_only(ix, end):
            continue   # a lone 1x1 Conv (ResNet's, MobileNet's): cuDNN runs it as well as a fused op would
        x = ix.node(i).input[0]
        rank = ix.rank(x) or ix.const(ix.node(i).input[1]).ndim
        runs.append(ConvRun(convs, regions, x, end, rank, [weights[c] for c in convs]))
    return runs, refused


def _pooled_axis(ix: GraphIndex, t: str, rank: int) -> int | None:
    """The one spatial axis of channels-first t that every reduction reading it pools (PointNet++'s max over
    the samples of [B, C, samples, centres]), or None."""
    if not pooled_only(ix, t):
        return None
    found = set()
    for u in ix.users(t):
        axes = axes_of(ix, u, rank)
        if axes is None:
            return None
        found |= set(axes)
    return found.pop() if len(found) == 1 and min(found) >= 2 else None


def _perms(rank: int, last: int | None = None) -> tuple[list[int], list[int]]:
    """(channels-first -> channels-last, and back); `last`: the spatial axis to put right before the
    channels (a pooled axis: its rows then lie together, as the fused pool wants them, pool.py)."""
    spatial = [a for a in range(2, rank) if a != last] + ([last] if last is not None else [])
    to_last = [0] + spatial + [1]
    return to_last, [to_last.index(j) for j in range(rank)]


class _Names:
    def __init__(self, g: onnx.GraphProto):
        self.taken = {i.name for i in g.input} | {o.name for o in g.output} | {t.name for t in g.initializer}
        for n in g.node:
            self.taken.update(n.input)
            self.taken.update(n.output)
            self.taken |= node_reads(n)
            self.taken.add(n.name)

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name


@dataclass
class ChannelsLast:
    """What as_channels_last did: the model (the input itself when nothing changed), the runs rewritten
    (reports' "stock op rewritten") and the Convs of kernel 1 left alone, with why."""
    model: onnx.ModelProto
    rewritten: list[str] = field(default_factory=list)
    refusals: list[tuple[str, str]] = field(default_factory=list)   # (node key, reason)


def as_channels_last(model: onnx.ModelProto) -> ChannelsLast:
    """`model` with its pointwise Conv runs as MatMul chains over channels-last rows (module docstring)."""
    if not any(n.op_type == "Conv" for n in model.graph.node):
        return ChannelsLast(model)
    original = model
    pooled = global_pools_as_reduces(model)
    if pooled is not None:   # the global pools as Reduces only where they read a run (a CNN keeps the others)
        outputs = {r.output for r in find_conv_runs(GraphIndex(pooled))[0]}
        pooled = global_pools_as_reduces(model, outputs) if outputs else None
    model = pooled or model
    ix = GraphIndex(model)
    runs, refused = find_conv_runs(ix)
    res = ChannelsLast(original, refusals=[(ix.keys[i], r) for i, r in refused])
    if not runs:
        return res
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    fresh = _Names(g)
    before: dict[int, list[onnx.NodeProto]] = {}
    after: dict[int, list[onnx.NodeProto]] = {}
    replace: dict[int, list[onnx.NodeProto]] = {}
    # per run: its Transpose back and the permutation, or (flattened positions) its rows' tensor and None
    backs: list[tuple[onnx.NodeProto | str, list[int] | None]] = []
    for r in runs:
        to_last, back = _perms(r.rank, _pooled_axis(ix, r.output, r.rank))
        rename = {r.input: fresh(f"{r.input}_channels_last")}
        before[r.convs[0]] = [helper.make_node("Transpose", [r.input], [rename[r.input]], perm=to_last,
                                               name=fresh(f"{ix.keys[r.convs[0]]}_to_channels_last"))]
        flat = pools_whole_map(ix, r.output, r.rank)   # the rows' positions flattened into one axis (map_pools.py)
        if flat:   # [B, *positions, C] -> [B, prod(positions), C]
            before[r.convs[0]] += flatten_positions(ix, g, r.input, r.rank, rename[r.input], r.weights[0][0].shape[0],
                                                    ix.keys[r.convs[0]], fresh)
            rename[r.input] = before[r.convs[0]][-1].output[0]
        for c, region, (w, b) in zip(r.convs, r.regions, r.weights):
            conv = ix.node(c)
            dtype = ix.const(conv.input[1]).dtype
            y = conv.output[0]
            rename[y] = fresh(f"{y}_channels_last")
            w_name = fresh(f"{ix.keys[c]}_weight_t")
            g.initializer.append(numpy_helper.from_array(w.astype(dtype), w_name))
            src = rename[conv.input[0]]
            if b is None:
                replace[c] = [helper.make_node("MatMul", [src, w_name], [rename[y]], name=fresh(f"{ix.keys[c]}_matmul"))]
            else:
                b_name, prod = fresh(f"{ix.keys[c]}_bias"), fresh(f"{y}_product")
                g.initializer.append(numpy_helper.from_array(b.astype(dtype), b_name))
                replace[c] = [helper.make_node("MatMul", [src, w_name], [prod], name=fresh(f"{ix.keys[c]}_matmul")),
                              helper.make_node("Add", [prod, b_name], [rename[y]], name=fresh(f"{ix.keys[c]}_bias_add"))]
            for i in region:
                n = onnx.NodeProto()
                n.CopyFrom(ix.node(i))
                for k, o in enumerate(n.output):
                    if o:
                        rename[o] = fresh(f"{o}_channels_last")
                        n.output[k] = rename[o]
                for k, x in enumerate(n.input):
                    n.input[k] = rename.get(x, x)
                replace[i] = [n]
        last = max(r.convs + [i for reg in r.regions for i in reg])
        if flat:
            backs.append((rename[r.output], None))   # (its pools read the flattened rows: pools_read_flat_rows)
            continue
        t_back = helper.make_node("Transpose", [rename[r.output]], [r.output], perm=back,
                                  name=fresh(f"{ix.keys[r.convs[-1]]}_to_channels_first"))
        after[last] = [t_back]
        backs.append((t_back, back))
    nodes = []
    for i, n in enumerate(model.graph.node):
        nodes.extend(before.get(i, []))
        nodes.extend(replace.get(i, [n]))
        nodes.extend(after.get(i, []))
    del g.node[:]
    g.node.extend(nodes)
    replaced = {x for r in runs for c in r.convs for x in ix.node(c).input[1:]}
    for r, (t_back, back) in zip(runs, backs):
        if back is None:
            old_axes, pools = pools_read_flat_rows(out, r.output, t_back, r.weights[-1][0].shape[1], r.rank, fresh)
            replaced |= old_axes
            res.rewritten.append(r.describe(ix, pools, flat=True))
            continue
        old_axes, pools = _pools_read_channels_last(out, t_back, back, fresh)
        if not pools and _transposes_compose(out, t_back, back):
            pools = ["the Transpose after it"]
        replaced |= old_axes
        res.rewritten.append(r.describe(ix, pools))
    _drop_unread(out, replaced)
    try:
        out = onnx.shape_inference.infer_shapes(out, strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - types are inferred again where needed (GraphIndex)
        pass
    res.model = out
    return res


def _pool_axes(node: onnx.NodeProto, inits: dict) -> tuple[list[int] | None, bool]:
    """(the reduced axes, None for all of them; whether they are an input) of a Reduce node, or
    ([], False) when they are not known constants (written_axes)."""
    axes, known = written_axes(node, lambda t: numpy_helper.to_array(inits[t]) if t in inits else None)
    if not known:
        return [], False
    return axes, len(node.input) > 1 and bool(node.input[1])


def _transposes_compose(model: onnx.ModelProto, t_back: onnx.NodeProto, back: list[int]) -> bool:
    """Where only Transposes read t_back's output (a segmentation head's conv(x).transpose(2, 1)), each reads
    the channels-last rows with the composed permutation, `c[j] = back[p[j]]`, and t_back goes; a composition
    that is the identity leaves no Transpose at all (its readers read the rows). Whether it did."""
    g = model.graph
    y, y_last = t_back.output[0], t_back.input[0]
    outputs = {o.name for o in g.output}
    users = [n for n in g.node if y in node_reads(n)]
    if y in outputs or not users or any(n.op_type != "Transpose" or n.domain not in ("", "ai.onnx") for n in users):
        return False
    for n in users:
        p = next((list(a.ints) for a in n.attribute if a.name == "perm"), None)
        if p is None:
            p = list(reversed(range(len(back))))
        c = [back[j] for j in p]
        if c == list(range(len(c))) and n.output[0] not in outputs:
            for m in g.node:   # the identity: its readers read the rows
                m.input[:] = [y_last if x == n.output[0] else x for x in m.input]
            g.node.remove(n)
            continue
        n.input[0] = y_last
        for a in n.attribute:
            if a.name == "perm":
                del a.ints[:]
                a.ints.extend(c)
        if not any(a.name == "perm" for a in n.attribute):
            n.attribute.append(helper.make_attribute("perm", c))
    g.node.remove(t_back)
    return True


def _pools_read_channels_last(model: onnx.ModelProto, t_back: onnx.NodeProto, back: list[int],
                              fresh) -> tuple[set[str], list[str]]:
    """Where only Reduce nodes read t_back's output, they read its channels-last input instead, their axes
    mapped through `back`, and t_back goes. Returns (the axes inputs replaced, the Reduce ops)."""
    g = model.graph
    y, y_last = t_back.output[0], t_back.input[0]
    if y in {o.name for o in g.output}:
        return set(), []
    users = [n for n in g.node if y in node_reads(n)]
    inits = {t.name: t for t in g.initializer}
    rank = len(back)
    plans = []
    for n in users:
        if n.op_type not in REDUCE_POOLS or n.domain not in ("", "ai.onnx") or n.input[0] != y:
            return set(), []
        axes, as_input = _pool_axes(n, inits)
        if axes == []:
            return set(), []
        keep = next((a.i for a in n.attribute if a.name == "keepdims"), 1)
        noop = next((a.i for a in n.attribute if a.name == "noop_with_empty_axes"), 0)
        if axes is None and noop:
            return set(), []
        plans.append((n, axes, as_input, keep))
    old_axes = set()
    for n, axes, as_input, keep in plans:
        n.input[0] = y_last
        if axes is None:
            continue   # every axis: the same result in any layout
        reduced = sorted({a % rank for a in axes})
        mapped = sorted(back[a] for a in reduced)
        kept = [back[a] for a in range(rank) if a not in reduced]
        if as_input:
            old_axes.add(n.input[1])
            name = fresh(f"{n.name or n.output[0]}_axes_channels_last")
            g.initializer.append(numpy_helper.from_array(np.array(mapped, dtype=np.int64), name))
            n.input[1] = name
        else:
            for a in n.attribute:
                if a.name == "axes":
                    del a.ints[:]
                    a.ints.extend(mapped)
        if keep == 0 and kept == sorted(kept):
            continue
        # the kept axes come out in channels-last order: a Transpose of the (small) pooled tensor restores it
        pooled = fresh(f"{n.output[0]}_channels_last")
        perm = back if keep else [sorted(kept).index(a) for a in kept]
        transpose = helper.make_node("Transpose", [pooled], [n.output[0]], perm=perm,
                                     name=fresh(f"{n.name or n.output[0]}_to_channels_first"))
        n.output[0] = pooled
        at = list(g.node).index(n)
        g.node.insert(at + 1, transpose)
    g.node.remove(t_back)
    return old_axes, list(dict.fromkeys(n.op_type for n, *_ in plans))


def _drop_unread(model: onnx.ModelProto, replaced: set[str]) -> None:
    """Remove the replaced Convs' weights and biases (`replaced`) where nothing reads them now, and the
    value_info entries of tensors that are gone."""
    g = model.graph
    used = {x for n in g.node for x in node_reads(n)} | {o.name for o in g.output} | {i.name for i in g.input}
    produced = {o for n in g.node for o in n.output}
    keep = [t for t in g.initializer if t.name in used or t.name not in replaced]
    del g.initializer[:]
    g.initializer.extend(keep)
    infos = [v for v in g.value_info if v.name in used | produced]
    del g.value_info[:]
    g.value_info.extend(infos)
