"""onnx2fused: fuse the MLP chains of an ONNX model into generated CUDA/C++ kernels for ONNX Runtime."""
from ._version import __version__

from .errors import BuildError, ConversionError, ValidationError  # noqa: E402
from .convert import ConversionResult, InspectResult, convert, inspect  # noqa: E402  (rebinds the name `convert`)

__all__ = ["__version__", "convert", "inspect", "InferenceSession", "from_torch", "TorchConversion",
           "ConversionError", "ValidationError", "BuildError", "ConversionResult", "InspectResult"]

# Lazy attributes: importing onnx2fused imports neither onnxruntime nor torch until one of these is asked for.
_LAZY = {"InferenceSession": "session", "from_torch": "torch_export", "TorchConversion": "torch_export"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'onnx2fused' has no attribute {name!r}")
