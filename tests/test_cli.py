"""The `onnx2fused` command through `python -m onnx2fused` (subprocess): errors, nothing-to-fuse, JSON, inspect."""
from __future__ import annotations

import importlib.machinery
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import onnx
import pytest

from cli_support import run_cli
from onnx_builders import G

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"


def cli(*args, cwd=None):
    return run_cli(*args, cwd=cwd, timeout=300)


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("o2f-cli-cache")


def two_layer_with_graph_output_break():
    """x -> fc0 -> relu (h, also a graph output) -> fc1 -> y."""
    g = G()
    h = g.op("Relu", [g.linear("x", 8, 16, name="fc0")], name="relu0", outputs=["h"])
    g.linear(h, 16, 4, name="fc1")
    g.nodes[-1].output[0] = "y"
    return g.model([("x", ["B", 8])], [("y", ["B", 4]), ("h", ["B", 16])])


def nothing_to_fuse():
    """A Gemm whose weight is a graph input (refused) and a Softmax: no chain."""
    g = G()
    h = g.op("Gemm", ["x", "w"], name="fc", outputs=["h"])
    g.op("Softmax", [h], name="sm", outputs=["y"])
    return g.model([("x", ["B", 8]), ("w", [8, 4])], [("y", ["B", 4])])


def _bad_inputs(d: Path) -> dict[str, Path]:
    good = (MODELS / "nerf.opset17.onnx").read_bytes()
    (d / "not_onnx.onnx").write_text("this is not an onnx model\n" * 20)
    (d / "truncated.onnx").write_bytes(good[: len(good) // 2])
    shutil.copyfile(MODELS / "nerf.dynamo.onnx", d / "nodata.onnx")  # its .onnx.data is not copied
    (d / "empty.onnx").write_bytes(b"")
    (d / "adir.onnx").mkdir()
    return {"not_onnx": d / "not_onnx.onnx", "truncated": d / "truncated.onnx", "missing_data": d / "nodata.onnx",
            "empty": d / "empty.onnx", "directory": d / "adir.onnx", "missing_file": d / "nope.onnx",
            "missing_folder": d / "no" / "such" / "dir.onnx"}


def _snapshot(d: Path) -> dict:
    return {p.relative_to(d): (p.read_bytes() if p.is_file() else None) for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize("case", ["not_onnx", "truncated", "missing_data", "empty", "directory", "missing_file",
                                  "missing_folder"])
def test_bad_input_one_line_exit_2(case, tmp_path, cache):
    src = _bad_inputs(tmp_path)[case]
    before = _snapshot(tmp_path)
    out = tmp_path / "out.fused.onnx"
    p = cli("convert", src, "-o", out, "--cpu-only", "--cache-dir", cache)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnx2fused: error: "), p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert _snapshot(tmp_path) == before  # no output, input bytes unchanged
    p = cli("inspect", src)
    assert p.returncode == 2 and p.stderr.startswith("onnx2fused: error: ") and len(p.stderr.splitlines()) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_input(tmp_path):
    src = tmp_path / "m.onnx"
    shutil.copyfile(MODELS / "nerf.opset17.onnx", src)
    src.chmod(0)
    try:
        p = cli("convert", src, "--cpu-only")
        assert p.returncode == 2 and p.stderr.startswith("onnx2fused: error: ")
        assert sorted(x.name for x in tmp_path.iterdir()) == ["m.onnx"]
    finally:
        src.chmod(0o644)


def test_output_equals_input_refused(tmp_path):
    src = tmp_path / "m.onnx"
    shutil.copyfile(MODELS / "nerf.opset17.onnx", src)
    before = src.read_bytes()
    for out in (src, tmp_path / "." / "m.onnx"):
        p = cli("convert", src, "-o", out, "--cpu-only")
        assert p.returncode == 2 and len(p.stderr.splitlines()) == 1
        assert p.stderr.startswith("onnx2fused: error: ") and "input" in p.stderr
        assert src.read_bytes() == before and sorted(x.name for x in tmp_path.iterdir()) == ["m.onnx"]


def test_output_into_missing_folder(tmp_path):
    p = cli("convert", MODELS / "nerf.opset17.onnx", "-o", tmp_path / "no" / "out.onnx", "--cpu-only")
    assert p.returncode == 2 and p.stderr.startswith("onnx2fused: error: ") and "does not exist" in p.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")
def test_output_into_a_folder_that_takes_no_files():
    """/proc passes os.access for root, yet no file can be created there: one line naming the folder."""
    p = cli("convert", MODELS / "nerf.opset17.onnx", "-o", "/proc/out.onnx", "--cpu-only")
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1
    assert p.stderr.startswith("onnx2fused: error: /proc") and ".tmp-" not in p.stderr


def test_unknown_precision_names_the_choices(tmp_path):
    p = cli("convert", MODELS / "nerf.opset17.onnx", "-o", tmp_path / "o.onnx", "--precision", "fp8")
    assert p.returncode == 2 and "fp8" in p.stderr
    assert all(c in p.stderr for c in ("fp16", "bf16", "tf32", "fp32"))
    assert list(tmp_path.iterdir()) == []


def test_nothing_to_fuse_written_unchanged(tmp_path, cache):
    src = tmp_path / "plain.onnx"
    onnx.save(nothing_to_fuse(), str(src))
    p = cli("convert", src, "--cpu-only", "--cache-dir", cache)
    assert p.returncode == 0, p.stderr
    out = tmp_path / "plain.fused.onnx"
    assert out.read_bytes() == src.read_bytes()
    assert "nothing fused" in p.stdout and "weight 'w' is not a constant" in p.stdout
    assert not list(tmp_path.glob("*.so"))


def test_convert_json_and_default_output(tmp_path, cache):
    src = tmp_path / "nerf.onnx"
    shutil.copyfile(MODELS / "nerf.opset17.onnx", src)
    p = cli("convert", src, "--cpu-only", "--cache-dir", cache, "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["output_path"] == str(tmp_path / "nerf.fused.onnx")
    assert r["chains"][0]["widths"] == [32, 64, 64, 64, 64, 16] and r["precision"] == "auto"
    assert r["chains"][0]["precision"] == "fp16" and r["chains"][0]["precision_why"].startswith("CPU-only library")
    assert r["validation"]["passed"] and r["validation"]["outputs"][0]["name"] == "y"
    assert Path(r["library_path"]).is_file() and r["library_path"].endswith("nerf.fused.onnx2fused.so")
    assert "validating" in p.stderr  # progress lines on stderr
    # second run: a cache hit; --quiet silences progress; human table
    p = cli("convert", src, "--cpu-only", "--cache-dir", cache, "--quiet")
    assert p.returncode == 0 and p.stderr == ""
    assert "cache hit" in p.stdout and "rel L2" in p.stdout and "relu" in p.stdout


def test_inspect_lists_refusals(tmp_path):
    src = tmp_path / "brk.onnx"
    onnx.save(two_layer_with_graph_output_break(), str(src))
    p = cli("inspect", src)
    assert p.returncode == 0, p.stderr
    assert "2 chain(s)" in p.stdout and "is also a graph output" in p.stdout
    assert "8->16" in p.stdout and "16->4" in p.stdout and "resident weights" in p.stdout
    # every layer is fused: where chain 0 ends is a note, not a layer "not fused"
    assert "not fused" not in p.stdout and "where chains end:" in p.stdout
    p = cli("inspect", src, "--json")
    r = json.loads(p.stdout)
    assert [c["widths"] for c in r["chains"]] == [[8, 16], [16, 4]]
    assert r["refusals"] == ["chain 0 ends: output of layer 1 ('h') is also a graph output"]
    assert not list(tmp_path.glob("*.fused.onnx"))


def test_help_and_unknown_command():
    p = cli("--help")
    assert p.returncode == 0 and "convert" in p.stdout and "inspect" in p.stdout
    p = cli("frobnicate")
    assert p.returncode == 2


def _fake_hook(monkeypatch, module: str, status: int) -> dict:
    """Installs a stand-in hook module (add_arguments takes a `model`, main records it and returns
    `status`); returns the dict main records into."""
    calls = {}
    mod = types.ModuleType(module)
    mod.__spec__ = importlib.machinery.ModuleSpec(module, None)
    mod.add_arguments = lambda parser: parser.add_argument("model")
    mod.main = lambda args: calls.setdefault("model", args.model) and status
    monkeypatch.setitem(sys.modules, module, mod)
    return calls


def test_bench_hook_in_process(monkeypatch, capsys):
    """A module onnx2fused.bench with add_arguments/main becomes the `bench` subcommand."""
    from onnx2fused import cli as cli_mod
    calls = _fake_hook(monkeypatch, "onnx2fused.bench", 7)
    assert cli_mod.main(["bench", "m.onnx"]) == 7 and calls == {"model": "m.onnx"}
    # without the module (a trimmed install), `bench` is no subcommand: a usage error, exit 2
    monkeypatch.delitem(sys.modules, "onnx2fused.bench")
    monkeypatch.setattr(cli_mod, "_hook_available", lambda name: name != "bench")
    with pytest.raises(SystemExit) as e:
        cli_mod.main(["bench", "m.onnx"])
    assert e.value.code == 2 and "invalid choice: 'bench'" in capsys.readouterr().err


def test_hyphenated_hook_maps_to_its_module(monkeypatch):
    """`export-triton` is served by the module onnx2fused.triton (a module name cannot hold '-')."""
    from onnx2fused import cli as cli_mod
    assert cli_mod._hook_module("export-triton") == "onnx2fused.triton"
    assert cli_mod._hook_module("doctor") == "onnx2fused.doctor"
    calls = _fake_hook(monkeypatch, "onnx2fused.triton", 3)
    assert cli_mod.main(["export-triton", "m.onnx"]) == 3 and calls == {"model": "m.onnx"}


def test_help_lists_the_hooks():
    p = cli("--help")
    for name in ("doctor", "export-triton", "bench"):
        assert name in p.stdout
    p = cli("export-triton", "--help")
    assert p.returncode == 0 and "--library-dir" in p.stdout and "--repository-root" in p.stdout


def test_report_build_time_and_cache_hit(tmp_path_factory):
    """The report's build line and JSON fields: a fresh cache builds (time > 0), the next run hits."""
    fresh = tmp_path_factory.mktemp("o2f-cli-fresh-cache")
    d = tmp_path_factory.mktemp("report")
    runs = []
    for k in range(2):
        p = cli("convert", MODELS / "sdf.opset17.onnx", "-o", d / f"sdf{k}.fused.onnx", "--cpu-only",
                "--cache-dir", fresh, "--json", "-q")
        assert p.returncode == 0, p.stderr
        runs.append(json.loads(p.stdout))
    first, second = runs
    assert first["cache_hit"] is False and first["build_seconds"] > 0
    assert second["cache_hit"] is True and second["build_seconds"] == 0
    assert first["chains"][0]["activations"] and first["chains"][0]["precision"] == "fp16"
    assert {o["name"] for o in first["validation"]["outputs"]} == {"y"}
    p = cli("convert", MODELS / "sdf.opset17.onnx", "-o", d / "sdf2.fused.onnx", "--cpu-only", "--cache-dir", fresh, "-q")
    text = p.stdout
    assert "precision fp16" in text and "3->128->128->128->128->1" in text and "tanh" in text
    assert "cache hit" in text and "rel L2" in text and "y " in text


def test_library_warnings_do_not_reach_stderr():
    """A Python warning raised while a command runs must not add lines to stderr (one-line errors).
    In a subprocess: pytest would capture the warning itself."""
    code = ("import sys, warnings; from onnx2fused import cli; real = cli._inspect; "
            "cli._inspect = lambda a: (warnings.warn('a library complains'), real(a))[1]; "
            "sys.exit(cli.main(['inspect', sys.argv[1]]))")
    env = {k: v for k, v in os.environ.items() if k != "ONNX2FUSED_DEBUG"}
    p = subprocess.run([sys.executable, "-c", code, str(MODELS / "nerf.opset17.onnx")], capture_output=True,
                       text=True, env=env)
    assert p.returncode == 0 and "chain" in p.stdout
    assert "complains" not in p.stderr, p.stderr


@pytest.mark.parametrize("argv", [["inspect", str(MODELS / "nerf.opset17.onnx"), "--json"], ["--help"],
                                  ["doctor"]])
def test_broken_pipe_is_quiet(argv):
    """`onnx2fused ... | head`: the reader goes away before the command writes; no error, no traceback,
    the exit status of a command ended by SIGPIPE (141)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ONNX2FUSED_DEBUG", None)
    p = subprocess.Popen([sys.executable, "-m", "onnx2fused", *argv], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()          # before the child has written anything (its imports take far longer)
    err = p.stderr.read()
    rc = p.wait(timeout=300)
    # (argparse's --help swallows the write error itself and exits 0)
    assert err == "" and rc == (0 if argv == ["--help"] else 141), (rc, err)


def test_report_of_a_fully_fused_split_model(tmp_path, cache):
    """Both layers fused (two chains): the report counts no layer as not fused, and a CPU-only library's
    plan column shows its CPU kernel, no GPU plan."""
    src = tmp_path / "brk.onnx"
    onnx.save(two_layer_with_graph_output_break(), str(src))
    p = cli("convert", src, "--cpu-only", "--cache-dir", cache, "-q")
    assert p.returncode == 0, p.stderr
    assert "2 chain(s) fused" in p.stdout and "not fused" not in p.stdout
    assert "where chains end:\n  chain 0 ends: output of layer 1 ('h') is also a graph output" in p.stdout
    table = p.stdout.split("chain(s) fused", 1)[1].split("chain 0: op", 1)[0]
    assert "CUDA plan" not in table and "GPU:" not in table and "CPU-only library" in table


def nerf_copy(tmp_path) -> Path:
    src = tmp_path / "nerf.onnx"
    shutil.copyfile(MODELS / "nerf.opset17.onnx", src)
    return src


def test_atol_rtol_decide_validation(tmp_path, cache):
    """--atol/--rtol: |fused - ref| <= atol + rtol * |ref| for every element, instead of the rel L2 bound."""
    src = nerf_copy(tmp_path)
    base = ["convert", src, "--cpu-only", "--cache-dir", cache, "--precision", "fp16", "-q"]
    p = cli(*base, "--json", "--atol", "1e-5", "--rtol", "1e-4", "--input-shapes", "x:[64,32]")
    assert p.returncode == 0, p.stderr
    v = json.loads(p.stdout)["validation"]
    assert v["atol"] == 1e-5 and v["rtol"] == 1e-4 and v["passed"]
    (y,) = v["outputs"]
    assert y["elements"] == 64 * 16 and y["beyond"] == 0 and y["max_abs"] > 0   # fp32 rounding differs a bit
    assert "elementwise" in v["tolerance_note"]

    # far tighter than fp32 rounding: fails, one line naming the count; nothing written
    out = tmp_path / "tight.fused.onnx"
    p = cli(*base, "-o", out, "--atol", "1e-12", "--rtol", "0")
    assert p.returncode == 2 and len(p.stderr.splitlines()) == 1, p.stderr
    assert "element(s) outside |fused - ref| <= 1e-12 + 0 * |ref|" in p.stderr
    assert not out.exists() and not list(tmp_path.glob("tight*"))
    # and with --force it is written, the report saying which output and how many elements
    p = cli(*base, "-o", out, "--atol", "1e-12", "--force")
    assert p.returncode == 0 and out.is_file()
    assert re.search(r"y .* NO \(\d+/\d+ outside atol/rtol\)", p.stdout), p.stdout


@pytest.mark.parametrize("args, says", [
    (["--atol", "-1"], "--atol"), (["--rtol", "nan"], "--rtol"),
    (["--input-shapes", "y:[4,32]"], "'y' is not an input"),
    (["--input-shapes", "x:[4,31]"], "dimension 1 is fixed to 32"),
    (["--input-shapes", "x:[4,32,1]"], "rank 3"),
    (["--no-validate", "--save-inputs", "in.npz"], "--save-inputs needs validation"),
    (["--save-inputs", "nerf.onnx"], "would overwrite the input"),
    (["--save-outputs", "no/such/out.npz"], "does not exist"),
    (["--save-inputs", "a.npz", "--save-outputs", "a.npz"], "the same file"),
])
def test_validation_options_refused_in_one_line(args, says, tmp_path, cache):
    src = nerf_copy(tmp_path)
    before = _snapshot(tmp_path)
    p = cli("convert", src, "--cpu-only", "--cache-dir", cache, *args, cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnx2fused: error: ") and says in lines[0], p.stderr
    assert _snapshot(tmp_path) == before


def test_bad_input_shapes_syntax_is_a_usage_error(tmp_path):
    p = cli("convert", MODELS / "nerf.opset17.onnx", "-o", tmp_path / "o.onnx", "--input-shapes", "x:abc")
    assert p.returncode == 2 and "NAME:DIMS" in p.stderr
    # one line, as every other error, pointing at the help instead of printing the usage block
    assert p.stderr.startswith("onnx2fused: error: ") and len(p.stderr.splitlines()) == 1, p.stderr
    assert "onnx2fused convert --help" in p.stderr
    assert list(tmp_path.iterdir()) == []


def test_input_shapes_and_saved_arrays(tmp_path, cache):
    """--input-shapes sets the random validation inputs' shapes; --save-inputs/--save-outputs keep them and
    stock ORT's outputs on them (and the fused model's), so that a check can be rerun elsewhere."""
    import numpy as np
    import onnxruntime as ort
    src = nerf_copy(tmp_path)
    p = cli("convert", src, "--cpu-only", "--cache-dir", cache, "--precision", "fp16", "-q", "--json",
            "--input-shapes", "x:5x32", "--save-inputs", tmp_path / "in.npz", "--save-outputs", tmp_path / "out")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["validation"]["cases"] == ["random x[5, 32]"]
    assert not (tmp_path / "out.npz").exists()          # the name is kept as given
    with np.load(tmp_path / "in.npz") as zi, np.load(tmp_path / "out", allow_pickle=False) as zo:
        assert sorted(zi.files) == ["0/x", "cases"] and list(zi["cases"]) == ["random x[5, 32]"]
        assert sorted(zo.files) == ["0/y", "cases", "fused/0/y"]
        x = zi["0/x"]
        assert x.shape == (5, 32) and x.dtype == np.float32
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        want = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_array_equal(zo["0/y"], want)
        np.testing.assert_allclose(zo["fused/0/y"], want, rtol=1e-4, atol=1e-5)
        assert not np.array_equal(zo["fused/0/y"], np.zeros_like(want))
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")], "temp files left behind"
    # several shapes (repeated or in one flag): one input set per distinct shape
    p = cli("convert", src, "--cpu-only", "--cache-dir", cache, "--precision", "fp16", "-q", "--json",
            "-o", tmp_path / "b.fused.onnx", "--input-shapes", "x:[3,32]", "--input-shapes", "x:[3,32]")
    assert json.loads(p.stdout)["validation"]["cases"] == ["random x[3, 32]"]


def test_tune_without_a_hopper_gpu_says_why(tmp_path):
    """`onnx2fused tune` is the kernel search as a step of its own; where it cannot run it says why (exit 2)
    and writes nothing."""
    src = tmp_path / "m.onnx"
    shutil.copyfile(Path(__file__).resolve().parent.parent / "models" / "mnist.opset17.onnx", src)
    for env in ({"CUDA_VISIBLE_DEVICES": ""}, {"ONNX2FUSED_TUNE": "0"}):
        p = run_cli("tune", src, "--cache-dir", tmp_path / "cache", env_extra=env)
        assert p.returncode == 2 and p.stderr.startswith("onnx2fused: error: nothing to tune"), p.stderr
        assert len(p.stderr.strip().splitlines()) == 1
    assert sorted(x.name for x in tmp_path.iterdir() if x.name != "cache") == ["m.onnx"]


def test_stock_where_faster_on_the_command_line(tmp_path):
    """`inspect --cpu-only --stock-where-faster` lists mnist's chain (2.6 MiB of weights) as left stock; with a
    library that gets CUDA kernels (an nvcc on PATH: a stand-in script, never run) the flag is refused in one
    line, exit 2 (bad input), and convert writes nothing."""
    mnist = ROOT / "models" / "mnist.opset17.onnx"
    r = run_cli("inspect", mnist, "--cpu-only", "--stock-where-faster")
    assert r.returncode == 0, r.stderr
    assert "0 chain(s)" in r.stdout and "left as stock ops, faster on the CPU (weights 2.6 MiB" in r.stdout
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (fake / "nvcc").chmod(0o755)
    env = {"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    r = run_cli("convert", mnist, "-o", tmp_path / "m.onnx", "--stock-where-faster", env_extra=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--stock-where-faster is for CPU-only libraries (add --cpu-only)" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]
