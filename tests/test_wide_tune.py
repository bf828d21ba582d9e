"""Per-GPU kernel selection of the wide design (onnx2fused/wide_tune.py), without a GPU: the tuning
library's entry is replaced by a fake that reports times, so what is tested is the decision, the
cache per spec and GPU, and that failures keep the defaults. The real search runs in
tests/test_gpu_tune.py."""
from __future__ import annotations

import json

import pytest

from onnx2fused import codegen, wide_tune
from onnx2fused import expr as ex
from onnx2fused.plan import sm90
from onnx2fused.plan.choose import make_plan, make_plans
from onnx2fused.spec import LayerSpec, MLPSpec

H100 = wide_tune.Gpu("NVIDIA H100 80GB HBM3", 90)


def _spec(widths, act=ex.gelu_erf()):
    acts = [act] * (len(widths) - 2) + [ex.identity()]
    return MLPSpec(tuple(LayerSpec(a, b, True, f) for a, b, f in zip(widths, widths[1:], acts)), "fp16", "f32")


FFN = _spec([768, 3072, 768])
NARROW = _spec([32, 64, 16])   # the resident design: nothing to tune


def _plans(*specs):
    return make_plans(specs or [FFN])


class FakeTuning:
    """Stands in for the build and for the tuning library's two entries (ctypes): candidate `fast` takes
    `ms` where the default takes 1.0, every other candidate 1.0, and every pass size the same time. The
    decision (a candidate must beat the default by MIN_GAIN) and the record are run_tuning's own."""

    def __init__(self, fast: int, ms: float):
        self.fast, self.ms, self.builds = fast, ms, []

    def build(self, specs, **kw):
        self.builds.append(([s.name for s in specs], kw))
        return type("Lib", (), {"path": "fake-tuning-library.so"})()

    def library(self, path):
        assert path == "fake-tuning-library.so"
        fake = self

        class Entries:
            def __getattr__(self, name):
                if name.endswith("_cuda_tune"):
                    def tune(reps, index, ms, default_ms, every):
                        n, k = len(index), len(every) // len(index)
                        for i in range(n):
                            index[i], ms[i], default_ms[i] = fake.fast, fake.ms, 1.0
                            for c in range(k):
                                every[i * k + c] = fake.ms if c == fake.fast else 1.0
                        return 0
                    return tune
                if name.endswith("_cuda_time_chain"):
                    def time_chain(index, rows, block, reps, ms):
                        ms._obj.value = 1.0   # ctypes.byref(c_float)
                        return 0
                    return time_chain
                raise AttributeError(name)
        return Entries()


COOP128_DP = sm90.sm90_candidates().index(sm90.Sm90Choice(1, "data_parallel"))  # Coop128x128, data-parallel


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.delenv(wide_tune.TUNE_ENV, raising=False)
    monkeypatch.setattr(wide_tune, "current_gpu", lambda: H100)


def test_tunes_once_per_spec_and_gpu_then_reads_the_cache(tmp_path, gpu, monkeypatch):
    fake = FakeTuning(fast=COOP128_DP, ms=0.5)
    monkeypatch.setattr(wide_tune, "load_library", fake.library)
    said = []
    plans = _plans(FFN, NARROW)
    out = wide_tune.resolve(plans, tmp_path, fake.build, said.append, tune=True)
    assert [n for n in out if out[n] != plans[n]] == [FFN.name] and out[NARROW.name] is plans[NARROW.name]
    assert [(names, sorted(kw)) for names, kw in fake.builds] == [([FFN.name], ["cpu_enabled", "plans"])]
    built = fake.builds[0][1]
    assert built["cpu_enabled"] == {FFN.name: False} and built["plans"][FFN.name].tuning
    chosen = sm90.sm90_candidates()[COOP128_DP]
    assert all(c == chosen for per in out[FFN.name].choices for c in per)
    assert out[FFN.name].tuned_on == H100.name
    record = json.loads(wide_tune.cache_file(tmp_path, FFN, H100).read_text())
    assert record["gpu"] == H100.name and record["spec"] == FFN.name
    assert any("tuning the Hopper GEMM kernels" in s for s in said) and any(s.startswith("tuned: ") for s in said)
    # a second build of the same spec on the same GPU model: no tuning build, the same choice
    again = wide_tune.resolve(_plans(FFN), tmp_path, fake.build, said.append, tune=True)
    assert again[FFN.name] == out[FFN.name] and len(fake.builds) == 1
    # the rendered library instantiates the chosen kernel only, and inspect's text says where it was tuned
    files = codegen.render([FFN], True, plans=out)
    assert {n.split("_")[2] for n in files if n.startswith("o2f_inst_") and "Sm80" not in n} == {"Coop128x128"}
    assert "o2f_inst_Coop128x128_" in files[f"{FFN.name}_cuda.cu"]
    plan = out[FFN.name]
    assert f"tuned on {H100.name}" in plan.describe() and "16384 rows Coop128x128/data_parallel" in plan.choice_text()
    assert wide_tune.cached_plan(make_plan(FFN), tmp_path) == out[FFN.name]


