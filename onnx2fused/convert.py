"""The `convert()` API: load -> find chains -> specs -> build the plugin -> rewrite -> write -> validate.

Nothing is written until the fused model passed validation: the model, its external data (large models
only) and a copy of the plugin library are first written into a temp folder beside the output, the
temp model is validated there, then each file is moved into place with os.replace (the model last).
The input model is only read.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import onnx

from .cpu_policy import cpu_kernel_wins
from .build import build_plugin, find_nvcc
from .errors import ConversionError
from .loader import load_model
from .passes import find_chains, rewrite
from .passes.activations import describe_expr
from .plan.choose import make_plan
from .plan.options import PlanOptions
from .plan.protocol import Plan
from .spec import PRECISIONS, SpecError
from . import validate as val

PLUGIN_KEY = "onnx2fused.plugin"
EXTERNAL_DATA_BYTES = 1_500_000_000   # above this the output model keeps its weights in `<output>.data`
LIBRARY_SUFFIX = ".onnx2fused.so"


@dataclass
class ChainReport:
    index: int
    name: str                 # MLPSpec.name = the custom op type
    widths: list[int]
    activations: list[str]
    precision: str
    io_dtype: str
    cuda_plan: str
    input: str
    output: str


@dataclass
class ConversionResult:
    input_path: str
    output_path: str
    precision: str
    chains: list[ChainReport] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    library_path: str | None = None      # the copy next to the output model
    cached_library: str | None = None    # the build-cache entry it was copied from
    build_seconds: float = 0.0
    cache_hit: bool = False
    with_cuda: bool = False
    validation: val.ValidationReport | None = None
    warnings: list[str] = field(default_factory=list)
    nothing_to_fuse: str | None = None   # why the model was written unchanged
    external_data: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["validation"] = self.validation.to_dict() if self.validation else None
        return d

    def format(self) -> str:
        return format_report(self)


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConversionError(f"unknown precision {precision!r}; choose fp16, bf16, tf32 or fp32")
    return precision


def plan_specs(specs, options: PlanOptions) -> tuple[dict[str, Plan], dict[str, str]]:
    """Each distinct spec planned once: ({name: plan}, {name: why no design can run it})."""
    plans, errors = {}, {}
    for s in specs:
        if s.name in plans or s.name in errors:
            continue
        try:
            plans[s.name] = make_plan(s, options)
        except SpecError as e:
            errors[s.name] = str(e)
    return plans, errors


def plan_text(spec, plan: Plan | None, error: str = "") -> str:
    """The CUDA plan and the CPU decision of a spec, as the report and `inspect` show them (`error`:
    why there is no plan)."""
    cpu = cpu_kernel_wins(spec)[1]
    if plan is None:
        return f"GPU: no tensor-core plan: {error}; CPU: {cpu}"
    text = plan.describe()
    if plan.design == "wide" and plan.tuned_on:
        text += f" [{plan.choice_text()}]"
    return f"GPU: {text}; CPU: {cpu}"


def default_output(input_path) -> Path:
    p = Path(input_path)
    stem = p.name[: -len(".onnx")] if p.name.endswith(".onnx") else p.name
    return p.with_name(stem + ".fused.onnx")


def library_name(output_path) -> str:
    p = Path(output_path)
    stem = p.name[: -len(".onnx")] if p.name.endswith(".onnx") else p.name
    return stem + LIBRARY_SUFFIX


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _check_paths(inp: Path, out: Path) -> None:
    if not inp.exists():
        raise ConversionError(f"{inp}: no such file")
    if out.is_dir():
        raise ConversionError(f"{out}: is a directory; give the output model's file name")
    clobbered = [out, out.with_name(library_name(out)), out.with_name(out.name + ".data")]
    for c in clobbered:
        if _same_file(inp, c):
            raise ConversionError(f"the output {out} would overwrite the input model {inp}; "
                                  "choose another output path (-o)")
    parent = out.parent
    if not parent.is_dir():
        raise ConversionError(f"{parent}: output folder does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConversionError(f"{parent}: output folder is not writable")


def _external_locations(model: onnx.ModelProto) -> set[str]:
    from onnx import external_data_helper as edh
    return {edh.ExternalDataInfo(t).location for t in edh._get_all_tensors(model) if edh.uses_external_data(t)}


def _save(model: onnx.ModelProto, path: Path, final_name: str) -> str | None:
    """Write `model` to `path`; weights go to `<final_name>.data` beside it when the model is large."""
    if model.ByteSize() > EXTERNAL_DATA_BYTES:
        loc = final_name + ".data"
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=loc, size_threshold=1024)
        return loc
    onnx.save_model(model, str(path))
    return None


def _set_meta(model: onnx.ModelProto, key: str, value: str) -> None:
    keep = [p for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    model.metadata_props.add(key=key, value=value)


def convert(input_path, output_path=None, precision: str = "fp16", validate: bool = True, inputs=None,
            force: bool = False, cache_dir=None, with_cuda: bool | None = None,
            progress: Callable[[str], None] | None = None, plan_options: PlanOptions | None = None) -> ConversionResult:
    """Fuse the MLP chains of `input_path` into one custom op each; write `output_path` and its plugin.

    precision: fp16 (default), bf16, tf32 (tensor cores) or fp32 (CUDA cores, exact). validate: compare with stock ORT
    (ValidationError above the tolerance unless force=True; nothing is written then). inputs: an .npz
    path or a dict name -> array used for validation besides random inputs. with_cuda: build the CUDA
    kernels (None: when nvcc is found). plan_options: how the CUDA kernels are planned (None: from the
    environment, PlanOptions.from_env). Returns the report.
    """
    t0 = time.monotonic()
    say = progress or (lambda msg: None)
    check_precision(precision)
    options = plan_options or PlanOptions.from_env()
    inp = Path(input_path)
    out = Path(output_path) if output_path is not None else default_output(inp)
    _check_paths(inp, out)

    model = load_model(inp)
    user_inputs = val.load_user_inputs(inputs, model) if (inputs is not None and validate) else None
    plan = find_chains(model)
    result = ConversionResult(str(inp), str(out), precision, refusals=[r.reason for r in plan.refusals])

    tmpdir = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if not plan.chains:
            result.nothing_to_fuse = ("no MLP chain to fuse" + (f" ({len(plan.refusals)} layer(s) refused, see below)"
                                                               if plan.refusals else
                                                               ": the model has no Gemm/MatMul layer with constant weights"))
            say(f"{result.nothing_to_fuse}; writing the model unchanged")
            _write_unchanged(inp, out, tmpdir, result)
            result.seconds = time.monotonic() - t0
            return result

        try:
            specs = [c.to_spec(precision) for c in plan.chains]
        except SpecError as e:
            raise ConversionError(str(e)) from None
        unique = list({s.name: s for s in specs}.values())
        plans, plan_errors = plan_specs(unique, options)
        for k, (c, s) in enumerate(zip(plan.chains, specs)):
            result.chains.append(ChainReport(k, s.name, list(s.widths), [describe_expr(a) for a in c.activations],
                                             precision, s.io_dtype, plan_text(s, plans.get(s.name), plan_errors.get(s.name, "")),
                                             c.input, c.output))
        cuda = with_cuda if with_cuda is not None else find_nvcc() is not None
        if cuda and plan_errors:
            raise ConversionError(next(iter(plan_errors.values())))

        say(f"building the plugin for {len(unique)} kernel(s)")
        cpu_enabled = {s.name: cpu_kernel_wins(s)[0] for s in unique}
        lib = build_plugin(unique, with_cuda=cuda, cache_dir=cache_dir, cpu_enabled=cpu_enabled, progress=say,
                           plans=plans)
        for report, s in zip(result.chains, specs):
            if s.name in lib.plans:  # with the kernels tuned for this GPU (wide_tune.py)
                report.cuda_plan = plan_text(s, lib.plans[s.name])
        result.cached_library, result.build_seconds = str(lib.path), lib.build_seconds
        result.cache_hit, result.with_cuda = lib.cache_hit, lib.with_cuda
        if lib.cache_hit:
            say(f"plugin found in the build cache: {lib.path}")

        fused = rewrite(model, plan, specs)
        lib_name = library_name(out)
        _set_meta(fused, PLUGIN_KEY, lib_name)  # relative to the model's folder: they are written side by side
        _set_meta(fused, "onnx2fused.precision", precision)

        tmp_model, tmp_lib = tmpdir / out.name, tmpdir / lib_name
        say(f"writing {out.name}")
        try:
            data = _save(fused, tmp_model, out.name)
            shutil.copyfile(lib.path, tmp_lib)
        except OSError as e:
            raise ConversionError(f"cannot write into {out.parent}: {e.strerror or e}") from None
        except ValueError as e:
            raise ConversionError(f"cannot serialize the fused model: {e}") from None
        result.external_data = data

        if validate:
            report = val.validate(str(inp), tmp_model, tmp_lib, precision, original_model=model,
                                  chains=plan.chains, with_cuda=lib.with_cuda, user_inputs=user_inputs,
                                  progress=say)
            result.validation = report
            result.warnings.extend(report.warnings)
            if report.failures:
                if not force:
                    val.check(report)
                result.warnings.extend(f"written anyway (force): {f}" for f in report.failures)

        try:
            if data:
                os.replace(tmpdir / data, out.parent / data)
            os.replace(tmp_lib, out.parent / lib_name)
            os.replace(tmp_model, out)
        except OSError as e:
            raise ConversionError(f"cannot move the output into {out.parent}: {e.strerror or e}") from None
        result.library_path = str(out.parent / lib_name)
        result.seconds = time.monotonic() - t0
        return result
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _write_unchanged(inp: Path, out: Path, tmpdir: Path, result: ConversionResult) -> None:
    raw = onnx.load(str(inp), load_external_data=False)
    tmp = tmpdir / out.name
    try:
        if not _external_locations(raw):
            shutil.copyfile(inp, tmp)
            data = None
        else:
            full = onnx.load(str(inp))
            data = _save(full, tmp, out.name) if full.ByteSize() > EXTERNAL_DATA_BYTES else None
            if data is None:
                onnx.save_model(full, str(tmp))
        if data:
            os.replace(tmpdir / data, out.parent / data)
        os.replace(tmp, out)
    except OSError as e:
        raise ConversionError(f"cannot write {out}: {e.strerror or e}") from None
    result.external_data = data


# ------------------------------------------------------------------------------------------ report
def _fmt_err(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.2e}"


def format_report(r: ConversionResult) -> str:
    lines = [f"{r.input_path} -> {r.output_path}"]
    if r.nothing_to_fuse:
        lines.append(f"nothing fused: {r.nothing_to_fuse}; the model was written unchanged")
    else:
        lines.append(f"{len(r.chains)} chain(s) fused, precision {r.precision}:")
        lines += _chain_table(r.chains, "CUDA plan")
        for c in r.chains:
            lines.append(f"  chain {c.index}: op {c.name} ('{c.input}' -> '{c.output}')")
        where = "cache hit" if r.cache_hit else f"built in {r.build_seconds:.1f} s"
        lines.append(f"plugin: {r.library_path or '(not written)'} ({where}"
                     f"{', with CUDA' if r.with_cuda else ', CPU only'})")
    if r.refusals:
        lines.append(f"{len(r.refusals)} not fused:")
        lines += [f"  {x}" for x in r.refusals]
    v = r.validation
    if v is not None:
        lines.append(f"validation vs stock ORT on {len(v.cases)} input set(s): {v.tolerance_note}")
        rows = [("output", "max abs", "rel L2", "ref≠0", "ok")]
        for e in v.outputs:
            if e.exact:
                rows.append((e.name, f"{e.mismatches} diff", "-", "yes" if e.reference_nonzero else "no", "exact"))
            else:
                rows.append((e.name, _fmt_err(e.max_abs), _fmt_err(e.rel_l2), "yes" if e.reference_nonzero else "no",
                             "yes" if e.within(v.tolerance) else "NO"))
        lines += _table(rows, indent="  ")
        if v.max_activation:
            lines.append("  fp16 range: max |intermediate| per chain " + ", ".join(f"{m:.4g}" for m in v.max_activation))
    elif not r.nothing_to_fuse:
        lines.append("validation: skipped")
    for w in r.warnings:
        lines.append(f"warning: {w}")
    lines.append(f"done in {r.seconds:.1f} s")
    return "\n".join(lines)


def _chain_table(chains, plan_header: str) -> list[str]:
    """The per-chain table shared by the convert report and `inspect`."""
    rows = [("#", "widths", "activations", "io", plan_header)]
    for c in chains:
        rows.append((str(c.index), "->".join(map(str, c.widths)), ", ".join(c.activations), c.io_dtype, c.cuda_plan))
    return _table(rows, indent="  ")


def _table(rows, indent="") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


# ------------------------------------------------------------------------------------------ inspect
@dataclass
class InspectResult:
    input_path: str
    chains: list[ChainReport] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)
    plan: str = ""          # FusionPlan.describe()

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [f"{self.input_path}: {len(self.chains)} chain(s) to fuse"]
        if self.chains:
            lines += _chain_table(self.chains, f"plan ({self.chains[0].precision})")
            for c in self.chains:
                lines.append(f"  chain {c.index}: '{c.input}' -> '{c.output}', op {c.name}")
        if self.refusals:
            lines.append(f"{len(self.refusals)} not fused:")
            lines += [f"  {x}" for x in self.refusals]
        elif not self.chains:
            lines.append("  the model has no Gemm/MatMul layer with constant weights")
        return "\n".join(lines)


def inspect(input_path, precision: str = "fp16", cache_dir=None, plan_options: PlanOptions | None = None) -> InspectResult:
    """The chains `convert` would fuse (with the CUDA plan at `precision`, and the wide kernels tuned
    for this GPU when the build cache holds them) and why other layers are not."""
    from .build import default_cache_dir
    from .wide_tune import cached_plan
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    check_precision(precision)
    options = plan_options or PlanOptions.from_env()
    model = load_model(input_path)
    plan = find_chains(model)
    res = InspectResult(str(input_path), refusals=[r.reason for r in plan.refusals], plan=plan.describe())
    for k, c in enumerate(plan.chains):
        try:
            s = c.to_spec(precision)
        except SpecError as e:
            raise ConversionError(str(e)) from None
        plans, errors = plan_specs([s], options)
        p = plans.get(s.name)
        res.chains.append(ChainReport(k, s.name, list(s.widths), [describe_expr(a) for a in c.activations],
                                      precision, s.io_dtype,
                                      plan_text(s, cached_plan(p, cache) if p else None, errors.get(s.name, "")),
                                      c.input, c.output))
    return res
