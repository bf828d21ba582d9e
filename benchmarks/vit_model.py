"""A whole Vision Transformer as ONNX, for issue 16's end-to-end target (timm ViT-tiny / ViT-small at batch 64
faster than stock ORT fp16): the same modules as timm's `VisionTransformer` (patch embedding, class token,
position embedding, pre-LN blocks of multi-head attention and a GELU MLP, each with its residual, final
LayerNorm, classifier head on the class token), written out here because timm is not a dependency.

    python benchmarks/vit_model.py --size tiny --out build/vit/vit_tiny.onnx     # torch.onnx.export, opset 17
    onnx2fused inspect build/vit/vit_tiny.onnx      # 12 FFN blocks, each one fused op (LN, fc1, GELU, fc2, +x)
    onnx2fused bench build/vit/vit_tiny.onnx --batches 64           # GPU: ORT fp32 / fp16 / fused
    onnx2fused bench build/vit/vit_tiny.onnx --cpu --batches 1      # CPU EP
    python benchmarks/vit_model.py --size base --layerscale       # DeiT-III / CaiT / DINOv2 blocks: x + gamma * f(x)

Weights are random (seed 0), scaled as timm initialises them (trunc normal 0.02 for linear layers), so the
activations have the ranges of a real ViT; the attention stays stock ONNX ops, only the MLP blocks fuse.
"""
from __future__ import annotations

import argparse
from pathlib import Path

# name: (width D, heads, depth)
SIZES = {"tiny": (192, 3, 12), "small": (384, 6, 12), "base": (768, 12, 12)}
IMAGE, PATCH, CLASSES = 224, 16, 1000


def build_vit(size: str, layerscale: bool = False):
    """The ViT of `size` as a torch module in eval mode; `layerscale`: each branch scaled per channel
    before its residual (timm's `LayerScale`, init 1e-5 in DeiT-III, here 0.1 +- 0.05 as trained ones are)."""
    import torch
    from torch import nn

    dim, heads, depth = SIZES[size]

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
            att = (q @ k.transpose(-2, -1)) * (dim // heads) ** -0.5
            return self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, n, dim))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    class LayerScale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gamma = nn.Parameter(0.05 + 0.1 * torch.rand(dim))

        def forward(self, x):
            return x * self.gamma

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), Attention()
            self.norm2, self.mlp = nn.LayerNorm(dim, eps=1e-6), Mlp()
            self.ls1, self.ls2 = (LayerScale(), LayerScale()) if layerscale else (nn.Identity(), nn.Identity())

        def forward(self, x):
            x = x + self.ls1(self.attn(self.norm1(x)))
            return x + self.ls2(self.mlp(self.norm2(x)))

    class VisionTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch_embed = nn.Conv2d(3, dim, PATCH, PATCH)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
            self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, dim) * 0.02)
            self.blocks = nn.Sequential(*[Block() for _ in range(depth)])
            self.norm, self.head = nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, CLASSES)

        def forward(self, x):
            x = self.patch_embed(x).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
            return self.head(self.norm(self.blocks(x))[:, 0])

    torch.manual_seed(0)
    model = VisionTransformer()
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
    nn.init.trunc_normal_(model.cls_token, std=0.02)
    return model.eval()


def export(size: str, out: Path, layerscale: bool = False) -> Path:
    """torch.onnx.export (the TorchScript exporter, opset 17) with a dynamic batch."""
    import torch
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(build_vit(size, layerscale), (torch.randn(2, 3, IMAGE, IMAGE),), str(out), input_names=["x"],
                          output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
                          opset_version=17, dynamo=False)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--layerscale", action="store_true", help="LayerScale on both branches (DeiT-III, CaiT, DINOv2)")
    ap.add_argument("--out", default=None, help="the .onnx file (default build/vit/vit_<size>[_ls].onnx)")
    args = ap.parse_args(argv)
    name = f"vit_{args.size}{'_ls' if args.layerscale else ''}.onnx"
    out = Path(args.out or Path(__file__).resolve().parent.parent / "build" / "vit" / name)
    print(f"wrote {export(args.size, out, args.layerscale)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
