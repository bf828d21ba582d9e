"""bench: the variants and the two modes' sweeps: converting the model (the fused variants), opening each
variant's session, and timing every variant at every batch size (run_cpu, run_gpu)."""
from __future__ import annotations

import datetime as _dt
import gc
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ..errors import ConversionError
from ..spec import PLUGIN_KEY
from .models import (_ELEM_NP, _features, _find_zoo_entry, _input_shape, _random_feed, _reason, default_cpu_batch,
                     dim_sizes, fp16_model_file, gpu_batches, load_torch_module, model_info, with_dim_sizes,
                     zoo_torch_module)
from .clocks import describe as describe_clocks
from .report import _command_line, _cpu_name, _git_commit, _versions, _write_outputs, format_table
from .timing import (FALLBACK_BW, FALLBACK_TC, _cuda_torch, _Dev, _empty_cache, measure_peaks, spread,
                     time_interleaved, time_ort_gpu, time_ort_gpu_pipelined, time_ort_gpu_sustained, time_torch)

DEFAULT_GPU_BATCHES = [2 ** k for k in range(10, 23, 2)]   # 2^10 ... 2^22, x4
DEFAULT_GPU_REPS = 100
DEFAULT_CPU_REPS = 15
DEFAULT_THREADS = 2

GPU_VARIANTS = ["ort_fp32", "ort_fp16", "fused", "fused_graph", "torch_eager", "torch_compile"]
OPTIONAL_GPU_VARIANTS = ["fused_fp16",                       # --fp16-model
                         "ort_fp16_pipelined", "fused_pipelined",   # --pipelined: these sessions' runs back to back
                         "fused_sustained"]                      # --sustain: the fused runs back to back for seconds
PIPELINED = {"ort_fp16": "ort_fp16_pipelined", "fused": "fused_pipelined"}
CPU_VARIANTS = ["ort_cpu", "fused_cpu"]


def _convert_fn():
    mod = importlib.import_module("onnx2fused.convert")
    return getattr(mod, "convert")


def convert_model(model: Path, out_dir: Path, precision: str, with_cuda: bool, plans: list | None = None,
                  progress=None):
    """(fused model path, plugin path); `plans` (if given) receives (chain name, plan text) per chain.
    Raises ConversionError when the model has nothing to fuse (there would be no fused variant to time)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / (model.name[:-5] if model.name.endswith(".onnx") else model.name)
    dst = dst.with_name(dst.name + ".fused.onnx")
    res = _convert_fn()(str(model), str(dst), precision=precision, validate=True, with_cuda=with_cuda,
                        progress=progress)
    if getattr(res, "nothing_to_fuse", None):
        raise ConversionError(f"nothing to fuse in {model}: {res.nothing_to_fuse}")
    if plans is not None:
        plans.extend((c.name, c.cuda_plan) for c in getattr(res, "chains", []) if getattr(c, "cuda_plan", None))
    out = Path(getattr(res, "output_path", None) or dst)
    lib = getattr(res, "library_path", None)
    return out, (Path(lib) if lib else None)


def fused_session(path: Path, library: Path | None, so, providers):
    """A session on the fused model with its plugin: onnx2fused.InferenceSession when it gives a plain
    onnxruntime session (IOBinding needed), else the recorded plugin registered by hand."""
    import onnxruntime as ort
    try:
        sess_mod = importlib.import_module("onnx2fused.session")
        sess = sess_mod.InferenceSession(str(path), sess_options=so, providers=providers)
        if hasattr(sess, "io_binding") and hasattr(sess, "run_with_iobinding"):
            return sess
        inner = getattr(sess, "session", None) or getattr(sess, "_sess", None)
        if inner is not None and hasattr(inner, "io_binding"):
            return inner
    except ImportError:
        pass
    import onnx
    if library is None:
        meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
        library = path.resolve().parent / meta[PLUGIN_KEY]
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(str(path), so, providers=providers)


def _default_out(model: Path, cpu: bool) -> Path:
    stem = model.name[:-5] if model.name.endswith(".onnx") else model.name
    return Path("build") / "bench" / (stem + ("-cpu" if cpu else ""))


def _setup(args, cpu: bool):
    """(model, output folder (made), repetitions, warm-up runs, ModelInfo) of a bench run: the mode's
    defaults where the arguments leave them unset."""
    model = Path(args.model)
    out_dir = Path(args.out) if args.out else _default_out(model, cpu)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:   # one line, as convert's "output folder is not writable"
        raise ConversionError(f"{out_dir}: cannot create the output folder ({e.strerror or e})") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ConversionError(f"{out_dir}: output folder is not writable")
    reps = args.reps or (DEFAULT_CPU_REPS if cpu else DEFAULT_GPU_REPS)
    warmup = args.warmup if args.warmup is not None else (2 if cpu else 10)
    return model, out_dir, reps, warmup, with_dim_sizes(model_info(model), dim_sizes(args))


def timed_variants(standard: list[str], opened: list[str]) -> list[str]:
    """The result's variants: the standard ones, then the optional ones this run opened."""
    return standard + [v for v in OPTIONAL_GPU_VARIANTS if v in opened]


