"""Shared test setup.

Tests build many plugin libraries in throwaway caches; on a Hopper GPU host each wide chain would first
build and time its tuning library (onnx2fused/wide_tune.py: minutes of nvcc per chain). The suite runs
with tuning off unless a test turns it on (tests/test_wide_tune.py, tests/test_gpu_tune.py); subprocesses
(the CLI tests) inherit the setting.
"""
import os

os.environ.setdefault("ONNX2FUSED_TUNE", "0")
