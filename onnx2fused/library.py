"""The plugin library of some specs: plans (with this GPU's tuned wide kernels) -> sources -> compile.

    build_plugin(specs) -> build.BuiltLibrary (with .plans)

The one place that puts the three steps together, for convert, the kernel search's tuning libraries
(wide_tune.py), the tests and the benchmarks: plan.choose plans (unless given), wide_tune.resolve gives
the wide plans the kernel choices cached for this GPU (with `tune`, a fresh search where none is cached),
codegen.render writes the sources, build.compile compiles them.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from . import build, targets, wide_tune
from .codegen import render
from .errors import ConversionError
from .cpu_policy import stock_faster
from .passes import FusionPlan, Refusal, block_key, find_chains
from .passes.batchnorm import find_batchnorms
from .passes.constants import GraphIndex, node_keys
from .passes.pointwise_conv import as_channels_last
from .passes.skip_merge import join_key
from .plan.choose import block_refused, make_plan, make_plans, skip_refused
from .plan.options import PlanOptions
from .spec import BLOCK_NO_CUDA, GATED_NO_CUDA, SKIP_NO_CUDA, SKIP_SLOWER, SpecError


def resolve_with_cuda(with_cuda: bool | None) -> bool:
    """None: CUDA kernels when nvcc is found."""
    nvcc = targets.find_nvcc()
    if with_cuda and not nvcc:
        raise ConversionError("CUDA kernels need nvcc: put it on PATH or set CUDA_HOME, or build with with_cuda=False")
    return nvcc is not None if with_cuda is None else with_cuda


def gated_refusal(with_cuda: bool, chains=(), options: PlanOptions | None = None) -> str | None:
    """Whether a library fuses gated layers (SwiGLU/GeGLU, passes/gated.py): None, it does; else why not,
    as `passes.find_chains(model, gated_refused=...)` takes it. The one place this is decided.

    The CPU kernel, the fused CUDA kernels (resident, streamed: plan/fused.py) and the wide design (a GEMM
    of gate and up columns and a glu pass: plan/wide.py) compute gated layers. A library with CUDA
    kernels must not hold a gated chain that no CUDA design can plan: it would have no CUDA kernel, and the
    whole block would run on the CPU EP inside a CUDA session. `chains`: the chains found with gated
    layers fused (passes.Chain); each gated one is planned at fp16, where every chain starts (a precision
    further up the ladder that has no plan is skipped: convert.plannable; fp32 always plans), and where
    one has no plan (no CUTLASS headers for the wide design, and too large for the fused kernels) the
    model's gated layers are split, as before issue 16 (its linear layers fuse on their own)."""
    if not with_cuda:
        return None
    options = options or PlanOptions.from_env()
    for chain in chains:
        spec = chain.to_spec("fp16")
        if not spec.has_gated:
            continue
        try:
            make_plan(spec, options)
        except (SpecError, ConversionError) as e:
            return GATED_NO_CUDA.format(why=str(e))
    return None


def block_refusal(with_cuda: bool, chains=(), options: PlanOptions | None = None) -> dict[int, str]:
    """Which chains keep a transformer block's norm in front and residual Add behind (passes/block.py) as
    stock ops: {passes.block_key(chain): reason} ({} where the library fuses every one), as
    `passes.find_chains(model, block_refused=...)` takes it. The one place this is decided.

    The CPU kernel and the fused CUDA kernels (resident, streamed, fp32: a norm prologue as the input rows
    are loaded, the residual in the last layer's epilogue) compute them; the wide and wgmma designs do not.
    A library with CUDA kernels keeps them stock for a chain (`chains`: found with blocks fused) where no
    fused kernel plans it with them at tf32, or where its layers go to the wide design and stay there
    (768 -> 3072 -> 768: the CUTLASS GEMMs with the norm and the Add as stock passes beat one streamed
    kernel): plan.choose.block_refused decides. Its layers then fuse as before; one fused op without a
    CUDA kernel would run on the CPU EP inside a CUDA session."""
    if not with_cuda:
        return {}
    options = options or PlanOptions.from_env()
    refused = {}
    for chain in chains:
        spec = chain.to_spec("tf32")
        if not spec.has_block:
            continue
        why = block_refused(spec, options)
        if why is not None:
            # find_block fills in {what} (the norm or the residual); the reason's own braces are text
            refused[block_key(chain)] = BLOCK_NO_CUDA.format(what="{what}", why=why.replace("{", "{{").replace("}", "}}"))
    return refused


