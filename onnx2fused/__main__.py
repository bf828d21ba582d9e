"""`python -m onnx2fused ...` = the `onnx2fused` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
