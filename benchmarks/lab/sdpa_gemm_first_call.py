"""First call vs later calls of the ATen ops the prefill uses, at 7B shapes, per token count M:
F.linear (qkv with bias, o, gate/up, down) and F.scaled_dot_product_attention (28 query heads,
4 K/V heads, causal, enable_gqa) with PyTorch's default backend choice (cuDNN first on Hopper)
and with cuDNN's off (at M+1, so that length is new to it too). Each timed once, synced, in
ms. Pure torch, no engine: it isolates what a prefill at a new length pays the first time.
usage (GPU machine): python3 benchmarks/lab/sdpa_gemm_first_call.py
"""
import torch, time
torch.manual_seed(0)
dev = "cuda"
H, I, Q = 3584, 18944, 4608
W0 = torch.randn(Q, H, device=dev, dtype=torch.half) * .02; b0 = torch.randn(Q, device=dev, dtype=torch.half)
W1 = torch.randn(H, H, device=dev, dtype=torch.half) * .02
W2 = torch.randn(2 * I, H, device=dev, dtype=torch.half) * .02
W3 = torch.randn(H, I, device=dev, dtype=torch.half) * .02
def tm(f):
    torch.cuda.synchronize(); t = time.perf_counter(); f(); torch.cuda.synchronize(); return round((time.perf_counter() - t) * 1e3, 3)
for M in [64, 64, 45, 45, 42, 47, 61, 100, 100, 1114, 1114, 33]:
    x = torch.randn(M, H, device=dev, dtype=torch.half); xi = torch.randn(M, I, device=dev, dtype=torch.half)
    r = dict(M=M)
    r["qkv+bias"] = tm(lambda: torch.nn.functional.linear(x, W0, b0))
    r["o"] = tm(lambda: torch.nn.functional.linear(x, W1))
    r["gu"] = tm(lambda: torch.nn.functional.linear(x, W2))
    r["down"] = tm(lambda: torch.nn.functional.linear(xi, W3))
    q = torch.randn(1, 28, M, 128, device=dev, dtype=torch.half); k = torch.randn(1, 4, M, 128, device=dev, dtype=torch.half)
    r["sdpa"] = tm(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
    q2 = torch.randn(1, 28, M + 1, 128, device=dev, dtype=torch.half); k2 = torch.randn(1, 4, M + 1, 128, device=dev, dtype=torch.half)
    torch.backends.cuda.enable_cudnn_sdp(False)
    r["sdpa_nocudnn"] = tm(lambda: torch.nn.functional.scaled_dot_product_attention(q2, k2, k2, is_causal=True, enable_gqa=True))
    torch.backends.cuda.enable_cudnn_sdp(True)
    r["silu"] = tm(lambda: (torch.nn.functional.silu(xi.float()) * xi.float()).half())
    print(r, flush=True)
