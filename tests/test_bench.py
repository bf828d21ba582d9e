"""`onnx2fused bench` on a CPU host: the CPU mode end to end (table with p10..p90 spread, bench.json,
bench.png, progress lines), the refusals (no GPU without --cpu, an already fused model, nothing to fuse:
exit 2 with the reason), the plot skipped without matplotlib, the fp16 model helper, argument parsing and
the torch module builders."""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

ort = pytest.importorskip("onnxruntime")

import onnx2fused  # noqa: E402
from onnx2fused import bench  # noqa: E402
from cli_support import run_cli  # noqa: E402
from onnx_builders import G  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NERF = ROOT / "models" / "nerf.opset17.onnx"


def parse(*argv):
    p = argparse.ArgumentParser(prog="onnx2fused bench")
    bench.add_arguments(p)
    return p.parse_args([str(a) for a in argv])


def test_batches_parsing():
    assert parse(NERF, "--batches", "1024,2^12, 8").batches == [1024, 4096, 8]
    with pytest.raises(SystemExit):
        parse(NERF, "--batches", "12x")
    with pytest.raises(SystemExit):
        parse(NERF, "--batches", "0")
    a = parse(NERF)
    assert a.batches is None and a.reps is None and a.threads == 2 and not a.cpu and a.precision == "fp16"


def test_cpu_bench_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    rc = bench.main(parse(NERF, "--cpu", "--batches", "512,2048", "--reps", "5", "--warmup", "1", "--out", out))
    captured = capsys.readouterr()
    text = captured.out
    assert rc == 0, captured.err
    assert "ORT CPU ms (p10..p90)" in text and "fused CPU ms (p10..p90)" in text and "speed-up" in text
    lines = [l.split() for l in text.splitlines()]
    assert any(l and l[0] == "512" for l in lines) and any(l and l[0] == "2048" for l in lines)
    # progress on stderr, each line with the time since the start; the build/validation steps too
    progress = captured.err.splitlines()
    assert progress and all(re.match(r"onnx2fused: \[ *\d+\.\d s\] ", l) for l in progress), captured.err
    assert any("timing batch 2048" in l for l in progress) and any("validating" in l for l in progress)
    assert "Traceback" not in captured.err

    res = json.loads((out / "bench.json").read_text())
    for key in ("mode", "model", "device", "date", "versions", "commit", "command", "rows", "threads", "reps"):
        assert key in res, key
    assert res["mode"] == "cpu" and res["threads"] == 2 and res["reps"] == 5
    assert res["versions"]["onnxruntime"] == ort.__version__
    assert [r["batch"] for r in res["rows"]] == [512, 2048]
    for r in res["rows"]:
        assert not r["na"], r["na"]
        assert r["ms"]["ort_cpu"] > 0 and r["ms"]["fused_cpu"] > 0
        assert len(r["rep_ms"]["ort_cpu"]) == 5
        for v in ("ort_cpu", "fused_cpu"):   # the spread of the runs, beside the median
            runs = r["rep_ms"][v]
            assert r["p10_ms"][v] == pytest.approx(np.percentile(runs, 10), rel=1e-3, abs=1e-4)
            assert r["p90_ms"][v] == pytest.approx(np.percentile(runs, 90), rel=1e-3, abs=1e-4)
            assert min(runs) - 1e-4 <= r["p10_ms"][v] <= r["ms"][v] <= r["p90_ms"][v] <= max(runs) + 1e-4
            cell = f"{r['ms'][v]:.4f} ({r['p10_ms'][v]:.4f}..{r['p90_ms'][v]:.4f})"
            assert cell in text, (cell, text)
        assert r["speedup_vs_ort_cpu"] == pytest.approx(r["ms"]["ort_cpu"] / r["ms"]["fused_cpu"])
        assert r["flops"] == r["batch"] * 2 * (32 * 64 + 3 * 64 * 64 + 64 * 16)

    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    # the fused model and its plugin were written into the output folder
    assert list(out.glob("*.fused.onnx"))


def _one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnx2fused: error: "), err
    return lines[0]