def _record(row: dict, name: str, ts: list[float]) -> None:
    """A variant's per-run times into a result row: median, p10 and p90 (ms) and the runs themselves."""
    med, p10, p90 = spread(ts)
    row["ms"][name] = med
    row.setdefault("p10_ms", {})[name] = p10
    row.setdefault("p90_ms", {})[name] = p90
    row["rep_ms"][name] = [round(t, 5) for t in ts]


def _timed(row: dict, name: str) -> str:
    return f"{row['ms'][name]:.4f} ms (p10 {row['p10_ms'][name]:.4f}, p90 {row['p90_ms'][name]:.4f})"


def _time_also(row: dict, name: str, say, timing, describe=None):
    """Variant `name`'s timing of a row: `timing()` gives (per-run ms, extra); records the times (or why
    they are missing) and says so, with describe(extra) where given; returns the extra (None on failure)."""
    try:
        ts, extra = timing()
    except Exception as e:
        row["na"][name] = _reason(e)
        say(f"  {name:<14} batch {row['batch']:>8}: n/a ({row['na'][name]})")
        return None
    _record(row, name, ts)
    say(f"  {name:<14} batch {row['batch']:>8}: {_timed(row, name)}"
        + (f"; {describe(extra)}" if describe else ""))
    return extra


def nothing_timed(rows: list[dict], fused_variants) -> str | None:
    """Why no fused variant has a time in any row (the bench then exits non-zero), or None."""
    if any(v in r["ms"] for r in rows for v in fused_variants):
        return None
    for v in fused_variants:
        for r in rows:
            if r["na"].get(v):
                return f"{v}: {r['na'][v]}"
    return "no batch size was timed"


def run_cpu(args, say=None) -> int:
    import onnxruntime as ort
    from ..cli import _error
    say = say or (lambda msg: None)
    model, out_dir, reps, warmup, info = _setup(args, cpu=True)
    batches = args.batches or [default_cpu_batch(info)]
    notes: list[str] = []

    def so():
        o = ort.SessionOptions()
        o.intra_op_num_threads = args.threads
        o.inter_op_num_threads = 1
        return o

    try:
        stock = ort.InferenceSession(str(model), so(), providers=["CPUExecutionProvider"])
    except Exception as e:
        raise ConversionError(f"stock onnxruntime cannot load {model}: {_reason(e)}") from None
    fused, fused_err = None, None
    t0 = time.perf_counter()
    say(f"converting {model} (CPU kernels; build and validation)")
    try:
        plans: list[str] = []
        fpath, lib = convert_model(model, out_dir, args.precision, with_cuda=False, plans=plans, progress=say)
        fused = fused_session(fpath, lib, so(), ["CPUExecutionProvider"])
        notes.append(f"fused model: {fpath} (converted and validated in {time.perf_counter() - t0:.1f} s)")
        # which chains run the generated kernel and which their stock-op fallback (cpu_policy.py)
        notes += [f"{n}: {p[p.find('CPU:'):] if 'CPU:' in p else p}" for n, p in plans]
    except Exception as e:   # nothing to compare with: stop before timing the stock model alone
        return _error(f"no fused model to time: {_reason(e)}")

    rng = np.random.default_rng(0)
    rows = []
    for b in batches:
        feed = _random_feed(info, b, rng)
        row = {"batch": b, "ms": {}, "na": {}, "rep_ms": {}}
        sessions = {}
        for name, sess, err in (("ort_cpu", stock, None), ("fused_cpu", fused, fused_err)):
            if sess is None:
                row["na"][name] = err
                continue
            try:
                sess.run(None, feed)  # a failing variant is reported, the other still timed
                sessions[name] = sess
            except Exception as e:
                row["na"][name] = _reason(e)
        if sessions:
            say(f"timing batch {b}: {', '.join(sessions)}, {warmup} warm-up + {reps} runs each, interleaved")
        for name, ts in (time_interleaved(sessions, feed, reps, warmup) if sessions else {}).items():
            _record(row, name, ts)
            say(f"  {name:<10} batch {b:>8}: {_timed(row, name)}")
        s, f = row["ms"].get("ort_cpu"), row["ms"].get("fused_cpu")
        row["speedup_vs_ort_cpu"] = s / f if s and f else None
        fl = info.batch_flops(b)
        row["flops"] = fl
        row["fused_gflops"] = fl / (f * 1e-3) / 1e9 if f and fl else None
        rows.append(row)

    result = {
        "mode": "cpu", "model": str(model), "device": _cpu_name(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(), "commit": _git_commit(), "command": _command_line(),
        "argv": sys.argv[:], "precision": args.precision, "threads": args.threads, "reps": reps,
        "warmup": warmup, "variants": CPU_VARIANTS, "notes": notes,
        "layers": [[l.k, l.n] for l in info.layers], "rows": rows,
    }
    print(f"onnx2fused bench --cpu: {model}  ({_cpu_name()}, {args.threads} threads, median and p10..p90 of "
          f"{reps} runs)")
    print(format_table(result))
    for n in notes:
        print("note:", n)
    _write_outputs(result, out_dir, say)
    why = nothing_timed(rows, ["fused_cpu"])
    return _error(f"the fused model was not timed: {why}") if why else 0


def _set_dynamo_limits(torch):
    try:
        import torch._dynamo as dynamo
        for attr in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(dynamo.config, attr):
                setattr(dynamo.config, attr, max(64, getattr(dynamo.config, attr)))
    except Exception:
        pass


def _nvidia_smi(field: str) -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=20)
        return r.stdout.strip().splitlines()[0].strip() if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _nvidia_smi_name() -> str:
    return _nvidia_smi("name") or "CUDA device 0"


