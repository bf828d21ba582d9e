"""bench: timing: device buffers and CUDA-event (or host-timer) timing of ORT IOBinding runs and torch
calls, interleaved CPU timing, and the copy-bandwidth / fp16-matmul peaks behind the floor column."""
from __future__ import annotations

import itertools
import time

import numpy as np

from .models import L2_ROTATE_BYTES, ROTATE_BUFFERS, ModelInfo, _ELEM_NP, _input_shape, _reason

FALLBACK_BW = 3.0e12      # bytes/s, H100 SXM device-to-device copy (read + write)
FALLBACK_TC = 665e12      # flop/s, H100 SXM dense fp16 matmul
ORT_DEVICE = "cuda"       # where ORT-side buffers live in GPU mode ("cpu" only for a smoke test of the flow)


def spread(ts) -> tuple[float, float, float]:
    """(median, p10, p90) of per-run times: the spread shows how far one number can be trusted."""
    a = np.asarray(ts, dtype=np.float64)
    med, p10, p90 = np.percentile(a, [50, 10, 90])
    return float(med), float(p10), float(p90)


def time_interleaved(sessions: dict, feed, reps: int, warmup: int) -> dict[str, list[float]]:
    """ms per run of each session, the sessions taking turns (in alternating order) within every
    repetition, so that a slow phase of a shared host (other processes, frequency changes) hits them
    all alike instead of whichever happened to run then. A session that fails is left out."""
    names = list(sessions)
    for _ in range(warmup):
        for n in names:
            sessions[n].run(None, feed)
    ts: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        for n in (names if i % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            sessions[n].run(None, feed)
            ts[n].append((time.perf_counter() - t0) * 1e3)
    return ts


def measure_peaks(torch) -> tuple[float, float, list[str]]:
    """(bytes/s of a large device-to-device copy counted as read + write, flop/s of a large fp16 matmul)."""
    notes = []
    dev = torch.device("cuda")

    def best_ms(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        return min(ts)

    try:
        nbytes = 1 << 30
        free, _ = torch.cuda.mem_get_info()
        while nbytes > (1 << 24) and 2 * nbytes > 0.5 * free:
            nbytes //= 2
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        ms = best_ms(lambda: dst.copy_(src))
        bw = 2 * nbytes / (ms * 1e-3)
        del src, dst
    except Exception as e:
        bw = FALLBACK_BW
        notes.append(f"bandwidth measurement failed ({_reason(e)}); using {FALLBACK_BW:.3g} B/s")
    try:
        n = 8192
        a = torch.randn(n, n, device=dev, dtype=torch.float16)
        b = torch.randn(n, n, device=dev, dtype=torch.float16)
        c = torch.empty(n, n, device=dev, dtype=torch.float16)
        ms = best_ms(lambda: torch.matmul(a, b, out=c))
        tc = 2 * n ** 3 / (ms * 1e-3)
        del a, b, c
    except Exception as e:
        tc = FALLBACK_TC
        notes.append(f"matmul measurement failed ({_reason(e)}); using {FALLBACK_TC:.3g} flop/s")
    torch.cuda.empty_cache()
    return bw, tc, notes


def _torch_dtype(torch, t: str):
    return {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(double)": torch.float64,
            "tensor(int64)": torch.int64, "tensor(int32)": torch.int32, "tensor(bool)": torch.bool,
            "tensor(bfloat16)": torch.bfloat16}[t]


def _np_dtype_of_torch(torch, dt):
    return {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
            torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_}[dt]


class _Dev:
    """Device buffers and timing: torch (CUDA tensors, CUDA events) when torch has CUDA, else ORT OrtValues
    on the device and host timers around each (synchronous) ORT run."""

    def __init__(self, torch):
        self.torch = torch
        if torch is not None:
            self.gen = torch.Generator(device="cuda")
            self.gen.manual_seed(0)
        self.rng = np.random.default_rng(0)

    def sync(self):
        if self.torch is not None:
            self.torch.cuda.synchronize()

    def empty(self, shape, t: str):
        if self.torch is not None:
            return self.torch.empty(shape, device="cuda", dtype=_torch_dtype(self.torch, t))
        import onnxruntime as ort
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), _ELEM_NP[t], ORT_DEVICE, 0)

    def random(self, shape, t: str):
        if self.torch is not None:
            torch = self.torch
            dt = _torch_dtype(torch, t)
            if dt.is_floating_point:
                return torch.randn(shape, device="cuda", dtype=torch.float32, generator=self.gen).to(dt)
            return torch.zeros(shape, device="cuda", dtype=dt)
        import onnxruntime as ort
        dt = _ELEM_NP[t]
        arr = (self.rng.standard_normal(shape, dtype=np.float32).astype(dt) if np.issubdtype(dt, np.floating)
               else np.zeros(shape, dtype=dt))
        return ort.OrtValue.ortvalue_from_numpy(arr, ORT_DEVICE, 0)

    def nbytes(self, buf) -> int:
        if self.torch is not None:
            return buf.numel() * buf.element_size()
        return int(np.prod(buf.shape())) * np.dtype(_ELEM_NP[buf.data_type()]).itemsize

    def bind(self, io, name, buf, output=False):
        if self.torch is None:
            (io.bind_ortvalue_output if output else io.bind_ortvalue_input)(name, buf)
            return
        args = (name, "cuda", 0, _np_dtype_of_torch(self.torch, buf.dtype), list(buf.shape), buf.data_ptr())
        (io.bind_output if output else io.bind_input)(*args)

    def time(self, step, reps: int, warmup: int) -> list[float]:
        """Per-run times (ms) of one step: time_interleaved with nothing to take turns with."""
        return self.time_interleaved({"step": step}, reps, warmup)["step"]

    def time_interleaved(self, steps: dict, reps: int, warmup: int) -> dict[str, list[float]]:
        """Per-run times (ms) of each step: in every repetition each step runs once, the order reversed
        every other repetition, each run timed on its own with the device idle before it. torch: CUDA
        events on the current stream (a synchronous ORT run ends after its work, so the end event follows
        it); else the host timer."""
        names = list(steps)
        for i in range(warmup):
            for n in names:
                steps[n](i)
        self.sync()
        ts: dict[str, list[float]] = {n: [] for n in names}
        for i in range(reps):
            for n in (names if i % 2 == 0 else names[::-1]):
                if self.torch is None:
                    t0 = time.perf_counter()
                    steps[n](i)
                    ts[n].append((time.perf_counter() - t0) * 1e3)
                    continue
                start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
                start.record()
                steps[n](i)
                end.record()
                end.synchronize()
                ts[n].append(start.elapsed_time(end))
        return ts