def test_gpu_mode_without_cuda_ep_exits_2(tmp_path):
    """Nothing can run: a non-zero exit with the reason (a script must not take this for a result)."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA EP")
    p = run_cli("bench", NERF, "--out", tmp_path / "o")
    assert p.returncode == 2 and p.stdout == ""
    line = _one_error_line(p.stderr)
    assert "no GPU" in line and "--cpu" in line
    assert not (tmp_path / "o").exists()


def test_missing_model(tmp_path, capsys):
    assert bench.main(parse(tmp_path / "nope.onnx", "--cpu")) == 2
    assert "no such file" in _one_error_line(capsys.readouterr().err)


def test_unreadable_model_and_output_folder_in_convert_s_words(tmp_path, capsys):
    """A file that is not a model and an output folder that cannot be made: the one line convert gives."""
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    assert bench.main(parse(junk, "--cpu")) == 2
    assert "not an ONNX model" in _one_error_line(capsys.readouterr().err)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert bench.main(parse(NERF, "--cpu", "--out", blocker / "o")) == 2
    assert "cannot create the output folder" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("opt", [("--reps", "0"), ("--warmup", "-1"), ("--threads", "0")])
def test_bad_counts(opt, tmp_path, capsys):
    assert bench.main(parse(NERF, "--cpu", *opt, "--out", tmp_path / "o")) == 2
    assert opt[0] in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_fused_model_is_refused(tmp_path):
    """A fused model: bench converts the original itself; timing a fused one would compare it with itself."""
    fused = tmp_path / "nerf.fused.onnx"
    onnx2fused.convert(NERF, fused, with_cuda=False, cache_dir=tmp_path / "cache")
    for mode in (["--cpu"], []):
        p = run_cli("bench", fused, *mode, "--out", tmp_path / "o")
        assert p.returncode == 2, p.stderr
        assert "already fused" in _one_error_line(p.stderr)
    assert not (tmp_path / "o").exists()


def test_nothing_to_fuse_exits_2(tmp_path):
    g = G()
    g.op("Softmax", ["x"], name="sm", outputs=["y"])
    src = tmp_path / "plain.onnx"
    onnx.save(g.model([("x", ["B", 8])], [("y", ["B", 8])]), str(src))
    p = run_cli("bench", src, "--cpu", "--batches", "64", "--reps", "2", "--out", tmp_path / "o", "-q",
                env_extra={"ONNX2FUSED_CACHE": str(tmp_path / "cache")})
    assert p.returncode == 2 and p.stdout == ""
    assert "nothing to fuse" in _one_error_line(p.stderr)


def test_no_matplotlib_skips_the_plot_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib fails, find_spec says None
    out = tmp_path / "out"
    rc = bench.main(parse(NERF, "--cpu", "--batches", "256", "--reps", "2", "--warmup", "0", "--out", out, "-q"))
    captured = capsys.readouterr()
    assert rc == 0
    assert captured.err.splitlines() == ["onnx2fused: " + bench.report.NO_MATPLOTLIB]
    assert (out / "bench.json").is_file() and not (out / "bench.png").exists()
    assert "wrote" in captured.out and "Traceback" not in captured.out + captured.err


def test_quiet_and_progress_heartbeat(tmp_path, capsys):
    import io
    import time
    from onnx2fused.progress import Progress
    rc = bench.main(parse(NERF, "--cpu", "--batches", "256", "--reps", "2", "--out", tmp_path / "o", "-q"))
    assert rc == 0 and capsys.readouterr().err == ""
    buf = io.StringIO()
    with Progress(stream=buf, interval=0.1) as say:
        say("compiling 3 translation units")
        time.sleep(0.45)
    lines = buf.getvalue().splitlines()
    assert re.fullmatch(r"onnx2fused: \[ +0\.\d s\] compiling 3 translation units", lines[0]), lines
    beats = [l for l in lines[1:] if "still: compiling 3 translation units" in l]
    assert len(beats) >= 2 and len(beats) == len(lines) - 1, lines
    n = len(lines)
    time.sleep(0.25)
    assert len(buf.getvalue().splitlines()) == n, "the heartbeat went on after close()"
    quiet = io.StringIO()
    Progress(stream=quiet, interval=0.1, enabled=False)("x")
    time.sleep(0.2)
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("name", ["nerf.opset17", "gelu.opset17", "silu.dynamo", "nobias.opset17", "ffn3d.dynamo"])
def test_to_fp16_runs_on_ort_cpu(name, tmp_path):
    src = ROOT / "models" / f"{name}.onnx"
    m16 = onnx.load(bench.fp16_model_file(src, tmp_path / "m.fp16.onnx"))
    onnx.checker.check_model(m16)
    f16 = onnx.TensorProto.FLOAT16
    assert all(t.data_type != onnx.TensorProto.FLOAT for t in m16.graph.initializer)
    assert all(v.type.tensor_type.elem_type == f16 for v in list(m16.graph.input) + list(m16.graph.output))

    info = bench.model_info(src)
    name_in, _, dims = info.inputs[0]
    x = np.random.default_rng(0).standard_normal(bench._input_shape(dims, 8)).astype(np.float32)
    try:
        s16 = ort.InferenceSession(str(tmp_path / "m.fp16.onnx"), providers=["CPUExecutionProvider"])
    except Exception as e:  # an op without an fp16 CPU kernel: loading and checking is all we can ask here
        pytest.skip(f"ORT CPU cannot run this fp16 model: {e}")
    y16 = s16.run(None, {name_in: x.astype(np.float16)})[0]
    y32 = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {name_in: x})[0]
    assert y16.dtype == np.float16 and y16.shape == y32.shape
    err = np.linalg.norm(y16.astype(np.float32) - y32) / max(np.linalg.norm(y32), 1e-12)
    assert err < 2e-2


def test_model_info_layers():
    info = bench.model_info(ROOT / "models" / "nobias.opset17.onnx")   # MatMul, no bias
    assert [(l.k, l.n, l.bias) for l in info.layers] == [(16, 32, False), (32, 32, False), (32, 32, False),
                                                          (32, 8, False)]
    info = bench.model_info(ROOT / "models" / "mnist.dynamo.onnx")     # Gemm transB, external data
    assert [(l.k, l.n) for l in info.layers] == [(784, 512), (512, 512), (512, 10)]
    assert bench.default_cpu_batch(info) < 65536
    assert bench.default_cpu_batch(bench.model_info(NERF)) == 65536


def test_flops_count_every_row_of_a_token_batch():
    """A ViT block's input is [batch, 197, 384]: a batch item is 197 rows through the layers."""
    from onnx2fused.bench.models import Layer, ModelInfo
    info = ModelInfo(ROOT, [("x", "tensor(float)", ["batch", 197, 384])], [], [Layer(384, 1536, True)])
    assert info.rows_per_item == 197 and info.flops_per_row == 2 * 384 * 1536
    assert ModelInfo(ROOT, [("x", "tensor(float)", ["batch", "seq", 64])], []).rows_per_item == 1
    assert bench.model_info(NERF).rows_per_item == 1


