"""The `convert()` API: load -> find chains -> specs -> build the plugin -> rewrite -> write -> validate.

Nothing is written until the fused model passed validation: the model, its external data (large models
only) and a copy of the plugin library are first written into a temp folder beside the output, the
temp model is validated there, then each file is moved into place with os.replace (the model last).
The input model is only read.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import onnx


from .cpu_policy import cpu_kernel_wins
from .targets import cuda_archs, find_nvcc
from .library import build_plugin, fusion_plan
from .errors import ConversionError
from .loader import load_model, read_model
from .passes import rewrite
from .plan.ffn import FFN_ENV
from .plan.choose import make_plan, short_reason, wgmma_note
from .plan.options import PlanOptions
from .plan.protocol import Plan
from .precision import (PrecisionChoice, chain_block, chain_layers, chain_noise, choose_precision, next_step,
                        noise_note, step_label)
from .spec import ACT_MATHS, PLUGIN_KEY, PRECISIONS, SpecError, holds_fused_nodes
from . import validate as val

EXTERNAL_DATA_BYTES = 1_500_000_000   # above this the output model keeps its weights in `<output>.data`
LIBRARY_SUFFIX = ".onnx2fused.so"


def is_fused(model: onnx.ModelProto) -> bool:
    """Whether `model` is an onnx2fused output: its plugin recorded, or onnx2fused nodes in its graph."""
    return any(p.key == PLUGIN_KEY for p in model.metadata_props) or holds_fused_nodes(model)


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
    precision_why: str = ""   # why this precision (automatic precision: why not the faster ones)
    takes_in: list[str] = field(default_factory=list)   # beside its layers (passes.Chain.extras): a norm, skips, a head


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
    rewritten: list[str] = field(default_factory=list)   # stock ops outside the chains written otherwise
    external_data: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["validation"] = self.validation.to_dict() if self.validation else None
        return d

    def format(self) -> str:
        return format_report(self)


AUTO = "auto"
CHAINS_KEY = "onnx2fused.chains"   # metadata: JSON list of {op, precision, why} per chain


def check_precision(precision: str) -> str:
    if precision != AUTO and precision not in PRECISIONS:
        raise ConversionError(f"unknown precision {precision!r}; choose auto, fp16, bf16, tf32 or fp32")
    return precision


CPU_ONLY_WHY = "CPU-only library: its kernels compute in fp32 (the label is for a GPU build)"


def _chain_tensors(model, chains, cases) -> dict:
    """Each chain's input and output tensors on stock ORT over the validation inputs."""
    names = list(dict.fromkeys(t for c in chains for t in (*c.input_tensors, c.rows_output)))
    return val.reference_tensors(model, names, cases)


def initial_precisions(model, chains, cases, with_cuda: bool, say) -> list[PrecisionChoice]:
    """Automatic precision before any build: the numerics model (precision.py) on the reference tensors
    of each chain. A CPU-only library computes in fp32 whatever the label: every chain gets fp16, the
    cheapest label, with no range check (and its conditioning, which validation allows for)."""
    if not with_cuda:
        return asked_precisions(model, chains, cases, "fp16", CPU_ONLY_WHY)
    if cases is None:
        return [PrecisionChoice("fp16", "default: the original model could not run on random inputs to choose one")
                for _ in chains]
    say("choosing each chain's precision (numerics model on the validation inputs)")
    try:
        ref = _chain_tensors(model, chains, cases)
    except Exception as e:  # noqa: BLE001 - the model runs (cases exist) but not with its intermediates read out
        return [PrecisionChoice("fp16", f"default: the chains' tensors could not be read on stock ORT "
                                        f"({val._one_line(e)})") for _ in chains]
    return [choose_precision(chain_layers(c), c.input_rows(ref), ref[c.rows_output], range_check=True,
                             tolerances=val.TOLERANCES, block=chain_block(c)) for c in chains]


def asked_precisions(model, chains, cases, precision: str, why: str) -> list[PrecisionChoice]:
    """`precision` for every chain, with each chain's conditioning (precision.chain_noise) measured on the
    validation inputs where there are any: an ill-conditioned chain (a reciprocal, a SIREN) differs from
    stock ORT by more than the tolerance even in exact fp32, and validation allows for it on every EP."""
    noises = [0.0] * len(chains)
    if cases is not None:
        try:
            ref = _chain_tensors(model, chains, cases)
            noises = [chain_noise(chain_layers(c), c.input_rows(ref), ref[c.rows_output], chain_block(c)) for c in chains]
        except Exception:  # noqa: BLE001 - as initial_precisions: then the plain tolerance
            pass
    return [PrecisionChoice(precision, why + noise_note(n, val.TOLERANCES), noise=n) for n in noises]


