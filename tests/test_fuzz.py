"""Fuzz `onnx2fused convert` and `inspect` with mutated zoo models.

Every run must end in a correct conversion or a clean error: exit 2 with exactly one stderr line
`onnx2fused: error: ...`, never exit 1 (an internal error), a crash, a hang, or a partial output file.
Each case is reproducible from its seed: the failure message names it, and ONNX2FUSED_FUZZ_SEED=<seed>
reruns that one case alone.

Cases are seeded and cheap: most run `inspect` in-process (cli.main with argv), a subset runs
`convert --cpu-only --quiet` (validated; a few with --no-validate), a few run the real command in a
subprocess so that a native crash shows as a signal instead of killing pytest. ONNX2FUSED_FUZZ_CASES=N
runs N cases per shard instead of the default (CI) number.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, external_data_helper, helper

ort = pytest.importorskip("onnxruntime")

from onnx2fused import cli  # noqa: E402
from onnx2fused.session import InferenceSession  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
# Small zoo models (mnist's 2.7 MB of weights would only slow the byte-level mutations down).
BASES = [f"{n}.{k}.onnx" for n in ("nerf", "sdf", "gelu", "silu", "nobias", "ffn3d") for k in ("opset17", "dynamo")]
# convert runs use the models whose kernels are pre-built once per session (a new spec costs a compile)
CONVERT_BASES = ["nerf.opset17.onnx", "nerf.dynamo.onnx", "nobias.opset17.onnx", "nobias.dynamo.onnx"]
SHARDS = 8
CASES_PER_SHARD = int(os.environ.get("ONNX2FUSED_FUZZ_CASES", "300"))
CONVERT_EVERY = 25         # one case in 25 also runs convert
SUBPROCESS_EVERY = 300     # one case in 300 also runs the real command in a subprocess
NEW_SPEC_BUDGET = 2        # compiles of kernels not pre-built, in shard 0 only (each costs seconds)
CASE_TIMEOUT_S = 60
# Seeds that once crashed onnx2fused (each a fixed bug), run in every session whatever the case count:
# corrupt external-data keys/offsets/locations (loader), Gelu `approximate` bytes that are not UTF-8.
REGRESSION_SEEDS = [67, 433, 657, 923, 1256, 3667, 5233, 5000112, 5000183, 8000260]


class Hang(BaseException):
    """Raised by the alarm: a BaseException, so that the CLI's `except Exception` cannot swallow it."""


# ------------------------------------------------------------------------------------------ mutations
@dataclass
class Mutant:
    """A mutated model file (bytes) and, for external-data models, the data file's bytes."""
    model: bytes
    data: dict[str, bytes]
    what: str


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _truncate(rng, m, raw, data):
    return raw[: int(rng.integers(0, len(raw)))], data, "truncate"


def _flip_bytes(rng, m, raw, data):
    b = bytearray(raw)
    # the graph structure (nodes, value infos) is serialised before the initializers: aim there half the time
    span = len(b) if rng.random() < 0.5 else min(len(b), 4096)
    for _ in range(int(rng.integers(1, 9))):
        b[int(rng.integers(span))] ^= int(rng.integers(1, 256))
    return bytes(b), data, "flip bytes"


def _splice(rng, m, raw, data):
    a, c = sorted(int(v) for v in rng.integers(0, len(raw), 2))
    at = int(rng.integers(len(raw)))
    return raw[:at] + raw[a:c] + raw[at:], data, "splice"


def _tensors(m):
    return list(m.graph.initializer) + [a.t for n in m.graph.node for a in n.attribute if a.HasField("t")]


def _init_dims(rng, m):
    ts = _tensors(m)
    if not ts:
        return "no tensor"
    t = _pick(rng, ts)
    if t.dims and rng.random() < 0.7:
        k = int(rng.integers(len(t.dims)))
        t.dims[k] = int(_pick(rng, [0, 1, t.dims[k] + 1, t.dims[k] - 1, 2**31, -3]))
    elif t.dims and rng.random() < 0.5:
        t.dims.pop()
    else:
        t.dims.append(int(_pick(rng, [1, 2, 0])))
    return f"dims of {t.name}"


