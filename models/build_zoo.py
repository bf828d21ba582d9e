#!/usr/bin/env python3
"""Build the model zoo: small PyTorch MLPs exported to ONNX with both torch exporters.

For each model NAME this writes, next to this script (or into --out):
  NAME.dynamo.onnx   torch.onnx.export(..., dynamo=True): opset 20; weights as external data in
                     NAME.dynamo.onnx.data when the exporter writes them there (kept as written;
                     torch 2.13 does so even for the smallest model). Only the per-node
                     "pkg.torch.onnx.stack_trace" metadata (absolute local paths) is removed.
  NAME.opset17.onnx  torch.onnx.export(..., dynamo=False, opset_version=17): weights inline
and zoo.json describing every file (tests read it). Input is named "x", output "y"; the batch
dimension is symbolic in both exports (ffn3d: batch and sequence).

Gated FFN blocks (issue 16; `block` in the table and in zoo.json): swiglu is LLaMA's form, separate gate,
up and down projections without bias, down(silu(gate(x)) * up(x)); geglu is timm's GluMlp form, one
fc1 of 2H outputs cut with `chunk`, fc2(gelu(a) * b) (the activation on the first half). Their widths
are K0, H, N: the hidden width H is the gated product's.

Transformer FFN blocks (issue 16, second stage; also `block`): preln is the pre-LN block
x + fc2(gelu(fc1(LayerNorm(x)))); llama is LLaMA's MLP block with its hand-written RMSNorm,
x + down(silu(gate(h)) * up(h)), h = x * rsqrt(mean(x^2) + eps) * weight. Their norms' weights (and
LayerNorm's bias) are drawn at random, so that a fused block that dropped them could not pass.

A tabular model (`block` "tabular"): BatchNorm1d on the input features, then Linear, BatchNorm1d, ReLU,
Dropout per hidden layer and a last Linear, with running statistics and affine parameters drawn at random
(the input's |mean| / std below 1): the norms fold into the layers (passes/input_affine.py, chains.py), so
the whole model is one chain reading x.

Deterministic: every model is built from a fixed seed (torch.manual_seed(SEED + index)).
A model whose export fails is recorded in zoo.json under "failed" and skipped.

Usage: python models/build_zoo.py [--out DIR] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

SEED = 1234
HERE = Path(__file__).resolve().parent


def _mlp(widths, act, bias=True):
    import torch.nn as nn

    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1], bias=bias))
        if i < len(widths) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


def model_table():
    """name -> dict(widths, activation, bias, feature_shape, batch_shape, description)."""
    return {
        "nerf": dict(widths=[32, 64, 64, 64, 64, 16], activation="Relu", bias=True,
                     feature_shape=[32], sample_lead=[4]),
        "sdf": dict(widths=[3, 128, 128, 128, 128, 1], activation="Tanh", bias=True,
                    feature_shape=[3], sample_lead=[4]),
        "gelu": dict(widths=[64, 128, 128, 128, 128, 64], activation="Gelu", bias=True,
                     feature_shape=[64], sample_lead=[4]),
        "silu": dict(widths=[256, 256, 256, 256, 256], activation="Silu", bias=True,
                     feature_shape=[256], sample_lead=[4]),
        "mnist": dict(widths=[784, 512, 512, 10], activation="Relu", bias=True,
                      feature_shape=[784], sample_lead=[4]),
        "nobias": dict(widths=[16, 32, 32, 32, 8], activation="Relu", bias=False,
                       feature_shape=[16], sample_lead=[4]),
        "ffn3d": dict(widths=[64, 256, 64], activation="Gelu", bias=True,
                      feature_shape=[64], sample_lead=[2, 8]),
        "swiglu": dict(widths=[64, 256, 64], activation="Silu", bias=False,
                       feature_shape=[64], sample_lead=[4], block="swiglu"),
        "geglu": dict(widths=[64, 128, 64], activation="Gelu", bias=True,
                      feature_shape=[64], sample_lead=[4], block="geglu"),
        "preln": dict(widths=[64, 256, 64], activation="Gelu", bias=True,
                      feature_shape=[64], sample_lead=[4], block="preln"),
        "llama": dict(widths=[64, 128, 64], activation="Silu", bias=False,
                      feature_shape=[64], sample_lead=[4], block="llama"),
        "tabular": dict(widths=[24, 128, 128, 1], activation="Relu", bias=True,
                        feature_shape=[24], sample_lead=[4], block="tabular"),
    }


def _gated(block: str, widths, act, bias: bool):
    import torch
    import torch.nn as nn

    k, h, n = widths

    class SwiGLU(nn.Module):  # LLaMA's FFN
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(k, h, bias=bias)
            self.up = nn.Linear(k, h, bias=bias)
            self.down = nn.Linear(h, n, bias=bias)
            self.act = act()

        def forward(self, x):
            return self.down(self.act(self.gate(x)) * self.up(x))

    class GluMlp(nn.Module):  # timm's GluMlp, activation on the first half
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(k, 2 * h, bias=bias)
            self.fc2 = nn.Linear(h, n, bias=bias)
            self.act = act()

        def forward(self, x):
            a, b = self.fc1(x).chunk(2, dim=-1)
            return self.fc2(self.act(a) * b)

    class RMSNorm(nn.Module):  # LLaMA's, written out (not nn.RMSNorm): what the exporters see in most models
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))
            self.eps = eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class PreLN(nn.Module):  # a pre-LN transformer's FFN sublayer
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(k)
            with torch.no_grad():
                self.norm.weight.copy_(1.0 + 0.1 * torch.randn(k))
                self.norm.bias.copy_(0.1 * torch.randn(k))
            self.fc1 = nn.Linear(k, h, bias=bias)
            self.fc2 = nn.Linear(h, n, bias=bias)
            self.act = act()

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(self.norm(x))))

    class LlamaMLP(nn.Module):  # LLaMA's decoder MLP sublayer: RMSNorm, SwiGLU, residual
        def __init__(self):
            super().__init__()
            self.norm = RMSNorm(k)
            self.ffn = SwiGLU()

        def forward(self, x):
            return x + self.ffn(self.norm(x))

    return {"swiglu": SwiGLU, "geglu": GluMlp, "preln": PreLN, "llama": LlamaMLP}[block]()


def _tabular(widths):
    import torch
    import torch.nn as nn

    mods = [nn.BatchNorm1d(widths[0])]
    for i, (k, n) in enumerate(zip(widths, widths[1:])):
        mods.append(nn.Linear(k, n))
        if i < len(widths) - 2:
            mods += [nn.BatchNorm1d(n), nn.ReLU(), nn.Dropout(0.1)]
    with torch.no_grad():
        for bn in (m for m in mods if isinstance(m, nn.BatchNorm1d)):
            var = torch.rand(bn.num_features) + 0.5
            bn.running_var.copy_(var)
            bn.running_mean.copy_((torch.rand(bn.num_features) * 2 - 1) * var.sqrt())
            bn.weight.copy_(torch.rand(bn.num_features) + 0.5)
            bn.bias.copy_(0.1 * torch.randn(bn.num_features))
    return nn.Sequential(*mods)


def build_module(name: str, index: int):
    import torch
    import torch.nn as nn

    acts = {"Relu": nn.ReLU, "Tanh": nn.Tanh, "Gelu": nn.GELU, "Silu": nn.SiLU}
    info = model_table()[name]
    torch.manual_seed(SEED + index)
    if info.get("block") == "tabular":
        m = _tabular(info["widths"])
    elif "block" in info:
        m = _gated(info["block"], info["widths"], acts[info["activation"]], info["bias"])
    else:
        m = _mlp(info["widths"], acts[info["activation"]], bias=info["bias"])
    m.eval()
    return m


def _example(info, index):
    import torch

    g = torch.Generator().manual_seed(SEED + 1000 + index)
    return torch.randn(*info["sample_lead"], *info["feature_shape"], generator=g)


def _export_dynamo(m, x, path: Path, rank: int):
    import torch
    from torch.export import Dim

    dims = {0: Dim("batch", min=1, max=2**30)}
    if rank == 3:
        dims[1] = Dim("seq", min=1, max=2**20)
    torch.onnx.export(m, (x,), str(path), dynamo=True, input_names=["x"], output_names=["y"],
                      dynamic_shapes=(dims,), verbose=False)
    _strip_stack_traces(path)


def _strip_stack_traces(path: Path):
    """The dynamo exporter records a Python stack trace (absolute paths of this machine's
    site-packages) on every node; drop it so the files are the same bytes on every machine."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)  # external data stays where it is
    changed = False
    for node in model.graph.node:
        keep = [p for p in node.metadata_props if p.key != "pkg.torch.onnx.stack_trace"]
        if len(keep) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(keep)
            changed = True
    if changed:
        onnx.save(model, str(path))


