"""Find maximal MLP chains: x -> f_1(x W_1 + b_1) -> f_2(. W_2 + b_2) -> ... -> y.

A layer L_i (see `linear`) with activation f_i (see `activations`) continues into L_{i+1} when the
activation's output t_i

    has exactly one consumer, which is the first node of L_{i+1}, reading t_i as its input;
    is not a graph output;
    has the width L_{i+1} expects (N_i == K_{i+1}).

Otherwise the chain ends at t_i. A chain of one layer is still a chain. Every Gemm/MatMul that ends up
in no chain, and every chain end that stopped something fusable, gets a one-line `Refusal`: a second
consumer, a graph output, a width mismatch, an elementwise op that cannot join the activation, and any
op at all (LayerNormalization, Split, Softmax, ...) where another Gemm/MatMul follows, so that every
split of what could have been one chain says why. A chain that ends in the graph's tail (a Softmax
over the logits) is not a split and gets none.

A gated layer (see `gated`: f(x Wg) * (x Wu), or a 2H-wide layer cut in two halves) is one layer of H
outputs here; it continues from the layer whose output is exactly what its linear layers read (both of
them, in the two-layer form). With `gated_refused` (a reason: the library has no kernel for gated layers)
its parts stay separate chains and the layers that feed its Mul or cut end with that reason.

A chain then takes in a normalisation of its input in front and a residual Add of the block's input
behind (see `block`: the transformer FFN block x + FFN(norm(x))); where `block_refused` names the chain
(`block_key`: the library has no kernel for its block) they stay stock ops and say why ("chain N starts:
...", "chain N ends: ...").

A chain with neither takes in a per-channel scale and shift of its input instead (see `input_affine`:
(x - mean) / std, an input BatchNorm1d), folded into its first layer's weights and bias; a residual Add
of the unscaled input behind it then joins too (x + MLP(BN(x)): RTDL's ResNet blocks for tabular data).

Three Concats continue a chain (neural fields): a Concat of the chain's own input with a layer's output
into the next layer is a skip connection (see `skip`; MLPSpec.skip); Concat(sin z, cos z) of a layer's
output is one sin layer of twice the width (see `sincos`); and a layer without activation that is only
concatenated into the next layer folds into it, the Concat reading its input (see `concat_fold`; a
chain's `concat_edit`). Two more end one: a small linear head beside the chain, concatenated with its
output, rides it and the op writes that Concat (see `head_fold`: NeRF's density); and two chains join where
the second one's first layer reads Concat(the first one's output, a piece of the first one's input), the
joined chain reading the whole input with one more skip layer (see `skip_merge`: NeRF's view head).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import onnx

from .. import expr as ex
from ..spec import LayerSpec, MLPSpec, NormSpec
from .activations import (ELEMENTWISE_OPS, Activation, describe_expr, match_activation, normalise, subst,
                          unsupported)
from .block import NormMatch, find_block, residual_of_input
from .casts import trim_output_casts
from .concat_fold import ConcatEdit, ConcatFold, apply_fold, match_concat_fold
from .constants import GraphIndex, elem_name
from .gated import fed_node, find_gated
from .head_fold import HeadFold, apply_head, carry_fits, carry_mode, head_candidate, input_parts, last_activation
from .input_affine import InputAffine, match_input_affine
from .linear import LinearLayer, LinearRefusal, is_linear_node, match_linear
from .pool import PoolMatch, describe_pool, match_pool
from .regroup import reads_removed, regroup_ends, shape_feeders
from .sincos import match_sincos, sincos_activation, widen
from .skip_merge import merge_skips
from .skip import SKIP_NO_BLOCK, SkipConcat, lay_out_skip_weight, match_skip_concat, not_a_skip, skip_cut

IO_TYPES = {onnx.TensorProto.FLOAT: "f32", onnx.TensorProto.FLOAT16: "f16"}


@dataclass
class ChainLayer:
    linear: LinearLayer
    activation: ex.Expr
    activation_nodes: list[str]
    output: str = ""  # the tensor after the activation ('' = the linear layer's output)
    gated: bool = False  # linear holds [Wg | Wu] (2H columns); activation is the gate's; output H wide

    def __post_init__(self):
        self.output = self.output or self.linear.output

    @property
    def out_features(self) -> int:
        return self.linear.out_features // 2 if self.gated else self.linear.out_features


@dataclass
class Chain:
    input: str
    output: str
    layers: list[ChainLayer]
    nodes: list[str]
    input_dtype: str  # 'f32' or 'f16'
    norm: NormMatch | None = None  # normalisation of the input rows in front of the first layer
    residual: bool = False         # the input rows added to the last layer's output (output: the Add's)
    input_map: str = ""            # the ops of a scale and shift of the input folded into the first layer
    skip: tuple[int, ...] = ()     # these layers read [input, the layer before's output] (skip.py)
    input_edit: tuple[int, int, str] | None = None  # a folded layer (concat_fold.py): the input's columns
                                   # offset..offset+width are its output in the model, `tensor` in the fused op
    concat_edit: object = None     # ... and the Concat that then reads `tensor` (concat_fold.ConcatEdit)
    head: str = ""                 # a head that rides the chain into its output Concat (head_fold.py)
    joined: bool = False           # two chains joined through a piece of their input (skip_merge.py)
    pool: str = ""                 # spec.POOLS ("max", "sumk", ...): the op writes the pool over axis -2 of its
                                   # rows (pool.py)

    @property
    def rows_output(self) -> str:
        """The tensor that holds the last layer's output rows (the pool's input, where the chain pools)."""
        return self.layers[-1].output if self.pool else self.output

    def input_rows(self, ref: Mapping[str, list]) -> list:
        """The rows the fused op reads in each case, from the model's tensors `ref` ({name: one array a
        case}): its input as the model computes it, a folded layer's output replaced by that layer's input."""
        if self.input_edit is None:
            return ref[self.input]
        offset, width, tensor = self.input_edit
        return [np.concatenate([x[..., :offset], h, x[..., offset + width:]], axis=-1)
                for x, h in zip(ref[self.input], ref[tensor])]

    @property
    def input_tensors(self) -> tuple[str, ...]:
        """The model's tensors input_rows reads."""
        return (self.input,) + ((self.input_edit[2],) if self.input_edit is not None else ())

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.layers[0].linear.in_features,) + tuple(l.out_features for l in self.layers)

    @property
    def activations(self) -> list[ex.Expr]:
        return [l.activation for l in self.layers]

    def to_spec(self, precision: str = "fp16", act_math: str = "packed") -> MLPSpec:
        norm = None if self.norm is None else NormSpec(self.norm.kind, self.norm.eps, self.norm.bias is not None)
        return MLPSpec(tuple(LayerSpec(l.linear.in_features, l.out_features, l.linear.has_bias, l.activation,
                                       gated=l.gated)
                             for l in self.layers), precision=precision, io_dtype=self.input_dtype,
                       norm=norm, residual=self.residual, act_math=act_math, skip=self.skip,
                       pool=self.pool or None)

    def activation_labels(self) -> list[str]:
        """Each layer's activation as reports print it (`gated silu`: a gated layer's gate activation)."""
        return [("gated " if l.gated else "") + describe_expr(l.activation) for l in self.layers]

    def extras(self) -> list[str]:
        """What the chain takes in beside its layers and activations, as reports say it."""
        return ([f"{self.norm.label} in front"] if self.norm is not None else []) \
            + ([f"input {self.input_map} folded into layer 1"] if self.input_map else []) \
            + (["residual"] if self.residual else []) \
            + ([f"the input joins layer{'s' if len(self.skip) > 1 else ''} {', '.join(str(j + 1) for j in self.skip)} "
                f"(skip Concat{'s' if len(self.skip) > 1 else ''})"] if self.skip else []) \
            + (["two chains joined through pieces of the input"] if self.joined else []) \
            + ([f"head {self.head} rides it into its output Concat"] if self.head else []) \
            + ([describe_pool(self.pool)] if self.pool else [])

    def describe(self) -> str:
        acts = ", ".join(self.activation_labels())
        block = "".join(f", {e}" for e in self.extras())
        return (f"'{self.input}' -> '{self.output}': widths {' -> '.join(map(str, self.widths))}, "
                f"activations [{acts}]{block}, {self.input_dtype}, {len(self.nodes)} nodes")


