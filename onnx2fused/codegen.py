"""Render the C++/CUDA sources of a plugin library from the specs and their plans: a pure function of
its arguments (planning happens before: plan/choose.py).

    render(specs, with_cuda, cpu_enabled, plans) -> {filename: text}
      <name>_cpu.cc   per spec   templates/cpu_kernel.cc.j2   (S_cpu)
      <name>_cuda.cu  per spec   the template of the plan's design (S_cuda_*; when with_cuda)
      o2f_inst_*.cu   per CUTLASS kernel instance a wide plan runs (templates/cuda_wide_instance.cu.j2,
                      wide_params.wide_instances: no chain in its text, shared by every chain that runs it)
      registry.cc                templates/registry.cc.j2     (the KernelEntry table ort_plugin registers)

Templates hold placeholders and simple loops only; every number and string is computed here and passed
as one flat dict, under jinja2's StrictUndefined, so a missing key is an error, never empty text.
Identifiers in the generated code come from `MLPSpec.name` (already a C identifier), never from model
strings.
"""
from __future__ import annotations

import re
from functools import lru_cache

import jinja2

from . import expr as ex
from ._version import __version__
from .block_params import c_float
from .cuda_params import fp32_params, fused_params
from .errors import ConversionError
from .plan.protocol import Plan
from .resources import templates_dir
from .spec import MLPSpec
from .wgmma_params import fallback_symbol, wgmma_params
from .wide_params import FFN_TEMPLATE, ffn_unit, tail_symbol, wide_instances, wide_params

CPU_TEMPLATE = "cpu_kernel.cc.j2"
REGISTRY_TEMPLATE = "registry.cc.j2"
# the CUDA template of each design (a wide plan's tuning build: WIDE_TUNE_TEMPLATE)
CUDA_TEMPLATES = {"resident": "cuda_resident.cu.j2", "streamed": "cuda_streamed.cu.j2", "fp32": "cuda_fp32.cu.j2",
                  "wide": "cuda_wide.cu.j2", "wgmma": "cuda_wgmma.cu.j2"}
WIDE_TUNE_TEMPLATE = "cuda_wide_tune.cu.j2"
_HEADER_INCLUDE = re.compile(r'^#include "(o2f_\w+\.cuh)"', re.M)   # (a comment may follow)

# CPU micro-kernel shapes: rows x vectors of accumulators (AVX2: 16 ymm, AVX-512: 32 zmm registers).
MR_AVX2, NV_AVX2 = 6, 2
MR_AVX512, NV_AVX512 = 8, 2
ROW_QUANTUM = 24                # the row block is a multiple of both micro-kernel row counts
BLOCK_BUDGET_BYTES = 96 * 1024  # the two activation buffers of a row block: about L2-resident
MAX_ROW_BLOCK = 192
TASK_BLOCKS = 2                 # row blocks per ORT ParallelFor task

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@lru_cache(maxsize=None)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def _render(template: str, params: dict) -> str:
    try:
        return _env().get_template(template).render(**params)
    except jinja2.TemplateNotFound as e:
        raise ConversionError(f"template {template} is missing from {templates_dir()}") from e


def c_string(text: str) -> str:
    """A C string literal holding `text` (ASCII; anything else octal-escaped)."""
    out = []
    for ch in text.encode("utf-8"):
        c = chr(ch)
        if c in '"\\':
            out.append("\\" + c)
        elif 32 <= ch < 127 and c != "?":  # '?' avoids trigraphs
            out.append(c)
        else:
            out.append(f"\\{ch:03o}")
    return '"' + "".join(out) + '"'


def _check_name(spec: MLPSpec) -> str:
    name = spec.name
    if not _IDENT.match(name):
        raise ConversionError(f"spec name {name!r} is not a C identifier")
    return name


def row_block(spec: MLPSpec) -> int:
    """Rows of one CPU block: both activation buffers (rows x max width floats) within the budget."""
    per_row = 2 * spec.widest_row * 4
    rows = BLOCK_BUDGET_BYTES // per_row // ROW_QUANTUM * ROW_QUANTUM
    return max(ROW_QUANTUM, min(MAX_ROW_BLOCK, rows))


def _buffers(num_layers: int, skip: tuple[int, ...] = ()) -> list[tuple[str, str]]:
    """(src, dst) of each layer: ping-pong between bufB/bufA; the last layer writes `out_last`. A skip
    layer reads the buffer its [x, h] rows are assembled in: the one the layer before did not write."""
    out, src, dst = [], "in0", "bufB"
    other = {"bufA": "bufB", "bufB": "bufA"}
    for i in range(num_layers):
        if i in skip:
            src = other[src]   # (src is the layer before's dst, never in0 here)
            dst = other[src]
        out.append((src, "out_last" if i == num_layers - 1 else dst))
        src, dst = dst, other[dst]
    return out


