"""The `onnx2fused` command: convert | inspect (| bench | doctor, when those modules are installed).

Every ConversionError (and OSError) prints one line `onnx2fused: error: <message>` to stderr and exits 2.
Progress lines of long steps go to stderr (`--quiet` hides them); reports go to stdout.

A subcommand hook: for each NAME in HOOKS, when the module `onnx2fused.<module>` exists, `onnx2fused NAME`
is offered; <module> is NAME, or HOOK_MODULES[NAME] where NAME is not a valid module name (a '-' in it).
The module is imported only when that subcommand is run (or its --help asked), and must provide
`add_arguments(parser)` and `main(args) -> int`.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import warnings

from ._version import __version__
from .envvars import environment
from .errors import ConversionError

PROG = "onnx2fused"
HOOKS = {
    "bench": "time stock ONNX Runtime vs the fused model",
    "doctor": "toolchain, headers, GPU and ONNX Runtime providers",
    "export-triton": "write a Triton Inference Server model repository for a (fused) model",
    "tune": "search the wide design's Hopper GEMM kernels for a model on this GPU, once (convert reuses them)",
}
# command name -> module name, for command names that are not valid module names
HOOK_MODULES = {"export-triton": "triton"}


def _hook_module(name: str) -> str:
    return f"{__package__}.{HOOK_MODULES.get(name, name)}"


def _error(msg) -> int:
    text = " ".join(str(msg).split()) or "unknown error"
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return 2


_OPEN_PROGRESS: list = []


def progress(args=None, quiet: bool | None = None):
    """The progress hook of a command: lines on stderr with the elapsed time and a heartbeat during long
    steps (progress.Progress); None when --quiet. Closed when `main` returns."""
    from .progress import Progress
    if quiet is None:
        quiet = bool(getattr(args, "quiet", False))
    if quiet:
        return None
    p = Progress(PROG)
    _OPEN_PROGRESS.append(p)
    return p


_progress = progress


def _close_progress() -> None:
    while _OPEN_PROGRESS:
        _OPEN_PROGRESS.pop().close()


def _broken_pipe() -> int:
    """stdout's reader went away (`onnx2fused ... | head`): stop quietly, as a command killed by SIGPIPE
    would, with its status 128 + 13; stdout is pointed at /dev/null so that the interpreter's final flush
    does not complain either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass
    return 141


# build-target options -> the environment variables build.py reads (set for the command only)
TARGET_ENV = {"cpu_arch": "ONNX2FUSED_CPU_ARCH", "cuda_archs": "ONNX2FUSED_CUDA_ARCHS", "cuda_ptx": "ONNX2FUSED_CUDA_PTX"}


def add_target_arguments(parser) -> None:
    """--cpu-arch / --cuda-archs / --cuda-ptx: which CPUs and GPUs the built library runs on."""
    g = parser.add_argument_group("build targets (where the library will run; default: this host's CPU, "
                                  "GPUs sm_80 and sm_90 with PTX for newer ones)")
    g.add_argument("--cpu-arch", metavar="ARCH",
                   help="-march of the C++ kernels: native (default, this host's CPU only), or e.g. x86-64-v3 "
                        "(any AVX2 x86 server), x86-64-v4, armv8.2-a ($ONNX2FUSED_CPU_ARCH)")
    g.add_argument("--cuda-archs", metavar="LIST",
                   help="compute capabilities of the CUDA kernels' SASS, e.g. 80,86,89,90 (default 80,90; "
                        "$ONNX2FUSED_CUDA_ARCHS)")
    g.add_argument("--cuda-ptx", metavar="auto|off|ARCH",
                   help="PTX embedded for GPUs newer than every listed arch (JIT-compiled by the driver at "
                        "load): auto (default) = the highest listed arch, off, or an arch ($ONNX2FUSED_CUDA_PTX)")


