"""Where the packaged data lives: the jinja2 `templates/` and the hand-written `ort_plugin/` sources.

In a source checkout they sit at the repository root (beside the `onnx2fused` package); in an installed
wheel they are packaged inside it as `onnx2fused/_data/templates` and `onnx2fused/_data/ort_plugin`.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from .errors import ConversionError

_PKG = Path(__file__).resolve().parent


def _candidates(name: str) -> list[Path]:
    return [_PKG / "_data" / name, _PKG.parent / name]


@lru_cache(maxsize=None)
def _find(name: str, marker: str) -> Path:
    for d in _candidates(name):
        if (d / marker).is_file():
            return d
    tried = ", ".join(str(d) for d in _candidates(name))
    raise ConversionError(f"onnx2fused's {name}/ folder is missing (looked in {tried}); reinstall onnx2fused")


def templates_dir() -> Path:
    """The folder holding the jinja2 templates of the generated code."""
    return _find("templates", "cpu_kernel.cc.j2")


def ort_plugin_dir() -> Path:
    """The folder holding the hand-written plugin sources compiled into every library."""
    return _find("ort_plugin", "plugin.cc")