def _next_step(chain, choice: PrecisionChoice, options: PlanOptions | None = None) -> tuple[str, str] | None:
    """Where a chain goes after its validation failed at `choice` (precision.next_step): fp16b32 only where
    the chain has packed layers (a packed glu adds its bias in fp32 anyway). With `options`, past a step
    that would rebuild the same kernel: `fp16b32` where the chain's plan adds no bias in fp16 (not wgmma),
    `fp16a32` where its only packed part is a glu and the plan has no one-kernel FFN to compute it."""
    spec = chain.to_spec("fp16")
    step = next_step(choice.precision, choice.act_math, spec.has_packable, bool(spec.packable_layers))
    # (the two never both ask for the plan: fp16b32 comes only where plain layers pack)
    if (step == ("fp16", "packed_b32") and options is not None
            and not getattr(_packed_fp16_plan(chain, options), "bias16", False)):   # BIAS16: the wgmma kernel's
        step = next_step(*step, True)
    if (step == ("fp16", "fp32") and options is not None and not spec.packable_layers
            and getattr(_packed_fp16_plan(chain, options), "ffn", None) is None):   # no one-kernel FFN
        step = next_step(*step, True)
    return step


def _packed_fp16_plan(chain, options: PlanOptions):
    """The chain's CUDA plan at fp16 with packed activations, or None where none plans it."""
    try:
        return make_plan(chain.to_spec("fp16", "packed"), options)
    except SpecError:
        return None


def _step_label(chain, precision: str, act_math: str) -> str:
    return step_label(precision, act_math, chain.to_spec("fp16").has_packable)


def plannable(chain, choice: PrecisionChoice, options: PlanOptions) -> PrecisionChoice:
    """`choice`, or the first step up the ladder from it that a CUDA design plans (automatic precision
    only): the wide design has no tf32 GEMM, so a wide chain that fails at bf16 goes to fp32 (CUDA cores,
    which plan every chain) rather than to a build without a plan. The reason says which were skipped."""
    c = choice
    while True:
        try:
            make_plan(chain.to_spec(c.precision, c.act_math), options)
            return c
        except SpecError as e:
            step = _next_step(chain, c)
            if step is None:
                return c   # _build_and_check reports the planner's reason
            label = _step_label(chain, c.precision, c.act_math)
            c = PrecisionChoice(step[0], f"{label} has no CUDA plan ({short_reason(e)}); {c.why}",
                                noise=c.noise, act_math=step[1])


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


def plan_text(spec, plan: Plan | None, error: str = "", with_cuda: bool = True) -> str:
    """The CUDA plan and the CPU decision of a spec, as the report and `inspect` show them (`error`:
    why there is no plan; `with_cuda` False: a CPU-only library, which has no GPU plan to show)."""
    cpu = cpu_kernel_wins(spec)[1]
    if not with_cuda:
        return f"CPU: {cpu}; no GPU kernels (CPU-only library)"
    if plan is None:
        return f"GPU: no tensor-core plan: {error}; CPU: {cpu}"
    text = plan.describe()
    if plan.design == "wide" and plan.tuned_on:
        text += f" [{plan.choice_text()}]"
    note = wgmma_note(spec, plan)
    return f"GPU: {text}{'; ' + note if note else ''}; CPU: {cpu}"


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


def _written_paths(out: Path) -> list[Path]:
    """What convert writes for output `out`: the model, its plugin library and its external data."""
    return [out, out.with_name(library_name(out)), out.with_name(out.name + ".data")]


def _input_files(inp: Path, candidates: list[Path]) -> list[Path]:
    """The files no output may overwrite: the input model and its external data files (a dynamo export
    keeps its weights in `<model>.onnx.data`). The model is read (once, without its data) only where one
    of the `candidates` an output would write is already taken by a file."""
    if not any(c.is_file() for c in candidates):
        return [inp]
    try:
        raw = read_model(inp)
    except ConversionError:   # load_model reports it
        return [inp]
    return [inp] + [inp.parent / loc for loc in _external_locations(raw)]