def test_no_search_unless_asked_only_the_cached_choice(tmp_path, gpu, monkeypatch):
    """convert's default: the search is off the critical path; a choice cached by an earlier --tune is used."""
    fake = FakeTuning(fast=COOP128_DP, ms=0.5)
    monkeypatch.setattr(wide_tune, "load_library", fake.library)
    plans = _plans()
    assert wide_tune.resolve(plans, tmp_path, fake.build, lambda s: None) == plans and not fake.builds
    tuned = wide_tune.resolve(plans, tmp_path, fake.build, lambda s: None, tune=True)
    assert tuned != plans and tuned[FFN.name].tuned_on
    assert wide_tune.resolve(plans, tmp_path, fake.build, lambda s: None) == tuned and len(fake.builds) == 1


def test_noise_keeps_the_default(tmp_path, gpu, monkeypatch):
    fake = FakeTuning(fast=3, ms=0.99)   # 1% faster: within MIN_GAIN
    monkeypatch.setattr(wide_tune, "load_library", fake.library)
    out = wide_tune.resolve(_plans(), tmp_path, fake.build, lambda s: None, tune=True)
    assert all(c == sm90.DEFAULT_CHOICE for per in out[FFN.name].choices for c in per)


def test_another_gpu_model_tunes_again(tmp_path, gpu, monkeypatch):
    fake = FakeTuning(fast=COOP128_DP, ms=0.5)
    monkeypatch.setattr(wide_tune, "load_library", fake.library)
    wide_tune.resolve(_plans(), tmp_path, fake.build, lambda s: None, tune=True)
    monkeypatch.setattr(wide_tune, "current_gpu", lambda: wide_tune.Gpu("NVIDIA H200", 90))
    assert wide_tune.cached_plan(make_plan(FFN), tmp_path) == make_plan(FFN)   # nothing stored for this one
    wide_tune.resolve(_plans(), tmp_path, fake.build, lambda s: None, tune=True)
    assert len(fake.builds) == 2 and len(list((tmp_path / "tune").iterdir())) == 2


@pytest.mark.parametrize("gpu_seen,env", [(None, None), (wide_tune.Gpu("NVIDIA A100", 80), None), (H100, "0")])
def test_no_tuning_without_a_hopper_gpu_or_when_disabled(tmp_path, monkeypatch, gpu_seen, env):
    monkeypatch.setattr(wide_tune, "current_gpu", lambda: gpu_seen)
    if env is None:
        monkeypatch.delenv(wide_tune.TUNE_ENV, raising=False)
    else:
        monkeypatch.setenv(wide_tune.TUNE_ENV, env)
    fake = FakeTuning(fast=COOP128_DP, ms=0.5)
    assert wide_tune.resolve(_plans(), tmp_path, fake.build, lambda s: None, tune=True) == _plans() and not fake.builds


def test_a_failed_tuning_build_keeps_the_defaults_and_says_why(tmp_path, gpu):
    def broken_build(specs, **kw):
        raise RuntimeError("compiling the plugin failed (stub)\nmore lines")
    said = []
    assert wide_tune.resolve(_plans(), tmp_path, broken_build, said.append, tune=True) == _plans()
    assert any("failed (compiling the plugin failed (stub)); using the default kernels" in s for s in said)
    assert not (tmp_path / "tune").exists()