def _io_dims(rng, m):
    vi = _pick(rng, list(m.graph.input) + list(m.graph.output))
    shape = vi.type.tensor_type.shape
    r = rng.random()
    if r < 0.25:
        vi.type.tensor_type.ClearField("shape")
    elif r < 0.5 and shape.dim:
        shape.dim.pop()
    elif r < 0.7:
        shape.dim.add().dim_value = int(_pick(rng, [1, 3]))
    elif shape.dim:
        d = shape.dim[int(rng.integers(len(shape.dim)))]
        if rng.random() < 0.5:
            d.dim_value = int(_pick(rng, [0, 1, 7, 33, 2**40]))
        else:
            d.dim_param = _pick(rng, ["N", "", "batch size"])
    return f"shape of {vi.name}"


DTYPES = [TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.INT64, TensorProto.INT8,
          TensorProto.STRING, TensorProto.BOOL, TensorProto.UNDEFINED, 99]


def _dtypes(rng, m):
    if rng.random() < 0.5 and _tensors(m):
        t = _pick(rng, _tensors(m))
        t.data_type = int(_pick(rng, DTYPES))
        return f"dtype of {t.name}"
    vi = _pick(rng, list(m.graph.input) + list(m.graph.output) + list(m.graph.value_info) or list(m.graph.input))
    vi.type.tensor_type.elem_type = int(_pick(rng, DTYPES))
    return f"dtype of {vi.name}"


def _attributes(rng, m):
    nodes = list(m.graph.node)
    n = _pick(rng, nodes)
    r = rng.random()
    if n.attribute and r < 0.4:
        a = _pick(rng, list(n.attribute))
        if a.type == onnx.AttributeProto.INT:
            a.i = int(_pick(rng, [0, 1, 2, -1, 2**40]))
        elif a.type == onnx.AttributeProto.FLOAT:
            a.f = float(_pick(rng, [0.0, -1.0, float("nan"), float("inf"), 1e30]))
        elif a.type == onnx.AttributeProto.STRING:
            a.s = _pick(rng, [b"", b"tanh", b"none", b"\xff\xfe"])
        else:
            a.type = onnx.AttributeProto.INT
        return f"attribute {a.name} of {n.op_type}"
    if n.attribute and r < 0.6:
        n.attribute.pop(int(rng.integers(len(n.attribute))))
        return f"drop an attribute of {n.op_type}"
    if r < 0.8:
        n.attribute.append(helper.make_attribute(_pick(rng, ["transA", "transB", "alpha", "beta", "axis", "bogus"]),
                                                 _pick(rng, [0, 1, 2, 0.5, "x", [1, 2]])))
        return f"add an attribute to {n.op_type}"
    a = _pick(rng, [("transA", 1), ("transB", 0), ("alpha", 2.0), ("beta", 0.0), ("approximate", "tanh")])
    n.attribute.append(helper.make_attribute(*a))
    return f"attribute {a[0]}={a[1]} on {n.op_type}"


def _drop_initializers(rng, m):
    inits = m.graph.initializer
    if not inits:
        return "no initializer"
    for _ in range(int(rng.integers(1, 3))):
        if inits:
            inits.pop(int(rng.integers(len(inits))))
    return "drop initializers"


def _opset(rng, m):
    r = rng.random()
    if r < 0.7:
        for o in m.opset_import:
            if o.domain in ("", "ai.onnx"):
                o.version = int(_pick(rng, [1, 5, 6, 7, 9, 11, 13, 20, 21, 26, 27, 99, 2**40]))
        return "opset version"
    if r < 0.85:
        del m.opset_import[:]
        m.opset_import.append(helper.make_opsetid("ai.onnx.ml", 3))
        return "no default opset"
    m.ir_version = int(_pick(rng, [0, 1, 2, 3, 4, 7, 10, 13, 14, 99]))
    return "ir version"


OPS = ["Relu", "Tanh", "Sigmoid", "Gemm", "MatMul", "Add", "Mul", "Gelu", "Erf", "Softmax", "Identity", "NoSuchOp",
       "Elu", "LeakyRelu", "HardSwish", "Mish", "Softplus", "Div", "Transpose", "Reshape",
       # issue 14: ops that fuse now (CastLike reads only its second input's type) or end a chain with a reason
       "Shrink", "Swish", "CastLike", "Round", "Sign", "Sinh", "Sum", "LayerNormalization", "Split"]