@contextlib.contextmanager
def build_targets(args):
    """The build-target options of `args` as the environment build.py reads, for the command's duration;
    bad values are a ConversionError before any work."""
    values = {env: v for opt, env in TARGET_ENV.items() if (v := getattr(args, opt, None)) is not None}
    with environment(values):
        if values:
            from .targets import cpu_arch, cuda_archs, cuda_ptx_arch, find_cxx, native_flags
            if "ONNX2FUSED_CPU_ARCH" in values:
                native_flags(find_cxx(), cpu_arch())   # the compiler knows the -march value
            cuda_ptx_arch(cuda_archs())
        yield


def _hook_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(_hook_module(name)) is not None
    except (ImportError, ValueError):
        return False


def _command_of(argv: list[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a
    return None


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line, as every other error (`onnx2fused: error: ...`, status 2), with where to
    look instead of the usage block."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Fuse the MLP chains of an ONNX model into one custom "
                                "op each, build its ONNX Runtime plugin and validate it against stock ORT.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("convert", help="fuse, build the plugin, validate, write the fused model and a report",
                       description="Fuse the MLP chains of IN, build the plugin library, validate against "
                                   "stock ONNX Runtime and write OUT (default: <IN stem>.fused.onnx) with the "
                                   "library <OUT stem>.onnx2fused.so beside it.")
    c.add_argument("input", metavar="IN", help="the ONNX model (never modified)")
    c.add_argument("-o", "--output", metavar="OUT", help="the fused model (default: <IN stem>.fused.onnx beside IN)")
    c.add_argument("--precision", choices=["auto", "fp16", "bf16", "tf32", "fp32"], default="auto",
                   help="auto (default): per chain, the fastest of fp16, bf16, tf32, fp32 whose numerics pass; "
                        "or one tensor-core operand precision for every chain (fp16, bf16, tf32), or fp32 "
                        "on CUDA cores (exact); an explicit choice that fails validation is refused")
    c.add_argument("--tune", action="store_true",
                   help="search the wide design's Hopper GEMM kernels on this GPU where no choice is cached "
                        "(minutes; cached per spec and GPU model)")
    c.add_argument("--no-validate", dest="validate", action="store_false", help="skip the comparison with stock ORT")
    c.add_argument("--inputs", metavar="NPZ", help=".npz of input name -> array, validated besides random inputs")
    c.add_argument("--atol", type=float, metavar="A",
                   help="validation: pass when |fused - ref| <= A + R * |ref| for every element (with --rtol R; "
                        "a missing one is 0), instead of the precision's relative-L2 tolerance")
    c.add_argument("--rtol", type=float, metavar="R", help="validation: the relative term of --atol's check")
    c.add_argument("--input-shapes", nargs="+", action="extend", metavar="NAME:DIMS", type=input_shape,
                   help="shapes of the random validation inputs, e.g. x:[64,32] or x:64x32 (instead of batches "
                        "1, 37 and 256 with other symbolic dims 5)")
    c.add_argument("--save-inputs", metavar="NPZ",
                   help="write the validation input sets to this .npz (keys '<set>/<input>', and 'cases')")
    c.add_argument("--save-outputs", metavar="NPZ",
                   help="write stock ORT's outputs on them to this .npz (keys '<set>/<output>'; the fused "
                        "model's as 'fused/<set>/<output>')")
    c.add_argument("--force", action="store_true", help="write the model even when validation fails")
    c.add_argument("--cache-dir", metavar="DIR", help="build cache (default $ONNX2FUSED_CACHE or ~/.cache/onnx2fused)")
    c.add_argument("--cpu-only", action="store_true", help="build the C++ (CPU) kernels only, no CUDA")
    c.add_argument("--stock-where-faster", action="store_true",
                   help="with --cpu-only: leave as stock ops the chains whose fused CPU kernel would be slower "
                        "than stock ORT (large weights, a lone linear layer, scalar activations), instead of "
                        "fused nodes that run those stock ops inside")
    c.add_argument("--json", action="store_true", help="print the report as JSON")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    add_target_arguments(c)

    i = sub.add_parser("inspect", help="list the chains found, and why other layers are not fused",
                       description="List the MLP chains convert would fuse (widths, activations, CUDA plan) "
                                   "and, for each linear layer not fused, why.")
    i.add_argument("input", metavar="IN", help="the ONNX model")
    i.add_argument("--precision", choices=["auto", "fp16", "bf16", "tf32", "fp32"], default="auto",
                   help="precision of the plan shown (default auto: what convert would choose per chain)")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.add_argument("--cpu-only", action="store_true",
                   help="show what convert --cpu-only would fuse (gated layers fuse only without CUDA)")
    i.add_argument("--stock-where-faster", action="store_true",
                   help="show what convert --cpu-only --stock-where-faster would fuse")
    i.add_argument("--cache-dir", metavar="DIR", help="build cache whose tuned wide kernels to show "
                                                     "(default $ONNX2FUSED_CACHE or ~/.cache/onnx2fused)")

    argv = sys.argv[1:] if argv is None else argv
    chosen = _command_of(argv)
    for name, help_text in HOOKS.items():
        if not _hook_available(name):
            continue
        h = sub.add_parser(name, help=help_text, description=help_text)
        h.set_defaults(_hook=name)
        if chosen == name:  # import the module only when its subcommand runs
            mod = importlib.import_module(_hook_module(name))
            mod.add_arguments(h)
    return p


def input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """NAME:DIMS of --input-shapes: x:[64,32], x:64x32 or x:64,32 -> ("x", (64, 32)); the name is what is
    before the last ':' (input names may hold ':')."""
    name, sep, dims = text.rpartition(":")
    body = dims.strip().strip("[]()").replace("x", ",").replace(" ", "")
    try:
        shape = tuple(int(d) for d in body.split(",") if d)
    except ValueError:
        shape = ()
    if not sep or not name or not shape or any(d <= 0 for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:DIMS with positive sizes, e.g. x:[64,32]")
    return name, shape


def _convert(args) -> int:
    from .convert import convert
    shapes = dict(args.input_shapes) if args.input_shapes else None
    with build_targets(args):
        result = convert(args.input, args.output, precision=args.precision, validate=args.validate,
                         inputs=args.inputs, force=args.force, cache_dir=args.cache_dir,
                         with_cuda=False if args.cpu_only else None, progress=_progress(args), tune=args.tune,
                         atol=args.atol, rtol=args.rtol, input_shapes=shapes, save_inputs=args.save_inputs,
                         save_outputs=args.save_outputs, stock_where_faster=args.stock_where_faster)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(result.format())
    return 0


def _inspect(args) -> int:
    from .convert import inspect
    result = inspect(args.input, precision=args.precision, cache_dir=args.cache_dir,
                     with_cuda=False if args.cpu_only else None, stock_where_faster=args.stock_where_faster)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(result.format())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not os.environ.get("ONNX2FUSED_DEBUG"):
        # Library warnings (onnx, onnxruntime, torch) would break the one-line error contract on stderr.
        warnings.simplefilter("ignore")
    try:
        parser = build_parser(argv)
    except ImportError as e:
        return _error(f"cannot load the subcommand: {e}")
    try:
        args = parser.parse_args(argv)
    except BrokenPipeError:   # --help into a closed pipe
        return _broken_pipe()
    try:
        rc = _run(parser, args)
        sys.stdout.flush()    # a closed pipe shows here, not at exit
        return rc
    except BrokenPipeError:
        return _broken_pipe()
    except ConversionError as e:
        return _error(e)
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        return _error(f"{where}{e.strerror or e}")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug, not bad input: one line unless asked for the traceback
        if os.environ.get("ONNX2FUSED_DEBUG"):
            raise
        print(f"{PROG}: internal error: {type(e).__name__}: {' '.join(str(e).split())} "
              "(set ONNX2FUSED_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1
    finally:
        _close_progress()


def _run(parser, args) -> int:
    if getattr(args, "_hook", None):
        mod = importlib.import_module(_hook_module(args._hook))
        return int(mod.main(args) or 0)
    if args.command == "convert":
        return _convert(args)
    if args.command == "inspect":
        return _inspect(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
