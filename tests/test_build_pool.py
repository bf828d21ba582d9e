"""build_pool: parallel compiles within the host's memory, and compilers the OOM killer took run again."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from onnx2fused import build as build_mod
from onnx2fused import build_pool
from onnx2fused import expr as ex
from onnx2fused.errors import BuildError
from onnx2fused.library import build_plugin
from onnx2fused.spec import LayerSpec, MLPSpec

# nvcc's own words when the OOM killer takes its cicc (the GPU host's build log said "Killed")
NVCC_KILLED = "nvcc error   : 'cicc' died due to signal 9 (Kill signal)"


def test_available_memory_reads_meminfo(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   8388608 kB\n")
    assert build_pool.available_memory_mb(info) == 8192
    info.write_text("MemTotal: 1 kB\n")
    assert build_pool.available_memory_mb(info) is None
    assert build_pool.available_memory_mb(tmp_path / "missing") is None


@pytest.mark.parametrize("rc, output, killed", [
    (255, NVCC_KILLED, True),
    (1, "sh: line 1: 4242 Killed  cicc ...", True),
    (-9, "", True),
    (137, "", True),
    (1, "error: expected ';' before '}' token", False),
    (0, "Killed means nothing when the compile succeeded", False),
])
def test_was_killed_tells_a_kill_from_a_compile_error(rc, output, killed):
    assert build_pool.was_killed(rc, output) is killed


def _run_tracking(jobs, peak, budget, workers=8, fail=lambda job, attempt: None, together=0, wait_s=10.0):
    """run_all over `jobs` with a fake compile; returns (results, the largest sum of peaks that ran at
    once, attempts per job, progress lines). together=N: the first N compiles to start wait for each
    other (a barrier, `wait_s` at most): they must be able to run at the same time, or it breaks."""
    lock = threading.Lock()
    running, most, attempts, lines, started = [0], [0], {}, [], [0]
    barrier = threading.Barrier(together) if together else None

    def run(job):
        with lock:
            attempts[job] = attempts.get(job, 0) + 1
            running[0] += peak(job)
            most[0] = max(most[0], running[0])
            slot = started[0]
            started[0] += 1
        try:
            if barrier and slot < together:
                barrier.wait(timeout=wait_s)
            time.sleep(0.01)
        finally:
            with lock:
                running[0] -= peak(job)
        return fail(job, attempts[job]) or (0, "")

    results = build_pool.run_all(jobs, run, peak, workers, budget, lines.append)
    return results, most[0], attempts, lines


def test_jobs_run_together_only_while_their_peaks_fit():
    jobs = [f"unit{i}" for i in range(6)]
    results, most, _, _ = _run_tracking(jobs, lambda j: 4096, budget=9000, together=2)
    assert [j for j, _, _ in results] == jobs and all(rc == 0 for _, rc, _ in results)
    assert most == 8192            # two at a time (they met at the barrier); never three
    with pytest.raises(threading.BrokenBarrierError):   # a third never joins them: 3 x 4096 > 9000
        _run_tracking(jobs, lambda j: 4096, budget=9000, together=3, wait_s=0.5)
    _, most, _, _ = _run_tracking(jobs, lambda j: 4096, budget=None, together=6)
    assert most == 6 * 4096        # no budget known: the workers alone limit it


def test_a_job_larger_than_the_budget_runs_alone():
    jobs = ["big", "a", "b", "c"]
    peaks = {"big": 50000, "a": 1000, "b": 1000, "c": 1000}
    results, most, _, _ = _run_tracking(jobs, peaks.__getitem__, budget=4000)
    assert all(rc == 0 for _, rc, _ in results)
    assert most == 50000   # alone: beside any other job the sum would pass 50000


def test_a_killed_compile_runs_again_on_its_own():
    def kill_first_try(job, attempt):
        return (255, NVCC_KILLED) if job == "hopper" and attempt == 1 else None

    results, _, attempts, lines = _run_tracking(["hopper", "chain", "registry"], lambda j: 1024, budget=None,
                                                fail=kill_first_try)
    assert attempts == {"hopper": 2, "chain": 1, "registry": 1}
    assert all(rc == 0 for _, rc, _ in results)
    assert lines == ["  hopper was killed (out of memory?); compiling it again on its own"]


def test_a_compile_error_is_not_retried():
    results, _, attempts, lines = _run_tracking(["bad"], lambda j: 1024, budget=None,
                                                fail=lambda job, attempt: (1, "error: no such type"))
    assert attempts == {"bad": 1} and results[0][1] == 1 and lines == []


SPEC = MLPSpec((LayerSpec(8, 24, True, ex.relu()), LayerSpec(24, 3, False, ex.identity())), io_dtype="f32")


def test_build_survives_a_compiler_killed_once(tmp_path, monkeypatch):
    """Through build_plugin (CPU-only library, real compiles): the chain's unit is killed on its first
    compile, as the OOM killer does to a cicc when builds crowd a host; the build retries it and succeeds."""
    real = build_mod._compile
    tries = {}

    def killed_once(args, cwd):
        unit = Path(args[args.index("-c") + 1]).name if "-c" in args else None
        if unit == f"{SPEC.name}_cpu.cc":
            tries[unit] = tries.get(unit, 0) + 1
            if tries[unit] == 1:
                return 255, NVCC_KILLED
        return real(args, cwd)

    monkeypatch.setattr(build_mod, "_compile", killed_once)
    lines = []
    lib = build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path, progress=lines.append)
    assert tries == {f"{SPEC.name}_cpu.cc": 2} and lib.path.is_file()
    assert any("was killed (out of memory?)" in line for line in lines), lines


def test_build_killed_twice_says_so(tmp_path, monkeypatch):
    real = build_mod._compile

    def always_killed(args, cwd):
        if "-c" in args and Path(args[args.index("-c") + 1]).name == f"{SPEC.name}_cpu.cc":
            return 255, NVCC_KILLED
        return real(args, cwd)

    monkeypatch.setattr(build_mod, "_compile", always_killed)
    with pytest.raises(BuildError, match=r"_cpu\.cc \(killed twice: out of memory\?\)"):
        build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path)


def test_hopper_instances_are_planned_with_the_largest_peak():
    """_jobs gives each unit its kind's peak: a CUTLASS 3.x instance the Hopper one, plain units (and our own
    Hopper GEMM's, which include no CUTLASS) the least; the longest compiles start first."""
    sources = {"o2f_inst_Pingpong128x128_x.cu": '// onnx2fused-arch: sm90a\n#include "cutlass/cutlass.h"\n',
               "o2f_inst_Light128x128_x.cu": '// onnx2fused-arch: sm90a\n#include "o2f_light_gemm.cuh"\n',
               "o2f_inst_Sm80T1_x.cu": '#include "cutlass/cutlass.h"\n', "registry.cc": "int x;\n"}

    class Cutlass:
        path, version = Path("/cutlass"), "4"

    planned = build_mod._jobs(sources, "g++", "nvcc", [], ["-gencode", "arch=compute_90,code=sm_90"], set(), {}, Cutlass())
    jobs = {j.name: j.peak_mb for j in planned}
    assert jobs == {"o2f_inst_Pingpong128x128_x.cu": build_pool.PEAK_MB_HOPPER,
                    "o2f_inst_Light128x128_x.cu": build_pool.PEAK_MB_OTHER,
                    "o2f_inst_Sm80T1_x.cu": build_pool.PEAK_MB_CUTLASS, "registry.cc": build_pool.PEAK_MB_OTHER}
    assert [j.name for j in planned][:2] == ["o2f_inst_Pingpong128x128_x.cu", "o2f_inst_Sm80T1_x.cu"]
    light = next(j.args for j in planned if j.name.startswith("o2f_inst_Light"))
    assert "arch=compute_90a,code=sm_90a" in light and "--expt-relaxed-constexpr" not in light