def test_flops_count_conv_positions(tmp_path):
    """PointNet's pointwise Conv1d over [batch, 3, points]: every point is a row through the layer, which a
    per-row count of the first input's last axis misses (it counted the head's Gemm alone); the Conv's
    weights count among the weight bytes. The counted Gemm behind the pool counts once per batch item."""
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.ones((16, 3, 1), np.float32), "w")
    b = numpy_helper.from_array(np.zeros(16, np.float32), "b")
    g = numpy_helper.from_array(np.ones((16, 10), np.float32), "g")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"]),
         helper.make_node("ReduceMax", ["c"], ["p"], axes=[2], keepdims=0),
         helper.make_node("Gemm", ["p", "g"], ["y"])],
        "pn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 100])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])], [w, b, g])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.save(model, str(tmp_path / "pn.onnx"))
    info = bench.model_info(tmp_path / "pn.onnx")
    assert info.batch_flops(8) == 8 * (2 * 100 * 16 * 3 + 2 * 16 * 10)
    assert info.conv_params == 16 * 3 + 16 and info.weight_params == 16 * 10 + 16 * 3 + 16
    # an MLP on [batch, features]: the per-row count, as before
    assert bench.model_info(NERF).batch_flops(4) == 4 * bench.model_info(NERF).flops_per_row


