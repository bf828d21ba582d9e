"""The float casts at the ends of a 16-bit chain, as float16 converters write them.

onnxconverter-common's `float16.convert_float_to_float16(model, keep_io_types=True)` (what ONNX Runtime's
documentation recommends for fp16 models) keeps float32 inputs and outputs and puts a Cast at each end:

    x (float32) -> Cast(to=float16) -> L_1 ... L_n -> Cast(to=float32) -> y (float32)

(and so does a model exported under torch.autocast(dtype=torch.float16), then .float()).

The last Cast widens exactly, so the activation walk takes it into the last layer's activation (a cast
between float types is the identity there), and the chain then read float16 and wrote float32: no chain
could be fused at all. Two ways out, tried in this order by `chains.find_chains`:

- `rounding_input_cast` (taken by input_affine's walk, behind any scale and shift it folds, such as an
  input BatchNorm the converter left in float16): the Cast in front rounds float32 to 16 bits, exactly
  as the fused kernel itself rounds a float32 input (round to nearest even, then 16-bit tensor-core operands): the chain reads the
  float32 x and writes float32 (io f32), both Casts go with it, and a kernel launch at each end is saved.
  The fused output skips the fp16 rounding the converted model applies before its last Cast, so it is
  closer to the float32 original than that model is; validation judges it like any other chain.
- `trim_output_casts`: otherwise the widening Casts leave the last activation and stay stock ops after
  the chain, which keeps its 16-bit input type.
"""
from __future__ import annotations

import onnx

from .activations import Activation
from .constants import FLOAT_TYPES, GraphIndex

NARROW = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)   # the 16-bit float types


def _cast_to(ix: GraphIndex, i: int | None) -> int | None:
    """The element type node i casts to, None when it is no standard-domain Cast."""
    if i is None:
        return None
    n = ix.node(i)
    if n.op_type != "Cast" or n.domain not in ("", "ai.onnx"):
        return None
    return ix.attr(i, "to")


def trim_output_casts(ix: GraphIndex, act: Activation, want: int) -> Activation | None:
    """`act` without the Casts that end it, so that its output has element type `want`; None when no
    such Casts are there (or what is left would not have that type)."""
    idx, names, out = list(act.node_indices), list(act.nodes), act.output
    while ix.types.get(out) != want:
        p = ix.producer.get(out)
        if p not in idx or _cast_to(ix, p) is None:
            return None
        k = idx.index(p)
        del idx[k], names[k]
        out = ix.node(p).input[0]
    if out == act.output:
        return None
    return Activation(act.expr, idx, names, out, act.rejected)


def rounding_cast(ix: GraphIndex, t: str) -> int | None:
    """The Cast producing t (a 16-bit value) from a float32 value: the node's index, else None."""
    p = ix.producer.get(t)
    if ix.types.get(t) not in NARROW or _cast_to(ix, p) is None:
        return None
    return p if ix.types.get(ix.node(p).input[0]) == onnx.TensorProto.FLOAT else None


def rounding_input_cast(ix: GraphIndex, t: str, readers: set[int]) -> int | None:
    """The Cast producing t (a 16-bit value read only by `readers`: the first layer, or the scale and
    shift in front of it) from a float32 value: the node's index, else None."""
    if t in ix.graph_outputs or not set(ix.users(t)) <= readers:
        return None
    return rounding_cast(ix, t)


def same_type_cast(ix: GraphIndex, t: str) -> int | None:
    """The Cast producing t from a value of t's own float type (a copy): the node's index, else None."""
    p = ix.producer.get(t)
    to = _cast_to(ix, p)
    return p if to in FLOAT_TYPES and ix.types.get(ix.node(p).input[0]) == to else None


def upcast_source(ix: GraphIndex, x: str, narrow: int) -> tuple[int, str] | None:
    """(the Cast, its input) when x is Cast(to=float) of a tensor of the 16-bit type `narrow` (exact)."""
    p = ix.producer.get(x)
    if _cast_to(ix, p) != onnx.TensorProto.FLOAT:
        return None
    src = ix.node(p).input[0]
    return (p, src) if ix.types.get(src) == narrow else None


__all__ = ["rounding_cast", "rounding_input_cast", "same_type_cast", "trim_output_casts", "upcast_source"]