@pytest.mark.parametrize("corrupt", [
    "not json",
    json.dumps({"format": wide_tune.TUNE_FORMAT, "gpu": H100.name, "buckets": [1, 2], "choices": []}),
    json.dumps({"format": wide_tune.TUNE_FORMAT, "gpu": H100.name, "buckets": [32, 256, 2048, 16384],
                "choices": [[[99, "heuristic", 1]] * 4] * 2}),
    json.dumps({"format": wide_tune.TUNE_FORMAT + 1, "gpu": H100.name}),
])
def test_a_stale_or_corrupt_cache_entry_is_ignored_and_replaced(tmp_path, gpu, monkeypatch, corrupt):
    path = wide_tune.cache_file(tmp_path, FFN, H100)
    path.parent.mkdir(parents=True)
    path.write_text(corrupt)
    assert wide_tune.cached_plan(make_plan(FFN), tmp_path) == make_plan(FFN)
    fake = FakeTuning(fast=COOP128_DP, ms=0.5)
    monkeypatch.setattr(wide_tune, "load_library", fake.library)
    assert wide_tune.resolve(_plans(), tmp_path, fake.build, lambda s: None, tune=True)[FFN.name].tuned_on
    assert json.loads(path.read_text())["spec"] == FFN.name


def test_current_gpu_without_a_driver_is_none(monkeypatch):
    import ctypes

    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")
    wide_tune.current_gpu.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    try:
        assert wide_tune.current_gpu() is None and wide_tune.tunable_gpu() is None
    finally:
        wide_tune.current_gpu.cache_clear()


def test_inspect_shows_the_kernels_tuned_for_this_gpu(tmp_path, gpu, monkeypatch, capsys):
    """`onnx2fused inspect --cache-dir D`: the wide chain's plan names the GPU its kernels were tuned on
    and the kernel per layer and row bucket; without a stored choice, the defaults."""
    import onnx

    from onnx2fused import cli, passes
    from onnx2fused.loader import load_model
    from onnx_builders import mlp
    path = tmp_path / "ffn.onnx"
    onnx.save(mlp([768, 3072, 768]), str(path))
    spec = passes.find_chains(load_model(str(path))).chains[0].to_spec("fp16")
    assert make_plan(spec).design == "wide"

    def inspect_text():
        assert cli.main(["inspect", str(path), "--cache-dir", str(tmp_path / "cache")]) == 0
        return capsys.readouterr().out
    assert "default kernels (not tuned)" in inspect_text()
    fake = FakeTuning(fast=COOP128_DP, ms=0.5)
    monkeypatch.setattr(wide_tune, "load_library", fake.library)
    wide_tune.resolve(make_plans([spec]), tmp_path / "cache", fake.build, lambda s: None, tune=True)
    text = inspect_text()
    assert f"kernels tuned on {H100.name}" in text and "16384 rows Coop128x128/data_parallel" in text


def test_tile_orders_are_searched_for_the_ping_pong_kernels_and_survive_the_cache(tmp_path, gpu, monkeypatch):
    """The ping-pong kernels' scheduler takes a swizzle and a raster order at run time (no new CUTLASS
    instance): the search times each; a chosen one is written to the cache, read back into the plan, and
    rendered into the chain's choice table (the kernel index, mode, splits, swizzle, RASTERS index)."""
    cands = sm90.sm90_candidates()
    ping = [c for c in cands if not sm90.SM90_KERNELS[c.kernel].stream_k]
    cutlass_ping = sm90.kernel_index("Pingpong128x128")
    assert {(c.swizzle, c.raster) for c in ping if c.kernel == cutlass_ping} == \
        {(s, "heuristic") for s in sm90.SWIZZLES} | {(1, r) for r in sm90.RASTERS}
    # the light kernel takes the raster order only (its tile order has no swizzle)
    assert {(c.swizzle, c.raster) for c in ping if c.kernel == sm90.LIGHT_KERNEL} == {(1, r) for r in sm90.RASTERS}
    assert all(c.swizzle == 1 and c.raster == "heuristic" for c in cands if sm90.SM90_KERNELS[c.kernel].stream_k)
    assert len({c.label for c in cands}) == len(cands)   # the report's keys stay distinct
    order = next(c for c in ping if c.swizzle == 4 and c.kernel == cutlass_ping)
    fake = FakeTuning(fast=cands.index(order), ms=0.5)
    monkeypatch.setattr(wide_tune, "load_library", fake.library)
    out = wide_tune.resolve(_plans(FFN), tmp_path, fake.build, lambda m: None, tune=True)
    assert all(c == order for per in out[FFN.name].choices for c in per)
    again = wide_tune.resolve(_plans(FFN), tmp_path, fake.build, lambda m: None)   # from the cache
    assert again[FFN.name].choices == out[FFN.name].choices and len(fake.builds) == 1
    from onnx2fused.codegen import render
    text = render([FFN], True, plans=again)[f"{FFN.name}_cuda.cu"]
    assert f"{{ {order.kernel}, {sm90.MODES.index('data_parallel')}, 1, 4, 0 }}" in text
