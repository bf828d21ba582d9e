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

from .errors import ConversionError, ValidationError

TOLERANCES = {"fp16": 2e-3, "bf16": 1e-2, "tf32": 1e-3, "fp32": 1e-5}
CPU_TOLERANCE = 1e-4          # the CPU kernel computes in fp32 for every precision
FP16_MAX = 65504.0
FP16_WARN = 0.5 * FP16_MAX
BATCHES = (1, 37, 256)
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

    @property
    def passed(self) -> bool:
        return not self.failures

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


def random_inputs(model: onnx.ModelProto, batches=BATCHES, seed: int = SEED) -> list[tuple[str, dict]]:
    """[(case name, feeds)]: normal(0, 1) floats (zeros for integer inputs), one set per distinct shape."""
    rng = np.random.default_rng(seed)
    ins = graph_inputs(model)
    cases, seen = [], set()
    for b in batches:
        shapes = tuple(_shape(vi, b) for vi in ins)
        if shapes in seen:
            continue
        seen.add(shapes)
        feeds = {}
        for vi, shape in zip(ins, shapes):
            t = _np_type(vi)
            if np.issubdtype(t, np.floating):
                feeds[vi.name] = rng.standard_normal(shape).astype(t)
            else:
                feeds[vi.name] = np.zeros(shape, t)
        name = ", ".join(f"{vi.name}{list(s)}" for vi, s in zip(ins, shapes))
        cases.append((f"random {name}", feeds))
    return cases


