"""Numerics of folding a block's LayerNorm into its first GEMM against normalising the rows first (the
wide design's norm pass today), both with fp16 operands and fp32 accumulation, on fp16 input rows (a
model's fp16 copy): docs/DESIGN.md, "Planned: the LayerNorm folded into the first GEMM".

    python benchmarks/ln_fold_numerics.py

Prints each form's relative L2 distance from the float64 pre-activations LN(x) W + b, for rows of several
shapes (centred, large row means, outlier channels). No GPU.
"""
import numpy as np
from math import erf
rng = np.random.default_rng(0)
K, N, M = 768, 3072, 2048
gelu = np.vectorize(lambda v: 0.5 * v * (1 + erf(v / np.sqrt(2))))

def run(x, gamma, beta, W, b, eps=1e-5):
    x = x.astype(np.float16)                       # the fp16 model's input
    xd = x.astype(np.float64)
    mu = xd.mean(1, keepdims=True); var = xd.var(1, keepdims=True)
    ref = ((xd - mu) / np.sqrt(var + eps) * gamma + beta) @ W.astype(np.float64) + b   # exact pre-activation
    # today: LN in fp32, rounded to fp16, fp16 GEMM with fp32 accumulation
    xf = x.astype(np.float32); m32 = xf.mean(1, keepdims=True); v32 = (xf * xf).mean(1, keepdims=True) - m32 * m32
    ln = ((xf - m32) * (1 / np.sqrt(v32 + eps)) * gamma + beta).astype(np.float16)
    now = ln.astype(np.float32) @ W.astype(np.float16).astype(np.float32) + b
    # folded: W' = fp16(gamma * W), acc = x W', out = rstd * acc - rstd * mu * colsum(W') + (beta W + b)
    Wp = (gamma[:, None] * W).astype(np.float16).astype(np.float32)
    acc = xf @ Wp
    colsum = Wp.sum(0, dtype=np.float64).astype(np.float32)
    bias2 = (beta.astype(np.float64) @ W.astype(np.float64) + b).astype(np.float32)
    rstd = (1 / np.sqrt(v32 + eps)).astype(np.float32)
    fold = rstd * acc - (rstd * m32) * colsum + bias2
    rel = lambda a: float(np.linalg.norm(a - ref) / np.linalg.norm(ref))
    return rel(now), rel(fold)

W = rng.standard_normal((K, N)) / np.sqrt(K); b = 0.1 * rng.standard_normal(N)
gamma = 1 + 0.1 * rng.standard_normal(K); beta = 0.1 * rng.standard_normal(K)
for name, x in [
    ("N(0,1)", rng.standard_normal((M, K))),
    ("mean 5, std 1", 5 + rng.standard_normal((M, K))),
    ("mean 50, std 1", 50 + rng.standard_normal((M, K))),
    ("row means N(0,10)", rng.standard_normal((M, K)) + 10 * rng.standard_normal((M, 1))),
    ("outlier channels x100", rng.standard_normal((M, K)) * np.where(np.arange(K) % 97 == 0, 100, 1)),
]:
    now, fold = run(x, gamma, beta, W, b)
    print(f"{name:24s} normalise first {now:.2e}   folded {fold:.2e}")

# fp32 input rows: folding would round x itself to fp16 for the MMA, and the error then grows with the
# row mean over the row's spread (normalising first rounds x - mean instead)
print("fp32 input rows, x rounded to fp16 for the folded GEMM:")
for mean in (0, 5, 50):
    x = (mean + rng.standard_normal((M, K))).astype(np.float32)
    xd = x.astype(np.float64)
    mu, sd = xd.mean(1, keepdims=True), np.sqrt(xd.var(1, keepdims=True) + 1e-5)
    ref = ((xd - mu) / sd * gamma + beta) @ W + b
    Wp = (gamma[:, None] * W).astype(np.float16).astype(np.float32)
    fold = (x.astype(np.float16).astype(np.float32) @ Wp) / sd - (mu / sd) * Wp.sum(0) + (beta @ W + b)
    print(f"  row mean {mean:2d} sigma: folded {float(np.linalg.norm(fold - ref) / np.linalg.norm(ref)):.2e}")