def chan_array_params(arrays: dict, size: int) -> list[dict]:
    """The constant arrays of a layer's per-channel constants (`expr.chan_arrays`), `size` entries
    each: only numbers go into the generated code, never a model's names."""
    return [{"name": name, "size": size, "init": ex.c_array_values(c, size)} for c, name in arrays.items()]


def cpu_params(spec: MLPSpec) -> dict:
    name = _check_name(spec)
    n = len(spec.layers)
    bufs = _buffers(n, spec.skip)
    last_src = bufs[-1][0]
    layers = []
    for i, (layer, (src, dst)) in enumerate(zip(spec.layers, bufs)):
        arrays = ex.chan_arrays(layer.activation, f"kChan{i}_")
        layers.append({
            "index": i,
            "k": layer.in_features,
            "n": layer.out_features,
            "bias": "true" if layer.has_bias else "false",
            "kernel": "gated_layer" if layer.gated else "layer",  # gated: n is H, W is [K, 2H]
            "act_c": ex.render_c(layer.activation, "v", col="col", arrays=arrays),
            # The CPU kernel applies the activation to true columns only: arrays of N entries.
            "chans": chan_array_params(arrays, layer.out_features),
            "act_text": ex.to_text(layer.activation).replace("\n", " "),
            "src": src,
            "dst": dst,
            # the skip layer: its rows [x zero-padded to skip_width, the layer before's output] assembled first
            "skip_from": bufs[i - 1][1] if i in spec.skip else "",
        })
    return {
        "version": __version__,
        "name": name,
        "description": spec.describe().replace("\n", " "),
        "prelude": ex.C_PRELUDE.strip("\n"),
        "row_block": row_block(spec),
        "max_width": spec.widest_row,
        "skip_width": spec.skip_width,
        "io_half": "true" if spec.io_dtype == "f16" else "false",
        "io_ctype": "uint16_t" if spec.io_dtype == "f16" else "float",
        "k0": spec.widths[0],
        "n_last": spec.widths[-1],
        "mr_avx2": MR_AVX2, "nv_avx2": NV_AVX2,
        "mr_avx512": MR_AVX512, "nv_avx512": NV_AVX512,
        "last_buffer": "bufA" if last_src == "bufB" else "bufB",
        "any_gated": spec.has_gated,
        "layers": layers,
        # a transformer block (spec.norm, spec.residual): '' / False leave the template's text as before
        "norm": spec.norm.kind if spec.norm is not None else "",
        "norm_eps": c_float(spec.norm.eps) if spec.norm is not None else "",
        "norm_bias": "true" if spec.norm is not None and spec.norm.has_bias else "false",
        "residual": spec.residual,
        # fp16 I/O: ORT runs a model's LayerNormalization with its fp16 kernel, whose output is fp16 (the
        # ops around it are cast to fp32): the kernel rounds the normalised row the same way
        "norm_round_half": spec.io_dtype == "f16" and spec.norm is not None and spec.norm.kind == "layernorm",
    }


def cuda_template(plan: Plan) -> str:
    """The template of the plan's design."""
    return WIDE_TUNE_TEMPLATE if plan.design == "wide" and plan.tuning else CUDA_TEMPLATES[plan.design]


def cuda_params(plan: Plan) -> dict:
    """The parameters of the plan's template (cuda_template)."""
    if plan.design == "wide":
        params = wide_params(plan)
    elif plan.design == "fp32":
        params = fp32_params(plan)
    elif plan.design == "wgmma":
        params = wgmma_params(plan)
    else:
        params = fused_params(plan)
    params["template"] = cuda_template(plan)
    return _common_params(params, plan.spec)


def _common_params(params: dict, spec: MLPSpec) -> dict:
    params.setdefault("version", __version__)
    params.setdefault("name", _check_name(spec))
    params.setdefault("prelude", ex.C_PRELUDE.strip("\n"))
    return params


def cuda_sources(plan: Plan) -> dict[str, str]:
    """The CUDA translation units of one spec: `<name>_cuda.cu`; for a wide plan the CUTLASS kernel
    instances it runs (`o2f_inst_*.cu`, one unit each) and, when segmented, its fused tail
    `<name>_tail_cuda.cu` (the tail's plan under the tail's own symbol); for a wgmma plan its mma.sync
    fallback for the other GPUs, `<name>_mma_cuda.cu` (the fallback plan under its own symbol)."""
    files = {f"{plan.spec.name}_cuda.cu": _render(cuda_template(plan), cuda_params(plan))}
    if plan.design == "wide":
        for file, params in wide_instances(plan).items():
            files[file] = _render(params["template"], params)
        unit = ffn_unit(plan)
        if unit is not None:   # the whole FFN in one kernel on sm_90 (plan/ffn.py)
            files[unit[0]] = _render(FFN_TEMPLATE, unit[1])
    tail = plan.tail if plan.design == "wide" else None
    if tail is not None:
        params = cuda_params(tail)
        params["sym"] = tail_symbol(plan.spec)
        files[f"{params['sym']}_cuda.cu"] = _render(cuda_template(tail), params)
    if plan.design == "wgmma":
        params = cuda_params(plan.fallback)
        params["sym"] = fallback_symbol(plan.spec)
        files[f"{params['sym']}_cuda.cu"] = _render(cuda_template(plan.fallback), params)
    return _with_headers(files)