def _op_types(rng, m):
    n = _pick(rng, list(m.graph.node))
    old = n.op_type
    if rng.random() < 0.85:
        n.op_type = _pick(rng, OPS)
    else:
        n.domain = _pick(rng, ["com.example", "onnx2fused", "com.microsoft"])
    return f"{old} -> {n.op_type} ({n.domain or 'ai.onnx'})"


def _rewire(rng, m):
    nodes = list(m.graph.node)
    names = [t for n in nodes for t in n.output] + [i.name for i in m.graph.input] + \
            [t.name for t in m.graph.initializer] + ["", "missing"]
    n = _pick(rng, nodes)
    r = rng.random()
    if r < 0.4 and n.input:
        n.input[int(rng.integers(len(n.input)))] = _pick(rng, names)
    elif r < 0.6:
        n.input.append(_pick(rng, names))
    elif r < 0.75 and n.input:
        n.input.pop()
    elif r < 0.9:
        m.graph.node.remove(n)
    else:
        n.output[0] = _pick(rng, names)  # a second producer, or a name already used
    return f"rewire {n.op_type}"


def _special_weights(rng, m):
    floats = [t for t in m.graph.initializer
              if t.data_type == TensorProto.FLOAT and t.raw_data and len(t.raw_data) % 4 == 0]
    if not floats:
        return "no inline float weights"
    t = _pick(rng, floats)
    a = np.frombuffer(t.raw_data, np.float32).copy()
    idx = rng.integers(0, a.size, max(1, a.size // int(_pick(rng, [1, 10, 1000]))))
    a[idx] = _pick(rng, [np.nan, np.inf, -np.inf, 1e30, 0.0, 7e4])
    t.raw_data = a.tobytes()
    return f"special values in {t.name}"


def _raw_data(rng, m):
    inline = [t for t in m.graph.initializer if t.raw_data]
    if not inline:
        return "no inline tensor"
    t = _pick(rng, inline)
    cut = int(rng.integers(0, len(t.raw_data)))
    t.raw_data = t.raw_data[:cut] if rng.random() < 0.7 else t.raw_data + b"\0" * 4
    return f"raw_data size of {t.name}"


def _external(rng, m):
    tensors = [t for t in m.graph.initializer if external_data_helper.uses_external_data(t)]
    if not tensors:
        t = _pick(rng, list(m.graph.initializer))
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value=_pick(rng, ["nowhere.bin", "../up.bin", "/etc/hostname"]))
        t.ClearField("raw_data")
        return f"{t.name} points to external data"
    t = _pick(rng, tensors)
    kv = {e.key: e for e in t.external_data}
    r = rng.random()
    if r < 0.4:
        kv["location"].value = _pick(rng, ["../escape.data", "/etc/passwd", "", "missing.data", "sub/dir.data",
                                           "nerf.dynamo.onnx"])
    elif r < 0.8:
        e = kv.get("offset") or t.external_data.add(key="offset", value="0")
        e.value = str(_pick(rng, [-1, 2**40, 3, 10**6]) if rng.random() < 0.8 else "abc")
    else:
        e = kv.get("length") or t.external_data.add(key="length", value="0")
        e.value = str(_pick(rng, [0, 1, 2**40, 4]))
    return f"external data of {t.name}"


def _truncate_data(rng, m, raw, data):
    if not data:
        return _truncate(rng, m, raw, data)
    name = _pick(rng, sorted(data))
    return raw, {**data, name: data[name][: int(rng.integers(0, len(data[name]) + 1))]}, f"truncate {name}"


def _graph_io(rng, m):
    r = rng.random()
    if r < 0.3:
        del m.graph.output[:]
        return "no graph output"
    if r < 0.5:
        m.graph.input.append(m.graph.input[0])
        return "duplicate graph input"
    if r < 0.7:
        m.graph.output.append(helper.make_tensor_value_info(m.graph.node[0].output[0], TensorProto.FLOAT, None))
        return "first node output is also a graph output"
    if r < 0.85:
        del m.graph.node[:]
        return "no nodes"
    m.graph.input[0].name = "renamed"
    return "rename the graph input"


BYTE_MUTATIONS = [_truncate, _flip_bytes, _splice, _truncate_data]
PROTO_MUTATIONS = [_init_dims, _io_dims, _dtypes, _attributes, _drop_initializers, _opset, _op_types, _rewire,
                   _special_weights, _raw_data, _external, _graph_io]


_BASE_CACHE: dict[str, tuple[bytes, dict[str, bytes]]] = {}


def _base(name: str) -> tuple[bytes, dict[str, bytes]]:
    if name not in _BASE_CACHE:
        raw = (MODELS / name).read_bytes()
        data = {p.name: p.read_bytes() for p in MODELS.glob(name + ".data")}
        _BASE_CACHE[name] = (raw, data)
    return _BASE_CACHE[name]


def mutate(seed: int, bases=BASES) -> tuple[str, Mutant]:
    """The seeded mutant: 1 to 3 mutations of one zoo model."""
    rng = np.random.default_rng(seed)
    name = _pick(rng, bases)
    raw, data = _base(name)
    whats = []
    for _ in range(int(_pick(rng, [1, 1, 1, 2, 3]))):
        if rng.random() < 0.3:
            raw, data, what = _pick(rng, BYTE_MUTATIONS)(rng, None, raw, data)
        else:
            m = onnx.ModelProto()
            try:
                m.ParseFromString(raw)
            except Exception:
                whats.append("(unparsable: proto mutation skipped)")
                continue
            if not m.graph.node or not m.graph.input:
                whats.append("(empty graph: proto mutation skipped)")
                continue
            mutation = _pick(rng, PROTO_MUTATIONS)
            try:
                what = mutation(rng, m)
                raw = m.SerializeToString()
            except (ValueError, IndexError, TypeError) as e:  # an earlier mutation broke what this one edits
                what = f"({mutation.__name__} skipped: {type(e).__name__})"
        whats.append(what)
    return name, Mutant(raw, data, "; ".join(whats))


def write_mutant(d: Path, name: str, mut: Mutant) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for fname, blob in mut.data.items():
        (d / fname).write_bytes(blob)
    p = d / name
    p.write_bytes(mut.model)
    return p


# ------------------------------------------------------------------------------------------ running
@dataclass
class Outcome:
    rc: int | None   # None: killed by a signal (the crash is in `err`)
    out: str
    err: str


@contextlib.contextmanager
def _native_stderr_to(f):
    """Send fd 2 to `f` meanwhile: native code (ONNX Runtime's logger) writes there, bypassing sys.stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def run_in_process(argv: list[str]) -> Outcome:
    out, err = io.StringIO(), io.StringIO()

    def on_alarm(signum, frame):
        raise Hang(f"{' '.join(argv)} ran longer than {CASE_TIMEOUT_S} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        with tempfile.TemporaryFile("w+") as native, _native_stderr_to(native), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # argparse
                rc = e.code if isinstance(e.code, int) else 2
            native.seek(0)
            err.write(native.read())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return Outcome(rc, out.getvalue(), err.getvalue())


def run_subprocess(argv: list[str]) -> Outcome:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ONNX2FUSED_DEBUG", None)
    try:
        p = subprocess.run([sys.executable, "-m", "onnx2fused", *argv], env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=CASE_TIMEOUT_S * 3)
    except subprocess.TimeoutExpired:
        raise Hang(f"{' '.join(argv)} ran longer than {CASE_TIMEOUT_S * 3} s") from None
    if p.returncode < 0:
        return Outcome(None, p.stdout, f"killed by signal {-p.returncode}\n{p.stderr}")
    return Outcome(p.returncode, p.stdout, p.stderr)


def clean_error_or_success(o: Outcome) -> str | None:
    """None when `o` is a success (exit 0) or a clean error; else what is wrong."""
    if o.rc == 0:
        return None if o.out.strip() else "exit 0 without a report"
    lines = o.err.splitlines()
    if o.rc != 2:
        return f"exit {o.rc}: {o.err.strip()[-2000:]}"
    if len(lines) != 1 or not lines[0].startswith("onnx2fused: error: "):
        return f"exit 2 but stderr is not one error line: {o.err[-2000:]!r}"
    if o.out:
        return f"exit 2 with a report on stdout: {o.out[:300]!r}"
    return None


def _folder_state(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def check_convert(src: Path, out_dir: Path, o: Outcome, before: dict[str, bytes], validated: bool) -> str | None:
    """The outputs after a convert run: all (model and plugin) or nothing; the inputs unchanged."""
    if problem := clean_error_or_success(o):
        return problem
    if "compiling the plugin failed" in o.err:  # a spec was made, so its generated code must compile
        return f"the generated code does not compile: {o.err.strip()}"
    left = {p.name for p in out_dir.iterdir()}
    if o.rc != 0:
        return f"an error left files behind: {sorted(left)}" if left else None
    now = _folder_state(src.parent)
    if now != before:
        return "the input folder changed"
    model = out_dir / "out.onnx"
    if not model.is_file():
        return f"exit 0 but no output model: {sorted(left)}"
    unexpected = left - {"out.onnx", "out.onnx2fused.so", "out.onnx.data"}
    if unexpected:
        return f"unexpected files next to the output: {sorted(unexpected)}"
    if "nothing fused" in o.out:  # written unchanged: the same bytes, no library
        same = model.read_bytes() == src.read_bytes() or "out.onnx.data" in left
        return None if same and "out.onnx2fused.so" not in left else "nothing fused, yet the model was changed"
    if "out.onnx2fused.so" not in left:
        return "exit 0 without a plugin library although chains were fused"
    if validated:
        return fused_matches_original(src, model)
    return None


def fused_matches_original(src: Path, fused: Path) -> str | None:
    """Run the written fused model (plugin registered) against stock ORT on the mutated original."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    ref = ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
    sess = InferenceSession(str(fused), so, providers=["CPUExecutionProvider"])
    feeds = {}
    rng = np.random.default_rng(0)
    for i in ref.get_inputs():
        shape = [d if isinstance(d, int) and d > 0 else 3 for d in i.shape]
        dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16}.get(i.type)
        if dtype is None:
            return None  # validation generated these inputs already; nothing more to check cheaply
        feeds[i.name] = rng.standard_normal(shape).astype(dtype)
    for a, b in zip(sess.run(None, feeds), ref.run(None, feeds)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            return f"fused output shape {a.shape} != original {b.shape}"
        same = (np.isnan(a) & np.isnan(b)) | (a == b)
        close = np.abs(a - b) <= 1e-3 * (1 + np.abs(b))
        if not np.all(same | close):
            return f"fused output differs from stock ORT by {np.nanmax(np.abs(a - b)):.3g}"
    return None


# ------------------------------------------------------------------------------------------ the tests
@pytest.fixture(scope="session")
def fuzz_cache(tmp_path_factory):
    """A per-session build cache with the kernels of CONVERT_BASES built once."""
    cache = tmp_path_factory.mktemp("o2f-fuzz-cache")
    out = tmp_path_factory.mktemp("o2f-fuzz-warm")
    for name in CONVERT_BASES:
        src = out / name
        shutil.copyfile(MODELS / name, src)
        for data in MODELS.glob(name + ".data"):
            shutil.copyfile(data, out / data.name)
        o = run_in_process(["convert", str(src), "-o", str(out / "w.onnx"), "--cpu-only", "--quiet",
                            "--no-validate", "--cache-dir", str(cache)])
        assert o.rc == 0, o.err
    return cache


class SpecBudget:
    """Lets convert compile only the pre-built kernels plus `new` others (each costs seconds).

    Deterministic whatever the test order: only the warm-up's kernels and this budget's own count."""

    def __init__(self, known: set[str], new: int):
        self.known, self.new = set(known), new

    def allows(self, inspect_out: Outcome) -> bool:
        if inspect_out.rc != 0:
            return True  # convert fails before any build
        try:
            names = {c["name"] for c in json.loads(inspect_out.out)["chains"]}
        except (ValueError, KeyError, TypeError):
            return True
        if names <= self.known:
            return True
        if self.new > 0:
            self.new -= 1
            self.known |= names
            return True
        return False


@pytest.fixture(scope="session")
def prebuilt(fuzz_cache) -> frozenset[str]:
    """The kernels the warm-up built (set up right after it, before any shard adds its own)."""
    return frozenset(p.name[: -len("_cpu.cc")] for p in fuzz_cache.glob("*/sources/*_cpu.cc"))


def _seeds(shard: int) -> list[int]:
    only = os.environ.get("ONNX2FUSED_FUZZ_SEED")
    if only:
        return [int(only)] if shard == 0 else []
    return [1_000_000 * (shard + 1) + k for k in range(CASES_PER_SHARD)]


def run_case(seed: int, d: Path, fuzz_cache: Path, budget: SpecBudget) -> list[str]:
    """Run one seeded case; the problems found (empty: all good)."""
    convert_bases = seed % CONVERT_EVERY == 0
    name, mut = mutate(seed, CONVERT_BASES if convert_bases else BASES)
    case_dir = d / f"case{seed}"
    src = write_mutant(case_dir / "in", name, mut)
    tag = f"seed {seed} ({name}: {mut.what})"
    problems = []
    try:
        ins = run_in_process(["inspect", str(src), "--json"])
        if p := clean_error_or_success(ins):
            problems.append(f"inspect, {tag}: {p}")
        if not convert_bases or not budget.allows(ins):
            return problems
        sub = seed % SUBPROCESS_EVERY == 0
        validated = seed % (CONVERT_EVERY * 4) != 0  # one convert in four skips validation
        out_dir = case_dir / "out"
        out_dir.mkdir()
        before = _folder_state(src.parent)
        argv = ["convert", str(src), "-o", str(out_dir / "out.onnx"), "--cpu-only", "--quiet",
                "--cache-dir", str(fuzz_cache)] + ([] if validated else ["--no-validate"])
        o = run_subprocess(argv) if sub else run_in_process(argv)
        if p := check_convert(src, out_dir, o, before, validated):
            problems.append(f"convert{' (subprocess)' if sub else ''}, {tag}: {p}")
        if sub:
            o = run_subprocess(["inspect", str(src)])
            if p := clean_error_or_success(o):
                problems.append(f"inspect (subprocess), {tag}: {p}")
    finally:
        shutil.rmtree(case_dir, ignore_errors=True)
    return problems


def test_mutations_are_deterministic():
    a, b = mutate(12345), mutate(12345)
    assert a[0] == b[0] and a[1].model == b[1].model and a[1].what == b[1].what
    assert mutate(12346)[1].model != a[1].model or mutate(12346)[0] != a[0]


def test_the_checks_catch_bad_outcomes(tmp_path):
    """The oracle itself: an internal error, a two-line error, a crash and leftovers are all flagged."""
    assert clean_error_or_success(Outcome(0, "report", "")) is None
    assert clean_error_or_success(Outcome(2, "", "onnx2fused: error: bad\n")) is None
    assert clean_error_or_success(Outcome(1, "", "onnx2fused: internal error: KeyError\n"))
    assert clean_error_or_success(Outcome(2, "", "onnx2fused: error: a\nmore\n"))
    assert clean_error_or_success(Outcome(None, "", "killed by signal 11"))
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "out.onnx").write_bytes(b"partial")
    assert "left files behind" in check_convert(tmp_path / "in" / "m.onnx", tmp_path / "out",
                                                Outcome(2, "", "onnx2fused: error: x\n"), {}, True)


