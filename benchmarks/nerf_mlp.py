"""The original NeRF MLP (Mildenhall et al., as nerf-pytorch writes it), for `onnx2fused bench` and the tests.

    pts (63 after positional encoding), views (27): x = [pts | views], 90 features a row
    h = relu(L_i(h)) for 8 layers of 256, with the skip h = cat([pts, h]) after the fifth (so the sixth is 319 wide)
    alpha = L(h) (256 -> 1); rgb = L(relu(L(cat([L(h), views])))) (256 -> 256, 283 -> 128 -> 3)

The exporters write the skip as a Concat of the Split's pts with the fifth ReLU: convert joins the trunk
into one chain through it (passes/skip.py), folds feature_linear (no activation, only concatenated with the
views) into the view head (passes/concat_fold.py), lets the density ride the view head (passes/head_fold.py)
and joins trunk and view head through x (passes/skip_merge.py): one op, x (90) -> y (4).

`--variant pl`: kwea123's nerf_pl NeRF (NeRFPL below): the skip Concat before the fifth layer, the rgb head
ending in a Sigmoid; the same one op.

    python benchmarks/nerf_mlp.py build/nerf        # writes nerf_mlp.onnx (TorchScript, opset 17), rows dynamic
    onnx2fused bench build/nerf/nerf_mlp.onnx --batches 1048576 --reps 50 --no-torch
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import model_export


class NeRF(nn.Module):
    def __init__(self, depth: int = 8, width: int = 256, input_ch: int = 63, input_ch_views: int = 27,
                 skips: tuple[int, ...] = (4,)):
        super().__init__()
        self.input_ch, self.input_ch_views, self.skips = input_ch, input_ch_views, skips
        self.pts_linears = nn.ModuleList(
            [nn.Linear(input_ch, width)]
            + [nn.Linear(width + (input_ch if i in skips else 0), width) for i in range(depth - 1)])
        self.views_linears = nn.ModuleList([nn.Linear(input_ch_views + width, width // 2)])
        self.feature_linear = nn.Linear(width, width)
        self.alpha_linear = nn.Linear(width, 1)
        self.rgb_linear = nn.Linear(width // 2, 3)

    def forward(self, x):
        input_pts, input_views = torch.split(x, [self.input_ch, self.input_ch_views], dim=-1)
        h = input_pts
        for i, layer in enumerate(self.pts_linears):
            h = F.relu(layer(h))
            if i in self.skips:
                h = torch.cat([input_pts, h], -1)
        alpha = self.alpha_linear(h)
        h = torch.cat([self.feature_linear(h), input_views], -1)
        for layer in self.views_linears:
            h = F.relu(layer(h))
        return torch.cat([self.rgb_linear(h), alpha], -1)


class NeRFPL(nn.Module):
    """kwea123's nerf_pl NeRF: xyz_encoding_i = Linear + ReLU (the input concatenated in front of layer
    `skips`), sigma = Linear(h), rgb = Sigmoid(Linear(ReLU(Linear(cat([Linear(h), dir]))))), cat([rgb, sigma])."""

    def __init__(self, depth: int = 8, width: int = 256, in_xyz: int = 63, in_dir: int = 27, skips=(4,)):
        super().__init__()
        self.input_ch, self.input_ch_views, self.skips = in_xyz, in_dir, skips
        self.xyz = nn.ModuleList(nn.Linear(in_xyz if i == 0 else width + (in_xyz if i in skips else 0), width)
                                 for i in range(depth))
        self.xyz_final = nn.Linear(width, width)
        self.dir_encoding = nn.Linear(width + in_dir, width // 2)
        self.sigma = nn.Linear(width, 1)
        self.rgb = nn.Linear(width // 2, 3)

    def forward(self, x):
        input_xyz, input_dir = torch.split(x, [self.input_ch, self.input_ch_views], dim=-1)
        h = input_xyz
        for i, layer in enumerate(self.xyz):
            if i in self.skips:
                h = torch.cat([input_xyz, h], -1)
            h = F.relu(layer(h))
        sigma = self.sigma(h)
        d = F.relu(self.dir_encoding(torch.cat([self.xyz_final(h), input_dir], -1)))
        return torch.cat([torch.sigmoid(self.rgb(d)), sigma], -1)


def export(module: nn.Module, path: Path, features: int | None = None) -> Path:
    """`module` as a TorchScript export at opset 17, rows dynamic (x [N, features] -> y; a NeRF's: 90)."""
    return model_export.export(module, path, features or module.input_ch + module.input_ch_views)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for nerf_mlp.onnx")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variant", choices=("pytorch", "pl"), default="pytorch",
                    help="nerf-pytorch's NeRF (default) or kwea123's nerf_pl (writes nerf_pl.onnx)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    if args.variant == "pl":
        print(export(NeRFPL(width=args.width), args.out / "nerf_pl.onnx"))
    else:
        print(export(NeRF(width=args.width), args.out / "nerf_mlp.onnx"))


if __name__ == "__main__":
    main()