def test_named_dynamic_dimensions_take_the_sizes_given(tmp_path, capsys):
    """bench --dim NAME=SIZE: an input's named dynamic axis past the batch (a CNN head's map, PointNet's
    points) is fed, and its flops counted, at that size, not at 1; the batch axis's name, an unknown name and
    a malformed item are refused in one line."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx2fused.bench.models import with_dim_sizes
    from onnx2fused.errors import ConversionError
    w = numpy_helper.from_array(np.ones((16, 3, 1), np.float32), "w")
    g = numpy_helper.from_array(np.ones((16, 10), np.float32), "g")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("ReduceMax", ["c"], ["p"], axes=[2], keepdims=0),
         helper.make_node("Gemm", ["p", "g"], ["y"])],
        "pn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, "points"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])], [w, g])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(tmp_path / "pn.onnx"))
    info = bench.model_info(tmp_path / "pn.onnx")
    assert info.batch_flops(8) == 8 * (2 * 1 * 16 * 3 + 2 * 16 * 10)   # the points axis at 1 unless told
    sized = with_dim_sizes(info, {"points": 100})
    assert sized.inputs[0][2] == ["batch", 3, 100] and info.inputs[0][2] == ["batch", 3, "points"]
    assert sized.batch_flops(8) == 8 * (2 * 100 * 16 * 3 + 2 * 16 * 10)
    with pytest.raises(ConversionError, match="batch axis"):
        with_dim_sizes(info, {"batch": 4})
    with pytest.raises(ConversionError, match=r"no input has a dynamic dimension of that name .*: points\)"):
        with_dim_sizes(info, {"h": 7})
    for bad in ("h", "h=0", "=7", "h=x"):
        assert bench.main(parse(tmp_path / "pn.onnx", "--cpu", "--dim", bad)) == 2
        assert f"--dim {bad}: expected NAME=SIZE" in _one_error_line(capsys.readouterr().err)
    assert bench.main(parse(tmp_path / "pn.onnx", "--cpu", "--dim", "h=7", "--out", tmp_path / "o")) == 2
    assert "--dim h: no input has a dynamic dimension" in _one_error_line(capsys.readouterr().err)


def test_gpu_batches_capped_to_memory():
    info = bench.model_info(ROOT / "models" / "mnist.opset17.onnx")
    kept, notes = bench.gpu_batches(info, bench.DEFAULT_GPU_BATCHES, total_mem=80 * 2 ** 30)
    assert kept and kept == sorted(kept) and kept[0] == 2 ** 10
    assert 2 ** 22 not in kept and notes   # 2^22 x 784 fp32 rows, rotated, do not fit with activations
    kept, _ = bench.gpu_batches(bench.model_info(NERF), bench.DEFAULT_GPU_BATCHES, total_mem=80 * 2 ** 30)
    assert kept == bench.DEFAULT_GPU_BATCHES


def test_zoo_torch_module_matches_onnx():
    torch = pytest.importorskip("torch")
    # tabular: its BatchNorms (the input's too) folded into the chain, whose weights the Sequential takes
    for name in ("gelu.opset17", "nobias.dynamo", "tabular.opset17", "tabular.dynamo"):
        path = ROOT / "models" / f"{name}.onnx"
        entry = bench._find_zoo_entry(path)
        assert entry is not None
        mod, note = bench.zoo_torch_module(torch, path, entry)
        assert "ONNX model's weights" in note, note
        x = np.random.default_rng(1).standard_normal((5, entry["widths"][0])).astype(np.float32)
        with torch.no_grad():
            yt = mod(torch.from_numpy(x)).numpy()
        yo = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(yt, yo, rtol=1e-4, atol=1e-5)


def test_load_torch_module(tmp_path):
    pytest.importorskip("torch")
    f = tmp_path / "mymod.py"
    f.write_text("import torch\ndef make():\n    return torch.nn.Linear(4, 2)\nnet = torch.nn.ReLU()\n")
    assert type(bench.load_torch_module(f"{f}:make")).__name__ == "Linear"
    assert type(bench.load_torch_module(f"{f}:net")).__name__ == "ReLU"
    with pytest.raises(ValueError):
        bench.load_torch_module(str(f))


def test_table_marks_missing_values():
    res = {"mode": "gpu", "rows": [{"batch": 1024, "ms": {"ort_fp32": 1.0}, "na": {"fused": "BuildError: x"},
                                    "p10_ms": {"ort_fp32": 0.9}, "p90_ms": {"ort_fp32": 1.25},
                                    "speedup_vs_ort_fp32": None, "floor_ms": 0.1}]}
    t = bench.format_table(res)
    assert "n/a" in t and "n/a fused: BuildError: x" in t and "1.0000 (0.9000..1.2500)" in t
    assert "ORT CUDA fp32 ms (p10..p90)" in t


def test_fp16_model_variant_is_a_column_only_when_timed():
    """--fp16-model adds fused_fp16 (the fp16 copy, converted) and its speed-up over ORT fp16 on the same
    copy; without it, the table is the standard one."""
    from onnx2fused.bench.variants import GPU_VARIANTS, timed_variants
    row = {"batch": 64, "ms": {"ort_fp16": 3.0, "fused": 4.0, "fused_fp16": 2.0}, "na": {},
           "speedup_vs_ort_fp16": 0.75, "speedup_fp16_vs_ort_fp16": 1.5, "floor_ms": 0.1}
    with_copy = bench.format_table({"mode": "gpu", "rows": [row], "variants": timed_variants(GPU_VARIANTS, ["fused_fp16"])})
    header = with_copy.splitlines()[0]
    assert "onnx2fused on the fp16 copy ms" in header and "fused fp16 copy/fp16 x" in header
    assert "2.0000" in with_copy and "1.50" in with_copy
    plain = bench.format_table({"mode": "gpu", "rows": [row], "variants": timed_variants(GPU_VARIANTS, ["fused"])})
    assert "fp16 copy" not in plain and timed_variants(GPU_VARIANTS, ["fused"]) == GPU_VARIANTS


def test_nothing_timed():
    rows = [{"batch": 8, "ms": {"ort_cpu": 1.0}, "na": {"fused_cpu": "RuntimeError: boom"}}]
    assert bench.variants.nothing_timed(rows, ["fused_cpu"]) == "fused_cpu: RuntimeError: boom"
    rows.append({"batch": 16, "ms": {"ort_cpu": 1.0, "fused_cpu": 0.5}, "na": {}})
    assert bench.variants.nothing_timed(rows, ["fused_cpu"]) is None


def test_commit_is_the_checkout_head_unless_the_caller_says(monkeypatch):
    """The JSON's commit: git's HEAD here (a copy of the tree with a stale .git, as on the GPU host, is
    told its commit through ONNX2FUSED_COMMIT instead)."""
    import subprocess
    from onnx2fused.bench import report
    monkeypatch.delenv(report.COMMIT_ENV, raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(report.__file__).parent, capture_output=True,
                          text=True)
    if head.returncode == 0:
        assert report._git_commit().startswith(head.stdout.strip())
    monkeypatch.setenv(report.COMMIT_ENV, " 0123abc ")
    assert report._git_commit() == "0123abc"


def test_kernel_profile_tables_per_run_times():
    """benchmarks/kernel_profile.py (ort_kernels.py and profile_case.py): CUDA events only, grouped by
    kernel, longest first, per-run µs and launches, and a total line."""
    from types import SimpleNamespace as E
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from kernel_profile import kernel_table, kernel_times

    cuda, cpu = E(name="CUDA"), E(name="CPU")
    events = [E(name="gemm", device_type=cuda, device_time=30.0), E(name="glu", device_type=cuda, device_time=5.0),
              E(name="gemm", device_type=cuda, device_time=34.0), E(name="glu", device_type=cuda, device_time=7.0),
              E(name="cudaLaunchKernel", device_type=cpu, device_time=0.0),
              E(name="old_torch", device_type=cuda, cuda_time=2.0), E(name="old_torch", device_type=cuda, cuda_time=2.0)]
    per = kernel_times(events)
    assert per == {"gemm": [30.0, 34.0], "glu": [5.0, 7.0], "old_torch": [2.0, 2.0]}
    lines = kernel_table(per, runs=2, width=4)
    assert [l.split()[0] for l in lines[:3]] == ["32.0", "6.0", "2.0"] and lines[0].endswith("gemm")
    assert lines[2].endswith("old_") and "x1" in lines[0]
    assert lines[-1].split()[:2] == ["40.0", "total"] and lines[-1].endswith("3 launches")


def test_kernel_profile_run_spans_cover_gaps_and_overlap():
    """run_spans: per run, the first kernel's start to the last one's end, so a gap between two kernels
    counts and an overlap (programmatic dependent launch) does not count twice; CPU events are left out and
    a run count that does not divide the kernels gives no spans rather than mixed runs."""
    from types import SimpleNamespace as E
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from kernel_profile import run_spans

    cuda, cpu = E(name="CUDA"), E(name="CPU")

    def k(start, end, dev=cuda):
        return E(name="k", device_type=dev, time_range=E(start=start, end=end))

    # run 1: kernels 0-10 and 15-30 (a 5 µs gap); run 2: 100-120 and 110-125 (5 µs of overlap)
    events = [k(110, 125), k(0, 10), k(15, 30), k(100, 120), k(1, 500, cpu)]
    assert run_spans(events, 2) == [30, 25]
    assert run_spans(events, 3) == [] and run_spans([], 1) == []


@pytest.mark.parametrize("switch", ["ONNX2FUSED_WIDE_KERNELS", "=sm80"])
def test_wide_cases_refuses_a_switch_without_name_and_value(switch, capsys):
    """benchmarks/wide_cases.py --env NAME=VALUE: anything else is a usage error before any model or GPU
    work (argparse's exit status 2 and the reason on stderr)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import wide_cases

    with pytest.raises(SystemExit) as exc:
        wide_cases.main(["--cases", "ffn", "--env", switch])
    assert exc.value.code == 2
    assert "--env takes NAME=VALUE" in capsys.readouterr().err


def test_wide_cases_judges_each_target_on_the_fp32_model_and_on_the_fp16_copy():
    """benchmarks/wide_cases.py --fp16-model: a target is judged on the converted fp32 model and, where the
    converted fp16 copy was timed, on that too; the verdicts differ where only one of them reaches it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import wide_cases

    ms = {"ort_fp32": 0.8, "ort_fp16": 0.45, "fused": 0.32, "fused_fp16": 0.28}
    sp, sp16 = wide_cases.speedups(ms, "fused"), wide_cases.speedups(ms, "fused_fp16")
    assert sp["ort_fp16"] == pytest.approx(0.45 / 0.32) and sp16["ort_fp16"] == pytest.approx(0.45 / 0.28)
    t = wide_cases.judge_targets({"ort_fp16": 1.5}, sp, sp16)["ort_fp16"]
    assert (t["met"], t["met_fp16_copy"]) == (False, True)
    assert wide_cases.target_text("ort_fp16", t) == "ort_fp16 >= 1.5x: MISSED (fp16 copy: met)"
    # without the copy timed: one verdict, and no fp16-copy ratio at all
    alone = wide_cases.judge_targets({"ort_fp16": 1.5}, sp, wide_cases.speedups({"ort_fp16": 0.45}, "fused_fp16"))
    assert "met_fp16_copy" not in alone["ort_fp16"]
    assert wide_cases.target_text("ort_fp16", alone["ort_fp16"]) == "ort_fp16 >= 1.5x: MISSED"


def test_device_timer_interleaves_the_steps_in_alternating_order():
    """_Dev.time_interleaved (bench.time_ort_gpu_interleaved's loop; host timer without torch): every step
    runs warmup + reps times, the steps take turns, and the order is reversed every other repetition, so a
    slow phase of the machine cannot land on one of them alone."""
    from onnx2fused.bench.timing import _Dev

    calls = []
    steps = {n: (lambda i, n=n: calls.append((n, i))) for n in ("a", "b", "c")}
    ts = _Dev(None).time_interleaved(steps, reps=3, warmup=1)
    assert set(ts) == {"a", "b", "c"} and all(len(t) == 3 and min(t) >= 0 for t in ts.values())
    assert [n for n, _ in calls] == list("abc") + list("abc") + list("cba") + list("abc")
    assert [i for n, i in calls if n == "b"] == [0, 0, 1, 2]


def test_kernel_profile_host_phases_split_each_run_at_its_launches():
    """host_phases: per run range, the host time before the first launch call, across the launch calls and
    after the last one, the device's idle time before the run's first kernel, and each API call's total;
    calls and kernels outside every run range (warm-up, another thread's work) are not counted."""
    from types import SimpleNamespace as E
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from kernel_profile import RUN_RANGE, host_phases

    cuda, cpu = E(name="CUDA"), E(name="CPU")

    def ev(name, start, end, dev=cpu):
        return E(name=name, device_type=dev, time_range=E(start=start, end=end))

    events = [ev(RUN_RANGE, 0, 100), ev("cudaLaunchKernel", 30, 35), ev("cuLaunchKernelEx", 40, 48),
              ev("cudaStreamSynchronize", 50, 95), ev("gemm", 38, 90, cuda),
              ev(RUN_RANGE, 200, 260), ev("cudaLaunchKernel", 210, 214), ev("gemm", 220, 250, cuda),
              ev("cudaLaunchKernel", 150, 151)]   # between the runs: no run's
    ph = host_phases(events)
    assert ph["run"] == [100, 60]
    assert ph["to_first_launch"] == [30, 10] and ph["launching"] == [18, 4] and ph["after_last_launch"] == [52, 46]
    assert ph["gpu_idle_before"] == [38, 20]
    assert ph["api cudaLaunchKernel"] == [5, 4] and ph["api cuLaunchKernelEx"] == [8, 0]
    assert ph["api cudaStreamSynchronize"] == [45, 0]


def test_pipelined_timing_runs_bursts_that_wait_only_at_their_end(monkeypatch):
    """time_ort_gpu_pipelined (--pipelined): each timed burst is `burst` runs of the session on bound
    buffers, all but the last with ORT's no-wait run option, the last one waiting; one per-run time per
    burst. Here on ORT's CPU EP with OrtValue buffers (the flow, not the speed)."""
    from onnx2fused.bench import timing

    monkeypatch.setattr(timing, "ORT_DEVICE", "cpu")
    sess = ort.InferenceSession(str(NERF), providers=["CPUExecutionProvider"])
    waits = []

    class Recording:   # the session, recording whether each run would wait for the GPU
        def __getattr__(self, name):
            return getattr(sess, name)

        def run_with_iobinding(self, io, options=None):
            no_sync = options is not None and options.get_run_config_entry(timing.NO_SYNC_OPTION) == "1"
            waits.append(not no_sync)
            return sess.run_with_iobinding(io, options)

    info = bench.model_info(NERF)
    ts = timing.time_ort_gpu_pipelined(timing._Dev(None), Recording(), info, 8, reps=3, warmup=2, burst=4)
    assert len(ts) == 3 and all(t > 0 for t in ts)
    first_timed = len(waits) - 3 * 4
    assert waits[:first_timed] == [True] * first_timed   # the output-shape run and the warm-up runs wait
    assert waits[first_timed:] == ([False] * 3 + [True]) * 3


def test_pipelined_variants_are_columns_only_when_asked():
    from onnx2fused.bench.variants import GPU_VARIANTS, PIPELINED, timed_variants
    row = {"batch": 64, "ms": {"ort_fp16": 3.0, "fused": 1.0, "ort_fp16_pipelined": 2.5, "fused_pipelined": 0.5},
           "na": {}, "speedup_vs_ort_fp16": 3.0, "speedup_pipelined_vs_ort_fp16": 5.0, "floor_ms": 0.1}
    table = bench.format_table({"mode": "gpu", "rows": [row],
                                "variants": timed_variants(GPU_VARIANTS, ["fused"] + list(PIPELINED.values()))})
    header = table.splitlines()[0]
    assert "onnx2fused pipelined ms" in header and "pipelined fused/fp16 x" in header and "5.00" in table
    assert "pipelined" not in bench.format_table({"mode": "gpu", "rows": [row], "variants": GPU_VARIANTS})
    assert parse(NERF, "--pipelined").pipelined and not parse(NERF).pipelined


def test_kernel_check_interleaves_its_timings_in_alternating_rounds():
    """kernel_check --interleave: every case once a round, the order reversed every other round."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_check
    rounds = kernel_check.interleaved_rounds(["a", "b", "c"], 4)
    assert rounds == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"], ["c", "b", "a"]]
    assert kernel_check.interleaved_rounds(["a"], 0) == []


def test_every_kernel_check_case_plans_and_renders_in_the_design_it_names():
    """Each case and variant of kernel_check (the GPU host's A/B harness) still makes a plan and renders its
    CUDA sources (no nvcc), and a variant's override lands in the design it overrides: a stale variant would
    otherwise surface only as a failed call on the GPU host."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_check
    from onnx2fused import codegen
    from onnx2fused.plan.options import PlanOptions, ResidentOptions, WgmmaOptions
    cases = kernel_check.all_cases(PlanOptions())
    assert set(kernel_check.CASES) | set(kernel_check.VARIANTS) == set(cases)
    for name, (spec, _, options) in cases.items():
        plan = kernel_check.make_plan(spec, options)
        assert codegen.cuda_sources(plan), name
        override = kernel_check.VARIANTS.get(name, (None, None))[1]
        if override is not None and spec.precision != "fp32":
            want = ("wgmma" if isinstance(override, WgmmaOptions) else
                    "resident" if isinstance(override, ResidentOptions) else "streamed")
            assert plan.design == want, (name, plan.design)


def test_kernel_check_diag_cases_name_a_base_case_and_its_macros():
    """kernel_check --diag NAME=BASE:MACRO[+MACRO]: BASE built with O2F_DIAG_<MACRO> defined (upper-cased);
    a BASE that is no case, or no macro, stops the run with the item named."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_check
    cases = {"w256silu": object(), "w128gelu": object()}
    got = kernel_check.diag_cases(["s=w256silu:no_fill+no_load", "g=w128gelu:clocks"], cases)
    assert got == {"s": ("w256silu", ["-DO2F_DIAG_NO_FILL", "-DO2F_DIAG_NO_LOAD"]),
                   "g": ("w128gelu", ["-DO2F_DIAG_CLOCKS"])}
    for bad in ("s=nosuch:no_fill", "s=w256silu", "w256silu:no_fill"):
        with pytest.raises(SystemExit, match="--diag"):
            kernel_check.diag_cases([bad], cases)


def test_clock_samples_summarise_past_the_ramp_with_the_power_cap_share():
    """clocks.py: nvidia-smi's csv lines (unparsable ones skipped) summarised past the first quarter:
    median SM clock, power and limit, and the share of samples the power cap (0x4) held the clock down."""
    from onnx2fused.bench import clocks
    lines = ["1980, 1980, 300.5, 700.00, 0x0000000000000000"] * 4 + [
        "1560, 1980, 693.1, 700.00, 0x0000000000000004"] * 9 + ["1600, 1980, 690.0, 700.00, 0x0000000000000000",
                                                               "[N/A], 1980, 1, 700, 0x0", "1550, 19"]
    samples = clocks.parse_samples("\n".join(lines))
    assert len(samples) == 14 and samples[4].reasons == clocks.SW_POWER_CAP
    s = clocks.summarize(samples)
    assert s["samples"] == 11 and s["sm_mhz"] == 1560 and s["max_sm_mhz"] == 1980 and s["limit_watts"] == 700
    assert s["power_capped"] == 9 / 11 and s["watts"] == 693.1
    assert clocks.describe(s) == "SM clock 1560 of 1980 MHz, 693 of 700 W; held down by the power limit in 82% of the samples"
    assert clocks.summarize([]) is None and "nvidia-smi" in clocks.describe(None)
    idle = clocks.summarize(clocks.parse_samples("1980, 1980, 120, 700, 0x0\n" * 8))
    assert idle["power_capped"] == 0 and "power limit" not in clocks.describe(idle)


def test_sustained_timing_runs_bursts_for_its_seconds_without_nvidia_smi(monkeypatch):
    """time_ort_gpu_sustained (--sustain): pipelined bursts back to back until its seconds are up, one
    per-run time per burst, and no clock summary where nvidia-smi is missing. On ORT's CPU EP."""
    from onnx2fused.bench import clocks, timing

    monkeypatch.setattr(timing, "ORT_DEVICE", "cpu")
    monkeypatch.setattr(clocks.shutil, "which", lambda name: None)
    sess = ort.InferenceSession(str(NERF), providers=["CPUExecutionProvider"])
    t0 = time.perf_counter()
    ts, summary = timing.time_ort_gpu_sustained(timing._Dev(None), sess, bench.model_info(NERF), 8, 0.3, 1, burst=3)
    assert time.perf_counter() - t0 >= 0.3 and len(ts) >= 2 and all(t > 0 for t in ts) and summary is None


def test_sustain_is_gpu_only_and_bounded(capsys):
    for args, words in ((["--sustain", "0"], "between 0 and 600"), (["--sustain", "700"], "between 0 and 600"),
                        (["--sustain", "2", "--cpu"], "no CPU mode")):
        assert bench.main(parse(NERF, *args)) == 2
        assert words in capsys.readouterr().err
    assert parse(NERF, "--sustain", "5").sustain == 5 and parse(NERF).sustain is None


def test_sustained_variant_is_a_column_only_when_asked():
    from onnx2fused.bench.variants import GPU_VARIANTS, timed_variants
    row = {"batch": 64, "ms": {"fused": 1.0, "fused_sustained": 1.1}, "na": {}, "floor_ms": 0.1}
    asked = timed_variants(GPU_VARIANTS, ["fused", "fused_sustained"])
    assert asked[-1] == "fused_sustained" and "fused_sustained" not in timed_variants(GPU_VARIANTS, ["fused"])
    table = bench.format_table({"mode": "gpu", "rows": [row], "variants": asked})
    assert "onnx2fused sustained ms" in table.splitlines()[0] and "1.1000" in table
    assert "sustained" not in bench.format_table({"mode": "gpu", "rows": [row], "variants": GPU_VARIANTS})