@dataclass
class Refusal:
    node: str
    reason: str
    chain: int = -1   # a note on where chain `chain` starts or ends ("chain N starts: ..."), else -1

    def __str__(self) -> str:
        return self.reason

    def renumbered(self, chain: int) -> Refusal:
        """This note about chain `self.chain` as the note of chain `chain` (its index in a smaller plan)."""
        prefix = f"chain {self.chain} "
        assert self.reason.startswith(prefix), self.reason
        return Refusal(self.node, f"chain {chain} " + self.reason[len(prefix):], chain)


@dataclass
class FusionPlan:
    chains: list[Chain] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    batchnorms: list = field(default_factory=list)   # batchnorm.BatchNormRewrite: stock BatchNorms as Mul + Add
    channels_last: list[str] = field(default_factory=list)   # pointwise Conv runs as MatMuls (pointwise_conv.py)

    @property
    def concat_edits(self) -> list:
        """concat_fold.ConcatEdit of the chains that took a folded layer: the Concats that read its input."""
        return [c.concat_edit for c in self.chains if c.concat_edit is not None]

    @property
    def rewritten(self) -> list[str]:
        """The stock ops the fused model changes (reports' "stock op rewritten")."""
        return (self.channels_last + [b.describe() for b in self.batchnorms]
                + [e.describe() for e in self.concat_edits])

    def describe(self) -> str:
        lines = [f"{len(self.chains)} chain(s) to fuse:"]
        for k, c in enumerate(self.chains):
            lines.append(f"  chain {k}: {c.describe()}")
        if self.refusals:
            lines.append(f"{len(self.refusals)} not fused:")
            lines.extend(f"  {r.reason}" for r in self.refusals)
        lines.extend(f"stock op rewritten: {r}" for r in self.rewritten)
        return "\n".join(lines)


