"""`InferenceSession`: an onnxruntime session with the fused model's recorded plugin registered.

    sess = onnx2fused.InferenceSession("model.fused.onnx")     # CUDA EP first when available, then CPU

The library is `metadata_props["onnx2fused.plugin"]`, a path relative to the model file's folder.
A model without that entry (nothing was fused) opens as a plain session.
"""
from __future__ import annotations

import os
from pathlib import Path

import onnx
import onnxruntime as ort

from .errors import ConversionError

PLUGIN_KEY = "onnx2fused.plugin"

# SessionOptions attributes copied onto the session's own options (the caller's object is not modified).
_OPTION_ATTRS = ("enable_cpu_mem_arena", "enable_mem_pattern", "enable_mem_reuse", "enable_profiling",
                 "execution_mode", "execution_order", "graph_optimization_level", "inter_op_num_threads",
                 "intra_op_num_threads", "log_severity_level", "log_verbosity_level", "logid",
                 "optimized_model_filepath", "profile_file_prefix", "use_deterministic_compute")


class PluginNotFoundError(ConversionError, FileNotFoundError):
    """The fused model's plugin library is not where its metadata says."""


def plugin_path(model_path) -> Path | None:
    """The plugin library recorded in the model (resolved against the model's folder), or None."""
    p = Path(model_path)
    try:
        model = onnx.load(str(p), load_external_data=False)
    except FileNotFoundError:
        raise ConversionError(f"{p}: no such file") from None
    except Exception as e:
        raise ConversionError(f"{p}: cannot read the model: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    meta = {m.key: m.value for m in model.metadata_props}
    rel = meta.get(PLUGIN_KEY)
    if not rel:
        return None
    lib = Path(rel) if os.path.isabs(rel) else p.resolve().parent / rel
    if not lib.is_file():
        raise PluginNotFoundError(f"{p}: its onnx2fused plugin library {lib} is missing (metadata "
                                  f"'{PLUGIN_KEY}' = {rel!r}); copy the library next to the model or "
                                  "convert the model again")
    return lib


def copy_session_options(so: ort.SessionOptions | None) -> ort.SessionOptions:
    """A new SessionOptions with the settable attributes of `so`.

    Session config entries, added initializers and custom-op libraries already registered on `so` cannot
    be read back from onnxruntime and are not copied.
    """
    new = ort.SessionOptions()
    if so is None:
        return new
    for a in _OPTION_ATTRS:
        try:
            setattr(new, a, getattr(so, a))
        except (AttributeError, TypeError):
            pass
    return new


def default_providers() -> list[str]:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class InferenceSession(ort.InferenceSession):
    """onnxruntime.InferenceSession for a model written by `onnx2fused.convert`."""

    def __init__(self, path, sess_options: ort.SessionOptions | None = None, providers=None, **kwargs):
        if isinstance(path, (bytes, bytearray)):
            raise TypeError("onnx2fused.InferenceSession needs the model's file path (the plugin is found "
                            "relative to it)")
        path = os.fspath(path)
        lib = plugin_path(path)
        so = sess_options
        if lib is not None:
            so = copy_session_options(sess_options)
            so.register_custom_ops_library(str(lib))
        self.plugin_path = lib
        super().__init__(path, so, providers=providers if providers is not None else default_providers(), **kwargs)
