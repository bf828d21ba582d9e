"""`InferenceSession`: an onnxruntime session with the fused model's recorded plugin registered.

    sess = onnx2fused.InferenceSession("model.fused.onnx")     # CUDA EP first when available, then CPU

The library is `metadata_props["onnx2fused.plugin"]`, a file name in the model file's folder (convert
writes them side by side; a name that points elsewhere is refused: a model file must not choose which
shared library a process loads). A model without that entry (nothing was fused) opens as a plain session.
"""
from __future__ import annotations

import os
import threading
import warnings
import weakref
from pathlib import Path

import onnx
import onnxruntime as ort

from .errors import ConversionError
from .spec import PLUGIN_KEY, holds_fused_nodes


# SessionOptions attributes copied where the caller's options already hold another fused model's plugin.
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
    if Path(rel).name != rel or rel in (".", ".."):
        raise ConversionError(f"{p}: its '{PLUGIN_KEY}' entry {rel!r} is not a file name beside the model; "
                              "onnx2fused.InferenceSession loads only a library in the model's folder")
    lib = p.resolve().parent / rel
    if not holds_fused_nodes(model):
        return None   # no fused node left (e.g. ORT's optimised copy, saved without the plugin): plain ORT runs it
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


# The plugin each caller's SessionOptions got from InferenceSession. Every plugin defines the custom-op
# domain "onnx2fused", and onnxruntime refuses a second library of the same domain on one SessionOptions
# ("Domain already set in registry"), so an options object holds one plugin.
_REGISTERED: "weakref.WeakKeyDictionary[ort.SessionOptions, Path]" = weakref.WeakKeyDictionary()
_REGISTERING = threading.Lock()   # sessions opened from several threads with one options object: one registration


def _options_with(lib: Path, so: ort.SessionOptions | None) -> ort.SessionOptions:
    """The options to open a session with `lib`: the caller's own, with the plugin registered on them
    (once), so that everything set on them counts (session config entries, free dimension overrides,
    initializers, other libraries); where they already hold another fused model's plugin, a copy of their
    settable attributes with `lib` (the rest cannot be read back from onnxruntime: a warning says so)."""
    if so is None:
        so = ort.SessionOptions()
    with _REGISTERING:
        held = _REGISTERED.get(so)
        if held == lib:
            return so
        if held is not None:
            warnings.warn(f"these SessionOptions already hold the plugin {held.name}; the session for {lib.name} "
                          "uses a copy of their attributes, without their session config entries, initializers "
                          "or other libraries (use one SessionOptions per fused model)", stacklevel=3)
            so = copy_session_options(so)
        so.register_custom_ops_library(str(lib))
        _REGISTERED[so] = lib
        return so


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
        so = _options_with(lib, sess_options) if lib is not None else sess_options
        self.plugin_path = lib
        try:
            super().__init__(path, so, providers=providers if providers is not None else default_providers(),
                             **kwargs)
        except Exception as e:
            if lib is not None and "Domain already set" in str(e):   # an onnx2fused library registered by hand
                raise ConversionError(f"{path}: its SessionOptions already hold another onnx2fused plugin (every "
                                      "plugin defines the 'onnx2fused' op domain): use one SessionOptions per "
                                      "fused model") from e
            raise