def _make_inputs(dev: _Dev, sess, info: ModelInfo, batch: int, nbuf: int) -> list[dict]:
    """nbuf sets of device inputs {name: buffer} for the session's inputs."""
    dims = {n: d for n, _, d in info.inputs}
    return [{i.name: dev.random(_input_shape(dims.get(i.name, i.shape), batch), i.type) for i in sess.get_inputs()}
            for _ in range(nbuf)]


def _bind(dev: _Dev, sess, inputs: dict, outputs: dict | None):
    io = sess.io_binding()
    for name, buf in inputs.items():
        dev.bind(io, name, buf)
    for o in sess.get_outputs():
        if outputs is None:
            io.bind_output(o.name, ORT_DEVICE, 0)
        else:
            dev.bind(io, o.name, outputs[o.name], output=True)
    return io


_graph_ids = itertools.count(1)  # CUDA graphs captured by ORT in this process, one per binding


def _new_graph_options():
    """Run options that make a CUDA-graph session capture (then replay) a graph of its own."""
    import onnxruntime as ort
    options = ort.RunOptions()
    options.add_run_config_entry("gpu_graph_id", str(next(_graph_ids)))
    return options


# ORT's run option that ends a run without waiting for the GPU (no cudaStreamSynchronize on the CUDA EP's
# stream): the pipelined timings run back to back with it, as a serving loop that never reads the
# outputs on the host between runs would.
NO_SYNC_OPTION = "disable_synchronize_execution_providers"
PIPELINE_RUNS = 10   # runs per timed burst of a pipelined timing


def _run_options(graph_id: bool, wait: bool):
    """The run options of one binding: a CUDA graph of its own (graph_id), and/or no wait at the end."""
    if not graph_id and wait:
        return None
    import onnxruntime as ort
    options = _new_graph_options() if graph_id else ort.RunOptions()
    if not wait:
        options.add_run_config_entry(NO_SYNC_OPTION, "1")
    return options


def _ort_gpu_runner(dev: _Dev, sess, info: ModelInfo, batch: int, cuda_graph: bool = False):
    """(step, output features per row, buffers): step(i) runs the session once on device-resident inputs
    and outputs (IOBinding), rotating input sets where they would stay in L2; step(i, wait=False) returns
    without waiting for the GPU (NO_SYNC_OPTION); `buffers` must outlive the steps. cuda_graph: the
    session was made with enable_cuda_graph=1; each binding (fixed buffer addresses) gets its own captured
    graph (run option gpu_graph_id), replayed on every later run."""
    sets = _make_inputs(dev, sess, info, batch, 1)
    in_bytes = sum(dev.nbytes(b) for b in sets[0].values())
    if in_bytes < L2_ROTATE_BYTES:   # small enough to stay in L2 between runs: rotate buffers
        sets += _make_inputs(dev, sess, info, batch, ROTATE_BUFFERS - 1)
    # One run with ORT-allocated outputs gives their shapes.
    io0 = _bind(dev, sess, sets[0], None)
    # With CUDA graphs this run needs a graph of its own: the default one was captured at another batch.
    sess.run_with_iobinding(io0, _new_graph_options() if cuda_graph else None)
    outs, out_feat = {}, 0
    for o, v in zip(sess.get_outputs(), io0.get_outputs()):
        shape = list(v.shape())
        outs[o.name] = dev.empty(shape, o.type)
        out_feat += int(np.prod(shape[1:])) if len(shape) > 1 else 1
    del io0
    dev.sync()
    bindings = [_bind(dev, sess, s, outs) for s in sets]
    run_options = {wait: [_run_options(cuda_graph, wait) for _ in bindings] for wait in (True, False)}

    def step(i: int, wait: bool = True):
        sess.run_with_iobinding(bindings[i % len(bindings)], run_options[wait][i % len(bindings)])
    return step, out_feat, (sets, outs, bindings)