def _with_headers(files: dict[str, str]) -> dict[str, str]:
    """`files` and the static headers (templates/o2f_*.cuh) they include, by name: a library's sources
    are then complete, and the build keys and compiles them like any other source."""
    out, todo = dict(files), list(files.values())
    while todo:
        for name in _HEADER_INCLUDE.findall(todo.pop()):
            if name not in out:
                path = templates_dir() / name
                try:
                    out[name] = path.read_text()
                except OSError as e:
                    raise ConversionError(f"header {name} is missing from {templates_dir()}") from e
                todo.append(out[name])
    return out


def registry_params(specs: list[MLPSpec], with_cuda: bool, cpu_enabled: dict[str, bool],
                    plans: dict[str, Plan] | None = None) -> dict:
    kernels = []
    for spec in specs:
        name = _check_name(spec)
        has_cpu = cpu_enabled.get(name, True)
        # A kernel whose cuda_run writes scratch regions of the workspace (the wide design): the plugin then
        # orders runs on different streams.
        uses_scratch = int(_plan_of(plans, spec).uses_scratch) if with_cuda else 0
        kernels.append({
            "name": name,
            "num_layers": len(spec.layers),
            "widths": ", ".join(str(w) for w in spec.widths),
            "activations": [c_string(ex.to_text(l.activation)) for l in spec.layers],
            "io_is_half": 1 if spec.io_dtype == "f16" else 0,
            "skip_mask": sum(1 << j for j in spec.skip), "skip_width": spec.skip_width,
            "rows_per_task": row_block(spec) * TASK_BLOCKS,
            "has_cpu": has_cpu,
            "cpu_fn": f"&{name}_cpu" if has_cpu else "nullptr",
            "cuda_workspace_fn": f"&{name}_cuda_workspace_bytes" if with_cuda else "nullptr",
            "cuda_pack_fn": f"&{name}_cuda_pack" if with_cuda else "nullptr",
            "cuda_run_fn": f"&{name}_cuda_run" if with_cuda and spec.pool is None else "nullptr",
            # a pooled spec (spec.pool): its output is [groups, N_last]; 0 leaves the fields out
            "pool": 0 if spec.pool is None else 1 + spec.pool_keeps_axis,   # 2: the pooled axis kept
            "pool_op": spec.pool_code,   # KernelEntry::pool_op
            "cuda_run_pool_fn": f"&{name}_cuda_run_pool" if with_cuda and spec.pool is not None else "nullptr",
            "cuda_uses_scratch": uses_scratch,
            # a gated layer's weight is [K, 2N]: the plugin checks (and feeds the stock body) that shape;
            # '' (plain chains): the registry leaves the field out, so their sources do not change
            "weight_cols": ", ".join(str(l.weight_columns) for l in spec.layers) if spec.has_gated else "",
            # the norm's inputs after the layers' (NS; NS, NB for a layer norm); 0: the field is left out
            "norm_inputs": len(spec.norm.input_names) if spec.norm is not None else 0,
        })
    return {"version": __version__, "with_cuda": with_cuda, "kernels": kernels}


def _plan_of(plans: dict[str, Plan] | None, spec: MLPSpec) -> Plan:
    plan = (plans or {}).get(spec.name)
    if plan is None:
        raise ConversionError(f"no CUDA plan was given for {spec.name}: plan the specs first "
                              "(plan.choose.make_plans) or render with with_cuda=False")
    return plan


def render(specs: list[MLPSpec], with_cuda: bool, cpu_enabled: dict[str, bool] | None = None,
           plans: dict[str, Plan] | None = None) -> dict[str, str]:
    """Sources of one plugin library: {filename: text}. Pure: same arguments, same text.
    `plans`: {spec name: its CUDA plan} (plan.choose.make_plans), needed with CUDA."""
    cpu_enabled = dict(cpu_enabled or {})
    unique: dict[str, MLPSpec] = {}
    for spec in specs:
        unique.setdefault(spec.name, spec)  # equal specs share one kernel
    specs = list(unique.values())
    if not specs:
        raise ConversionError("nothing to build: no fused MLP specs were given")
    files: dict[str, str] = {}
    for spec in specs:
        if cpu_enabled.get(spec.name, True):
            files[f"{spec.name}_cpu.cc"] = _render(CPU_TEMPLATE, cpu_params(spec))
        if with_cuda:
            for file, text in cuda_sources(_plan_of(plans, spec)).items():
                # shared files (headers, kernel instances) are one text whichever spec renders them
                if files.setdefault(file, text) != text:
                    raise ConversionError(f"two chains render different texts for {file}")
    files["registry.cc"] = _render(REGISTRY_TEMPLATE, registry_params(specs, with_cuda, cpu_enabled, plans))
    return files
