"""CUDA kernel plans, as data: which design runs a spec and every number its template needs.

    options.py   PlanOptions (frozen; read from the environment once, at the edge), per-design overrides
    protocol.py  Plan: what every plan offers (design, describe, workspace_bytes, uses_scratch)
    fused.py     the fused kernels: resident and streamed (FusedPlan), fp32 on CUDA cores (Fp32Plan)
    wide.py      the wide design: one CUTLASS GEMM per layer (WidePlan)
    sm90.py      the Hopper GEMM kernel catalogue and the per-bucket kernel choices
    wgmma.py     the Hopper fused kernel on warpgroup MMA (WgmmaPlan), with its mma.sync fallback plan
    cost.py      the cost model (rooflines calibrated on an H100)
    choose.py    make_plan: the only module that imports every design
    padding.py   round_up, ALIGN

Nothing here reads the environment except PlanOptions.from_env, nothing renders text.
"""
