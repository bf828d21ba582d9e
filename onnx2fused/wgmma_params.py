"""The wgmma design's template parameters (templates/cuda_wgmma.cu.j2) from a WgmmaPlan, and the symbol of
its mma.sync fallback unit. Every number the template prints is computed here or in the plan: descriptor
words and offsets, the chunk schedule, fragment indices, columns; the template only places them.
"""
from __future__ import annotations

from .cuda_params import act_params, spec_params
from .plan.fused import elem_bytes
from .plan.wgmma import BULK_PIECE, REST_GROUP, ROWS, WgmmaLayer, WgmmaPlan
from .spec import MLPSpec


def fallback_symbol(spec: MLPSpec) -> str:
    """The extern "C" prefix of the mma.sync kernel that a wgmma library runs on GPUs other than 9.0."""
    return f"{spec.name}_mma"


def _schedule(l: WgmmaLayer) -> list[dict]:
    """Chunk c's accumulators live in buffer c % 2. Chunks 0 and 1 are issued first; then, per chunk c:
    wait until at most one group is in flight (c's is done, c+1's may run), its epilogue, and chunk c+2
    issued into the buffer just freed."""
    steps = [{"op": "issue", "chunk": c, "buf": c % 2} for c in range(min(2, l.chunks))]
    for c in range(l.chunks):
        steps.append({"op": "wait", "pending": 1 if c + 1 < l.chunks else 0, "buf": c % 2, "chunk": c})
        steps.append({"op": "epilogue", "chunk": c, "buf": c % 2})
        if c + 2 < l.chunks:
            steps.append({"op": "issue", "chunk": c + 2, "buf": c % 2})
    return steps