def test_a_hang_is_caught(monkeypatch):
    import time
    monkeypatch.setattr(sys.modules[__name__], "CASE_TIMEOUT_S", 1)
    monkeypatch.setattr(cli, "main", lambda argv: time.sleep(30))
    with pytest.raises(Hang):
        run_in_process(["inspect", "x.onnx"])


def test_regression_seeds(tmp_path, fuzz_cache, prebuilt):
    budget = SpecBudget(prebuilt, 0)
    problems = []
    for seed in REGRESSION_SEEDS:
        problems += run_case(seed, tmp_path, fuzz_cache, budget)
    assert not problems, "\n".join(problems)


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo)
    for argv in (["inspect", str(fifo)], ["convert", str(fifo), "--cpu-only", "--quiet"]):
        o = run_in_process(argv)
        assert o.rc == 2 and "not a regular file" in o.err and clean_error_or_success(o) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


@pytest.mark.parametrize("shard", range(SHARDS))
def test_fuzz(shard, tmp_path, fuzz_cache, prebuilt):
    budget = SpecBudget(prebuilt, NEW_SPEC_BUDGET if shard == 0 else 0)
    problems = []
    for seed in _seeds(shard):
        problems += run_case(seed, tmp_path, fuzz_cache, budget)
    assert not problems, f"{len(problems)} problem(s); rerun one with ONNX2FUSED_FUZZ_SEED=<seed>:\n" + \
        "\n".join(problems[:20])