@dataclass
class _Layer:
    start: int
    linear: LinearLayer
    act: Activation
    next: int | None = None
    prev: int | None = None
    gated: bool = False
    entries: tuple[int, ...] = ()  # the nodes that read the input ((start,) for a plain layer)
    skip: SkipConcat | None = None  # this layer reads Concat(its chain's input?, the layer before's output)
    fold: ConcatFold | None = None  # a layer without activation concatenated into this one's input folds in
    folded: bool = False            # this layer folds into another (concat_fold.py): no chain of its own

    def __post_init__(self):
        self.entries = self.entries or (self.start,)

    @property
    def out_features(self) -> int:
        return self.linear.out_features // 2 if self.gated else self.linear.out_features


def _feeding_a_layer(ix: GraphIndex) -> set[str]:
    """The tensors some Gemm/MatMul depends on. A chain that ends at one of them was split (by a
    LayerNorm, a Split, ...), and says why; one that ends before the graph's tail (a Softmax) was not.
    One pass over the nodes in reverse (ONNX graphs are topologically sorted; if one is not, only a
    reason goes missing)."""
    feeds: set[str] = set()
    for n in reversed(ix.graph.node):
        if is_linear_node(n) or any(o in feeds for o in n.output if o):
            feeds.update(i for i in n.input if i)
    return feeds