def skip_refusal(with_cuda: bool, chains=(), options: PlanOptions | None = None) -> dict[int, str]:
    """Which chains end at their skip Concat (passes/skip.py): {passes.block_key(chain): reason} ({} where
    the library fuses every one), as `passes.find_chains(model, skip_refused=...)` takes it. The CPU
    kernel, the fp32 CUDA kernel, the resident and streamed mma.sync kernels and the wgmma kernel run a
    skip (not the wide design); a library with CUDA kernels splits a chain at its skip where none of them
    plans it at fp16, or where the split's parts in the wide design beat the joined streamed kernel
    (plan.choose.skip_refused); the chains before and after then fuse on their own."""
    if not with_cuda:
        return {}
    options = options or PlanOptions.from_env()
    refused = {}
    for chain in chains:
        spec = chain.to_spec("fp16")
        if not spec.skip:
            continue
        # a joined chain (skip_merge.py) refused: the join goes, its first chain keeps its own skips
        key = join_key(block_key(chain)) if chain.joined else block_key(chain)
        try:
            why = skip_refused(spec, options)
        except (SpecError, ConversionError) as e:
            refused[key] = SKIP_NO_CUDA.format(why=str(e))
            continue
        if why is not None:
            refused[key] = SKIP_SLOWER.format(why=why)
    return refused


def pool_refusal(with_cuda: bool, chains=(), options: PlanOptions | None = None) -> dict[int, str]:
    """Which chains leave the pool behind them a stock op (passes/pool.py): {block_key(chain): reason}.
    The CPU kernel (the plugin pools its rows), the resident, streamed and wgmma kernels and the fp32 CUDA
    kernel pool; the wide design does not, so a library with CUDA kernels keeps the pool apart where no
    fused kernel plans the chain at fp16."""
    if not with_cuda:
        return {}
    options = options or PlanOptions.from_env()
    refused = {}
    for chain in chains:
        if not chain.pool:
            continue
        try:
            make_plan(chain.to_spec("fp16"), options)
        except (SpecError, ConversionError) as e:
            refused[block_key(chain)] = f"no CUDA kernel takes the chain with its pool ({e}); CPU-only libraries fuse it"
    return refused


def fusion_refusals(with_cuda: bool, chains=(), options: PlanOptions | None = None) -> dict:
    """What a library with or without CUDA kernels cannot fuse, as find_chains' keyword arguments:
    `find_chains(model, **fusion_refusals(with_cuda, chains))`. `chains`: those found with everything
    fused (gated_refusal and block_refusal plan them; none given: nothing is refused). `find_fusions`
    does both steps."""
    return {"gated_refused": gated_refusal(with_cuda, chains, options),
            "block_refused": block_refusal(with_cuda, chains, options),
            "skip_refused": skip_refusal(with_cuda, chains, options),
            "pool_refused": pool_refusal(with_cuda, chains, options)}


def stock_where_faster(plan: FusionPlan, model=None) -> FusionPlan:
    """A CPU-only library's chains with only those whose fused CPU kernel beats stock ORT (cpu_policy); the
    others stay the model's own stock nodes, refused with the reason. As fused nodes they would run their
    stock body inside the node, a little slower than stock itself (ViT-tiny, one thread: 0.90-0.96x stock
    with them fused: the inner runs, and ORT's graph fusions stop at the node). `model`: to list the
    refusals in graph order."""
    keep, new_index, left = [], {}, []
    for k, chain in enumerate(plan.chains):
        why = stock_faster(chain.to_spec("fp32"))
        if why is None:
            new_index[k] = len(keep)
            keep.append(chain)
        else:
            left.append(Refusal(chain.nodes[0], f"{chain.describe()}: left as stock ops, faster on the CPU "
                                                f"({why}; --stock-where-faster)"))
    # the notes on where chains start and end: those of the chains kept, renumbered; a chain left has none
    notes = [r if r.chain < 0 else r.renumbered(new_index[r.chain]) for r in plan.refusals
             if r.chain < 0 or r.chain in new_index]
    refusals = notes + left
    if model is not None:   # in graph order, as find_chains lists them
        order = {k: i for i, k in enumerate(node_keys(model.graph))}
        refusals.sort(key=lambda r: order.get(r.node, len(order)))
    return FusionPlan(keep, refusals)


