"""`onnx2fused.from_torch`: a PyTorch module to a fused, validated ONNX model and a ready session, in one step.

    fused = onnx2fused.from_torch(nn.Sequential(...), torch.randn(8, 32))
    y = fused.session.run(None, {"x": x})[0]

Steps: export with `torch.onnx.export(..., dynamo=True)` (the batch dimension of every input symbolic),
`onnx2fused.convert` (which validates the fused model against stock ONNX Runtime on the export), then a
check that the fused model reproduces the module's own output on `example_input`: an exporter slip is
caught here, not in production. The exported model stays beside the fused one (`<stem>.exported.onnx`).
"""
from __future__ import annotations

import logging
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .convert import ConversionResult, check_precision, convert
from .errors import ConversionError, ValidationError
from .validate import CPU_TOLERANCE, TOLERANCES


@dataclass
class TorchConversion:
    path: Path                       # the fused model
    exported_path: Path              # what the dynamo exporter wrote (the conversion's input)
    result: ConversionResult         # convert()'s report (chains, validation vs stock ORT, build)
    session: object                  # onnx2fused.InferenceSession on `path`
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    torch_error: dict[str, float] = field(default_factory=dict)   # output -> relative L2 error vs the module

    def run(self, *inputs):
        """Run the fused model on numpy arrays or CPU tensors (positional, in input order)."""
        feeds = {n: _to_numpy(x) for n, x in zip(self.input_names, inputs)}
        return self.session.run(None, feeds)


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _export_names(model_path: Path) -> tuple[list[str], list[str]]:
    import onnx
    m = onnx.load(str(model_path), load_external_data=False)
    inits = {t.name for t in m.graph.initializer}
    return [i.name for i in m.graph.input if i.name not in inits], [o.name for o in m.graph.output]


def _export(module, args: tuple, path: Path, dynamic_batch: bool, input_names, output_names, opset) -> None:
    import torch
    from torch.export import Dim

    dynamic_shapes = None
    if dynamic_batch:
        # one shared symbol: all inputs have the same batch size (a leading dim of 1 would be specialised
        # by torch.export, hence min=1 and the caller's example batch > 1 advice below)
        batch = Dim("batch", min=1, max=2 ** 30)
        dynamic_shapes = tuple({0: batch} if getattr(a, "dim", lambda: 0)() > 0 else None for a in args)
    kwargs = {"dynamo": True, "dynamic_shapes": dynamic_shapes, "verbose": False}
    if input_names:
        kwargs["input_names"] = list(input_names)
    if output_names:
        kwargs["output_names"] = list(output_names)
    if opset is not None:
        kwargs["opset_version"] = opset
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet = [logging.getLogger(n) for n in ("torch.onnx", "torch.export",
                                                 "torch.onnx._internal.exporter._registration")]
        levels = [lg.level for lg in quiet]
        for lg in quiet:
            lg.setLevel(logging.ERROR)
        try:
            with torch.no_grad():
                torch.onnx.export(module, args, str(path), **kwargs)
        except Exception as e:
            hint = ("; give an example_input with batch size > 1 or dynamic_batch=False"
                    if dynamic_batch and any(getattr(a, "shape", (2,))[:1] == (1,) for a in args) else "")
            raise ConversionError(f"torch.onnx.export (dynamo) failed: {_export_error(e)}{hint}") from None
        finally:
            for lg, lv in zip(quiet, levels):
                lg.setLevel(lv)


