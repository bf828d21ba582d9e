"""Load an ONNX model for conversion: read it (and its external data), check it, infer shapes.

Every way this can fail becomes one `ConversionError` line that names the file and the way out.
The input file is only read, never written.
"""
from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import external_data_helper

from .errors import ConversionError
from .passes.constants import default_opset, is_ort_default_domain_op

MIN_IR, MAX_IR = 3, 13          # onnxruntime 1.31 refuses IR 14 ("Unsupported model IR version")
MIN_OPSET, MAX_OPSET = 7, 26    # default (ai.onnx) domain opsets onnxruntime 1.31 loads (27 is refused)
_TWO_GB = 2**31 - 1


def load_model(path) -> onnx.ModelProto:
    p = Path(path)
    model = read_model(p)
    _check_versions(p, model)
    if not model.graph.output:
        raise ConversionError(f"{p}: the graph has no outputs, so there is nothing to compute")
    _load_external(p, model)
    try:
        if model.ByteSize() > _TWO_GB:
            onnx.checker.check_model(str(p))
        else:
            onnx.checker.check_model(model)
    except Exception as e:
        if not _valid_with_ort_ops(model):
            raise ConversionError(f"{p}: the ONNX checker rejects the model: {_first_line(e)}") from None
    try:
        if model.ByteSize() <= _TWO_GB:
            model = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as e:
        raise ConversionError(f"{p}: shape inference failed: {_first_line(e)}") from None
    return model


def _valid_with_ort_ops(model: onnx.ModelProto) -> bool:
    """Whether the checker passes `model` once ONNX Runtime's own default-domain ops
    (passes.constants.ORT_DEFAULT_DOMAIN_OPS) are stood in for by Identity (a model ORT's graph optimiser
    saved is valid for ORT, not for the checker)."""
    opset = default_opset(model)
    if model.ByteSize() > _TWO_GB or not any(is_ort_default_domain_op(n, opset) for n in model.graph.node):
        return False
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for n in copy.graph.node:
        if is_ort_default_domain_op(n, opset):
            n.CopyFrom(onnx.helper.make_node("Identity", n.input[:1], n.output[:1], name=n.name))
    try:
        onnx.checker.check_model(copy)
    except Exception:
        return False
    return True


def read_model(path) -> onnx.ModelProto:
    """The model proto of `path` without its external data (which load_model adds): a clear
    ConversionError for a missing, unreadable, empty, truncated or non-ONNX file."""
    p = Path(path)
    if not p.exists():
        raise ConversionError(f"{p}: no such file")
    if p.is_dir():
        raise ConversionError(f"{p}: is a directory, not an ONNX model file")
    if not _is_regular_file(p):  # a FIFO or a device would block or never end
        raise ConversionError(f"{p}: not a regular file (a pipe, socket or device); save the model to a file")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise ConversionError(f"{p}: cannot read the file ({e.strerror or e})") from None
    if not data:
        raise ConversionError(f"{p}: the file is empty")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        if data[:1] == b"\x08" and 1 <= data[1] <= 20:  # starts like a ModelProto: field 1 = ir_version
            raise ConversionError(f"{p}: truncated or corrupt ONNX file (protobuf parse failed: {e})") from None
        raise ConversionError(f"{p}: not an ONNX model (the bytes are not an ONNX protobuf)") from None
    if model.ir_version == 0 or not model.HasField("graph"):
        raise ConversionError(f"{p}: not an ONNX model (no IR version or graph in the file)")
    return model


def _is_regular_file(p: Path) -> bool:
    try:
        return stat.S_ISREG(p.stat().st_mode)
    except OSError:
        return True  # let the read below report the error


def _first_line(e: Exception) -> str:
    lines = [l.strip() for l in str(e).strip().splitlines() if l.strip()]
    return lines[0] if lines else type(e).__name__


def _check_versions(p: Path, model: onnx.ModelProto) -> None:
    if not MIN_IR <= model.ir_version <= MAX_IR:
        raise ConversionError(f"{p}: IR version {model.ir_version} is outside what onnxruntime supports "
                              f"({MIN_IR}..{MAX_IR}); re-export with an older exporter setting or convert it "
                              f"with onnx.version_converter")
    opsets = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not opsets:
        raise ConversionError(f"{p}: the model imports no default-domain (ai.onnx) opset")
    v = opsets[0]
    if not MIN_OPSET <= v <= MAX_OPSET:
        raise ConversionError(f"{p}: opset {v} is outside the supported range {MIN_OPSET}..{MAX_OPSET}; "
                              f"convert it with onnx.version_converter.convert_version(model, {min(max(v, MIN_OPSET), MAX_OPSET)})")


def _load_external(p: Path, model: onnx.ModelProto) -> None:
    tensors = [t for t in external_data_helper._get_all_tensors(model) if external_data_helper.uses_external_data(t)]
    if not tensors:
        return
    base = p.parent
    for t in tensors:
        loc, offset, length = _external_info(p, t)
        if not loc or os.path.isabs(loc) or ".." in Path(loc).parts:
            raise ConversionError(f"{p}: tensor '{t.name}' has an unsafe external data location {loc!r}")
        f = base / loc
        if not f.is_file():
            raise ConversionError(f"{p}: missing external data file '{loc}' (expected at {f}) for tensor '{t.name}'")
        need = offset + length
        if length and f.stat().st_size < need:
            raise ConversionError(f"{p}: external data file '{loc}' is truncated ({f.stat().st_size} bytes, "
                                  f"tensor '{t.name}' needs {need})")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            external_data_helper.load_external_data_for_model(model, str(base))
    except Exception as e:
        raise ConversionError(f"{p}: cannot load external data: {_first_line(e)}") from None


def _external_info(p: Path, t: onnx.TensorProto) -> tuple[str, int, int]:
    """(location, offset, length) of an external tensor; a corrupt entry is a ConversionError."""
    try:
        with warnings.catch_warnings():  # onnx warns (on stderr) about unknown keys; a bad location fails below
            warnings.simplefilter("ignore")
            info = external_data_helper.ExternalDataInfo(t)
        loc, offset, length = info.location, int(info.offset or 0), int(info.length or 0)
    except (ValueError, TypeError) as e:
        raise ConversionError(f"{p}: tensor '{t.name}' has corrupt external data information: "
                              f"{_first_line(e)}") from None
    if not isinstance(loc, str):
        raise ConversionError(f"{p}: tensor '{t.name}' has an unreadable external data location {loc!r}")
    if offset < 0 or length < 0:
        raise ConversionError(f"{p}: tensor '{t.name}' has a negative external data offset or length")
    return loc, offset, length