def load_user_inputs(inputs, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """`inputs`: a path to an .npz whose keys are input names, or a mapping name -> array."""
    if isinstance(inputs, Mapping):
        arrays = {str(k): np.asarray(v) for k, v in inputs.items()}
        where = "inputs"
    else:
        p = Path(inputs)
        try:
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


def _compare(name: str, a: np.ndarray, b: np.ndarray, case: str, acc: OutputError) -> None:
    """Fold the error of fused `a` vs reference `b` into `acc`."""
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
    return [chain.input] + [l.output for l in chain.layers[:-1]]


def _max_activations(original: onnx.ModelProto, chains, cases) -> list[float]:
    """max |value| of each chain's intermediate tensors, running the original with them as extra outputs."""
    wanted = []
    for c in chains:
        for t in chain_intermediates(c):
            if t not in wanted:
                wanted.append(t)
    m = onnx.ModelProto()
    m.CopyFrom(original)
    g = m.graph
    have = {o.name for o in g.output} | {i.name for i in g.input}
    types = {v.name: v for v in list(g.value_info) + list(g.input) + list(g.output)}
    for t in wanted:
        if t in have:
            continue
        vi = types.get(t)
        elem = vi.type.tensor_type.elem_type if vi is not None else onnx.TensorProto.FLOAT
        g.output.append(onnx.helper.make_tensor_value_info(t, elem, None))
    if m.ByteSize() > 2**31 - 1:
        return []
    sess = _session(m, optimize=False)
    names = [o.name for o in sess.get_outputs()]
    peak = {t: 0.0 for t in wanted}
    for _, feeds in cases:
        outs = dict(zip(names, sess.run(None, feeds)))
        for t in wanted:
            v = feeds[t] if t in feeds else outs[t]
            v = np.abs(np.asarray(v, dtype=np.float64))
            v = v[np.isfinite(v)] if not np.all(np.isfinite(v)) else v
            if v.size:
                peak[t] = max(peak[t], float(v.max()))
    return [max(peak[t] for t in chain_intermediates(c)) for c in chains]


# ------------------------------------------------------------------------------------------ validate
def validate(original, fused, library, precision: str, *, original_model: onnx.ModelProto | None = None,
             chains=(), with_cuda: bool = False, user_inputs: dict | None = None,
             batches=BATCHES, progress: Callable[[str], None] | None = None) -> ValidationReport:
    """Compare `fused` (path, run with `library`) against `original` (path or ModelProto) on stock ORT.

    Never raises for a tolerance violation: the report's `failures` say what is wrong; `check(report)`
    raises. Raises ConversionError when a model cannot run at all.
    """
    say = progress or (lambda msg: None)
    if original_model is None:
        original_model = original if isinstance(original, onnx.ModelProto) else onnx.load(str(original))
    providers = choose_providers(with_cuda)
    provider = providers[0]
    if provider == "CPUExecutionProvider":
        tol = CPU_TOLERANCE
        note = (f"CPU EP: the plugin computes in fp32 whatever the precision, so the fp32 tolerance "
                f"{CPU_TOLERANCE:g} applies (the {precision} tolerance is {TOLERANCES[precision]:g})")
    else:
        tol = TOLERANCES[precision]
        note = f"{provider}: {precision} tolerance {tol:g}"
    report = ValidationReport(provider, precision, tol, note)

    cases = random_inputs(original_model, batches)
    if user_inputs:
        cases.append(("user inputs", user_inputs))
    report.cases = [c for c, _ in cases]

    say(f"validating on {len(cases)} input set(s) ({provider})")
    try:
        ref_sess = _session(original, optimize=False)
    except Exception as e:
        raise ConversionError(f"stock onnxruntime cannot load the original model: {_one_line(e)}") from None
    try:
        fused_sess = _session(fused, library=library, providers=providers)
    except Exception as e:
        raise ConversionError(f"onnxruntime cannot load the fused model with its plugin: {_one_line(e)}") from None
    names = [o.name for o in ref_sess.get_outputs()]
    fused_names = [o.name for o in fused_sess.get_outputs()]
    if names != fused_names:
        raise ValidationError(f"the fused model's outputs {fused_names} differ from the original's {names}")
    errs = {n: OutputError(n) for n in names}
    for case, feeds in cases:
        try:
            ref = ref_sess.run(None, feeds)
        except Exception as e:
            raise ConversionError(f"stock onnxruntime fails on the original model with {case}: {_one_line(e)}") from None
        try:
            out = fused_sess.run(None, feeds)
        except Exception as e:
            raise ValidationError(f"the fused model fails with {case}: {_one_line(e)}") from None
        for n, a, b in zip(names, out, ref):
            _compare(n, np.asarray(a), np.asarray(b), case, errs[n])
    report.outputs = list(errs.values())
    for e in report.outputs:
        if e.exact:
            if e.mismatches:
                report.warnings.append(f"output '{e.name}' (not floating point) differs in {e.mismatches} "
                                       "element(s) from stock ORT (near-ties of the fused values)")
        elif not e.within(tol):
            what = (f"relative L2 error {e.rel_l2:.3g}" if e.reference_nonzero
                    else f"max abs error {e.max_abs:.3g} (the reference is all zeros)")
            report.failures.append(f"output '{e.name}': {what} exceeds the tolerance {tol:g} "
                                   f"({provider}, {e.worst_case})")

    if precision == "fp16" and chains:
        say("checking fp16 range of the chains' intermediate tensors")
        try:
            report.max_activation = _max_activations(original_model, list(chains), cases)
        except Exception as e:  # the check is advisory; the comparison above already ran
            report.warnings.append(f"could not measure the fp16 range of the intermediates: {_one_line(e)}")
        for k, peak in enumerate(report.max_activation):
            if peak > FP16_MAX:
                report.failures.append(f"chain {k}: intermediate values reach {peak:.4g}, beyond the fp16 "
                                       f"maximum {FP16_MAX:g}; use --precision bf16 or fp32")
                report.warnings.append(f"chain {k}: intermediate values reach {peak:.4g} > {FP16_MAX:g} "
                                       "(fp16 overflow); use --precision bf16 or fp32")
            elif peak > FP16_WARN:
                report.warnings.append(f"chain {k}: intermediate values reach {peak:.4g}, more than half the "
                                       f"fp16 maximum {FP16_MAX:g}; consider --precision bf16 or fp32")
    return report


def check(report: ValidationReport) -> None:
    """Raise ValidationError (one line) when the report has failures."""
    if report.failures:
        more = f" (and {len(report.failures) - 1} more)" if len(report.failures) > 1 else ""
        raise ValidationError(f"validation failed: {report.failures[0]}{more}; nothing written "
                              "(pass --force / force=True to write it anyway)")