def _check_paths(inp: Path, out: Path, input_files: list[Path]) -> None:
    if not inp.exists():
        raise ConversionError(f"{inp}: no such file")
    if out.is_dir():
        raise ConversionError(f"{out}: is a directory; give the output model's file name")
    for c in _written_paths(out):
        if any(_same_file(f, c) for f in input_files):
            raise ConversionError(f"the output {out} would overwrite the input model {inp} or its data "
                                  f"({c.name}); choose another output path (-o)")
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


def convert(input_path, output_path=None, precision: str = AUTO, validate: bool = True, inputs=None,
            force: bool = False, cache_dir=None, with_cuda: bool | None = None,
            progress: Callable[[str], None] | None = None, tune: bool = False, *, atol: float | None = None,
            rtol: float | None = None, input_shapes: dict | None = None, save_inputs=None,
            save_outputs=None, plan_options: PlanOptions | None = None,
            stock_where_faster: bool = False) -> ConversionResult:
    """Fuse the MLP chains of `input_path` into one custom op each; write `output_path` and its plugin.

    precision: auto (default: per chain, the fastest of fp16, bf16, tf32, fp32 whose numerics pass; see
    precision.py), or fp16, bf16, tf32 (tensor cores) or fp32 (CUDA cores, exact) for every chain.
    validate: compare with stock ORT (ValidationError above the tolerance unless force=True; nothing is
    written then). inputs: an .npz path or a dict name -> array used for validation besides random
    inputs. with_cuda: build the CUDA kernels (None: when nvcc is found). tune: run the wide design's
    kernel search on this GPU where no choice is cached. Returns the report.
    atol/rtol: the model outputs pass validation when |fused - ref| <= atol + rtol * |ref| elementwise (a
    missing one is 0) instead of the precision's tolerance. input_shapes: {input name: shape} of the random
    validation inputs (instead of batches 1, 37, 256). save_inputs/save_outputs: .npz paths for the
    validation input sets and the reference (and fused) outputs (validate.save_arrays; written whenever
    validation ran, also when it fails). plan_options: how the CUDA kernels are planned (None: from the
    environment, PlanOptions.from_env). stock_where_faster: a library without CUDA kernels leaves the chains
    whose fused CPU kernel would be slower than stock ORT as the model's stock ops (cpu_policy), instead of
    fused nodes that run their stock body; with CUDA kernels it is an error (they fuse for the GPU).
    """
    t0 = time.monotonic()
    say = progress or (lambda msg: None)
    check_precision(precision)
    options = plan_options or PlanOptions.from_env()
    inp = Path(input_path)
    out = Path(output_path) if output_path is not None else default_output(inp)
    saved = [Path(v) for v in (save_inputs, save_outputs) if v is not None]
    input_files = _input_files(inp, _written_paths(out) + saved)
    _check_paths(inp, out, input_files)
    _check_validation_options(out, input_files, validate, atol, rtol, input_shapes, save_inputs, save_outputs)

    model = load_model(inp)
    if is_fused(model):
        raise ConversionError(f"{inp} is already fused (it holds onnx2fused nodes): convert takes the original "
                              "model; to move a fused model, copy it with its plugin library")
    user_inputs = val.load_user_inputs(inputs, model) if (inputs is not None and validate) else None
    shapes = val.check_input_shapes(input_shapes, model) if input_shapes else None
    found_nvcc = with_cuda is None and find_nvcc() is not None
    with_cuda = found_nvcc if with_cuda is None else with_cuda
    _check_stock_where_faster(stock_where_faster, with_cuda)
    if found_nvcc and val.choose_providers(True)[0] != "CUDAExecutionProvider":
        say("nvcc found: building CUDA kernels too, for a GPU host (this onnxruntime has no CUDA EP, so "
            "validation runs the CPU kernels; --cpu-only skips the CUDA build)")
    model, plan = fusion_plan(model, with_cuda, stock_faster=stock_where_faster)
    result = ConversionResult(str(inp), str(out), precision, refusals=[r.reason for r in plan.refusals],
                              rewritten=plan.rewritten)

    try:
        tmpdir = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:   # (os.access says yes for root, even where nothing can be created: /proc)
        raise ConversionError(f"{out.parent}: cannot create files in the output folder ({e.strerror or e})") from None
    try:
        if not plan.chains:
            result.nothing_to_fuse = ("no MLP chain to fuse" + (f" ({len(plan.refusals)} not fused, see below)"
                                                               if plan.refusals else
                                                               ": the model has no Gemm/MatMul/Einsum layer with constant weights"))
            say(f"{result.nothing_to_fuse}; writing the model unchanged")
            _write_unchanged(inp, out, tmpdir, result)
            result.seconds = time.monotonic() - t0
            return result

        auto = precision == AUTO
        cases = vacuous = None
        if validate or auto:
            try:
                cases, vacuous = val.validation_cases(model, user_inputs, shapes=shapes)
            except Exception as e:  # noqa: BLE001
                if validate:
                    raise ConversionError(f"stock onnxruntime fails on the original model: {val._one_line(e)}") from None
        if auto:
            choices = initial_precisions(model, plan.chains, cases, with_cuda, say)
            if with_cuda:
                choices = [plannable(c, ch, options) for c, ch in zip(plan.chains, choices)]
        else:
            choices = asked_precisions(model, plan.chains, cases if validate else None, precision,
                                       "asked for (--precision)")

        for attempt in range(len(PRECISIONS) + len(ACT_MATHS) - 1):   # fp16's extra steps: fp16b32, fp16a32
            # each round in a folder of its own: a library that a session loaded must not be overwritten
            # (it is mapped), and dlopen would hand back the first one loaded from the same path
            round_dir = tmpdir / f"round{attempt}"
            round_dir.mkdir()
            built = _build_and_check(model, inp, out, plan, choices, with_cuda, options, cache_dir, tune, validate,
                                     cases, vacuous, user_inputs, round_dir, say,
                                     dict(atol=atol, rtol=rtol, save_inputs=save_inputs, save_outputs=save_outputs))
            report = built.validation
            # Only the CUDA kernels compute at the chain's precision: a failure on the CPU EP (whose
            # kernels compute in fp32 whatever the label) is no reason to move a chain up.
            on_gpu = report is not None and report.provider == "CUDAExecutionProvider"
            # auto moves a failed chain up the ladder; an explicit fp16 still moves from packed to fp32
            # activations (the precision asked for, computed more exactly)
            steps = {k: _next_step(plan.chains[k], choices[k], options)
                     for k in (report.chain_failures if on_gpu else [])}
            moving = [k for k, st in steps.items() if st and (auto or st[0] == choices[k].precision)]
            if not moving:
                break
            for k in moving:
                old = _step_label(plan.chains[k], choices[k].precision, choices[k].act_math)
                new_p, new_math = steps[k]
                e = report.chain_errors[k] if k < len(report.chain_errors) and report.chain_errors[k] else None
                detail = f"rel. L2 {e.rel_l2:.2g} on {report.provider}" if e else f"validation on {report.provider}"
                choices[k] = PrecisionChoice(new_p, f"{old} failed ({detail}); " + choices[k].why,
                                             noise=choices[k].noise, act_math=new_math)
                if auto:
                    choices[k] = plannable(plan.chains[k], choices[k], options)
                new = _step_label(plan.chains[k], choices[k].precision, choices[k].act_math)
                say(f"chain {k}: {old} failed validation ({detail}); rebuilding it in {new}")

        specs, lib, data, tmp_model, tmp_lib, lib_name = built.specs, built.lib, built.data, built.model, built.lib_copy, built.lib_name
        result.chains = [ChainReport(k, s.name, list(s.widths), c.activation_labels(),
                                     s.precision, s.io_dtype,
                                     plan_text(s, lib.plans.get(s.name), with_cuda=with_cuda),
                                     c.input, c.output, choices[k].why, c.extras())
                         for k, (c, s) in enumerate(zip(plan.chains, specs))]
        result.cached_library, result.build_seconds = str(lib.path), built.build_seconds
        result.cache_hit, result.with_cuda = lib.cache_hit, lib.with_cuda
        result.external_data = data
        if report is not None:
            result.validation = report
            result.warnings.extend(report.warnings)
            if report.failures:
                if not force:
                    val.check(report)
                result.warnings.extend(f"written anyway (force): {f}" for f in report.failures)

        try:
            if data:
                os.replace(round_dir / data, out.parent / data)
            os.replace(tmp_lib, out.parent / lib_name)
            os.replace(tmp_model, out)
        except OSError as e:
            raise ConversionError(f"cannot move the output into {out.parent}: {e.strerror or e}") from None
        result.library_path = str(out.parent / lib_name)
        result.seconds = time.monotonic() - t0
        return result
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@dataclass
class _Built:
    specs: list
    lib: object
    build_seconds: float
    data: str | None
    model: Path
    lib_copy: Path
    lib_name: str
    validation: val.ValidationReport | None


