"""Validate a fused model against stock ONNX Runtime on the original.

    validate(original, fused_path, library, precision, ...) -> ValidationReport

The ORIGINAL runs on stock ORT (CPU EP, graph optimisations disabled: the plain stock ops, fp32);
the FUSED model runs with the plugin registered, on the CUDA EP when onnxruntime has it and the
library was built with CUDA, else on the CPU EP. Both see the same inputs: random normal(0, 1) ones
for several batch sizes (symbolic non-batch dimensions set to `OTHER_DIM`) and the user's inputs.

Per output we report the max abs error, the relative L2 error ||fused - ref|| / ||ref|| and whether the
reference is non-zero (an all-zero reference is judged by the max abs error instead). On the CPU EP
the plugin computes in fp32 whatever the precision, so the tolerance there is `CPU_TOLERANCE`.

For fp16 the largest |value| of each chain's intermediate tensors (what the kernel stores in fp16) is
measured on the original model; above 65504 it would overflow.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import onnx

from .envvars import environment
from .errors import ConversionError, ValidationError

TOLERANCES = {"fp16": 2e-3, "bf16": 1e-2, "tf32": 1e-3, "fp32": 1e-5}
CPU_TOLERANCE = 1e-4          # the CPU kernel computes in fp32 for every precision
FP16_MAX = 65504.0
NOISE_FACTOR = 4.0            # ill-conditioned chains: allowed this many times stock fp32's own noise (precision.py)
FP16_WARN = 0.5 * FP16_MAX
BATCHES = (1, 37, 256)
# Elements of all inputs of one set above which its batch is cut down (never below 1): an image model's
# 256-image set (a ViT: 256 x 3 x 224 x 224 = 38.5M floats, 50432 token rows per chain) costs seconds of
# stock CPU inference per run and tells no more than a few thousand rows do.
SET_ELEMENTS = 1 << 22
OTHER_DIM = 5                 # value of symbolic dimensions other than the leading (batch) one
SEED = 20261122

_NP_TYPES = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32, onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.BOOL: np.bool_,
}


@dataclass
class OutputError:
    name: str
    max_abs: float = 0.0
    rel_l2: float = 0.0
    reference_nonzero: bool = False
    worst_case: str = ""          # the input set where the relative error was largest
    exact: bool = False           # non-float output: compared for equality
    mismatches: int = 0           # non-float output: elements that differ
    elements: int = 0             # float output: elements compared (all input sets)
    beyond: int = 0               # float output: elements outside atol + rtol * |ref| (with --atol/--rtol)

    def within(self, tol: float) -> bool:
        if self.exact:
            return True           # reported (as a warning), never fails validation
        if not self.reference_nonzero:
            return self.max_abs <= tol
        return self.rel_l2 <= tol


@dataclass
class ValidationReport:
    provider: str
    precision: str
    tolerance: float
    tolerance_note: str
    cases: list[str] = field(default_factory=list)
    outputs: list[OutputError] = field(default_factory=list)
    max_activation: list[float] = field(default_factory=list)   # per chain (fp16 only)
    warnings: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    chain_errors: list[OutputError] = field(default_factory=list)  # per chain: its own output tensor
    chain_failures: list[int] = field(default_factory=list)        # chains whose numerics fail (auto moves them up)
    vacuous: list[str] = field(default_factory=list)               # outputs whose reference is degenerate everywhere
    atol: float | None = None     # --atol/--rtol: elementwise |fused - ref| <= atol + rtol * |ref| decides instead
    rtol: float | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def elementwise(self) -> bool:
        return self.atol is not None or self.rtol is not None

    def output_ok(self, e: OutputError) -> bool:
        """An output within the criterion that decides: the elementwise one when given, else the tolerance."""
        if self.elementwise and not e.exact:
            return e.beyond == 0
        return e.within(self.tolerance)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d


# ------------------------------------------------------------------------------------------ inputs
def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _np_type(vi: onnx.ValueInfoProto):
    t = vi.type.tensor_type.elem_type
    if t not in _NP_TYPES:
        raise ConversionError(f"input '{vi.name}' has element type "
                              f"{onnx.TensorProto.DataType.Name(t)}, which validation cannot generate; "
                              "pass --no-validate")
    return _NP_TYPES[t]


def _shape(vi: onnx.ValueInfoProto, batch: int) -> tuple[int, ...]:
    if not vi.type.tensor_type.HasField("shape"):
        raise ConversionError(f"input '{vi.name}' has no known rank; validation cannot make inputs for it "
                              "(pass --inputs or --no-validate)")
    dims = []
    for k, d in enumerate(vi.type.tensor_type.shape.dim):
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(d.dim_value)
        else:
            dims.append(batch if k == 0 else OTHER_DIM)
    return tuple(dims)


# Input distributions tried, in order, until the reference outputs are not degenerate (all NaN, all inf or
# all zero): a model that saturates or overflows on N(0, 1) may be fine at another scale.
DISTRIBUTIONS = (("normal", 1.0), ("normal", 0.1), ("uniform", 1.0), ("normal", 10.0), ("normal", 0.01),
                 ("normal", 100.0))


def _draw(rng, kind: str, scale: float, shape, t):
    if kind == "uniform":
        return rng.uniform(-scale, scale, shape).astype(t)
    return (scale * rng.standard_normal(shape)).astype(t)


def random_inputs(model: onnx.ModelProto, batches=BATCHES, seed: int = SEED,
                  distribution: tuple[str, float] = DISTRIBUTIONS[0],
                  shapes: dict | None = None) -> list[tuple[str, dict]]:
    """[(case name, feeds)]: random floats of `distribution` (zeros for integer inputs), one set per
    distinct shape. The default, normal(0, 1), keeps the case names short. `shapes` ({input: shape},
    check_input_shapes): those inputs get that shape in every set instead of the batch sizes."""
    shapes = shapes or {}
    kind, scale = distribution
    tag = "" if distribution == DISTRIBUTIONS[0] else (f" U(-{scale:g}, {scale:g})" if kind == "uniform"
                                                       else f" N(0, {scale:g}^2)")
    rng = np.random.default_rng(seed)
    ins = graph_inputs(model)
    cases, seen = [], set()
    # elements of one batch item over the inputs the batch sizes (a set larger than SET_ELEMENTS gets a
    # smaller batch; one that then equals another set is skipped below)
    per_item = sum(int(np.prod(_shape(vi, 1)[1:])) for vi in ins if vi.name not in shapes)
    for b in batches:
        if b > 1 and per_item * b > SET_ELEMENTS:
            b = max(1, SET_ELEMENTS // max(per_item, 1))
        set_shapes = tuple(tuple(shapes[vi.name]) if vi.name in shapes else _shape(vi, b) for vi in ins)
        if set_shapes in seen:
            continue
        seen.add(set_shapes)
        feeds = {}
        for vi, shape in zip(ins, set_shapes):
            t = _np_type(vi)
            if np.issubdtype(t, np.floating):
                feeds[vi.name] = _draw(rng, kind, scale, shape, t)
            else:
                feeds[vi.name] = np.zeros(shape, t)
        name = ", ".join(f"{vi.name}{list(s)}" for vi, s in zip(ins, set_shapes))
        cases.append((f"random{tag} {name}", feeds))
    return cases


def degenerate(a: np.ndarray) -> str | None:
    """Why a float reference output is no evidence ("all zeros", "all NaN", ...), or None when it is."""
    a = np.asarray(a)
    if not np.issubdtype(a.dtype, np.floating) or a.size == 0:
        return None
    finite = np.isfinite(a)
    if np.any(finite & (a != 0)):
        return None
    if not finite.any():
        return "all NaN" if np.isnan(a).all() else "all NaN or ±inf" if np.isnan(a).any() else "all ±inf"
    return "all zeros" if finite.all() else "only zeros, NaN and ±inf"


def validation_cases(model: onnx.ModelProto, user_inputs: dict | None = None, batches=BATCHES,
                     ref_sess=None, shapes: dict | None = None) -> tuple[list[tuple[str, dict]], list[str]]:
    """The input sets validation uses, and the outputs that stay degenerate on all of them.

    Random inputs first at N(0, 1); when some float output of the original is degenerate on every set,
    the other DISTRIBUTIONS are tried in turn and the first that makes it informative replaces N(0, 1)
    (an input scale is part of no model's contract, so any scale that gives evidence will do). The
    user's inputs, when given, are always added."""
    sess = ref_sess or _session(model, optimize=False)
    names = [o.name for o in sess.get_outputs()]

    def dead(cases) -> list[str]:
        """The outputs degenerate on every one of `cases`, with why (as on the last case)."""
        why: dict[str, str | None] = {n: "" for n in names}   # "": no case seen yet
        for _, feeds in cases:
            for n, y in zip(names, sess.run(None, feeds)):
                if why[n] is not None:
                    why[n] = degenerate(y)
        return [f"'{n}' is {w}" for n, w in why.items() if w]

    chosen = random_inputs(model, batches, shapes=shapes)
    vacuous = dead(chosen)
    for dist in DISTRIBUTIONS[1:]:
        if not vacuous:
            break
        cases = random_inputs(model, batches, distribution=dist, shapes=shapes)
        left = dead(cases)
        if len(left) < len(vacuous):
            chosen, vacuous = cases, left
    if user_inputs:
        chosen = chosen + [("user inputs", user_inputs)]
        if vacuous and not dead([("user inputs", user_inputs)]):
            vacuous = []
    return chosen, vacuous


def reference_tensors(original: onnx.ModelProto, names: list[str], cases) -> dict[str, list[np.ndarray]]:
    """Stock ORT's values of the tensors `names` (graph inputs, intermediates or outputs) of the original
    model on each input set: {name: [array per case]}. Runs the original once per case with the
    intermediates as extra outputs (graph optimisations off, so they exist as named)."""
    m = onnx.ModelProto()
    m.CopyFrom(original)
    g = m.graph
    have = {o.name for o in g.output} | {i.name for i in g.input}
    types = {v.name: v for v in list(g.value_info) + list(g.input) + list(g.output)}
    for t in names:
        if t in have:
            continue
        vi = types.get(t)
        elem = vi.type.tensor_type.elem_type if vi is not None else onnx.TensorProto.FLOAT
        g.output.append(onnx.helper.make_tensor_value_info(t, elem, None))
        have.add(t)
    if m.ByteSize() > 2**31 - 1:
        raise ConversionError("the model is too large to read its intermediate tensors (over 2 GB)")
    sess = _session(m, optimize=False)
    out_names = [o.name for o in sess.get_outputs()]
    got: dict[str, list[np.ndarray]] = {t: [] for t in names}
    for _, feeds in cases:
        outs = dict(zip(out_names, sess.run(None, feeds)))
        for t in names:
            got[t].append(np.asarray(feeds[t] if t in feeds else outs[t]))
    return got


def load_user_inputs(inputs, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """`inputs`: a path to an .npz whose keys are input names, or a mapping name -> array."""
    if isinstance(inputs, Mapping):
        arrays = {str(k): np.asarray(v) for k, v in inputs.items()}
        where = "inputs"
    else:
        p = Path(inputs)
        try:
            with open(p, "rb") as f:
                if f.read(4) != b"PK\x03\x04":   # an .npz is a zip archive (np.load would try it as a pickle)
                    raise ConversionError(f"{p}: not an .npz file (np.savez of input name -> array)")
            with np.load(p, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except FileNotFoundError:
            raise ConversionError(f"{p}: no such inputs file") from None
        except (OSError, ValueError) as e:
            raise ConversionError(f"{p}: cannot read the inputs (expected an .npz of input name -> array): "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        where = str(p)
    ins = {vi.name: vi for vi in graph_inputs(model)}
    unknown = sorted(set(arrays) - set(ins))
    if unknown:
        raise ConversionError(f"{where}: {', '.join(map(repr, unknown))} not among the model's inputs "
                              f"({', '.join(map(repr, ins))})")
    missing = sorted(set(ins) - set(arrays))
    if missing:
        raise ConversionError(f"{where}: no array for the model input(s) {', '.join(map(repr, missing))}")
    feeds = {}
    for name, vi in ins.items():
        a = arrays[name]
        shape = vi.type.tensor_type.shape
        if vi.type.tensor_type.HasField("shape"):
            if a.ndim != len(shape.dim):
                raise ConversionError(f"{where}: input '{name}' has shape {list(a.shape)} but the model "
                                      f"expects rank {len(shape.dim)}")
            for k, d in enumerate(shape.dim):
                if d.HasField("dim_value") and d.dim_value > 0 and a.shape[k] != d.dim_value:
                    raise ConversionError(f"{where}: input '{name}' has shape {list(a.shape)}; dimension {k} "
                                          f"must be {d.dim_value}")
        feeds[name] = np.ascontiguousarray(a.astype(_np_type(vi), copy=False))
    return feeds


# ------------------------------------------------------------------------------------------ sessions
def choose_providers(with_cuda: bool) -> list[str]:
    import onnxruntime as ort
    if with_cuda and "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _session(model, library=None, providers=("CPUExecutionProvider",), optimize: bool = True):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.log_severity_level = 4  # ORT logs errors straight to fd 2; ours are reported as one line instead
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if library is not None:
        so.register_custom_ops_library(str(library))
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, so, providers=list(providers))


def _one_line(e: Exception) -> str:
    lines = [l.strip() for l in str(e).splitlines() if l.strip()]
    return lines[0] if lines else type(e).__name__


def _compare(name: str, a: np.ndarray, b: np.ndarray, case: str, acc: OutputError,
             atol: float | None = None, rtol: float | None = None) -> None:
    """Fold the error of fused `a` vs reference `b` into `acc` (with atol/rtol: also count the elements
    outside atol + rtol * |ref|; NaN where the reference has NaN, and equal infinities, are equal)."""
    if a.shape != b.shape:
        raise ValidationError(f"output '{name}' has shape {list(a.shape)} in the fused model but "
                              f"{list(b.shape)} in the original ({case})")
    if not (np.issubdtype(b.dtype, np.floating) and np.issubdtype(a.dtype, np.floating)):
        acc.exact = True
        acc.mismatches += int(np.count_nonzero(a != b))
        acc.reference_nonzero |= bool(np.any(b != 0))
        return
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    same = (np.isnan(a64) & np.isnan(b64)) | (np.isinf(b64) & (a64 == b64))
    a64, b64 = np.where(same, 0.0, a64), np.where(same, 0.0, b64)
    diff = a64 - b64
    acc.elements += int(diff.size)
    if atol is not None or rtol is not None:
        with np.errstate(invalid="ignore"):
            acc.beyond += int(np.count_nonzero(~(np.abs(diff) <= (atol or 0.0) + (rtol or 0.0) * np.abs(b64))))
    if not np.all(np.isfinite(diff)):
        max_abs, rel = float("inf"), float("inf")
    else:
        max_abs = float(np.max(np.abs(diff))) if diff.size else 0.0
        nb = float(np.linalg.norm(b64))
        rel = float(np.linalg.norm(diff)) / nb if nb > 0 else 0.0
        acc.reference_nonzero |= nb > 0
    if not acc.worst_case or rel > acc.rel_l2:
        acc.worst_case = case
    acc.max_abs = max(acc.max_abs, max_abs)
    acc.rel_l2 = max(acc.rel_l2, rel)


def chain_intermediates(chain) -> list[str]:
    """The tensors the fp16 kernel stores in fp16: the chain input and every layer output but the last."""
    return list(chain.input_tensors) + [l.output for l in chain.layers[:-1]]


def _max_activations(original: onnx.ModelProto, chains, cases) -> list[float]:
    """max |value| (finite ones) of each chain's intermediate tensors on the original model."""
    wanted = list(dict.fromkeys(t for c in chains for t in chain_intermediates(c)))
    values = reference_tensors(original, wanted, cases)
    peak = {}
    for t, arrays in values.items():
        finite = [np.abs(a[np.isfinite(a)].astype(np.float64)) for a in arrays]
        peak[t] = max((float(v.max()) for v in finite if v.size), default=0.0)
    return [max(peak[t] for t in chain_intermediates(c)) for c in chains]


def _with_outputs(model, names: list[str], types: dict[str, int]):
    """`model` (path or ModelProto) with the tensors `names` (element types from `types`) added as graph
    outputs; None when it cannot be (over 2 GB in memory, or unreadable)."""
    try:
        m = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    except Exception:  # noqa: BLE001 - the per-chain errors are a refinement: the model outputs are still checked
        return None
    out = onnx.ModelProto()
    out.CopyFrom(m)
    have = {o.name for o in out.graph.output}
    for t in names:
        if t not in have:
            out.graph.output.append(onnx.helper.make_tensor_value_info(t, types.get(t, onnx.TensorProto.FLOAT), None))
    return out if out.ByteSize() < 2**31 - 1 else None


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    return {v.name: v.type.tensor_type.elem_type for v in list(g.value_info) + list(g.input) + list(g.output)
            if v.type.tensor_type.elem_type}


# ------------------------------------------------------------------------------------------ validate
def validate(original, fused, library, precision: str, *, original_model: onnx.ModelProto | None = None,
             chains=(), with_cuda: bool = False, user_inputs: dict | None = None,
             batches=BATCHES, progress: Callable[[str], None] | None = None,
             chain_precisions: list[str] | None = None, cases=None, vacuous=None, chain_noise=None,
             atol: float | None = None, rtol: float | None = None, save_inputs=None,
             save_outputs=None, run_variants=()) -> ValidationReport:
    """Compare `fused` (path, run with `library`) against `original` (path or ModelProto) on stock ORT.

    `chain_precisions`: each chain's precision (default: `precision` for all); the model outputs are held
    to the loosest of them, each chain's own output tensor to its own (`report.chain_errors`,
    `report.chain_failures`: what automatic precision moves up). `cases`/`vacuous`: the input sets and
    the degenerate outputs from `validation_cases` (computed here when not given).
    `atol`/`rtol`: the model outputs pass when every element has |fused - ref| <= atol + rtol * |ref| (a
    missing one is 0), instead of the precision's relative-L2 tolerance. `save_inputs`/`save_outputs`:
    .npz files written with the input sets, and the reference (and fused) outputs (save_arrays).
    `run_variants`: (environment variable, value, label) switches the plugin reads on every run, under
    which a CUDA session runs every set again, against the same references (a row-dependent path the
    sets' batches never reach: a wide plan's FFN kernel, plan/ffn.py). Those runs count in the outputs'
    errors, the per-chain errors (chain_errors) and the element counts (the messages say how many rounds);
    save_outputs holds the first round's.
    Never raises for a tolerance violation: the report's `failures` say what is wrong; `check(report)`
    raises. Raises ConversionError when a model cannot run at all.
    """
    say = progress or (lambda msg: None)
    if original_model is None:
        original_model = original if isinstance(original, onnx.ModelProto) else onnx.load(str(original))
    chains = list(chains)
    precisions = list(chain_precisions) if chain_precisions else [precision] * len(chains)
    providers = choose_providers(with_cuda)
    provider = providers[0]
    on_cpu = provider == "CPUExecutionProvider"
    # chain_noise (automatic precision): a chain that amplifies rounding, whose stock fp32 result is itself
    # far from the float64-accumulated one, is allowed NOISE_FACTOR x that distance where it exceeds the
    # tolerance; on the CPU EP every kernel computes in fp32
    noise = list(chain_noise) if chain_noise else [0.0] * len(precisions)
    chain_tols = [max(CPU_TOLERANCE if on_cpu else TOLERANCES[p], NOISE_FACTOR * n) for p, n in zip(precisions, noise)]
    gpu_tols = chain_tols
    if on_cpu:
        tol = max(chain_tols, default=CPU_TOLERANCE)
        note = (f"CPU EP: the plugin computes in fp32 whatever the precision, so the fp32 tolerance "
                f"{tol:g} applies")
    else:
        tol = max(gpu_tols, default=TOLERANCES[precision])
        used = sorted(set(precisions), key=list(TOLERANCES).index) or [precision]
        note = f"{provider}: {'/'.join(used)} tolerance {tol:g}"
    if atol is not None or rtol is not None:
        note += (f"; the outputs are held to |fused - ref| <= {atol or 0:g} + {rtol or 0:g} * |ref| elementwise "
                 "(--atol/--rtol) instead")
    report = ValidationReport(provider, precision, tol, note, atol=atol, rtol=rtol)

    try:
        ref_sess = _session(original, optimize=False)
    except Exception as e:
        raise ConversionError(f"stock onnxruntime cannot load the original model: {_one_line(e)}") from None
    if cases is None:
        try:
            cases, vacuous = validation_cases(original_model, user_inputs, batches, ref_sess)
        except Exception as e:
            raise ConversionError(f"stock onnxruntime fails on the original model: {_one_line(e)}") from None
    report.cases = [c for c, _ in cases]
    report.vacuous = list(vacuous or [])
    if report.vacuous:
        report.warnings.append(f"validation vacuous: {', '.join(report.vacuous)} on every input scale tried "
                               "(normal and uniform, 0.01 to 100); pass --inputs with real data")

    say(f"validating on {len(cases)} input set(s) ({provider})")
    try:
        fused_sess = _session(fused, library=library, providers=providers)
    except Exception as e:
        raise ConversionError(f"onnxruntime cannot load the fused model with its plugin: {_one_line(e)}") from None
    names = [o.name for o in ref_sess.get_outputs()]
    fused_names = [o.name for o in fused_sess.get_outputs()]
    if names != fused_names:
        raise ValidationError(f"the fused model's outputs {fused_names} differ from the original's {names}")
    errs = {n: OutputError(n) for n in names}

    def compare_fused(case: str, feeds, ref, label: str = ""):
        """The fused model's outputs on `feeds`, folded into `errs` against `ref` (under the run variant
        `label`, if any)."""
        under = f" and {label}" if label else ""
        try:
            out = fused_sess.run(None, feeds)
        except Exception as e:
            raise ValidationError(f"the fused model fails with {case}{under}: {_one_line(e)}") from None
        for n, a, b in zip(names, out, ref):
            _compare(n, np.asarray(a), np.asarray(b), f"{case}, {label}" if label else case, errs[n], atol, rtol)
        return out

    refs, fuseds = [], []
    for case, feeds in cases:
        try:
            ref = ref_sess.run(None, feeds)
        except Exception as e:
            raise ConversionError(f"stock onnxruntime fails on the original model with {case}: {_one_line(e)}") from None
        out = compare_fused(case, feeds, ref)
        refs.append(ref)
        if save_outputs is not None:
            fuseds.append(dict(zip(names, out)))
    variants = () if on_cpu else tuple(run_variants)
    for var, value, label in variants:
        say(f"validating again with {label} ({var}={value})")
        with environment({var: value}):
            for (case, feeds), ref in zip(cases, refs):
                compare_fused(case, feeds, ref, label)
        report.tolerance_note += f"; every set again with {label}"
    rounds = f" over {len(variants) + 1} rounds of the sets" if variants else ""
    report.outputs = list(errs.values())
    if save_inputs is not None:
        save_arrays(save_inputs, {f"{k}/{n}": a for k, (_, feeds) in enumerate(cases) for n, a in feeds.items()},
                    [c for c, _ in cases])
    if save_outputs is not None:
        save_arrays(save_outputs, {**{f"{k}/{n}": a for k, r in enumerate(refs) for n, a in zip(names, r)},
                                   **{f"fused/{k}/{n}": a for k, f in enumerate(fuseds) for n, a in f.items()}},
                    [c for c, _ in cases])
    mismatched_labels = False
    for e in report.outputs:
        if e.exact:
            if e.mismatches:
                mismatched_labels = True
                report.warnings.append(f"output '{e.name}' (not floating point) differs in {e.mismatches} "
                                       "element(s) from stock ORT (near-ties of the fused values)")
        elif report.elementwise:
            if e.beyond:
                report.failures.append(f"output '{e.name}': {e.beyond} of {e.elements} element(s){rounds} outside "
                                       f"|fused - ref| <= {atol or 0:g} + {rtol or 0:g} * |ref| (max abs error "
                                       f"{e.max_abs:.3g}; {provider}, worst rel L2 on {e.worst_case})")
        elif not e.within(tol):
            what = (f"relative L2 error {e.rel_l2:.3g}" if e.reference_nonzero
                    else f"max abs error {e.max_abs:.3g} (the reference is all zeros)")
            report.failures.append(f"output '{e.name}': {what} exceeds the tolerance {tol:g} "
                                   f"({provider}, {e.worst_case})")

    if chains:
        report.chain_errors = _chain_errors(original_model, fused, library, providers, chains, cases, variants)
        for k, (e, t) in enumerate(zip(report.chain_errors, chain_tols)):
            if e is not None and not e.within(t):
                report.chain_failures.append(k)
        if report.failures and not report.chain_failures:  # not attributable: every chain that can move up
            report.chain_failures = [k for k, p in enumerate(precisions) if p != "fp32"]
        if mismatched_labels:  # integer outputs (labels) must match exactly: every chain that can move up
            report.chain_failures = sorted(set(report.chain_failures) |
                                           {k for k, p in enumerate(precisions) if p != "fp32"})

    fp16_chains = [k for k, p in enumerate(precisions) if p == "fp16"]
    if with_cuda and fp16_chains:  # a CPU-only library computes in fp32: no fp16 range to respect
        say("checking fp16 range of the chains' intermediate tensors")
        try:
            peaks = _max_activations(original_model, chains, cases)
        except Exception as e:  # the check is advisory; the comparison above already ran
            peaks = []
            report.warnings.append(f"could not measure the fp16 range of the intermediates: {_one_line(e)}")
        report.max_activation = peaks
        for k in fp16_chains:
            peak = peaks[k] if k < len(peaks) else 0.0
            if peak > FP16_MAX:
                report.failures.append(f"chain {k}: intermediate values reach {peak:.4g}, beyond the fp16 "
                                       f"maximum {FP16_MAX:g}; use --precision bf16 or fp32")
                report.warnings.append(f"chain {k}: intermediate values reach {peak:.4g} > {FP16_MAX:g} "
                                       "(fp16 overflow); use --precision bf16 or fp32")
                report.chain_failures = sorted(set(report.chain_failures) | {k})
            elif peak > FP16_WARN:
                report.warnings.append(f"chain {k}: intermediate values reach {peak:.4g}, more than half the "
                                       f"fp16 maximum {FP16_MAX:g}; consider --precision bf16 or fp32")
    return report


def _chain_errors(original_model, fused, library, providers, chains, cases, variants=()) -> list[OutputError | None]:
    """Each chain's own output tensor, fused vs stock (the upstream chains' errors included): which chain
    to move up when the model outputs fail. Under each of `variants` too (validate's run_variants), so that
    a failure only one round shows is laid on the chain that fails it. None for a chain whose output
    cannot be read back."""
    outs = list(dict.fromkeys(c.output for c in chains))
    types = _elem_types(original_model)
    ref_m, fused_m = _with_outputs(original_model, outs, types), _with_outputs(fused, outs, types)
    if ref_m is None or fused_m is None:
        return [None] * len(chains)
    try:
        ref_s = _session(ref_m, optimize=False)
        fused_s = _session(fused_m, library=library, providers=providers)
    except Exception:  # noqa: BLE001 - a refinement only (the model outputs were compared above)
        return [None] * len(chains)
    errs = {t: OutputError(t) for t in outs}
    refs = [dict(zip(outs, ref_s.run(outs, feeds))) for _, feeds in cases]
    for var, value, label in ((None, None, ""), *variants):
        with environment({var: value} if var else {}):
            for (case, feeds), r in zip(cases, refs):
                f = dict(zip(outs, fused_s.run(outs, feeds)))
                for t in outs:
                    _compare(t, np.asarray(f[t]), np.asarray(r[t]), f"{case}, {label}" if label else case, errs[t])
    return [errs[c.output] for c in chains]


def save_arrays(path, arrays: dict[str, np.ndarray], cases: list[str]) -> None:
    """Write `arrays` (key "<set>/<name>", set = index into `cases`) and `cases` (the input sets' names)
    to the .npz `path`, atomically (a temp file beside it, renamed): a failure leaves no partial file."""
    import os
    import tempfile
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.tmp-", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:   # a file object: np.savez adds no ".npz" to the name
            np.savez(f, cases=np.array(cases, dtype=str), **{k: np.asarray(v) for k, v in arrays.items()})
        os.replace(tmp, p)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise ConversionError(f"cannot write {p}: {e.strerror or e}") from None


def check_input_shapes(shapes, model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """{input name: shape} for the random validation inputs (--input-shapes), checked against the model:
    a known input, its rank, its static dims, and positive sizes. Raises ConversionError (one line)."""
    ins = {vi.name: vi for vi in graph_inputs(model)}
    out = {}
    for name, dims in dict(shapes).items():
        if name not in ins:
            raise ConversionError(f"--input-shapes: {name!r} is not an input of the model "
                                  f"({', '.join(map(repr, ins))})")
        dims = tuple(int(d) for d in dims)
        if any(d <= 0 for d in dims):
            raise ConversionError(f"--input-shapes: {name}{list(dims)}: sizes must be positive")
        t = ins[name].type.tensor_type
        if t.HasField("shape"):
            if len(dims) != len(t.shape.dim):
                raise ConversionError(f"--input-shapes: {name}{list(dims)} has rank {len(dims)}; the model's "
                                      f"input has rank {len(t.shape.dim)}")
            for k, d in enumerate(t.shape.dim):
                if d.HasField("dim_value") and d.dim_value > 0 and dims[k] != d.dim_value:
                    raise ConversionError(f"--input-shapes: {name}{list(dims)}: dimension {k} is fixed to "
                                          f"{d.dim_value} in the model")
        out[name] = dims
    return out


def check(report: ValidationReport) -> None:
    """Raise ValidationError (one line) when the report has failures."""
    if report.failures:
        more = f" (and {len(report.failures) - 1} more)" if len(report.failures) > 1 else ""
        raise ValidationError(f"validation failed: {report.failures[0]}{more}; nothing written "
                              "(pass --force / force=True to write it anyway)")
