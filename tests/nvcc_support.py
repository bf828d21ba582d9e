"""Compiling a generated unit with nvcc in a test, as build.py would, and reading what ptxas said of one
kernel (tests/test_wgmma_build.py, tests/test_light_gemm_build.py)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path


def compile_kept(nvcc: str, flags: list[str], folder: Path, source: str) -> tuple[str, Path]:
    """`source` (with its headers already in `folder`) compiled to an object with ptxas's report and the
    intermediate files kept; returns nvcc's output and the folder of kept files (the .ptx among them).
    The unit is written as k.cu: a short name for the kept files."""
    (folder / "k.cu").write_text(source)
    keep = folder / "keep"
    keep.mkdir()
    r = subprocess.run([nvcc, *flags, "-Xptxas", "-v", "--keep", "--keep-dir", str(keep), "-I", str(folder),
                        "-c", str(folder / "k.cu"), "-o", str(folder / "k.o")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr, keep


def ptxas_entry(log: str, kernel: str, arch: str = "sm_90a", spill_bytes: int = 0) -> str:
    """ptxas's report of the entry function whose mangled name contains `kernel`, for `arch`; asserts
    it spilled nothing (at most `spill_bytes` of stores, where a plan's spills were measured and kept) and
    that no wgmma was serialized anywhere in the unit."""
    entry = re.search(rf"Compiling entry function '\S*{kernel}\S*' for '{arch}'(.*?)Compile time", log, re.S)
    assert entry, log[-3000:]
    text = entry.group(1)
    if spill_bytes:
        stores = re.search(r"(\d+) bytes spill stores", text)
        assert stores and int(stores.group(1)) <= spill_bytes, text
    else:
        assert "0 bytes spill stores, 0 bytes spill loads" in text and "0 bytes stack frame" in text, text
    assert "C7510" not in log and "C7512" not in log and "serializ" not in log.lower(), log[-3000:]
    return text
