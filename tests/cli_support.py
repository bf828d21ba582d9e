"""Run the `onnx2fused` command in a subprocess, the way a user does: this checkout on PYTHONPATH,
ONNX2FUSED_DEBUG unset (so errors are the one-line kind), no stdin."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, cwd=None, env_extra=None, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ONNX2FUSED_DEBUG", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "onnx2fused", *map(str, args)], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