def _build_and_check(model, inp: Path, out: Path, plan, choices, with_cuda, options: PlanOptions, cache_dir, tune,
                     validate, cases, vacuous, user_inputs, tmpdir: Path, say, checks: dict | None = None) -> _Built:
    """One round: specs at the chosen precisions -> CUDA plans (each spec planned once) -> library (units
    cached: a chain moved to another precision recompiles only its own) -> fused model written into
    `tmpdir` -> validation."""
    try:
        specs = [c.to_spec(ch.precision, ch.act_math) for c, ch in zip(plan.chains, choices)]
    except SpecError as e:
        raise ConversionError(str(e)) from None
    unique = list({s.name: s for s in specs}.values())
    plans = {}
    if with_cuda:
        plans, plan_errors = plan_specs(unique, options)
        if plan_errors:
            raise ConversionError(next(iter(plan_errors.values())))
    say(f"building the plugin for {len(unique)} kernel(s) ({', '.join(s.precision for s in specs)})")
    cpu_enabled = {s.name: cpu_kernel_wins(s)[0] for s in unique}
    lib = build_plugin(unique, with_cuda=with_cuda, cache_dir=cache_dir, cpu_enabled=cpu_enabled, progress=say,
                       tune=tune, plans=plans)
    if lib.cache_hit:
        say(f"plugin found in the build cache: {lib.path}")

    fused = rewrite(model, plan, specs)
    lib_name = library_name(out)
    _set_meta(fused, PLUGIN_KEY, lib_name)  # relative to the model's folder: they are written side by side
    _set_meta(fused, "onnx2fused.precision", choices[0].precision if len({c.precision for c in choices}) == 1
              else "mixed")
    _set_meta(fused, CHAINS_KEY, json.dumps([{"op": s.name, "precision": s.precision, "why": ch.why}
                                             for s, ch in zip(specs, choices)]))
    tmp_model, tmp_lib = tmpdir / out.name, tmpdir / lib_name
    say(f"writing {out.name}")
    try:
        data = _save(fused, tmp_model, out.name)
        shutil.copyfile(lib.path, tmp_lib)
    except OSError as e:
        raise ConversionError(f"cannot write into {out.parent}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConversionError(f"cannot serialize the fused model: {e}") from None

    report = None
    if validate:
        report = val.validate(str(inp), tmp_model, tmp_lib, specs[0].precision, original_model=model,
                              chains=plan.chains, with_cuda=lib.with_cuda, user_inputs=user_inputs,
                              progress=say, chain_precisions=[s.precision for s in specs], cases=cases,
                              vacuous=vacuous, chain_noise=[c.noise for c in choices],
                              run_variants=_run_variants(plans), **(checks or {}))
    return _Built(specs, lib, lib.build_seconds, data, tmp_model, tmp_lib, lib_name, report)


def _run_variants(plans: dict, gpus: list[dict] | None = None) -> tuple:
    """The run-time switches validation repeats every set under: a wide plan's FFN kernel (plan/ffn.py)
    runs from thousands of rows, which no validation set reaches, so the sets run again with it taken at
    every batch. Only where the library holds the kernel (sm_90 among the CUDA archs) and the GPUs
    (`gpus`: doctor.detected_gpus() when None) are not all of another compute capability: elsewhere the
    second round would run the same GEMMs again."""
    if (not any(getattr(p, "ffn", None) is not None for p in plans.values())
            or not any(a.startswith("90") for a in cuda_archs())):
        return ()
    if gpus is None:
        from .doctor import detected_gpus
        gpus = detected_gpus()
    if gpus and not any(g.get("compute_capability") == "9.0" for g in gpus):
        return ()
    return ((FFN_ENV, "1", "the FFN kernel at every batch"),)


def _check_validation_options(out: Path, input_files: list[Path], validate: bool, atol, rtol, input_shapes,
                              save_inputs, save_outputs) -> None:
    """The polygraphy-style validation options, before any work: tolerances >= 0, and .npz paths that are
    neither the input's files (_input_files) nor the outputs, in existing folders. Without validation they
    would do nothing."""
    given = [n for n, v in (("--atol", atol), ("--rtol", rtol), ("--input-shapes", input_shapes),
                            ("--save-inputs", save_inputs), ("--save-outputs", save_outputs)) if v is not None]
    if given and not validate:
        raise ConversionError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} validation; "
                              "drop --no-validate")
    for n, v in (("--atol", atol), ("--rtol", rtol)):
        if v is not None and not (float(v) >= 0 and float(v) != float("inf")):
            raise ConversionError(f"{n} {v}: must be a finite number >= 0")
    outputs = _written_paths(out)
    paths = [(n, Path(v)) for n, v in (("--save-inputs", save_inputs), ("--save-outputs", save_outputs))
             if v is not None]
    if len(paths) == 2 and _same_file(paths[0][1], paths[1][1]):
        raise ConversionError(f"--save-inputs and --save-outputs are the same file {paths[0][1]}")
    for n, p in paths:
        if any(_same_file(p, t) for t in input_files + outputs):
            raise ConversionError(f"{n} {p} would overwrite the input model or the output; choose another file")
        if p.is_dir():
            raise ConversionError(f"{n} {p}: is a directory; give a file name (.npz)")
        if not p.parent.is_dir():
            raise ConversionError(f"{n} {p}: folder {p.parent} does not exist")


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
        lines += _chain_table(r.chains, "plan")
        for c in r.chains:
            lines.append(f"  chain {c.index}: op {c.name} ('{c.input}' -> '{c.output}')")
            if c.takes_in:
                lines.append(f"    takes in: {'; '.join(c.takes_in)}")
            if c.precision_why:
                lines.append(f"    precision {c.precision}: {c.precision_why}")
        lines += [f"  stock op rewritten: {w}" for w in r.rewritten]
        where = "cache hit" if r.cache_hit else f"built in {r.build_seconds:.1f} s"
        lines.append(f"plugin: {r.library_path or '(not written)'} ({where}"
                     f"{', with CUDA' if r.with_cuda else ', CPU only'})")
    lines += refusal_lines(r.refusals)
    v = r.validation
    if v is not None:
        lines.append(f"validation vs stock ORT on {len(v.cases)} input set(s): {v.tolerance_note}")
        rows = [("output", "max abs", "rel L2", "ref≠0", "ok")]
        for e in v.outputs:
            if e.exact:
                rows.append((e.name, f"{e.mismatches} diff", "-", "yes" if e.reference_nonzero else "no", "exact"))
            else:
                ok = "yes" if v.output_ok(e) else "NO"
                if v.elementwise and e.beyond:
                    ok += f" ({e.beyond}/{e.elements} outside atol/rtol)"
                rows.append((e.name, _fmt_err(e.max_abs), _fmt_err(e.rel_l2),
                             "yes" if e.reference_nonzero else "no", ok))
        lines += _table(rows, indent="  ")
        if v.max_activation:
            lines.append("  fp16 range: max |intermediate| per chain " + ", ".join(f"{m:.4g}" for m in v.max_activation))
        if any(e is not None for e in v.chain_errors):
            lines.append("  per chain output, rel L2: " + ", ".join(
                f"{k}: {_fmt_err(e.rel_l2) if e is not None else '-'}" for k, e in enumerate(v.chain_errors)))
    elif not r.nothing_to_fuse:
        lines.append("validation: skipped")
    for w in r.warnings:
        lines.append(f"warning: {w}")
    lines.append(f"done in {r.seconds:.1f} s")
    return "\n".join(lines)