def time_ort_gpu(dev: _Dev, sess, info: ModelInfo, batch: int, reps: int, warmup: int,
                 cuda_graph: bool = False) -> tuple[list[float], int]:
    """Time one ORT CUDA session at one batch size with device-resident inputs/outputs (IOBinding)
    (_ort_gpu_runner). Returns (per-run ms, output features per row)."""
    step, out_feat, buffers = _ort_gpu_runner(dev, sess, info, batch, cuda_graph)
    if cuda_graph:
        warmup = max(warmup, len(buffers[2]))  # every graph is captured before the timed runs
    ts = dev.time(step, reps, warmup)
    del step, buffers
    return ts, out_feat


def time_ort_gpu_pipelined(dev: _Dev, sess, info: ModelInfo, batch: int, reps: int, warmup: int,
                           burst: int = PIPELINE_RUNS) -> list[float]:
    """Per-run ms of runs back to back: `reps` bursts of `burst` runs, each burst timed on the host from an
    idle device to the end of its last run; every run but the last returns without waiting for the GPU
    (NO_SYNC_OPTION), so ORT's host work for the next run overlaps the GPU's work on this one, and the
    last run's wait (ORT synchronises its stream) ends the burst. A burst's time / burst per run: the
    throughput of a serving loop, against the latency that time_ort_gpu measures."""
    step, _, buffers = _ort_gpu_runner(dev, sess, info, batch)
    for i in range(warmup):
        step(i)
    ts = []
    for _ in range(reps):
        dev.sync()
        ts.append(_burst(step, burst))
    del step, buffers
    return ts


def _burst(step, burst: int) -> float:
    """Per-run ms of `burst` runs back to back: all but the last without waiting for the GPU."""
    t0 = time.perf_counter()
    for j in range(burst - 1):
        step(j, wait=False)
    step(burst - 1)
    return (time.perf_counter() - t0) * 1e3 / burst


def time_ort_gpu_sustained(dev: _Dev, sess, info: ModelInfo, batch: int, seconds: float, warmup: int,
                           burst: int = PIPELINE_RUNS) -> tuple[list[float], dict | None]:
    """Pipelined bursts (time_ort_gpu_pipelined's) back to back for `seconds`, nvidia-smi sampling the
    GPU meanwhile (clocks.ClockProbe): (per-run ms of each burst, the clock and power summary or None).
    Long enough, a kernel meets the board's power limit and runs at the clock that keeps it there: the
    throughput a serving loop keeps, where the other timings see the first milliseconds."""
    from .clocks import ClockProbe
    step, _, buffers = _ort_gpu_runner(dev, sess, info, batch)
    for i in range(warmup):
        step(i)
    ts = []
    with ClockProbe() as probe:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            ts.append(_burst(step, burst))
    del step, buffers
    return ts, probe.summary


def time_ort_gpu_interleaved(dev: _Dev, sessions: dict, info: ModelInfo, batch: int, reps: int,
                             warmup: int) -> dict[str, list[float]]:
    """Per-run ms of each session at one batch size, the sessions taking turns within every repetition
    (in alternating order), each run timed alone with the device idle before it: a slow phase of the
    machine (clocks, the host) hits every session alike, so their ratio holds where one session timed
    after another drifts by several percent between calls."""
    runners = {name: _ort_gpu_runner(dev, sess, info, batch) for name, sess in sessions.items()}
    ts = dev.time_interleaved({name: r[0] for name, r in runners.items()}, reps, warmup)
    del runners
    return ts


def time_torch(dev: _Dev, fn, in_shape, reps, warmup) -> list[float]:
    torch = dev.torch
    x0 = dev.random(in_shape, "tensor(float16)")
    nbuf = ROTATE_BUFFERS if x0.numel() * 2 < L2_ROTATE_BYTES else 1
    xs = [x0] + [dev.random(in_shape, "tensor(float16)") for _ in range(nbuf - 1)]
    with torch.inference_mode():
        return dev.time(lambda i: fn(xs[i % nbuf]), reps, warmup)


def _empty_cache(torch):
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _cuda_torch():
    """torch when it sees a CUDA device, else None."""
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None
