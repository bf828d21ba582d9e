"""onnx2fused: fuse the MLP chains of an ONNX model into generated CUDA/C++ kernels for ONNX Runtime."""
__version__ = "0.1.0"
