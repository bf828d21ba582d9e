"""Package list for setuptools (all metadata lives in pyproject.toml).

pyproject.toml cannot combine automatic package discovery with the two mapped data packages,
so the list is computed here: every onnx2fused* package, plus onnx2fused._data.templates
(repo-root templates/) and onnx2fused._data.ort_plugin (repo-root ort_plugin/).
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["onnx2fused", "onnx2fused.*"])
    + ["onnx2fused._data.templates", "onnx2fused._data.ort_plugin"],
)
