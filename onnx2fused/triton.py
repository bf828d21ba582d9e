"""`onnx2fused export-triton MODEL OUT_DIR`: a Triton Inference Server model repository for a fused model.

    OUT_DIR/<name>/config.pbtxt
    OUT_DIR/<name>/<version>/model.onnx            the fused model (+ its external data files, if any)
    OUT_DIR/<name>/<version>/model.onnx2fused.so   its plugin library

MODEL is an original model (converted first, with `onnx2fused.convert`) or a fused one (it carries
`metadata_props["onnx2fused.plugin"]`; its library is found from there).

Triton's onnxruntime backend hands each `model_operations.op_library_filename` string, unchanged, to
ORT's RegisterCustomOpsLibrary (dlopen) when it creates a model instance's session: it is not resolved
against the model repository, so it must be the library's absolute path as the *server* sees it. We
write `<library-dir>/model.onnx2fused.so`, with library-dir defaulting to
`<repository-root>/<name>/<version>` and repository-root to `/models` (the usual mount point of
`tritonserver --model-repository=/models` in the NGC container).

Batching: when every input and output has a symbolic first dimension, the config sets
`max_batch_size` (> 0), leaves that dimension out of `dims`, and enables dynamic batching; otherwise
`max_batch_size: 0` and full dims. Nothing is written unless the whole repository entry was built: it is
assembled in a temp folder inside OUT_DIR and renamed into place.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import onnx

from .errors import ConversionError
from .spec import PLUGIN_KEY

MODEL_FILE = "model.onnx"                 # Triton's default_model_filename for onnxruntime
LIBRARY_FILE = "model.onnx2fused.so"      # = convert.library_name(MODEL_FILE)
DEFAULT_REPOSITORY_ROOT = "/models"
DEFAULT_MAX_BATCH = 1024

# ONNX element type -> Triton model-config data type (tritonclient's model_config_pb2.DataType names)
TRITON_TYPES = {
    onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.BFLOAT16: "TYPE_BF16", onnx.TensorProto.DOUBLE: "TYPE_FP64",
    onnx.TensorProto.INT8: "TYPE_INT8", onnx.TensorProto.INT16: "TYPE_INT16",
    onnx.TensorProto.INT32: "TYPE_INT32", onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.UINT8: "TYPE_UINT8", onnx.TensorProto.UINT16: "TYPE_UINT16",
    onnx.TensorProto.UINT32: "TYPE_UINT32", onnx.TensorProto.UINT64: "TYPE_UINT64",
    onnx.TensorProto.BOOL: "TYPE_BOOL", onnx.TensorProto.STRING: "TYPE_STRING",
}
_NAME_OK = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def add_arguments(parser) -> None:
    parser.add_argument("model", metavar="MODEL", help="an ONNX model, original (converted first) or already fused")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the model repository (created if missing)")
    parser.add_argument("--name", help="model name in the repository (default: MODEL's stem without .fused)")
    parser.add_argument("--version", dest="model_version", type=int, default=1,
                        help="model version folder (default 1)")
    parser.add_argument("--repository-root", default=DEFAULT_REPOSITORY_ROOT,
                        help="where the server mounts OUT_DIR (default /models); sets the default --library-dir")
    parser.add_argument("--library-dir",
                        help="absolute folder of the plugin library as the server sees it, written into "
                             "op_library_filename (default <repository-root>/<name>/<version>)")
    parser.add_argument("--cpu", action="store_true", help="instance_group KIND_CPU (default KIND_GPU)")
    parser.add_argument("--gpus", help="comma-separated GPU ids of the instance group (default: all GPUs)")
    parser.add_argument("--instances", type=int, default=1, help="model instances per device (default 1)")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH,
                        help=f"max_batch_size when the model has a dynamic batch dimension (default {DEFAULT_MAX_BATCH})")
    parser.add_argument("--max-queue-delay-us", type=int, default=100,
                        help="dynamic batching: max_queue_delay_microseconds (default 100)")
    parser.add_argument("--force", action="store_true", help="replace an existing non-empty OUT_DIR/<name>")
    parser.add_argument("--json", action="store_true",
                        help="print what was written as JSON (entry, files, config fields, library path, warnings)")
    conv = parser.add_argument_group("conversion (when MODEL is not fused yet)")
    from .spec import PRECISIONS
    conv.add_argument("--precision", choices=["auto", *PRECISIONS], default="auto",
                      help="kernel compute precision (default auto: per chain, as convert chooses)")
    conv.add_argument("--cpu-only", action="store_true", help="build the C++ (CPU) kernels only, no CUDA")
    conv.add_argument("--cache-dir", metavar="DIR", help="build cache (default $ONNX2FUSED_CACHE or ~/.cache/onnx2fused)")
    conv.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    from .cli import add_target_arguments
    add_target_arguments(parser)


def main(args) -> int:
    from .cli import build_targets, progress as cli_progress
    progress = cli_progress(args)
    gpus = parse_gpus(args.gpus)
    with build_targets(args):
        done = export_triton_entry(args.model, args.out_dir, name=args.name, version=args.model_version,
                                   repository_root=args.repository_root, library_dir=args.library_dir,
                                   kind="KIND_CPU" if args.cpu else "KIND_GPU", gpus=gpus,
                                   instances=args.instances, max_batch_size=args.max_batch_size,
                                   max_queue_delay_us=args.max_queue_delay_us, force=args.force,
                                   precision=args.precision, with_cuda=False if args.cpu_only else None,
                                   cache_dir=args.cache_dir, progress=progress)
    if args.json:
        print(json.dumps(done.to_dict(), indent=1))
        return 0
    entry = done.path
    print(f"wrote {entry}")
    for f in done.files:
        print(f"  {entry.name}/{f}")
    for w in done.warnings:
        print(f"warning: {w}")
    if done.targets.get("cpu_arch") == "native":
        print("note: the C++ kernels were built for this host's CPU (-march=native); for a server with another "
              "CPU, export with --cpu-arch (e.g. x86-64-v3)")
    print(f"serve with: tritonserver --model-repository={args.repository_root} "
          f"(mount {entry.parent} there)")
    return 0


@dataclass
class TritonEntry:
    """What export_triton wrote (`export-triton --json` prints `to_dict()`)."""
    path: Path                      # OUT_DIR/<name>
    name: str
    version: int
    files: list[str]                # relative to `path`
    kind: str                       # KIND_GPU or KIND_CPU
    gpus: list[int] | None
    instances: int
    max_batch_size: int             # 0: no batching
    dynamic_batching: bool
    op_library_filename: str | None  # as the server will dlopen it; None: nothing fused, no library
    inputs: list[dict] = field(default_factory=list)    # {name, data_type, dims} as in config.pbtxt
    outputs: list[dict] = field(default_factory=list)
    converted: bool = False         # MODEL was converted here (else it was already fused)
    library_has_cuda: bool | None = None   # None: not known (an already fused model's library)
    warnings: list[str] = field(default_factory=list)
    targets: dict = field(default_factory=dict)   # converted here: cpu_arch, and cuda_archs / cuda_ptx with CUDA

    def to_dict(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        d["config"] = str(self.path / "config.pbtxt")
        d["model"] = str(self.path / str(self.version) / MODEL_FILE)
        return d


def parse_gpus(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConversionError(f"--gpus {text!r}: expected comma-separated GPU ids, e.g. 0,1") from None
    if not ids or any(i < 0 for i in ids):
        raise ConversionError(f"--gpus {text!r}: expected comma-separated GPU ids >= 0, e.g. 0,1")
    return ids


# ------------------------------------------------------------------------------------------ config
def _dims(vi: onnx.ValueInfoProto) -> list[int | None]:
    """Static sizes as ints, symbolic ones as None."""
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        raise ConversionError(f"'{vi.name}' has no known shape; Triton needs the dims of every input and output")
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim]


def _triton_type(vi: onnx.ValueInfoProto) -> str:
    et = vi.type.tensor_type.elem_type
    if et not in TRITON_TYPES:
        raise ConversionError(f"'{vi.name}' has element type {onnx.TensorProto.DataType.Name(et)}, "
                              "which Triton's model configuration has no type for")
    return TRITON_TYPES[et]


def model_io(model: onnx.ModelProto) -> tuple[list, list]:
    """[(name, triton type, dims)] of the graph inputs (initializers excluded) and outputs."""
    inits = {t.name for t in model.graph.initializer}
    ins = [(v.name, _triton_type(v), _dims(v)) for v in model.graph.input if v.name not in inits]
    outs = [(v.name, _triton_type(v), _dims(v)) for v in model.graph.output]
    return ins, outs


def batchable(ins, outs) -> bool:
    """Triton batching needs a leading batch dimension on every input and output."""
    return all(dims and dims[0] is None for _, _, dims in ins + outs)


def _tensor_block(kind: str, tensors, drop_batch: bool) -> list[str]:
    lines = [f"{kind} ["]
    for k, (name, dtype, dims) in enumerate(tensors):
        shown = dims[1:] if drop_batch else dims
        # Triton needs at least one dim: a [batch]-only tensor becomes [1] (the reshape restores the rank)
        reshape = ""
        if not shown:
            shown, reshape = [1], "\n    reshape: { shape: [ ] }"
        dim_text = ", ".join("-1" if d is None else str(d) for d in shown)
        sep = "," if k < len(tensors) - 1 else ""
        lines.append(f'  {{\n    name: "{_escape(name)}"\n    data_type: {dtype}\n    dims: [ {dim_text} ]{reshape}\n  }}{sep}')
    lines.append("]")
    return lines


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def render_config(name: str, ins, outs, *, library: str | None, kind: str = "KIND_GPU",
                  gpus: list[int] | None = None, instances: int = 1, max_batch_size: int = DEFAULT_MAX_BATCH,
                  max_queue_delay_us: int = 100) -> str:
    """config.pbtxt text (protobuf text format of Triton's ModelConfig)."""
    batch = batchable(ins, outs)
    lines = [f'name: "{_escape(name)}"', 'backend: "onnxruntime"', 'platform: "onnxruntime_onnx"',
             f"max_batch_size: {max_batch_size if batch else 0}"]
    lines += _tensor_block("input", ins, batch)
    lines += _tensor_block("output", outs, batch)
    group = [f"    count: {instances}", f"    kind: {kind}"]
    if gpus is not None and kind == "KIND_GPU":
        group.append(f"    gpus: [ {', '.join(map(str, gpus))} ]")
    lines.append("instance_group [\n  {\n" + "\n".join(group) + "\n  }\n]")
    if batch:
        lines.append(f"dynamic_batching {{\n  max_queue_delay_microseconds: {max_queue_delay_us}\n}}")
    if library:
        lines.append(f'model_operations {{\n  op_library_filename: "{_escape(library)}"\n}}')
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ export
def default_name(model_path: Path) -> str:
    n = model_path.name
    for suffix in (".onnx", ".fused"):
        if n.endswith(suffix):
            n = n[: -len(suffix)]
    return re.sub(r"[^A-Za-z0-9_.-]", "_", n) or "model"


def _fused_library(model_path: Path) -> tuple[bool, Path | None]:
    """(is the model already fused, its library). Raises (one line) when the recorded library is missing."""
    from .session import plugin_path
    try:
        m = onnx.load(str(model_path), load_external_data=False)
    except Exception as e:
        raise ConversionError(f"{model_path}: cannot read the model: {' '.join(str(e).split()) or type(e).__name__}") from None
    if not any(p.key == PLUGIN_KEY for p in m.metadata_props):
        return False, None
    return True, plugin_path(model_path)


def _check_args(model: Path, out_dir: Path, name: str, version: int, library_dir: str, instances: int,
                max_batch_size: int, max_queue_delay_us: int, force: bool) -> None:
    if not model.is_file():
        raise ConversionError(f"{model}: no such file")
    if not _NAME_OK.match(name):
        raise ConversionError(f"model name {name!r}: use letters, digits, '_', '.', '-' (--name)")
    if version < 1:
        raise ConversionError(f"--version {version}: Triton model versions are integers >= 1")
    if not os.path.isabs(library_dir):
        raise ConversionError(f"--library-dir {library_dir!r} must be absolute: Triton passes "
                              "op_library_filename to dlopen unchanged, from the server's working directory")
    if instances < 1:
        raise ConversionError(f"--instances {instances}: must be >= 1")
    if max_batch_size < 1:
        raise ConversionError(f"--max-batch-size {max_batch_size}: must be >= 1")
    if max_queue_delay_us < 0:
        raise ConversionError(f"--max-queue-delay-us {max_queue_delay_us}: must be >= 0")
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"{out_dir}: exists and is not a folder")
    if not out_dir.exists() and not out_dir.parent.is_dir():
        raise ConversionError(f"{out_dir.parent}: folder does not exist (OUT_DIR itself is created if missing)")
    entry = out_dir / name
    if entry.exists() and not entry.is_dir():
        raise ConversionError(f"{entry}: exists and is not a folder")
    if entry.is_dir() and any(entry.iterdir()) and not force:
        raise ConversionError(f"{entry} exists and is not empty; pass --force to replace it")
    probe = out_dir if out_dir.exists() else out_dir.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConversionError(f"{probe}: not writable")