CHAIN_END = re.compile(r"^chain \d+ ends: ")


def refusal_lines(refusals: list[str]) -> list[str]:
    """The layers not fused (counted as such), then the notes on where fused chains end (a chain that
    ends at a graph output or a second consumer fused all its layers: not counted as "not fused")."""
    layers = [x for x in refusals if not CHAIN_END.match(x)]
    ends = [x for x in refusals if CHAIN_END.match(x)]
    lines = []
    if layers:
        lines.append(f"{len(layers)} not fused:")
        lines += [f"  {x}" for x in layers]
    if ends:
        lines.append("where chains end:")
        lines += [f"  {x}" for x in ends]
    return lines


def _chain_table(chains, plan_header: str) -> list[str]:
    """The per-chain table shared by the convert report and `inspect`."""
    rows = [("#", "widths", "activations", "precision", "io", plan_header)]
    for c in chains:
        rows.append((str(c.index), "->".join(map(str, c.widths)), ", ".join(c.activations), c.precision,
                     c.io_dtype, c.cuda_plan))
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
    fused: list[dict] = field(default_factory=list)   # a fused model: its chains as convert recorded them
    rewritten: list[str] = field(default_factory=list)   # stock ops convert would write otherwise

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [f"{self.input_path}: {len(self.chains)} chain(s) to fuse"]
        if self.fused:
            lines = [f"{self.input_path}: a fused model, {len(self.fused)} fused chain(s)"]
            lines += [f"  {k}: {c.get('op', '?')}: {c.get('precision', '?')} ({c.get('why', '')})"
                      for k, c in enumerate(self.fused)]
        if self.chains:
            lines += _chain_table(self.chains, "plan")
            for c in self.chains:
                lines.append(f"  chain {c.index}: '{c.input}' -> '{c.output}', op {c.name}")
                if c.takes_in:
                    lines.append(f"    takes in: {'; '.join(c.takes_in)}")
                if c.precision_why:
                    lines.append(f"    precision {c.precision}: {c.precision_why}")
            lines += [f"  stock op rewritten: {w}" for w in self.rewritten]
        if self.refusals:
            lines += refusal_lines(self.refusals)
        elif not self.chains and not self.fused:
            lines.append("  the model has no Gemm/MatMul/Einsum layer with constant weights")
        return "\n".join(lines)