def find_fusions(model, with_cuda: bool, options: PlanOptions | None = None, stock_faster: bool = False):
    """`passes.find_chains` with what this library fuses (convert, inspect). With CUDA kernels: the
    chains found with everything fused, then found again while refusals grow: the blocks no fused kernel
    takes first (block_refusal; their layers alone may then plan), then, where one of the gated chains
    has no plan, the gated layers split (gated_refusal). Refusals only grow, so this ends. Without CUDA
    kernels and with `stock_faster`, the chains whose CPU kernel would lose stay stock (stock_where_faster)."""
    plan = find_chains(model)
    if not with_cuda:
        return stock_where_faster(plan, model) if stock_faster else plan
    options = options or PlanOptions.from_env()
    blocks: dict[int, str] = {}
    skips: dict[int, str] = {}
    pools: dict[int, str] = {}
    gated = None

    def again():
        return find_chains(model, gated_refused=gated, block_refused=blocks, skip_refused=skips, pool_refused=pools)
    while True:
        more_skips = {k: v for k, v in skip_refusal(True, plan.chains, options).items() if k not in skips}
        if more_skips:
            skips.update(more_skips)
            plan = again()
            continue
        more_pools = {k: v for k, v in pool_refusal(True, plan.chains, options).items() if k not in pools}
        if more_pools:
            pools.update(more_pools)
            plan = again()
            continue
        more = {k: v for k, v in block_refusal(True, plan.chains, options).items() if k not in blocks}
        if not more and gated is None and any(c.to_spec("tf32").has_gated for c in plan.chains):
            gated = gated_refusal(True, plan.chains, options)
            if gated is None:
                break
        elif not more:
            break
        blocks.update(more)
        plan = again()
    # the BatchNorms on rank-2 rows no chain took, as Mul + Add where the model is fused at all
    if plan.chains and any(n.op_type == "BatchNormalization" for n in model.graph.node):
        plan.batchnorms = find_batchnorms(GraphIndex(model), {k for c in plan.chains for k in c.nodes})
    return plan


def fusion_plan(model, with_cuda: bool, options: PlanOptions | None = None, stock_faster: bool = False):
    """(the model convert rewrites, its find_fusions plan). The model is `model` with its pointwise Conv
    runs over channels-last rows (passes/pointwise_conv.py) where a chain takes one of them; otherwise
    `model` itself, so that Convs nothing fuses stay as they were."""
    layout = as_channels_last(model)
    refusals = [Refusal(key, reason) for key, reason in layout.refusals]
    if layout.rewritten:
        plan = find_fusions(layout.model, with_cuda, options, stock_faster)
        new_nodes = set(node_keys(layout.model.graph)) - set(node_keys(model.graph))
        if any(k in new_nodes for c in plan.chains for k in c.nodes):
            plan.channels_last = layout.rewritten
            plan.refusals = refusals + plan.refusals
            return layout.model, plan
    plan = find_fusions(model, with_cuda, options, stock_faster)
    plan.refusals = refusals + plan.refusals
    return model, plan


def build_plugin(specs, with_cuda: bool | None = None, cache_dir=None, cpu_enabled=None,
                 progress: Callable[[str], None] | None = None, plans: dict | None = None,
                 tune: bool = False) -> build.BuiltLibrary:
    """Build (or find in the cache) the plugin library of `specs`. `plans`: {spec name: CUDA plan}
    (plan.choose.make_plans); None: planned here with the environment's options."""
    say = progress or (lambda msg: None)
    with_cuda = resolve_with_cuda(with_cuda)
    cache = build.cache_folder(cache_dir)
    plans = dict(plans or {})
    if with_cuda:
        if not plans:
            plans = make_plans(specs, PlanOptions.from_env())

        def build_tuning(tune_specs, **kw):
            return build_plugin(tune_specs, with_cuda=True, cache_dir=cache, progress=say, **kw)
        plans = wide_tune.resolve(plans, cache, build_tuning, say, tune=tune)
    sources = render(list(specs), with_cuda, cpu_enabled, plans)
    return replace(build.compile(sources, with_cuda, cache, say), plans=plans)