def _copy_fused(model: Path, lib: Path | None, dest: Path) -> bool:
    """Copy a fused model and its library into the version folder `dest`; True when it has a library."""
    from onnx import external_data_helper as edh
    m = onnx.load(str(model), load_external_data=False)
    for loc in sorted({edh.ExternalDataInfo(t).location for t in edh._get_all_tensors(m) if edh.uses_external_data(t)}):
        rel = Path(loc)
        if rel.is_absolute() or ".." in rel.parts:
            raise ConversionError(f"{model}: external data location {loc!r} is outside the model's folder")
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model.parent / rel, dest / rel)
    keep = [p for p in m.metadata_props if p.key != PLUGIN_KEY]
    del m.metadata_props[:]
    m.metadata_props.extend(keep)
    if lib is not None:
        shutil.copyfile(lib, dest / LIBRARY_FILE)
        m.metadata_props.add(key=PLUGIN_KEY, value=LIBRARY_FILE)   # onnx2fused.InferenceSession works there too
    onnx.save_model(m, str(dest / MODEL_FILE))
    return lib is not None


def _convert_into(model: Path, dest: Path, precision: str, with_cuda, cache_dir, progress,
                  kind: str = "KIND_GPU") -> tuple[bool, list[str], bool]:
    """Convert into `dest`; (has a library, warnings, the library has CUDA kernels)."""
    from .convert import convert, library_name
    assert library_name(MODEL_FILE) == LIBRARY_FILE
    r = convert(model, dest / MODEL_FILE, precision=precision, with_cuda=with_cuda, cache_dir=cache_dir,
                progress=progress)
    notes = list(r.warnings)
    if r.library_path and not r.with_cuda and kind == "KIND_GPU":   # KIND_CPU instances never use CUDA
        notes.append("the plugin has no CUDA kernels (no nvcc, or --cpu-only): on KIND_GPU the fused nodes "
                     "run their stock-op fallback")
    return r.library_path is not None, notes, bool(r.with_cuda)


