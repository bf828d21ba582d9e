"""Every command in README.md is run (or, where running it is not possible here, checked).

The ```sh blocks and then ```python blocks are run in document order, in one temp folder, with the
placeholder model `my_mlp.onnx` being a copy of the zoo's nerf model (input `x`: [B, 32]), so that later
commands see what earlier ones wrote, as a reader following the README would. Per command:

  onnx2fused ...     run with the checkout's package; must exit 0. `bench` gets a quick `--out` and a
                     short sweep so the test stays short; a GPU `bench` (no --cpu) on a host without a
                     GPU must exit 2 saying so.
  make TARGET        `make -n TARGET` in the repository: the target exists and its recipe expands
                     (running it would rebuild the venv / run the suite from inside the suite).
  pip install ...    not run here (it would change this environment): the extras it names must exist in
                     pyproject.toml, a wheel path must be the one `make wheel` writes for this version,
                     and a torch pin and index must be the Makefile's; tests/test_packaging.py builds the
                     wheel with `make wheel`, installs it with `[cpu]` into a fresh venv and runs the
                     commands there.
  docker run ...     no container runtime here: the folder it mounts must exist (written by the commands
                     before it) and the container path must be the repository root that the generated
                     config.pbtxt files name in op_library_filename, and that --model-repository serves.
  anything else      run with bash; must exit 0.

```python blocks run with `x` (a [4, 32] float32 array) predefined, as the text around them implies.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PLACEHOLDER_MODEL = "my_mlp.onnx"
ZOO_MODEL = ROOT / "models" / "nerf.opset17.onnx"
PY_PREAMBLE = "import numpy as np\nx = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)\n"


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.M | re.S)]


def sh_commands(body: str) -> list[str]:
    """The commands of an sh block: comments dropped, backslash continuations joined."""
    cmds, cur = [], ""
    for line in body.splitlines():
        cur += line
        if cur.endswith("\\"):
            cur = cur[:-1] + " "
            continue
        words = shlex.split(cur, comments=True)
        if words:
            cmds.append(cur)
        cur = ""
    return cmds


def readme_steps() -> list[tuple[str, str]]:
    steps = []
    for lang, body in blocks(README.read_text()):
        if lang == "sh":
            steps += [("sh", c) for c in sh_commands(body)]
        elif lang == "python":
            steps.append(("python", body))
    return steps


def test_readme_has_commands():
    kinds = {k for k, _ in readme_steps()}
    assert kinds == {"sh", "python"}
    firsts = {shlex.split(c, comments=True)[0] for k, c in readme_steps() if k == "sh"}
    assert {"onnx2fused", "make", "pip"} <= firsts


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # the checkout's package first, the interpreter's bin folder (entry point `onnx2fused`) on PATH
    e = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
             PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    e.setdefault("ONNX2FUSED_CACHE", str(tmp_path_factory.mktemp("o2f-readme-cache")))
    e.pop("ONNX2FUSED_DEBUG", None)
    return e


def _has_gpu() -> bool:
    import onnxruntime as ort
    return "CUDAExecutionProvider" in ort.get_available_providers()


def _check_make(words: list[str], env) -> None:
    targets = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
    p = subprocess.run(["make", "-n", *targets], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"make -n {' '.join(targets)}: {p.stderr}"


def _makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*\?=\s*(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, f"Makefile: no {name}"
    return m.group(1).strip()


def _check_pip(words: list[str]) -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    import onnx2fused
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    checked = False
    for w in words[2:]:
        m = re.fullmatch(r"(onnx2fused|dist/onnx2fused-([^-]+)-py3-none-any\.whl)\[([\w,]+)\]", w)
        if m:
            assert not m.group(2) or m.group(2) == onnx2fused.__version__, \
                f"`{' '.join(words)}`: make wheel writes onnx2fused-{onnx2fused.__version__}-py3-none-any.whl"
            assert m.group(1) != "onnx2fused", f"`{' '.join(words)}`: onnx2fused is not on PyPI"
            missing = [x for x in m.group(3).split(",") if x not in extras]
            assert not missing, f"`{' '.join(words)}`: no extra {missing} in pyproject.toml"
            checked = True
        elif w.startswith("torch=="):
            assert w == _makefile_var("TORCH"), f"`{' '.join(words)}`: the Makefile pins {_makefile_var('TORCH')}"
            at = words.index("--index-url")
            assert words[at + 1] == _makefile_var("TORCH_INDEX") == "https://download.pytorch.org/whl/cpu"
            checked = True
    assert checked, f"`{' '.join(words)}`: nothing this test knows how to check"


def _check_docker(words: list[str], cwd: Path) -> None:
    mounts = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-v", "--volume")]
    repo_flag = next((w.split("=", 1)[1] for w in words if w.startswith("--model-repository=")), None)
    assert mounts and repo_flag, "the docker line mounts no model repository"
    for m in mounts:
        host, container = m.split(":")[:2]
        host_dir = Path(host.replace("$PWD", str(cwd)))
        configs = sorted(host_dir.glob("*/config.pbtxt"))
        assert configs, f"{host_dir}: no model written there by the README's commands"
        assert container == repo_flag, f"mounted at {container}, served from {repo_flag}"
        for c in configs:
            libs = re.findall(r'op_library_filename:\s*"([^"]+)"', c.read_text())
            assert libs, f"{c}: no op_library_filename"
            for lib in libs:
                assert lib.startswith(container.rstrip("/") + "/"), f"{c}: {lib} is not under {container}"
                assert (host_dir / lib[len(container.rstrip("/")) + 1:]).is_file(), f"{lib}: not in the repository"


def _run_onnx2fused(cmd: str, words: list[str], cwd: Path, env) -> None:
    gpu_bench_here = len(words) > 1 and words[1] == "bench" and "--cpu" not in words and not _has_gpu()
    tune_without_gpu = len(words) > 1 and words[1] == "tune" and not _has_gpu()
    if len(words) > 1 and words[1] == "bench":
        extra = ["--out", "bench_out", "--batches", "1024", "--reps", "3", "--no-torch"]
        cmd = " ".join([shlex.join(words)] + extra)
    p = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if gpu_bench_here:   # nothing can run: a non-zero exit that says why
        assert p.returncode == 2 and "no GPU" in p.stderr, (p.returncode, p.stderr[-3000:])
        return
    if tune_without_gpu:   # the search needs a Hopper GPU: a non-zero exit that says so
        assert p.returncode == 2 and "nothing to tune" in p.stderr and "Hopper" in p.stderr, \
            (p.returncode, p.stderr[-3000:])
        return
    assert p.returncode == 0, f"`{cmd}` exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    if words[1] == "bench":
        assert (cwd / "bench_out" / "bench.json").is_file() and "(p10..p90)" in p.stdout


def test_readme_commands_run(tmp_path, env):
    shutil.copyfile(ZOO_MODEL, tmp_path / PLACEHOLDER_MODEL)
    ran = []
    for kind, step in readme_steps():
        if kind == "python":
            p = subprocess.run([sys.executable, "-c", PY_PREAMBLE + step], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=900)
            assert p.returncode == 0, f"README python block failed:\n{step}\n{p.stderr[-3000:]}"
            ran.append("python")
            continue
        words = shlex.split(step, comments=True)
        if words[0] == "make":
            _check_make(words, env)
        elif words[:2] == ["pip", "install"]:
            _check_pip(words)
        elif words[0] == "docker":
            _check_docker(words, tmp_path)
        elif words[0] == "onnx2fused":
            _run_onnx2fused(step, words, tmp_path, env)
        else:
            p = subprocess.run(["bash", "-c", step], cwd=tmp_path, env=env, capture_output=True, text=True,
                               timeout=900)
            assert p.returncode == 0, f"`{step}` exited {p.returncode}: {p.stderr[-3000:]}"
        ran.append(" ".join(words[:2]))
    # the README's own promises: its commands produced what it says they do
    assert (tmp_path / "my_mlp.fused.onnx").is_file() and (tmp_path / "my_mlp.fused.onnx2fused.so").is_file()
    assert "onnx2fused doctor" in ran and "onnx2fused export-triton" in ran and "docker run" in ran
