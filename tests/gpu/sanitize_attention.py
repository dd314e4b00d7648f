"""Standalone: paged attention (and the RoPE/KV write feeding it) at a partial-page length,
for `compute-sanitizer --tool memcheck|racecheck python tests/gpu/sanitize_attention.py`.
Exits non-zero on a wrong result; the sanitizer's own exit code reports memory errors/races."""

import math
import sys

import torch

from nanoqwen.engine.build import load_extension

load_extension()
ops = torch.ops.nanoqwen
PAGE = 16
ok = True
for d, nh, nkv, L in ((128, 28, 4, 49), (64, 14, 2, 17), (128, 40, 8, 33)):
    g = torch.Generator(device="cuda").manual_seed(L)
    pages = 8
    table = torch.randperm(pages, generator=g, device="cuda").int()
    kc = torch.randn(pages, PAGE, nkv, d, generator=g, device="cuda").half()
    vc = torch.randn(pages, PAGE, nkv, d, generator=g, device="cuda").half()
    q = torch.randn(nh, d, generator=g, device="cuda").half()
    pos = torch.tensor([L - 1], dtype=torch.int32, device="cuda")
    for splits in (1, 3, 8):
        out = torch.empty(nh, d, device="cuda").half()
        ws_acc = torch.empty(nh, splits, d, device="cuda")
        ws_ml = torch.empty(nh, splits, 2, device="cuda")
        ops.paged_attention(out, ws_acc, ws_ml, q, kc, vc, table, pos)
        p = torch.arange(L, device="cuda")
        k = kc[table[p // PAGE].long(), p % PAGE].float().repeat_interleave(nh // nkv, 1)
        v = vc[table[p // PAGE].long(), p % PAGE].float().repeat_interleave(nh // nkv, 1)
        s = torch.einsum("hd,lhd->hl", q.float(), k) / math.sqrt(d)
        ref = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
        err = float((out.float() - ref).abs().max())
        print(f"d={d} nh={nh} nkv={nkv} L={L} splits={splits}: max err {err:.2e}")
        ok &= err < 2e-3
torch.cuda.synchronize()
sys.exit(0 if ok else 1)