def _nvidia_smi_memory() -> int:
    v = _nvidia_smi("memory.total")   # MiB
    try:
        return int(float(v)) * 2 ** 20
    except (TypeError, ValueError):
        return 16 * 2 ** 30


def gpu_providers() -> list:
    return [("CUDAExecutionProvider", {"device_id": 0, "arena_extend_strategy": "kSameAsRequested"}),
            "CPUExecutionProvider"]


def run_gpu(args, say=None) -> int:
    import onnxruntime as ort
    from ..cli import _error
    say = say or (lambda msg: None)
    model, out_dir, reps, warmup, info = _setup(args, cpu=False)
    notes: list[str] = []
    torch = _cuda_torch()
    if torch is not None:
        device = torch.cuda.get_device_name(0)
        total_mem = torch.cuda.get_device_properties(0).total_memory
        bw, tc, peak_notes = measure_peaks(torch)
        notes += peak_notes
    else:
        device, total_mem = _nvidia_smi_name(), _nvidia_smi_memory()
        bw, tc = FALLBACK_BW, FALLBACK_TC
        notes.append(f"torch has no CUDA: floor uses the fallback peaks {FALLBACK_BW:.3g} B/s and "
                     f"{FALLBACK_TC:.3g} flop/s (not measured); ORT buffers are OrtValues, times are host "
                     "timers around each synchronous run; no torch rows")
    dev = _Dev(torch)
    batches, cap_notes = gpu_batches(info, args.batches or DEFAULT_GPU_BATCHES, total_mem)
    notes += cap_notes
    print(f"onnx2fused bench: {model} on {device}; measured {bw / 1e12:.2f} TB/s copy, "
          f"{tc / 1e12:.0f} TFLOP/s fp16 matmul; median and p10..p90 of {reps} runs", flush=True)

    providers = gpu_providers()

    def so():
        o = ort.SessionOptions()
        o.log_severity_level = 3
        return o

    # Sessions are made one variant at a time (and dropped after its sweep) so that arenas do not pile up.
    def make_ort_fp32():
        return ort.InferenceSession(str(model), so(), providers=providers), None

    def fp16_copy() -> Path:
        return fp16_model_file(model, out_dir / (model.stem + ".fp16.onnx"))

    def make_ort_fp16():
        p = fp16_copy()
        return ort.InferenceSession(str(p), so(), providers=providers), f"ort_fp16 model: {p}"

    def convert_timed(src: Path, what: str):
        t0 = time.perf_counter()
        say(f"converting {src} (CUDA and CPU kernels; build, tuning and validation)")
        p, lib = convert_model(src, out_dir, args.precision, with_cuda=True, progress=say)
        s = fused_session(p, lib, so(), providers)
        return s, (f"{what}: {p} (precision {args.precision}; converted and validated in "
                   f"{time.perf_counter() - t0:.1f} s)")

    def make_fused():
        return convert_timed(model, "fused model")

    def make_fused_graph():
        # The same fused model with ORT's CUDA graphs: shows the op without ORT's per-run overhead.
        p, lib = convert_model(model, out_dir, args.precision, with_cuda=True, progress=say)
        cuda, *rest = providers
        graph_providers = [(cuda[0], {**cuda[1], "enable_cuda_graph": "1"})] + rest
        return fused_session(p, lib, so(), graph_providers), "fused_graph: enable_cuda_graph=1, one graph per IOBinding"

    def make_fused_fp16():
        # The fp16 copy ORT fp16 runs, converted: every op outside the chains in fp16 as in ort_fp16
        return convert_timed(fp16_copy(), "fused_fp16 model")

    variants = [("ort_fp32", make_ort_fp32), ("ort_fp16", make_ort_fp16), ("fused", make_fused),
                ("fused_graph", make_fused_graph)]
    if getattr(args, "fp16_model", False):
        variants.append(("fused_fp16", make_fused_fp16))
    pipelining = getattr(args, "pipelined", False)
    sustain = getattr(args, "sustain", None)
    rows = {b: {"batch": b, "ms": {}, "na": {}, "rep_ms": {}} for b in batches}
    out_features = {}

    for name, make in variants:
        say(f"{name}: opening the session")
        try:
            sess, note = make()
            if note:
                notes.append(note)
            if "CUDAExecutionProvider" not in sess.get_providers():
                notes.append(f"{name}: session has no CUDA EP ({sess.get_providers()})")
        except Exception as e:
            reason = _reason(e)
            notes.append(f"{name}: n/a: {reason}")
            for r in rows.values():
                r["na"][name] = reason
            continue
        failed = None
        pipelined = PIPELINED.get(name) if pipelining else None   # the same session's runs back to back
        sustained = "fused_sustained" if sustain and name == "fused" else None
        timed = (name,) + tuple(n for n in (pipelined, sustained) if n)
        for b in batches:
            if failed:
                for n in timed:
                    rows[b]["na"][n] = f"skipped after a failure at a smaller batch: {failed}"
                continue
            try:
                ts, of = time_ort_gpu(dev, sess, info, b, reps, warmup, cuda_graph=name == "fused_graph")
                _record(rows[b], name, ts)
                out_features.setdefault(b, of)
                say(f"  {name:<14} batch {b:>8}: {_timed(rows[b], name)}")
            except Exception as e:
                failed = _reason(e)
                for n in timed:
                    rows[b]["na"][n] = failed
                say(f"  {name:<14} batch {b:>8}: n/a ({failed})")
            else:   # the same session's further timings; a failure there is that variant's alone
                if pipelined:
                    _time_also(rows[b], pipelined, say,
                               lambda: (time_ort_gpu_pipelined(dev, sess, info, b, reps, warmup), None))
                if sustained:
                    clocks = _time_also(rows[b], sustained, say,
                                        lambda: time_ort_gpu_sustained(dev, sess, info, b, sustain, warmup),
                                        describe_clocks)
                    if sustained not in rows[b]["na"]:
                        rows[b].setdefault("clocks", {})[sustained] = clocks
                        notes.append(f"{sustained} at batch {b} ({sustain:g} s back to back): {describe_clocks(clocks)}")
            gc.collect()
            _empty_cache(torch)
        del sess
        gc.collect()
        _empty_cache(torch)

    # torch rows
    tmod, tnote = None, None
    if args.no_torch:
        tnote = "torch rows skipped (--no-torch)"
    elif torch is None:
        tnote = "torch rows skipped: torch has no CUDA"
    else:
        try:
            if args.torch_module:
                tmod, tnote = load_torch_module(args.torch_module), f"torch rows: --torch-module {args.torch_module}"
            else:
                entry = _find_zoo_entry(model)
                if entry is None:
                    tnote = "torch rows skipped: the model is not in models/zoo.json and no --torch-module was given"
                else:
                    tmod, tnote = zoo_torch_module(torch, model, entry)
        except Exception as e:
            tmod, tnote = None, f"torch rows n/a: {_reason(e)}"
    notes.append(tnote)
    if tmod is None:
        for r in rows.values():
            r["na"]["torch_eager"] = r["na"]["torch_compile"] = tnote
    else:
        tmod = tmod.to("cuda").half().eval()
        _set_dynamo_limits(torch)
        try:
            compiled = torch.compile(tmod, dynamic=False)
            compile_err = None
        except Exception as e:
            compiled, compile_err = None, _reason(e)
        in_dims = info.inputs[0][2] if info.inputs else ["batch"]
        for name, fn in (("torch_eager", tmod), ("torch_compile", compiled)):
            failed = compile_err if fn is None else None
            for b in batches:
                if failed:
                    rows[b]["na"][name] = failed
                    continue
                try:
                    ts = time_torch(dev, fn, _input_shape(in_dims, b), reps, max(warmup, 3))
                    _record(rows[b], name, ts)
                    say(f"  {name:<14} batch {b:>8}: {_timed(rows[b], name)}")
                except Exception as e:
                    failed = _reason(e)
                    rows[b]["na"][name] = failed
                    say(f"  {name:<14} batch {b:>8}: n/a ({failed})")
                gc.collect()
                _empty_cache(torch)

    # derived columns
    in_f = sum(_features(d) for _, _, d in info.inputs)
    io_bytes = _ELEM_NP.get(info.inputs[0][1], np.float32) if info.inputs else np.float32
    elem = np.dtype(io_bytes or np.float32).itemsize
    wbytes_per = 2 if args.precision in ("fp16", "bf16") else 4
    for b, r in rows.items():
        out_f = out_features.get(b) or sum(_features(d) for _, _, d in info.outputs)
        r["flops"] = info.batch_flops(b)
        r["bytes"] = b * (in_f + out_f) * elem + info.weight_params * wbytes_per
        r["floor_ms"] = max(r["bytes"] / bw, r["flops"] / tc) * 1e3
        f = r["ms"].get("fused")
        s32, s16 = r["ms"].get("ort_fp32"), r["ms"].get("ort_fp16")
        r["speedup_vs_ort_fp32"] = s32 / f if f and s32 else None
        r["speedup_vs_ort_fp16"] = s16 / f if f and s16 else None
        r["fused_tflops"] = r["flops"] / (f * 1e-3) / 1e12 if f and r["flops"] else None
        r["fused_over_floor"] = f / r["floor_ms"] if f and r["floor_ms"] else None
        fp, sp = r["ms"].get("fused_pipelined"), r["ms"].get("ort_fp16_pipelined")
        if fp and sp:
            r["speedup_pipelined_vs_ort_fp16"] = sp / fp
        f16 = r["ms"].get("fused_fp16")
        if f16 and s16:
            r["speedup_fp16_vs_ort_fp16"] = s16 / f16

    result = {
        "mode": "gpu", "model": str(model), "device": device,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(), "commit": _git_commit(), "command": _command_line(), "argv": sys.argv[:],
        "precision": args.precision, "reps": reps, "warmup": warmup, "variants": timed_variants(GPU_VARIANTS, [n for n, _ in variants]
                                                                       + (list(PIPELINED.values()) if pipelining else [])
                                                                       + (["fused_sustained"] if sustain else [])),
        "measured": {"copy_bytes_per_s": bw, "fp16_matmul_flops_per_s": tc},
        "timing": ("CUDA events" if torch is not None else "host timers") +
                  " around each run (ORT: run_with_iobinding, synchronous; torch: forward + event sync), "
                  "device-resident inputs/outputs, inputs < 50 MB rotated over 4 buffers; median, p10, p90"
                  + ("; *_pipelined: bursts of runs back to back (run option disable_synchronize_execution_providers=1 "
                     "but the last), host time of a burst from an idle device / its runs"
                     if pipelining else "")
                  + (f"; fused_sustained: such bursts back to back for {sustain:g} s, nvidia-smi sampling the SM "
                     "clock and power (rows' clocks)" if sustain else ""),
        "notes": notes, "layers": [[l.k, l.n] for l in info.layers],
        "rows": [rows[b] for b in batches],
    }
    print(format_table(result))
    for n in notes:
        print("note:", n)
    _write_outputs(result, out_dir, say)
    why = nothing_timed(list(rows.values()), ["fused", "fused_graph", "fused_fp16"])
    return _error(f"the fused model was not timed: {why}") if why else 0
