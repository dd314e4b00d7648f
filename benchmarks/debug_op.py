"""Smallest call of one nanoqwen op (for a native backtrace under cuda-gdb when an op crashes)."""
import torch

from nanoqwen.engine.build import load_extension

print(load_extension(), flush=True)
t = torch.randn(10, 256, device="cuda").half()
ids = torch.tensor([1, 2], dtype=torch.int32, device="cuda")
h = torch.empty(2, 256, device="cuda")
print("calling embed_gather", flush=True)
torch.ops.nanoqwen.embed_gather(h, t, ids)
torch.cuda.synchronize()
print("ok", torch.equal(h, t[ids.long()].float()), flush=True)
