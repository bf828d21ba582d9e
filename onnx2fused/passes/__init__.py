"""Graph passes: find MLP chains in an ONNX model and replace each by one fused custom node.

    find_chains(model) -> FusionPlan          (linear layers + activations (+ gated layers, gated.py)
                                               -> maximal chains, refusals)
    rewrite(model, plan, specs) -> ModelProto (one onnx2fused node per chain + fallback functions)
"""
from .activations import Activation, ActivationRefusal, match_activation
from .chains import Chain, ChainLayer, FusionPlan, Refusal, block_key, find_chains
from .linear import LinearLayer, LinearRefusal, match_linear
from .rewrite import make_fallback_function, rewrite

__all__ = ["find_chains", "block_key", "rewrite", "FusionPlan", "Chain", "ChainLayer", "Refusal", "LinearLayer",
           "LinearRefusal", "match_linear", "Activation", "ActivationRefusal", "match_activation",
           "make_fallback_function"]