def _fold_vectors(folded, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The scale and shift of an affine map found by expr.leading_affine / trailing_affine, as float32
    [n] vectors; None without one, or where either is not finite ((x W + b) / 0 is +-inf where x (W / 0)
    is NaN: such a map stays in the epilogue)."""
    if folded is None:
        return None
    scale, shift = (np.broadcast_to(np.asarray(v, dtype=np.float32), (n,)) for v in folded[1:])
    return (scale, shift) if np.isfinite(scale).all() and np.isfinite(shift).all() else None


def _layer_activation(ix: GraphIndex, lin: LinearLayer, strict: bool = False) -> Activation:
    """The activation after `lin`: the elementwise nodes on its output, after FusedGemm's own activation
    where it has one. A per-channel scale and shift it starts with (an inference BatchNorm, a LayerScale,
    the bias that ORT's FastGelu and BiasGelu add) folds into the layer's weights and bias, so that f is
    the named activation and the last layer the plain GEMM the wide design takes."""
    act = match_activation(ix, lin.output, lin.out_features, strict)
    half = ix.types.get(lin.output) in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    expr = act.expr if lin.activation is None else normalise(subst(act.expr, lin.activation), half)
    folded = ex.leading_affine(expr) if lin.activation is None else None
    vectors = _fold_vectors(folded, lin.out_features)
    if vectors is not None:
        expr, (scale, shift) = folded[0], vectors
        with np.errstate(all="ignore"):
            lin.weight = np.ascontiguousarray(lin.weight * scale[None, :], dtype=np.float32)
            bias = shift if lin.bias is None else lin.bias * scale + shift
        lin.bias = None if lin.bias is None and not shift.any() else np.ascontiguousarray(bias, dtype=np.float32)
        expr = normalise(expr, half)
    if expr is act.expr:
        return act
    return Activation(expr, act.node_indices, act.nodes, act.output, act.rejected)


def _fold_trailing_affines(seq: list[_Layer]) -> None:
    """A per-channel scale and shift that ends a hidden layer's activation (a BatchNorm after the ReLU)
    is the next layer's input map: x (s W) + (t W + b) for f(.) s + t then W, b. Folded there, f is the
    named activation again. Not a gated layer's (its expression is the gate's, not its output's)."""
    for l, nxt in zip(seq, seq[1:]):
        folded = None if l.gated else ex.trailing_affine(l.act.expr)
        vectors = _fold_vectors(folded, nxt.linear.in_features)
        if vectors is None:
            continue
        _fold_input_map(nxt.linear, *vectors)
        a = l.act
        l.act = Activation(folded[0], a.node_indices, a.nodes, a.output, a.rejected)


def _fold_input_map(linear: LinearLayer, scale: np.ndarray, shift: np.ndarray) -> None:
    """The layer reading x * s + t (s, t: float32 [K]) as one reading x: x (s W) + (t W + b)."""
    w = linear.weight
    with np.errstate(all="ignore"):
        bias = (shift.astype(np.float64) @ w.astype(np.float64)).astype(np.float32)
        linear.weight = np.ascontiguousarray(w * scale[:, None], dtype=np.float32)
    if linear.bias is not None:
        bias = (linear.bias + bias).astype(np.float32)
    if linear.bias is not None or shift.any():
        linear.bias = np.ascontiguousarray(bias)


@dataclass
class _Entry:
    tensor: str                         # what the chain reads
    readers: set[int]                   # the nodes that read it
    io_type: int                        # its element type, and the chain output's
    widened: InputAffine | None = None  # the walk across a float16 converter's rounding Cast (casts.py)


def _chain_entry(ix: GraphIndex, seq: list[_Layer], claimed: set[int]) -> _Entry | str:
    """Where the chain of layers `seq` starts, or why it cannot be one: its input and output element types
    differ beyond what a float16 converter's Casts at its ends explain (casts.py; a widening Cast that
    alone ends it is taken off the last layer's activation here)."""
    first = seq[0].linear
    entry = _Entry(first.input, set(seq[0].entries), ix.types[first.input])
    out_t = seq[-1].act.output
    out_type = ix.types.get(out_t)
    if out_type is None or out_type == entry.io_type:
        return entry
    if out_type == onnx.TensorProto.FLOAT:
        widened, _ = match_input_affine(ix, first.input, entry.readers, first.in_features, claimed, widen=True)
        if widened is not None and widened.widened:   # the chain reads the float32 x in front of the Cast
            readers = {min(j for j in widened.node_indices if widened.input in ix.node(j).input)}
            return _Entry(widened.input, readers, out_type, widened)
    trimmed = trim_output_casts(ix, seq[-1].act, entry.io_type)
    if trimmed is not None:
        seq[-1].act = trimmed
        return entry
    return (f"chain output '{out_t}' has element type {elem_name(out_type)} but its input '{first.input}' has "
            f"{elem_name(entry.io_type)}")


def _block_through_regroups(ix: GraphIndex, entry: _Entry, idx: list[int], out_t: str, first: LinearLayer,
                            last: _Layer, refused: str | None):
    """The chain's block where its ends are row-regrouping Reshapes (regroup.py: HF Conv1D's view to
    [-1, K0] in front and back to the input's leading shape behind): (the block found around them, the
    Reshapes, the chain's nodes with them and the nodes computing only their shapes), when that block
    takes a norm or a residual, or the chain between them would leave a Shape reading a tensor it
    removes (the TorchScript exporter's `view(h.size()[:-1] + (n,))` behind reads the activation's
    shape), and with them nothing left in the graph reads what the fused node removes; else None (the
    chain keeps its ends)."""
    ends = regroup_ends(ix, entry.tensor, entry.readers, out_t, first.in_features, last.out_features)
    if ends is None:
        return None
    block = find_block(ix, ends.input, {ends.node_indices[0]}, ends.output, first.in_features,
                       last.out_features, refused, shape_readers=True)
    if block.norm is None and block.residual is None and reads_removed(
            ix, set(idx) | shape_feeders(ix, set(idx)), {out_t}) is None:
        return None
    nodes = set(idx) | set(ends.node_indices)
    nodes |= set(block.norm.node_indices) if block.norm is not None else set()
    nodes |= {block.residual} if block.residual is not None else set()
    nodes |= shape_feeders(ix, nodes)
    if reads_removed(ix, nodes, {block.output or ends.output}) is not None:
        return None
    return block, ends, sorted(nodes - set(block.norm.node_indices if block.norm is not None else ())
                               - {block.residual})


def _walk(layers: dict[int, _Layer], first: _Layer) -> list[_Layer]:
    """The layers of the chain that starts at `first`, in order."""
    seq = [first]
    while seq[-1].next is not None:
        seq.append(layers[seq[-1].next])
    return seq


def _walk_back(layers: dict[int, _Layer], layer: _Layer) -> _Layer:
    """The first layer of the chain `layer` is linked into so far."""
    while layer.prev is not None:
        layer = layers[layer.prev]
    return layer


def block_key(chain: Chain) -> int:
    """What names a chain across two find_chains calls on one model (library.block_refusal's keys): the
    index of its first layer's first node."""
    return _first_node(chain.layers[0].linear)


def _first_node(linear: LinearLayer) -> int:
    return min(linear.node_indices)


def find_chains(model: onnx.ModelProto, gated_refused: str | None = None,
                block_refused: Mapping[int, str] | str | None = None,
                skip_refused: Mapping[int, str] | None = None,
                pool_refused: Mapping[int, str] | None = None) -> FusionPlan:
    """The chains of `model` and why the rest is not fused. `gated_refused`: None, gated layers fuse;
    else the reason they do not (library.gated_refusal: a library with CUDA kernels). `block_refused`:
    the same for a norm in front and a residual behind, per chain ({block_key: reason}, a template with
    `{what}`: library.block_refusal, spec.BLOCK_NO_CUDA), or one reason for every chain. `skip_refused`:
    the chains ({block_key: reason}) that end at their skip Concat (library.skip_refusal). `pool_refused`:
    the same for the chains that leave the pool behind them a stock op (library.pool_refusal)."""
    ix = GraphIndex(model)
    strict: set[int] = set()
    while True:
        plan, broken = _find_chains(ix, gated_refused, block_refused, strict, skip_refused, pool_refused)
        if not broken:
            return plan
        strict |= broken


def _find_chains(ix: GraphIndex, gated_refused: str | None, block_refused: Mapping[int, str] | str | None,
                 strict: set[int], skip_refused: Mapping[int, str] | None = None,
                 pool_refused: Mapping[int, str] | None = None) -> tuple[FusionPlan, set[int]]:
    """find_chains with the layers `strict` matching their activations strictly (match_activation):
    the plan, and the layers of chains that would leave a Shape node reading a tensor they remove
    (empty: the plan is final). Such a chain whose layers were strict already is refused instead."""
    plan = FusionPlan()
    broken: set[int] = set()
    layers: dict[int, _Layer] = {}
    refused: dict[int, str] = {}
    for i, n in enumerate(ix.graph.node):
        if not is_linear_node(n) or ix.const(n.output[0]) is not None:   # (a product of constants: folded)
            continue
        try:
            lin = match_linear(ix, i)
        except LinearRefusal as r:
            refused[i] = str(r)
            continue
        t = ix.types.get(lin.input)
        if t not in IO_TYPES:
            refused[i] = (f"{ix.describe(i)}: input '{lin.input}' has element type {elem_name(t)}; "
                          "only float32/float16 are fused")
            continue
        layers[i] = _Layer(i, lin, _layer_activation(ix, lin, i in strict),
                           entries=(i, lin.low_rank[0]) if lin.low_rank else ())
    # a LoRA branch folded into its layer (linear.fold_low_rank): its own linear nodes are no layers
    in_branches = {j for l in layers.values() for j in l.linear.low_rank}
    for j in in_branches:
        layers.pop(j, None)
        refused.pop(j, None)
    feeds_layer = _feeding_a_layer(ix)
    claimed = {j for l in layers.values() for j in l.linear.node_indices + l.act.node_indices}
    gated, gated_reasons = find_gated(ix, layers)
    for g in gated:
        if gated_refused is not None:
            for s in g.layers:
                gated_reasons[s] = f"feeds {ix.describe(fed_node(ix, layers[s].act.output))}: {gated_refused}"
            continue
        for s in g.layers:
            del layers[s]
        start = min(g.entries)
        layers[start] = _Layer(start, g.linear, g.activation, gated=True, entries=tuple(g.entries))
    # A bias Add is never another layer's start; make sure no node is claimed twice.
    by_entries = {frozenset(l.entries): l for l in layers.values()}
    ends: dict[int, str] = {}
    for l in sorted(layers.values(), key=lambda l: l.start):
        t = l.act.output
        users = ix.users(t)
        if t in ix.graph_outputs:
            if users:
                ends[l.start] = "is also a graph output"
            continue
        nxt = by_entries.get(frozenset(users))
        if nxt is not None and nxt.linear.input == t:
            if nxt.linear.in_features != l.out_features:
                ends[l.start] = (f"has {l.out_features} features but {ix.describe(users[0])} takes "
                                 f"{nxt.linear.in_features}")
                continue
            l.next, nxt.prev = nxt.start, l.start
            continue
        pair = match_sincos(ix, t, users) if l.act.output == l.linear.output and not l.gated else None
        if pair is not None:   # Fourier features: one layer of twice the width, sin (sincos.py)
            nodes, cat_out, sin_first = pair
            nxt = by_entries.get(frozenset(ix.users(cat_out)))
            if (nxt is not None and nxt.linear.input == cat_out and nxt.prev is None and nxt.fold is None
                    and nxt.linear.in_features == 2 * l.out_features and not l.linear.low_rank):
                widen(l.linear, sin_first)
                l.act = sincos_activation(ix, nodes, cat_out)
                l.next, nxt.prev = nxt.start, l.start
                continue
        skip, not_skip = match_skip_concat(ix, t, users), ""
        if skip is not None and skip.other != (own := _walk_back(layers, l).linear.input):
            # another tensor than the chain's input (NeRF's view directions): no skip; a fold, or the end
            not_skip = not_a_skip(ix, skip, own)
            skip = None
        if skip is not None:
            nxt = by_entries.get(frozenset(ix.users(skip.output)))
            if (nxt is not None and nxt.linear.input == skip.output and not nxt.gated and not l.gated
                    and nxt.linear.in_features == l.out_features + skip.width):
                l.next, nxt.prev, nxt.skip = nxt.start, l.start, skip
                continue
        fold = (match_concat_fold(ix, l.linear, t, users)
                if l.prev is None and not l.gated and l.act.output == l.linear.output else None)
        if fold is not None:
            nxt = by_entries.get(frozenset(ix.users(fold[1])))
            if (nxt is not None and nxt.linear.input == fold[1] and not nxt.gated and nxt.fold is None
                    and nxt.prev is None):
                l.folded, nxt.fold = True, fold[0]
                continue
        if not_skip:
            ends[l.start] = not_skip
            continue
        if l.start in gated_reasons:
            ends[l.start] = gated_reasons[l.start]
            continue
        if len(users) != 1:
            if len(users) > 1:
                names = ", ".join(ix.describe(u) for u in users[:3]) + (", ..." if len(users) > 3 else "")
                ends[l.start] = f"has {len(users)} consumers ({names})"
            continue
        u = users[0]
        if u in refused:
            ends[l.start] = f"feeds {ix.describe(u)}, which is not fused"
        elif u in l.act.rejected and (ix.node(u).op_type in ELEMENTWISE_OPS or t in feeds_layer):
            ends[l.start] = f"feeds {l.act.rejected[u]}"
    heads = {l.start: h for l in layers.values()
             if (h := head_candidate(ix, l.start, l.linear, l.act, l.prev is None and l.next is None and not l.folded
                                     and not l.gated and l.fold is None and l.skip is None)) is not None}
    taken: set[int] = set()   # heads that ride a chain (their turn comes after every other chain's)
    for l in sorted(layers.values(), key=lambda l: (l.start in heads, l.start)):
        if l.prev is not None or l.folded or l.start in taken:
            continue
        seq = _walk(layers, l)
        fold = seq[0].fold
        if fold is not None:   # (the layer it folds into starts a chain: the folded one goes with it)
            folded_start = _first_node(fold.folded)
        first = seq[0].linear
        entry = _chain_entry(ix, seq, claimed)
        cut = skip_cut(ix, seq, entry.widened is not None if not isinstance(entry, str) else False,
                       skip_refused, _first_node(first))
        if cut is not None:   # a Concat that is no skip of this chain: it ends here, what follows starts anew
            at, why = cut
            seq[at - 1].next, seq[at].prev, seq[at].skip = None, None, None
            ends[seq[at - 1].start] = why
            seq = seq[:at]
            entry = _chain_entry(ix, seq, claimed)
        if isinstance(entry, str):
            for s in seq:
                refused[s.start] = f"{ix.describe(s.start)}: {entry}"
            if fold is not None:
                refused[folded_start] = f"{ix.describe(folded_start)}: folds into a layer whose chain is not fused"
            continue
        widened, in_type, out_t = entry.widened, entry.io_type, seq[-1].act.output
        last = seq[-1]
        skips = tuple(k for k, s_ in enumerate(seq) if s_.skip is not None)
        refused_here = (block_refused if isinstance(block_refused, str) or block_refused is None
                        else block_refused.get(_first_node(first)))
        if skips:   # (the Concat reads x as it comes: no norm or input map may change what the op reads)
            refused_here = SKIP_NO_BLOCK
        if widened is not None:   # (a norm or residual in float32 around a float16 MLP: not handled)
            refused_here = "the {what} stays a stock op: the chain reads the float32 input of a float16 converter's Cast"
        block = find_block(ix, entry.tensor, entry.readers, out_t, first.in_features, last.out_features, refused_here)
        idx = sorted(j for s in seq for j in s.linear.node_indices + s.act.node_indices)
        regrouped = None
        if widened is None and block.norm is None and block.residual is None and not skips:
            regrouped = _block_through_regroups(ix, entry, idx, out_t, first, last, refused_here)
            if regrouped is not None:
                block, reshapes, idx = regrouped
                entry, out_t = _Entry(reshapes.input, {reshapes.node_indices[0]}, entry.io_type), reshapes.output
                ends.pop(last.start, None)   # (said of the output inside the Reshape)
                users = ix.users(out_t)
                if block.residual is None and len(users) == 1 and out_t in feeds_layer:
                    ends[last.start] = f"feeds {ix.describe(users[0])}: {unsupported(ix.node(users[0]))}"
        if block.norm is not None:
            idx = sorted(idx + block.norm.node_indices)
        if block.residual is not None:
            idx.append(block.residual)
            ends.pop(last.start, None)
        elif block.end_reason:
            ends[last.start] = block.end_reason
        chain_input, start_reason, input_map = entry.tensor, block.start_reason, widened
        if block.norm is not None:
            chain_input = block.norm.input
        elif widened is None and block.residual is None and not start_reason and not skips:   # (a residual reads its input)
            input_map, start_reason = match_input_affine(ix, entry.tensor, entry.readers, first.in_features, claimed)
        if input_map is not None:
            chain_input = input_map.input
            idx = sorted(idx + input_map.node_indices)
            _fold_input_map(first, input_map.scale, input_map.shift)
            residual = (None if block.residual is not None or refused_here is not None or input_map.widened
                        else residual_of_input(ix, out_t, chain_input, first.in_features, last.out_features))
            if residual is not None:   # x + MLP(BN(x)): the op reads x and adds it
                block.residual, block.output = residual
                block.end_reason = ""
                idx.append(block.residual)
                ends.pop(last.start, None)
        head = None
        if block.norm is None and block.residual is None and input_map is None and regrouped is None:
            head = _ridden_head(ix, layers, heads, taken, seq, fold, out_t)
        if head is not None:   # the chain writes the head's Concat (head_fold.py)
            idx += list(head.node_indices) + [head.concat]
            out_t = head.output
            ends.pop(last.start, None)
        pool = None
        if block.residual is None and head is None and regrouped is None and not last.gated:
            pool = match_pool(ix, out_t)
            refused_pool = (pool_refused or {}).get(_first_node(first))
            if isinstance(pool, PoolMatch) and refused_pool is not None:
                ends[last.start] = f"feeds {ix.describe(pool.node)}: {refused_pool}"
                pool = None
            elif isinstance(pool, str):
                ends[last.start] = f"feeds {pool}"
                pool = None
        if pool is not None:   # the op writes the pool over its rows (pool.py)
            idx.append(pool.node)
            out_t = pool.output
            ends.pop(last.start, None)
        for k in skips:
            idx += seq[k].skip.nodes
        if fold is not None:
            idx += fold.folded.node_indices
        idx = sorted(set(idx) | shape_feeders(ix, set(idx)))
        kept_reads = {block.output or out_t} | ({fold.folded.output} if fold is not None else set())
        left = reads_removed(ix, set(idx), kept_reads)
        if left is not None:
            if not {s.start for s in seq} <= strict:
                broken |= {s.start for s in seq}
                continue
            for s in seq:
                refused[s.start] = f"{ix.describe(s.start)}: not fused: {left}, a tensor its chain would remove"
            if fold is not None:
                refused[folded_start] = f"{ix.describe(folded_start)}: folds into a layer whose chain is not fused"
            continue
        _fold_trailing_affines(seq)
        for k in skips:
            lay_out_skip_weight(seq[k].linear, seq[k].skip, first.in_features)
        if fold is not None:
            apply_fold(first, fold)
        if head is not None:
            own = seq[-1].linear.out_features
            apply_head([s.linear for s in seq], head)
            a = seq[-1].act
            seq[-1].act = Activation(last_activation(a.expr, own, head.head.out_features, head.first, head.activation),
                                     a.node_indices, a.nodes, a.output, a.rejected)
            taken.add(_first_node(head.head))
        chain = Chain(chain_input, block.output or out_t,
                      [ChainLayer(s.linear, s.act.expr, list(s.act.nodes), s.act.output, s.gated) for s in seq],
                      [ix.keys[j] for j in idx], IO_TYPES[in_type], block.norm, block.residual is not None,
                      input_map.label if input_map is not None else "", skips,
                      (fold.offset, fold.folded.out_features, fold.folded.input) if fold is not None else None,
                      ConcatEdit(ix.keys[fold.concat], fold.position, fold.folded.input, ix.keys[folded_start])
                      if fold is not None else None,
                      f"'{head.head.nodes[0]}' ({head.head.in_features} -> {head.head.out_features})"
                      if head is not None else "", pool=pool.kind if pool is not None else "")
        plan.chains.append(chain)
        if start_reason:
            plan.refusals.append(Refusal(ix.keys[min(first.node_indices)],
                                         f"chain {len(plan.chains) - 1} starts: {start_reason}",
                                         len(plan.chains) - 1))
        if last.start in ends:
            end_node = ix.keys[(last.act.node_indices or last.linear.node_indices)[-1]]
            plan.refusals.append(Refusal(end_node, f"chain {len(plan.chains) - 1} ends: output of layer "
                                                   f"{len(seq)} ('{out_t}') {ends[last.start]}", len(plan.chains) - 1))
    _in_node_order(plan)
    _merge(ix, plan, skip_refused)
    for i in sorted(refused):
        plan.refusals.append(Refusal(ix.keys[i], refused[i]))
    plan.refusals.sort(key=lambda r: ix.index_of.get(r.node, 0))
    return plan, broken


def _ridden_head(ix: GraphIndex, layers: dict[int, _Layer], heads: dict, taken: set[int], seq: list[_Layer],
                 fold, out_t: str) -> HeadFold | None:
    """The head (head_fold.py) that joins the chain `seq`'s output `out_t` in a Concat and reads a part of
    the chain's first layer's input (after a folded layer's edit), where the chain's activations can
    carry it; else None."""
    users = ix.users(out_t)
    if len(users) != 1 or out_t in ix.graph_outputs:
        return None
    own = _first_node(seq[0].linear)
    cand = next((c for c in heads.values() if c.concat == users[0] and c.other == out_t
                 and c.start not in taken and c.start != own), None)
    if cand is None or any(s.gated for s in seq):
        return None
    head = layers[cand.start].linear
    paired = carry_mode([s.act.expr for s in seq])
    if paired is None or not carry_fits([s.out_features for s in seq[:-1]], head.out_features, paired):
        return None
    first = seq[0].linear
    k0, replaced = first.in_features, None
    if fold is not None:   # (the layer's input once the folded layer's input replaces its output)
        k0 += fold.folded.in_features - fold.folded.out_features
        replaced = (fold.position, fold.folded.input, fold.folded.in_features)
    offset = next((o for t, o in input_parts(ix, first.input, k0, replaced)
                   if t == head.input and o + head.in_features <= k0), None)
    if offset is None:
        return None
    return HeadFold(head, cand.concat, ix.node(cand.concat).output[0], offset, cand.first, paired, cand.activation,
                    cand.node_indices)


def _merge(ix: GraphIndex, plan: FusionPlan, skip_refused: Mapping[int, str] | None) -> None:
    """Chains joined through a skip Concat of a piece of their shared input (skip_merge.py), and the notes
    on where chains start and end renumbered: the first chain's end and the second's start are gone."""
    ends = {r.chain: r.node for r in plan.refusals if " ends: " in r.reason}
    last = {k: ix.keys[max(j for s in c.layers for j in s.linear.node_indices)] for k, c in enumerate(plan.chains)}
    mapping, joined, declined = merge_skips(ix, plan.chains, skip_refused, block_key)
    if not joined and not declined:
        return
    notes = []
    for r in plan.refusals:
        if r.chain < 0:
            notes.append(r)
        elif not ((r.chain in joined.values() and " ends: " in r.reason)
                  or (r.chain in joined and " starts: " in r.reason)
                  or (r.chain in declined and " ends: " in r.reason)):
            notes.append(r.renumbered(mapping[r.chain]))
    for k, why in declined.items():   # (in place of what it said of its output)
        notes.append(Refusal(ends.get(k, last[k]), f"chain {mapping[k]} ends: {why}", mapping[k]))
    plan.refusals = notes


def _in_node_order(plan: FusionPlan) -> None:
    """The chains in the order of their first nodes (a head candidate that rode nothing took its turn after
    the others), the notes on where they start and end renumbered."""
    order = sorted(range(len(plan.chains)), key=lambda k: block_key(plan.chains[k]))
    if order == list(range(len(order))):
        return
    new = {old: k for k, old in enumerate(order)}
    plan.chains = [plan.chains[k] for k in order]
    plan.refusals = [r if r.chain < 0 else r.renumbered(new[r.chain]) for r in plan.refusals]