def test_build_jobs_env_caps_the_compiles_at_once(tmp_path, monkeypatch):
    """ONNX2FUSED_BUILD_JOBS=1 through build_plugin (CPU-only library, real compiles): never two at once."""
    real = build_mod._compile
    lock = threading.Lock()
    running, most = [0], [0]

    def counted(args, cwd):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.05)
            return real(args, cwd)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(build_mod, "_compile", counted)
    monkeypatch.setattr(build_pool.os, "cpu_count", lambda: 8)
    monkeypatch.setenv(build_pool.JOBS_ENV, "1")
    assert build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path).path.is_file()
    assert most[0] == 1
    monkeypatch.delenv(build_pool.JOBS_ENV)
    assert build_pool.max_workers(3, None) == 3 and build_pool.max_workers(20, None) == 8
    assert build_pool.max_workers(20, 2) == 2 and build_pool.max_workers(0, None) == 1


@pytest.mark.parametrize("value", ["0", "-2", "many", "1.5"])
def test_a_bad_build_jobs_value_is_one_clear_error_before_any_work(tmp_path, monkeypatch, value):
    from onnx2fused.errors import ConversionError
    monkeypatch.setenv(build_pool.JOBS_ENV, value)
    with pytest.raises(ConversionError, match=rf"ONNX2FUSED_BUILD_JOBS='{re.escape(value)}': expected a whole number"):
        build_plugin([SPEC], with_cuda=False, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