def export_triton(model, out_dir, *, name: str | None = None, version: int = 1,
                  repository_root: str = DEFAULT_REPOSITORY_ROOT, library_dir: str | None = None,
                  kind: str = "KIND_GPU", gpus: list[int] | None = None, instances: int = 1,
                  max_batch_size: int = DEFAULT_MAX_BATCH, max_queue_delay_us: int = 100, force: bool = False,
                  precision: str = "auto", with_cuda: bool | None = None, cache_dir=None, progress=None) -> Path:
    """Write OUT_DIR/<name>/ (config.pbtxt, <version>/model.onnx, the library); return that folder.
    kind KIND_CPU builds no CUDA kernels unless with_cuda=True (a CPU instance runs ORT's CPU EP)."""
    return export_triton_entry(
        model, out_dir, name=name, version=version, repository_root=repository_root, library_dir=library_dir,
        kind=kind, gpus=gpus, instances=instances, max_batch_size=max_batch_size,
        max_queue_delay_us=max_queue_delay_us, force=force, precision=precision, with_cuda=with_cuda,
        cache_dir=cache_dir, progress=progress).path


def export_triton_entry(model, out_dir, *, name: str | None = None, version: int = 1,
                        repository_root: str = DEFAULT_REPOSITORY_ROOT, library_dir: str | None = None,
                        kind: str = "KIND_GPU", gpus: list[int] | None = None, instances: int = 1,
                        max_batch_size: int = DEFAULT_MAX_BATCH, max_queue_delay_us: int = 100,
                        force: bool = False, precision: str = "auto", with_cuda: bool | None = None,
                        cache_dir=None, progress=None) -> TritonEntry:
    """export_triton, returning what was written (TritonEntry)."""
    say = progress or (lambda m: None)
    model, out_dir = Path(model), Path(out_dir)
    name = name or default_name(model)
    if library_dir is None:
        if not os.path.isabs(repository_root):
            raise ConversionError(f"--repository-root {repository_root!r} must be absolute: the path where the "
                                  "server mounts the repository, e.g. /models")
        library_dir = f"{repository_root.rstrip('/')}/{name}/{version}"
    if kind not in ("KIND_GPU", "KIND_CPU"):
        raise ConversionError(f"instance kind {kind!r}: KIND_GPU or KIND_CPU")
    if gpus is not None and kind == "KIND_CPU":
        raise ConversionError("--gpus applies to GPU instances; drop it or --cpu")
    _check_args(model, out_dir, name, version, library_dir, instances, max_batch_size, max_queue_delay_us, force)
    fused, source_lib = _fused_library(model)

    created = not out_dir.exists()
    out_dir.mkdir(exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out_dir))
    try:
        vdir = stage / str(version)
        vdir.mkdir()
        if fused:
            say(f"{model} is already fused: copying it and its plugin")
            has_lib, notes, has_cuda = _copy_fused(model, source_lib, vdir), [], None
        else:
            if with_cuda is None and kind == "KIND_CPU":
                with_cuda = False
            has_lib, notes, has_cuda = _convert_into(model, vdir, precision, with_cuda, cache_dir, progress, kind)
        for n in notes:
            say(f"warning: {n}")
        ins, outs = model_io(onnx.load(str(vdir / MODEL_FILE), load_external_data=False))
        batch = batchable(ins, outs)
        if not batch:
            say("not every input/output has a symbolic first dimension: max_batch_size 0, no dynamic batching")
        lib_path = f"{library_dir.rstrip('/')}/{LIBRARY_FILE}" if has_lib else None
        (stage / "config.pbtxt").write_text(render_config(
            name, ins, outs, library=lib_path, kind=kind, gpus=gpus, instances=instances,
            max_batch_size=max_batch_size, max_queue_delay_us=max_queue_delay_us))
        files = sorted(p.relative_to(stage).as_posix() for p in stage.rglob("*") if p.is_file())
        _move_into_place(stage, out_dir / name)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise

    def tensors(ts):   # as config.pbtxt has them: without the batch dim when batching, [1] for none left
        return [{"name": n, "data_type": t,
                 "dims": [-1 if d is None else d for d in (dims[1:] if batch else dims)] or [1]}
                for n, t, dims in ts]
    targets = {}
    if has_lib and not fused:   # what build.py compiled for (cli.build_targets / the environment)
        from .targets import cpu_arch, cuda_archs, cuda_ptx_arch
        targets["cpu_arch"] = cpu_arch()
        if has_cuda:
            targets["cuda_archs"] = cuda_archs()
            targets["cuda_ptx"] = cuda_ptx_arch(targets["cuda_archs"])
    return TritonEntry(out_dir / name, name, version, files, kind, gpus if kind == "KIND_GPU" else None, instances,
                       max_batch_size if batch else 0, batch, lib_path, tensors(ins), tensors(outs),
                       converted=not fused, library_has_cuda=has_cuda if has_lib else None, warnings=list(notes),
                       targets=targets)


def _move_into_place(stage: Path, entry: Path) -> None:
    """Rename `stage` to `entry`; an existing `entry` (allowed by the caller) is replaced."""
    if entry.exists():
        old = entry.with_name(f".{entry.name}.old-{os.getpid()}")
        os.replace(entry, old)
        try:
            os.replace(stage, entry)
        except OSError:
            os.replace(old, entry)   # put the previous entry back
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, entry)
