"""GPT-2's feed-forward block as HF transformers writes it, for `onnx2fused bench` and the tests.

HF's Conv1D (GPT-2, DistilGPT-2, ...) flattens the rows for addmm and regroups them after it:

    size_out = x.size()[:-1] + (nf,); addmm(bias, x.view(-1, x.size(-1)), weight).view(size_out)

so the tanh GELU runs on [B, T, H] between two Reshapes, and the block's LayerNorm and residual sit outside
the views (passes/regroup.py). The modules here are that code (transformers is not a dependency):

    gpt2_mlp     c_fc -> gelu_new -> c_proj                       (GPT2MLP)
    gpt2_ffn     x + c_proj(gelu_new(c_fc(ln_2(x))))              (GPT2Block's second half)

    python benchmarks/gpt2_blocks.py build/gpt2 [--width 768] [--hidden 3072]
        # writes gpt2_mlp.{ts,dynamo}.onnx and gpt2_ffn.{ts,dynamo}.onnx, batch and sequence dynamic
    onnx2fused bench build/gpt2/gpt2_ffn.ts.onnx --input-shapes x:32x512x768 --reps 50 --no-torch
"""
from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import torch
from torch import nn


class Conv1D(nn.Module):
    """HF transformers' Conv1D: weight [K, N] (x @ W), the rows flattened for addmm and regrouped after."""

    def __init__(self, k: int, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, n) / math.sqrt(k))
        self.bias = nn.Parameter(torch.randn(n) * 0.1)
        self.nf = n

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


def gelu_new(h):
    """HF's NewGELUActivation, as written there."""
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))


class GPT2FFN(nn.Module):
    """GPT2MLP, with the block's ln_2 in front (`norm`) and its residual behind (`residual`)."""

    def __init__(self, width: int, hidden: int, norm: bool = False, residual: bool = False):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(width, hidden), Conv1D(hidden, width)
        self.ln_2 = nn.LayerNorm(width, eps=1e-5) if norm else None
        self.residual, self.width = residual, width

    def forward(self, x):
        h = self.c_proj(gelu_new(self.c_fc(self.ln_2(x) if self.ln_2 is not None else x)))
        return x + h if self.residual else h


def export(module: nn.Module, path: Path, dynamo: bool, example: tuple[int, int] = (2, 7),
           dtype: torch.dtype = torch.float32) -> Path:
    """`module` (its input `module.width` features wide) in `dtype`, exported with batch and sequence
    dynamic (as HF models are), input 'x', by the TorchScript exporter (opset 17) or the dynamo one."""
    module.eval().to(dtype)
    x = torch.randn(example[0], example[1], module.width).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            dims = {0: torch.export.Dim("b"), 1: torch.export.Dim("t")}
            torch.onnx.export(module, (x,), str(path), dynamo=True, input_names=["x"], dynamic_shapes=(dims,),
                              external_data=False)
        else:
            torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=17, input_names=["x"],
                              output_names=["y"], dynamic_axes={"x": {0: "b", 1: "t"}})
    return path


def export_all(out_dir: Path, width: int = 768, hidden: int = 3072) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    paths = []
    for name, block in (("gpt2_mlp", False), ("gpt2_ffn", True)):
        module = GPT2FFN(width, hidden, norm=block, residual=block)
        for kind in ("ts", "dynamo"):
            paths.append(export(module, out_dir / f"{name}.{kind}.onnx", kind == "dynamo"))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=3072)
    a = ap.parse_args()
    for p in export_all(a.out_dir, a.width, a.hidden):
        print(p)


if __name__ == "__main__":
    main()
