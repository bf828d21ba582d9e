"""LLaMA- and Gemma-style FFN blocks with HF transformers' RMSNorm code, for `onnx2fused bench` and the tests.

HF's RMSNorms normalise in float32 whatever the model's type, and round back to it before the weight
(LLaMA, Qwen2, Mistral) or after it (Gemma):

    LlamaRMSNorm:  h = x.to(float32); h = h * rsqrt(mean(h^2) + eps); weight * h.to(x.dtype)
    GemmaRMSNorm:  h = x.float();     h = h * rsqrt(mean(h^2) + eps); (h * (1 + weight.float())).type_as(x)

so a float16 export holds Cast(to=float) in front of the norm and a rounding Cast inside or after it, and a
float32 TorchScript export keeps the Casts to float (passes/block.py takes them with the norm). The block:

    x + down(act(gate(norm(x))) * up(norm(x)))       (LlamaDecoderLayer's / GemmaDecoderLayer's second half)

    python benchmarks/hf_rmsnorm_blocks.py build/hf [--width 4096] [--hidden 11008] [--fp16]
        # writes {llama,gemma}_ffn.{ts,dynamo}.onnx, batch and sequence dynamic
    onnx2fused bench build/hf/llama_ffn.ts.onnx --input-shapes x:1x4096x4096 --reps 50 --no-torch
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn

from gpt2_blocks import export, gelu_new


class LlamaRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm (Qwen2RMSNorm and MistralRMSNorm are the same code)."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(1 + 0.1 * torch.randn(width)), eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    """transformers' GemmaRMSNorm: the weight is stored as (scale - 1)."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(0.1 * torch.randn(width)), eps

    def forward(self, x):
        output = x.float()
        output = output * torch.rsqrt(output.pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class GatedFFN(nn.Module):
    """norm -> gate/up (no bias) -> act(gate) * up -> down, + x: SiLU with LLaMA's norm, tanh GELU with Gemma's."""

    def __init__(self, width: int, hidden: int, style: str = "llama"):
        super().__init__()
        self.norm = LlamaRMSNorm(width) if style == "llama" else GemmaRMSNorm(width)
        self.act = nn.functional.silu if style == "llama" else gelu_new
        self.gate_proj, self.up_proj = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)
        with torch.no_grad():
            for lin in (self.gate_proj, self.up_proj, self.down_proj):
                lin.weight.normal_(0, 1 / math.sqrt(lin.in_features))
        self.width = width

    def forward(self, x):
        h = self.norm(x)
        return x + self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))


def export_all(out_dir: Path, width: int = 4096, hidden: int = 11008, dtype=torch.float32) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    paths = []
    for style in ("llama", "gemma"):
        module = GatedFFN(width, hidden, style)
        for kind in ("ts", "dynamo"):
            paths.append(export(module, out_dir / f"{style}_ffn.{kind}.onnx", kind == "dynamo", dtype=dtype))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=11008)
    ap.add_argument("--fp16", action="store_true", help="export the float16 model")
    a = ap.parse_args()
    for p in export_all(a.out_dir, a.width, a.hidden, torch.float16 if a.fp16 else torch.float32):
        print(p)


if __name__ == "__main__":
    main()
