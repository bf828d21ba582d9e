"""onnx2fused: fuse the MLP chains of an ONNX model into generated CUDA/C++ kernels for ONNX Runtime."""
__version__ = "0.1.0"

from .errors import BuildError, ConversionError, ValidationError  # noqa: E402
from .convert import ConversionResult, InspectResult, convert, inspect  # noqa: E402  (rebinds the name `convert`)

__all__ = ["__version__", "convert", "inspect", "InferenceSession", "ConversionError", "ValidationError",
           "BuildError", "ConversionResult", "InspectResult"]


def __getattr__(name):
    # Lazy: importing onnx2fused does not import onnxruntime until a session is asked for.
    if name == "InferenceSession":
        from .session import InferenceSession
        return InferenceSession
    raise AttributeError(f"module 'onnx2fused' has no attribute {name!r}")