def _check_stock_where_faster(stock_where_faster: bool, with_cuda: bool) -> None:
    if stock_where_faster and with_cuda:
        raise ConversionError("--stock-where-faster is for CPU-only libraries (add --cpu-only): a library with "
                              "CUDA kernels fuses every chain for the GPU")


def inspect(input_path, precision: str = AUTO, cache_dir=None, plan_options: PlanOptions | None = None,
            with_cuda: bool | None = None, stock_where_faster: bool = False) -> InspectResult:
    """The chains `convert` would fuse (with the precision automatic precision would give each, and its
    reason, or `precision` for all; the CUDA plan at that precision, with the wide kernels tuned for this
    GPU when the build cache holds them) and why other layers are not. On a fused model: the precision
    and reason convert recorded for each chain. `with_cuda`: the library convert would build (None: with
    CUDA when nvcc is found), which decides whether gated layers and transformer blocks' norms and residuals fuse
    (library.find_fusions); `stock_where_faster` as for convert."""
    from .build import default_cache_dir
    from .wide_tune import cached_plan
    cache = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    options = plan_options or PlanOptions.from_env()
    check_precision(precision)
    model = load_model(input_path)
    cpu_only = with_cuda is False   # asked for (--cpu-only): precisions and plans as convert --cpu-only has them
    if with_cuda is None:
        with_cuda = find_nvcc() is not None
    _check_stock_where_faster(stock_where_faster, with_cuda)
    model, plan = fusion_plan(model, with_cuda, options, stock_where_faster)
    res = InspectResult(str(input_path), refusals=[r.reason for r in plan.refusals], plan=plan.describe(),
                        rewritten=plan.rewritten)
    recorded = {p.key: p.value for p in model.metadata_props}.get(CHAINS_KEY)
    if recorded:
        try:
            res.fused = [c for c in json.loads(recorded) if isinstance(c, dict)]
        except ValueError:
            res.fused = [{"op": "?", "precision": "?", "why": f"unreadable {CHAINS_KEY} metadata"}]
    if precision == AUTO:
        try:
            cases, _ = val.validation_cases(model)
        except Exception:  # noqa: BLE001 - inspect only reads: no cases, the default precision
            cases = None
        choices = initial_precisions(model, plan.chains, cases, not cpu_only, lambda msg: None) if plan.chains else []
        if with_cuda:   # as convert starts: a step no CUDA design plans is skipped
            choices = [plannable(c, ch, options) for c, ch in zip(plan.chains, choices)]
    else:
        choices = [PrecisionChoice(precision, "asked for (--precision)") for _ in plan.chains]
    for k, (c, ch) in enumerate(zip(plan.chains, choices)):
        try:
            s = c.to_spec(ch.precision, ch.act_math)
        except SpecError as e:
            raise ConversionError(str(e)) from None
        plans, errors = plan_specs([s], options)
        p = plans.get(s.name)
        res.chains.append(ChainReport(k, s.name, list(s.widths), c.activation_labels(),
                                      s.precision, s.io_dtype,
                                      plan_text(s, cached_plan(p, cache) if p else None, errors.get(s.name, ""),
                                                with_cuda=not cpu_only),
                                      c.input, c.output, ch.why, c.extras()))
    return res