def _export_legacy(m, x, path: Path, rank: int):
    import torch

    axes = {0: "batch"}
    if rank == 3:
        axes[1] = "seq"
    torch.onnx.export(m, (x,), str(path), dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": axes, "y": dict(axes)},
                      do_constant_folding=True)


def _describe(path: Path):
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    ext = sorted({e.value for t in model.graph.initializer for e in t.external_data
                  if e.key == "location"})
    ops = sorted({n.op_type for n in model.graph.node})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    inp = model.graph.input[0]
    dims = [d.dim_param if d.dim_param else d.dim_value for d in inp.type.tensor_type.shape.dim]
    return dict(file=path.name, external_data=ext, opset=opset, ir_version=model.ir_version,
                ops=ops, input_dims=dims, output=model.graph.output[0].name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args(argv)

    import torch

    warnings.filterwarnings("ignore")
    import logging
    for lg in ("torch.onnx", "torch.onnx._internal.exporter._registration", "torch.export"):
        logging.getLogger(lg).setLevel(logging.ERROR)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    table = model_table()
    names = list(table) if not args.only else args.only
    entries, failed = [], []
    for index, name in enumerate(table):
        if name not in names:
            continue
        info = table[name]
        m = build_module(name, index)
        x = _example(info, index)
        rank = x.dim()
        files = {}
        for kind, fn in (("dynamo", _export_dynamo), ("opset17", _export_legacy)):
            path = out / f"{name}.{kind}.onnx"
            for stale in (path, path.with_name(path.name + ".data")):
                if stale.exists():
                    stale.unlink()
            try:
                with torch.no_grad():
                    fn(m, x, path, rank)
                files[kind] = _describe(path)
                print(f"  wrote {path.name}" + (f" (+ {', '.join(files[kind]['external_data'])})"
                                                if files[kind]["external_data"] else ""))
            except Exception as e:  # record and go on: one exporter failing must not block the zoo
                msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                print(f"  FAILED {name} ({kind}): {msg}", file=sys.stderr)
                traceback.print_exc(limit=3, file=sys.stderr)
                failed.append(dict(name=name, exporter=kind, error=msg))
                for stale in (path, path.with_name(path.name + ".data")):
                    if stale.exists():
                        stale.unlink()
        entries.append(dict(
            name=name,
            input="x",
            output="y",
            feature_shape=info["feature_shape"],
            rank=rank,
            sample_shape=list(x.shape),
            widths=info["widths"],
            activations=[info["activation"]] * (len(info["widths"]) - 2),
            activation=info["activation"],
            bias=info["bias"],
            seed=SEED + index,
            files=files,
            **({"block": info["block"]} if "block" in info else {}),
        ))

    old_path = out / "zoo.json"
    if args.only and old_path.is_file():  # a partial rebuild keeps the other models' entries
        old = json.loads(old_path.read_text())
        done = {e["name"] for e in entries}
        entries = [e for e in old.get("models", []) if e["name"] not in done] + entries
        entries.sort(key=lambda e: list(table).index(e["name"]) if e["name"] in table else 99)
        failed = [f for f in old.get("failed", []) if f["name"] not in done] + failed
    manifest = dict(
        generator="models/build_zoo.py",
        torch=torch.__version__.split("+")[0],
        note=("activations: one per hidden layer (the last Linear has none); "
              "widths: K0, N0, N1, ...; files[kind].external_data lists the external "
              "weight files the exporter wrote (empty = weights inline)"),
        models=entries,
        failed=failed,
    )
    (out / "zoo.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in out.iterdir() if ".onnx" in p.name)
    print(f"zoo: {sum(len(e['files']) for e in entries)} files, {total / 1e6:.1f} MB, "
          f"{len(failed)} failed -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