def require_exporter() -> None:
    """ConversionError (one line, with the install command) unless torch and onnxscript, which
    torch.onnx.export(dynamo=True) imports, are installed."""
    import importlib.util
    missing = [m for m in ("torch", "onnxscript") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConversionError(f"from_torch needs {' and '.join(missing)} (the dynamo exporter uses onnxscript): "
                              'pip install "onnx2fused[torch]" (for the CPU build of torch, install it first '
                              "with --index-url https://download.pytorch.org/whl/cpu)")


def _export_error(e: Exception) -> str:
    """The exporter's own summary line when it has one (its full message is pages of advice)."""
    text = " ".join(str(e).split())
    at = text.find("## Exception summary")
    if at >= 0:
        text = text[at + len("## Exception summary"):].split("(Refer to")[0].strip()
    return text[:500] or type(e).__name__


def from_torch(module, example_input, path=None, precision: str = "auto", validate: bool = True,
               dynamic_batch: bool = True, *, input_names=None, output_names=None, opset: int | None = None,
               cache_dir=None, with_cuda: bool | None = None, providers=None, force: bool = False,
               progress=None) -> TorchConversion:
    """Export `module` (dynamo exporter), fuse its MLP chains, validate, and open a session on the result.

    example_input: a tensor or a tuple of tensors (the module's positional arguments), on the CPU.
    path: the fused model to write (default: `model.fused.onnx` in a new temp folder); the export is
    written beside it as `<stem>.exported.onnx`. validate: compare the fused model with stock ORT
    (convert's validation) and with the module's own output on `example_input`; either failing raises
    ValidationError. Other arguments go to `onnx2fused.convert` / `onnx2fused.InferenceSession`.
    """
    require_exporter()
    import torch

    check_precision(precision)   # before the (slow) export
    if not isinstance(module, torch.nn.Module):
        raise ConversionError(f"from_torch needs a torch.nn.Module, got {type(module).__name__}")
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        raise ConversionError("example_input must be a tensor or a tuple of tensors")
    if any(a.device.type != "cpu" for a in args):
        raise ConversionError("example_input must be on the CPU (the exporter and the checks run there)")

    out = Path(path) if path is not None else Path(tempfile.mkdtemp(prefix="onnx2fused-")) / "model.fused.onnx"
    if not out.parent.is_dir():
        raise ConversionError(f"{out.parent}: folder does not exist")
    stem = out.name[: -len(".onnx")] if out.name.endswith(".onnx") else out.name
    stem = stem[: -len(".fused")] if stem.endswith(".fused") else stem
    exported = out.with_name(stem + ".exported.onnx")
    if exported.resolve() == out.resolve():
        raise ConversionError(f"{out}: choose a fused model path other than {exported.name}")

    was_training = module.training
    module.eval()
    try:
        _export(module, args, exported, dynamic_batch, input_names, output_names, opset)
        with torch.no_grad():
            expected = module(*args)
    finally:
        module.train(was_training)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)

    result = convert(exported, out, precision=precision, validate=validate, cache_dir=cache_dir,
                     with_cuda=with_cuda, force=force, progress=progress)
    from .session import InferenceSession
    session = InferenceSession(str(out), providers=providers)
    ins, outs = _export_names(out)
    fused = TorchConversion(out, exported, result, session, ins, outs)
    got = fused.run(*args)
    for name, e, g in zip(outs, expected, got):
        e = _to_numpy(e).astype(np.float64)
        g = np.asarray(g, dtype=np.float64)
        if e.shape != g.shape:
            raise ValidationError(f"output '{name}': the fused model gives shape {g.shape}, the module {e.shape}")
        denom = np.linalg.norm(e)
        fused.torch_error[name] = float(np.linalg.norm(g - e) / denom) if denom else float(np.abs(g - e).max(initial=0))
    if validate:
        _check_against_torch(fused, session)
    return fused


def _check_against_torch(fused: TorchConversion, session) -> None:
    # the session's EP decides the compute precision of the plugin, as in convert's validation
    on_cpu = session.get_providers()[0] == "CPUExecutionProvider"
    tol = CPU_TOLERANCE if on_cpu else TOLERANCES[fused.result.precision]
    # convert bounds fused-vs-stock-ORT by tol on its own inputs; a small example_input (few rows) gives a
    # noisier relative error, and torch's fp32 kernels round differently from ORT's: allow 2x plus 1e-5
    tol = 2 * tol + 1e-5
    bad = {n: e for n, e in fused.torch_error.items() if not e <= tol}
    if bad:
        n, e = next(iter(bad.items()))
        raise ValidationError(f"the fused model differs from the torch module on example_input: output '{n}' "
                              f"relative error {e:.3g} > {tol:g}")
