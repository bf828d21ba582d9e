"""python -m onnx2fused.bench MODEL ... (the same as `onnx2fused bench MODEL ...`)."""
import sys

from ..cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