def _hidden_block(jj: int, n: int, kt0: int = 0) -> dict:
    """Hidden n8 block jj (columns 8jj..8jj+7 of a layer of n true outputs) as the next layer's A
    registers: k-step jj/2, registers 2*(jj%2) (rows g) and 2*(jj%2)+1 (rows g+8). Hidden padding columns
    are written as zeros (whatever the activation gives at 0: the next layer's padded weights are zeros,
    and 0 * inf would not be): pad "all", "part" or "none". `kt0`: the next layer's k-steps in front of
    them (a skip layer's x, plan.wgmma SKIP)."""
    col = 8 * jj
    return {"col": col, "pad": "all" if col >= n else "part" if col + 8 > n else "none",
            "kt": kt0 + jj // 2, "reg": 2 * (jj % 2), "reg_hi": 2 * (jj % 2) + 1}


def _blocks(l: WgmmaLayer, c: int, last: bool, kt0: int = 0) -> list[dict]:
    """The n8 blocks of chunk c: accumulators d[4j..4j+3] hold (row g, col, col+1) and (row g+8, col,
    col+1), col = the block's first column + 2*(lane%4); a hidden layer's block jj is _hidden_block(jj).
    A last layer's blocks past the true width are left out."""
    out = []
    for j in range(l.nc // 8):
        jj = c * (l.nc // 8) + j
        if last and 8 * jj >= l.n:
            continue
        out.append({**_hidden_block(jj, l.n, kt0), "d": [4 * j, 4 * j + 1, 4 * j + 2, 4 * j + 3], "j": j})
    return out


def _quads(l: WgmmaLayer, c: int) -> list[dict]:
    """A last layer's chunk c in quads (QUAD_STORES: the packed columns permuted within each 16, o2f_wgmma_pack's
    wgmma_source_column): n8 blocks j0 = 2m and j0 + 1 give a thread outputs col + 4t .. col + 4t + 3 of its
    rows g (accumulators d[4 j0], d[4 j0 + 1], d[4 j0 + 4], d[4 j0 + 5]) and g + 8 (the next of each pair);
    col is also the quad's first packed column (the bias's index: the permutation stays within the 16).
    Quads past the true width are left out; `partial`: the quad's 16 columns run past it (stores check)."""
    out = []
    for m in range(l.nc // 16):
        col, j0 = c * l.nc + 16 * m, 2 * m
        if col >= l.n:
            continue
        out.append({"col": col, "j0": j0, "partial": col + 16 > l.n, "rows": [
            {"hi": hi, "d": [4 * j0 + 2 * hi, 4 * j0 + 2 * hi + 1, 4 * j0 + 4 + 2 * hi, 4 * j0 + 5 + 2 * hi]}
            for hi in (0, 1)]})
    return out


def _gated_blocks(l: WgmmaLayer, c: int) -> list[dict]:
    """The gate/up pairs of a gated layer's chunk c: interleaved n8 blocks 2m (gate) and 2m + 1 (up) of the
    chunk hold hidden n8 block jj (its columns col..col+7) for rows g and g+8 in the same thread:
    h = act(gate + bias) * (up + bias), written as _hidden_block(jj), as a plain block jj would be."""
    out = []
    for m in range(l.nc // 16):
        b = c * (l.nc // 8) + 2 * m          # the gate block's index among the layer's interleaved blocks
        out.append({**_hidden_block(b // 2, l.n), "gcol": 8 * b, "ucol": 8 * b + 8,
                    "g": [8 * m + i for i in range(4)], "u": [8 * m + 4 + i for i in range(4)]})
    return out


def _layer_params(plan: WgmmaPlan) -> list[dict]:
    out = []
    n = len(plan.layers)
    parts, issued = plan.input_parts, 0
    for l in plan.layers:
        last = l.index == n - 1
        kt0 = plan.spec.skip_part(l.index + 1) // 16   # the next layer's x k-steps (a skip layer's)
        chunks = []
        for c in range(l.chunks):
            # streamed: a chunk's k-steps are relative to the ring slot it was copied into (the kernel adds
            # the slot's address); resident: to the shared-memory base
            start = 0 if plan.streamed else l.offset + c * l.chunk_bytes
            chunks.append({
                "index": c,
                "col0": c * l.nc,   # the chunk's first output column (a pooled last layer's pool_chunk)
                # descriptor low word = lo0 + (shared offset >> 4); scale-d 0 on the first k-step (no bias:
                # the epilogue adds it), 1 after
                "ksteps": [{"ks": ks, "lo": (start + l.kstep_offset(ks)) >> 4, "scale": int(ks > 0)}
                           for ks in range(l.k_steps)],
                "blocks": _gated_blocks(l, c) if l.gated else _blocks(l, c, last, kt0),
                "quads": _quads(l, c) if last and plan.quad_stores else [],
            })
        steps = _schedule(l)
        for st in steps:   # a gated layer's chunk c >= 2 waits for chunk c-2's epilogue (the template's issue)
            st["dep"] = ""
            if l.gated and st["op"] == "issue" and st["chunk"] >= 2:
                regs = [f"a{l.index + 1}[{b['kt']}][{b[r]}]" for b in chunks[st["chunk"] - 2]["blocks"]
                        if b["pad"] != "all" for r in ("reg", "reg_hi")]
                st["dep"] = f"({' ^ '.join(regs)})" if regs else ""
        for st in steps:   # the first input_parts issues of a pass each copy a share of the next tile's rows
            st["part"] = None
            if st["op"] == "issue" and parts > 1 and issued < parts:
                st["part"] = (ROWS * issued // parts, ROWS * (issued + 1) // parts)
            issued += st["op"] == "issue"
        out.append({
            "index": l.index, "k": l.k, "n": l.n, "kp": l.kp, "np": l.np_, "nc": l.nc, "acc": l.nc // 2,
            "chunks": chunks, "n_chunks": l.chunks, "atom": l.atom, "desc_hi": f"0x{l.desc_hi:08X}u",
            "k_steps": l.k_steps, "next_k_steps": kt0 + l.hidden // 16, "skip_steps": kt0, "offset": l.offset, "chunk_bytes": l.chunk_bytes,
            "gated": l.gated, "quads": last and plan.quad_stores,
            "bias_offset": l.bias_offset, "last": last, "next": l.index + 1, "steps": steps,
            "bias16": plan.bias16 and l.index in plan.spec.packed_layers,   # (hidden, not gated, packed)
        })
    return out


def wgmma_params(plan: WgmmaPlan) -> dict:
    spec = plan.spec
    params = spec_params(spec)
    pieces = [{"offset": o, "bytes": min(BULK_PIECE, plan.image_bytes - o)}
              for o in range(0, plan.image_bytes, BULK_PIECE)]
    params.update({
        "plan_text": plan.describe(),
        "layers": _layer_params(plan),
        # padded columns run the activation too
        "acts": act_params(spec, [l.np_ for l in plan.layers], prescaled=plan.prescale),
        "nwg": plan.nwg, "threads": plan.threads, "prefetch": plan.prefetch,
        "prefetch_regs": max(plan.prefetch, 1),
        "rest_steps": plan.layers[0].k_steps - plan.prefetch,   # k-steps of the input loaded per tile
        # ... in groups of at most REST_GROUP (a wide first layer's row would take every register at once)
        "rest_groups": [(k, min(k + REST_GROUP, plan.layers[0].k_steps))
                        for k in range(plan.prefetch, plan.layers[0].k_steps, REST_GROUP)],
        "k0": spec.layers[0].in_features, "k_steps0": plan.layers[0].k_steps, "n_out": spec.layers[-1].out_features,
        "image_bytes": plan.image_bytes, "bias_floats": plan.bias_floats, "smem_bytes": plan.smem_bytes,
        "bias_smem_offset": plan.smem.bias_offset, "bar_smem_offset": plan.smem.bar_offset,
        "pieces": pieces,
        "streamed": plan.streamed, "stages": plan.stages, "slot_bytes": plan.slot_bytes, "cluster": plan.cluster,
        "cnt_smem_offset": plan.smem.cnt_offset, "peer_bar_smem_offset": plan.smem.peer_bar_offset,
        "staged": plan.staged_input, "in_smem_offset": plan.smem.input_offset,
        "staged_col0": 16 * plan.prefetch, "staged_cols": plan.staged_cols,
        "store_rows": plan.store_rows,
        "bias16": plan.bias16, "bias16_smem_offset": plan.smem.bias16_offset,
        # a block's norm parameters: the fallback's packed bias array holds them (its pack runs first)
        "norm_params_bytes": (plan.fallback.weight_elems * elem_bytes(spec) + 4 * plan.fallback.norm_offset
                              if spec.norm is not None else 0),
        # ... copied by the pack after the layers' bias in the wgmma bias array (scale, then bias, kp floats
        # each), which the kernel holds in shared memory
        "norm_at": sum(l.np_ for l in plan.layers), "norm_kp": plan.layers[0].kp,
        "bias_halves": plan.bias_halves,
        "bulk_input": plan.bulk_input, "in_bar_smem_offset": plan.smem.input_bar_offset,
        "in_row_bytes": plan.input_row_bytes, "input_parts": plan.input_parts,
        # staged tiles a warpgroup has; two: the residual reads x from the tile (o2f_wgmma_norm.cuh)
        "in_buffers": plan.in_buffers, "residual_smem": plan.in_buffers > 1,
        # ... else from global memory: a chunk's values loaded ahead of its stores (plan.wgmma
        # RESIDUAL_AHEAD_ROOMY), or each store's own in its arguments
        "residual_ahead": plan.residual_ahead,
        "ring_chunks": sum(l.chunks for l in plan.layers),
        "image_offset": plan.image_offset, "bias_offset": plan.bias_offset,
        "workspace_bytes": plan.workspace_bytes, "fallback_bytes": plan.fallback_bytes,
        "fallback": fallback_symbol(spec), "fallback_design": plan.fallback.design,
        # the source weight's columns (a gated layer's: gate then up, 2n) and, gated, the hidden width
        "pack_layers": [{"index": l.index, "k": l.k, "n": 2 * l.n if l.gated else l.n, "kp": l.kp, "np": l.np_,
                         "nc": l.nc, "atom": l.atom, "gated": l.n if l.gated else 0,
                         "quads": int(l.index == len(plan.layers) - 1 and plan.quad_stores),
                         "offset": l.offset, "chunk_bytes": l.chunk_bytes, "bias_offset": l.bias_offset,
                         "elems": l.np_ * l.kp, "scale": f"{plan.weight_scale(l.index)!r}f"}
                        for l in plan.layers],
    })
    return params
