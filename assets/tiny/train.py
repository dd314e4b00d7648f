"""Tokenize the corpus and train the tiny Qwen2 model, time-boxed.

The training stream: every train document (code files and rendered chats, shuffled with the
seed), each followed by <|endoftext|>, cut into windows of seq_len+1 tokens in shuffled
order. bf16 autocast over fp32 master weights, AdamW (0.9, 0.95), weight decay 0.1 on
matrices, linear warmup then cosine to 10% of peak, clip 1.0. The schedule runs on wall-clock
progress, not steps: training stops at --train-seconds after the first (compiling) step or at
the global deadline (env NQ_DEADLINE, epoch seconds) minus --reserve, whichever is first, so
the run fits its device call however fast the GPU is. Writes <work>/ckpt.pt (fp32 weights,
config), <work>/eval_*.npy (held-out windows) and <work>/train_metrics.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import random
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as M  # noqa: E402

_TOK = None


def _init_worker(path: str) -> None:
    global _TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer
    _TOK = Tokenizer.from_file(path)


def _encode(texts: list[str]) -> list[np.ndarray]:
    eot = _TOK.token_to_id("<|endoftext|>")
    out = []
    for enc in _TOK.encode_batch_fast(texts, add_special_tokens=False):
        a = np.empty(len(enc.ids) + 1, dtype=np.uint16)
        a[:-1] = enc.ids
        a[-1] = eot
        out.append(a)
    return out


def tokenize(tok_path: str, texts: list[str], workers: int) -> list[np.ndarray]:
    chunks = [texts[i:i + 256] for i in range(0, len(texts), 256)]
    with Pool(workers, initializer=_init_worker, initargs=(tok_path,)) as pool:
        return [a for part in pool.imap(_encode, chunks) for a in part]


def windows(docs: list[np.ndarray], T: int, rng: random.Random, limit: int = 0) -> np.ndarray:
    order = list(range(len(docs)))
    rng.shuffle(order)
    stream = np.concatenate([docs[i] for i in order]) if docs else np.zeros(0, np.uint16)
    n = len(stream) // (T + 1)
    w = stream[:n * (T + 1)].reshape(n, T + 1)
    idx = np.random.default_rng(rng.randrange(2**31)).permutation(n)
    if limit:
        idx = idx[:limit]
    return w[idx]


@torch.no_grad()
def eval_loss(fn, w: np.ndarray, device, batch: int = 32) -> float:
    tot, n = 0.0, 0
    for i in range(0, len(w), batch):
        x = torch.from_numpy(w[i:i + batch].astype(np.int64)).to(device)
        loss = fn(x[:, :-1], x[:, 1:])
        tot += loss.item() * x[:, 1:].numel()
        n += x[:, 1:].numel()
    return tot / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--shapes", choices=["tiny", "micro"], default="tiny")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--train-seconds", type=float, default=400)
    ap.add_argument("--max-steps", type=int, default=0, help="0: no cap (smoke tests cap it)")
    ap.add_argument("--reserve", type=float, default=80, help="seconds kept for export after training")
    ap.add_argument("--eval-windows", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--compile", type=int, default=1)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    args = ap.parse_args()
    t0 = time.time()
    deadline = float(os.environ.get("NQ_DEADLINE", t0 + 1e9))
    work = Path(args.work)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    cfg = dict(M.TINY if args.shapes == "tiny" else M.MICRO)
    T = min(args.seq_len, cfg["max_position_embeddings"])

    docs = pickle.load(open(work / "docs.pkl", "rb"))
    tok_path = str(work / "tokenizer.json")
    enc = {k: tokenize(tok_path, v, args.workers) for k, v in docs.items()}
    del docs
    ntok = {k: int(sum(map(len, v))) for k, v in enc.items()}
    print(f"[train] tokens {ntok} ({time.time() - t0:.1f}s)", flush=True)
    train_w = windows(enc["train_raw"] + enc["train_chat"], T, rng)
    evals = {"heldout": windows(enc["heldout_raw"] + enc["heldout_chat"], T, rng, args.eval_windows),
             "heldout_code": windows(enc["heldout_raw"], T, rng, args.eval_windows),
             "heldout_chat": windows(enc["heldout_chat"], T, rng, args.eval_windows)}
    for k, w in evals.items():
        np.save(work / f"eval_{k}.npy", w)
    del enc
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # after the forks
    data = torch.from_numpy(train_w.astype(np.int32)).to(dev)   # [n_windows, T+1]
    print(f"[train] {len(train_w)} train windows of {T + 1} ({data.numel() / 1e6:.1f}M tokens); "
          f"eval windows { {k: len(w) for k, w in evals.items()} } ({time.time() - t0:.1f}s)", flush=True)

    model = M.Qwen2(cfg)
    model.init_weights(args.seed)
    model.to(dev)
    print(f"[train] params {M.n_params(model) / 1e6:.2f}M, config {json.dumps(cfg)}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=args.lr,
                            betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    # Regional compilation: one compiled decoder layer reused by all eight (a fraction of
    # a whole-model compile's start-up); the embedding and the loss run eager.
    compiled = bool(args.compile)

    def set_compiled(on: bool) -> None:
        for layer in model.model.layers:
            if on:
                layer.compile()
            else:
                layer._compiled_call_impl = None
    if compiled:
        set_compiled(True)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")  # CPU: fp32
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
    pos, epoch = 0, 0
    step, seen, log, t_start, t_end = 0, 0, [], None, None

    def batch():
        nonlocal pos, epoch, perm
        if pos + args.batch > len(perm):
            epoch += 1
            perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed + epoch))
            pos = 0
        x = data[perm[pos:pos + args.batch].to(dev)].long()
        pos += args.batch
        return x[:, :-1], x[:, 1:]

    def lr_at(step: int, progress: float) -> float:
        warm = min(1.0, (step + 1) / args.warmup)
        return args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))

    model.train()
    while True:
        now = time.time()
        progress = 0.0 if t_start is None else (now - t_start) / (t_end - t_start)
        if progress >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, progress)
        x, y = batch()
        try:
            with amp:
                loss = model(x, y)
            loss.backward()
        except Exception as e:  # noqa: BLE001 - a compile failure shows at the first call
            if not compiled or step > 0:
                raise
            print(f"[train] compiled step failed ({type(e).__name__}: {e}); eager", flush=True)
            opt.zero_grad(set_to_none=True)
            set_compiled(False)
            compiled = False
            continue
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        seen += x.numel()
        if t_start is None:  # the first step compiled: the clock starts now
            loss.item()
            t_start = time.time()
            t_end = min(t_start + args.train_seconds, deadline - args.reserve)
            print(f"[train] first step {t_start - now:.1f}s (compile); training until "
                  f"+{t_end - t_start:.0f}s", flush=True)
        if step % 50 == 0 or step in (1, 10):
            l = loss.item()
            el = time.time() - t_start
            log.append({"step": step, "loss": round(l, 4), "lr": lr_at(step, progress),
                        "grad_norm": round(gn.item(), 3), "tokens": seen, "seconds": round(el, 1)})
            print(f"[train] step {step} loss {l:.4f} lr {log[-1]['lr']:.2e} gn {gn.item():.2f} "
                  f"tokens {seen / 1e6:.1f}M {seen / max(el, 1e-9) / 1e6:.2f}M tok/s epoch {epoch}",
                  flush=True)
    train_s = time.time() - (t_start or time.time())
    model.eval()
    set_compiled(False)  # eager eval: the compiled layer would recompile for the eval shapes

    def bf16_loss(x, y):
        with amp:
            return model(x, y)
    metrics = {"steps": step, "tokens_trained": seen, "train_seconds": round(train_s, 1),
               "tokens_per_s": round(seen / max(train_s, 1e-9)), "epochs": round(seen / data.numel(), 3),
               "train_windows": len(train_w), "corpus_tokens": ntok, "seq_len": T,
               "batch": args.batch, "lr": args.lr, "seed": args.seed, "params": M.n_params(model),
               "config": cfg, "log": log, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               "torch": torch.__version__}
    for k, w in evals.items():
        metrics[f"{k}_loss_bf16"] = round(eval_loss(bf16_loss, w, dev), 5)
    with torch.no_grad():
        metrics["heldout_loss_fp32"] = round(eval_loss(lambda x, y: model.float()(x, y), evals["heldout"], dev), 5)
    print(f"[train] done: {json.dumps({k: v for k, v in metrics.items() if k != 'log'})}", flush=True)
    torch.save({"config": cfg, "state_dict": {k: v.float().cpu() for k, v in model.state_dict().items()}},
               work / "ckpt.pt")
    (work / "train_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")


if __name__ == "__main__":
    main()
