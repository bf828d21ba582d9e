"""`onnx2fused bench`: time stock ONNX Runtime against the fused model.

GPU mode (default; needs onnxruntime's CUDAExecutionProvider), all in one process on one GPU, for each
batch size of a sweep:

  ort_fp32       stock ORT CUDA EP on the original model
  ort_fp16       stock ORT CUDA EP on an fp16 copy of the model (`to_fp16`)
  fused          the model converted by `onnx2fused.convert` (validated), plugin registered
  fused_graph    the same with ORT's CUDA graphs (enable_cuda_graph=1): no per-run ORT overhead
  *_pipelined    (--pipelined) ort_fp16 and fused again, their runs back to back in bursts of 10 (every run
                 but a burst's last with ORT's disable_synchronize_execution_providers=1): throughput, where
                 the rows above are each run's latency from an idle GPU
  fused_sustained (--sustain SECONDS) the fused model's bursts back to back for that long, nvidia-smi
                 sampling the SM clock and power (clocks.py): the throughput once the GPU has met its power
                 limit, and whether it did
  fused_fp16     (--fp16-model) ort_fp16's fp16 copy, converted: for models where much of the time is
                 outside the chains (a whole transformer), the like-for-like comparison with ort_fp16
  torch_eager    torch fp16 eager   (zoo models, or --torch-module)
  torch_compile  torch.compile fp16 (same)

Inputs and outputs stay on the device (IOBinding on torch-allocated buffers); each case is warmed up
and then timed `--reps` times with CUDA events; the median is reported. The floor of a case is
max(bytes / BW, flops / TC) with BW (device-to-device copy) and TC (fp16 matmul) measured once in the
same process; flops are those of the MatMul, Gemm and Conv nodes with constant weights at the batch's
shapes (models.linear_flops: a pointwise Conv1d counts every point).

CPU mode (`--cpu`): stock ORT CPU EP on the original model vs the fused model with the CPU plugin,
same thread count, the two interleaved run by run (shared hosts drift), median of `--reps` runs
(default 15). Where the CPU policy (cpu_policy.py) does not register the fused kernel, the fused model
runs its stock-op fallback, and the table says so.

Both modes print a table and write `<out>/bench.json` and `<out>/bench.png`.

The package: models.py (what a model holds, its fp16 copy, feeds, the torch modules), timing.py (how a
run is timed), variants.py (what is timed: each variant's session, the sweeps of the two modes) and
report.py (table, bench.json, plot). The names below are re-exported for benchmarks/ and the tests.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ConversionError
from .models import (L2_ROTATE_BYTES, MAX_ELEMENTS, MEM_FRACTION, ROTATE_BUFFERS, Layer, ModelInfo,  # noqa: F401
                     _features, _find_zoo_entry, _input_shape, _random_feed, _reason, default_cpu_batch,
                     fp16_model_file, gpu_batches, dim_sizes, load_torch_module, model_info, to_fp16, zoo_torch_module)
from .report import LABELS, _write_outputs, format_table, plot  # noqa: F401
from .timing import (FALLBACK_BW, FALLBACK_TC, ORT_DEVICE, _cuda_torch, _Dev, measure_peaks,  # noqa: F401
                     time_interleaved, time_ort_gpu, time_ort_gpu_interleaved, time_ort_gpu_pipelined,
                     time_ort_gpu_sustained, time_torch)
from .variants import (CPU_VARIANTS, DEFAULT_CPU_REPS, DEFAULT_GPU_BATCHES, DEFAULT_GPU_REPS,  # noqa: F401
                       DEFAULT_THREADS, GPU_VARIANTS, convert_model, fused_session, gpu_providers, run_cpu, run_gpu)

NO_GPU_MESSAGE = ("no GPU: onnxruntime has no CUDAExecutionProvider (onnxruntime-gpu, with a CUDA GPU, has it); "
                  "use --cpu to time the CPU kernels")


# ----------------------------------------------------------------------------------------------- CLI

def _batch_value(part: str) -> int:
    if "^" in part:
        base, exp = part.split("^", 1)
        return int(base) ** int(exp)
    return int(part)


def _batches(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = _batch_value(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad batch size {part!r} (use e.g. 1024,4096 or 2^20)") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {v}")
        out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("no batch sizes given")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the ONNX model to benchmark (the original, not a fused one)")
    parser.add_argument("--cpu", action="store_true",
                        help="CPU mode: stock ORT CPU EP vs the fused model with the CPU plugin")
    parser.add_argument("--batches", type=_batches, default=None,
                        help="comma-separated batch sizes (2^20 allowed); GPU default 2^10..2^22 by 4x "
                             "(capped to fit memory), CPU default 65536 (less for wide models)")
    parser.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "tf32", "fp32"],
                        help="compute precision of the fused model (default fp16)")
    parser.add_argument("--out", default=None,
                        help="output folder for bench.json, bench.png and the converted models "
                             "(default build/bench/<model>[-cpu])")
    parser.add_argument("--reps", type=int, default=None,
                        help=f"timed runs per case (GPU default {DEFAULT_GPU_REPS}, CPU default {DEFAULT_CPU_REPS})")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs per case (GPU 10, CPU 2)")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                        help=f"CPU mode: intra_op_num_threads of both sessions (default {DEFAULT_THREADS})")
    parser.add_argument("--torch-module", default=None, metavar="PATH:CALLABLE",
                        help="torch rows: 'file.py:fn' or 'pkg.mod:fn' returning an nn.Module equivalent to the "
                             "model (or naming one); default: built from models/zoo.json when it describes the model")
    parser.add_argument("--no-torch", action="store_true", help="GPU mode: skip the torch rows")
    parser.add_argument("--fp16-model", action="store_true",
                        help="GPU mode: also convert the fp16 copy ORT fp16 runs and time it (fused_fp16): "
                             "every op outside the chains then runs in fp16 as in ort_fp16")
    parser.add_argument("--pipelined", action="store_true",
                        help="GPU mode: also time ort_fp16 and fused with runs back to back (ort_fp16_pipelined, "
                             "fused_pipelined): ORT's host work per run overlaps the GPU's, as in a serving loop")
    parser.add_argument("--sustain", type=float, default=None, metavar="SECONDS",
                        help="GPU mode: also run the fused model back to back this long per batch (fused_sustained), "
                             "nvidia-smi sampling the SM clock and power: the throughput under sustained load")
    parser.add_argument("--dim", action="append", default=None, metavar="NAME=SIZE",
                        help="the size of an input's named dynamic dimension past the batch axis (repeatable: "
                             "--dim h=7 --dim w=7 for a CNN head's map); others are 1")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress lines on stderr (build steps and each timing, with the elapsed time)")


def _already_fused(model: Path) -> bool:
    """Whether `model` is an onnx2fused output (its plugin recorded, or onnx2fused nodes in its graph)."""
    from ..convert import is_fused
    from ..loader import read_model
    return is_fused(read_model(model))


def main(args) -> int:
    """Exit 0 when the fused model was timed; 2 with a one-line reason when nothing (fused) could run:
    bad arguments, no GPU without --cpu, an already fused model, a model with nothing to fuse."""
    from ..cli import _error, progress
    for opt, v, low in (("--reps", args.reps, 1), ("--warmup", args.warmup, 0), ("--threads", args.threads, 1)):
        if v is not None and v < low:
            return _error(f"{opt} must be >= {low}, got {v}")
    sustain = getattr(args, "sustain", None)
    if sustain is not None and not 0 < sustain <= 600:
        return _error(f"--sustain must be between 0 and 600 seconds, got {sustain:g}")
    if sustain is not None and args.cpu:
        return _error("--sustain times the GPU (the fused model under sustained load); it has no CPU mode")
    try:
        dim_sizes(args)
    except ValueError as e:
        return _error(str(e))
    model = Path(args.model)
    if not model.is_file():
        return _error(f"{model}: no such file")
    try:
        fused = _already_fused(model)
    except ConversionError as e:   # the one line convert and inspect give for an unreadable model
        return _error(str(e))
    if fused:
        return _error(f"{model} is already fused (it holds onnx2fused nodes): bench takes the original model, "
                      "converts it and times both")
    if not args.cpu:
        import onnxruntime as ort
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return _error(NO_GPU_MESSAGE)
    say = progress(args)
    try:
        return run_cpu(args, say) if args.cpu else run_gpu(args, say)
    except ConversionError as e:   # e.g. an output folder that cannot be made
        return _error(str(e))
    finally:
        if say is not None:
            say.close()
