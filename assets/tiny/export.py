"""Quantize the trained tiny model to INT4, write the .nanoqwen file, and measure what that cost.

1. The seven projections of every layer go through `nanoqwen.engine.quant.quantize` (symmetric
   INT4, groups of 128); embeddings (tied lm_head), norms and q/k/v biases are stored fp16.
2. `write_model` writes <out>/tiny.nanoqwen with the tokenizer.json, the ChatML template
   (chat.CHAT_TEMPLATE), eos ids (<|im_end|>, <|endoftext|>) and sampling defaults.
3. The file is opened again, verified, dequantized into the training module and evaluated in
   fp32 on the same held-out windows as the bf16 model (train.py's numbers): the difference
   is the quantization cost.
4. Greedy sample replies with the reference backend over the file (on the GPU when there is
   one: same code, same fp32 math), written to <out>/samples.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chat  # noqa: E402
import model as M  # noqa: E402
from train import eval_loss  # noqa: E402

from nanoqwen.engine.config import ModelConfig  # noqa: E402
from nanoqwen.engine.format import open_model, write_model  # noqa: E402
from nanoqwen.engine.quant import dequantize, quantize  # noqa: E402

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NAME = "nanoqwen-tiny-coder-30m"
# Low-temperature sampling for the app (greedy is what the tests measure).
GENERATION = {"do_sample": True, "temperature": 0.2, "top_k": 20, "top_p": 0.9, "min_p": 0.05,
              "repetition_penalty": 1.0}
SAMPLE_PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function to reverse the words in a sentence.",
    "Write a Python function `def flatten(items)`. Flatten a nested list into a single list.",
]


def nanoqwen_config(cfg: dict) -> ModelConfig:
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "max_position_embeddings", "tie_word_embeddings")
    return ModelConfig(name=NAME, **{k: cfg[k] for k in keys})


def file_tensors(sd: dict, config: ModelConfig):
    """(name, tensor) in the .nanoqwen layout, produced one at a time."""
    yield "model.embed_tokens.weight", sd["model.embed_tokens.weight"].half()
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", sd[p + "input_layernorm.weight"].half()
        yield p + "post_attention_layernorm.weight", sd[p + "post_attention_layernorm.weight"].half()
        for proj in PROJ:
            q, s = quantize(sd[p + proj + ".weight"].float())
            yield p + proj + ".qweight", q
            yield p + proj + ".scales", s
            if proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                yield p + proj + ".bias", sd[p + proj + ".bias"].half()
    yield "model.norm.weight", sd["model.norm.weight"].half()


def dequantized_state(mf) -> dict:
    """The file's weights as the training module's fp32 state dict."""
    sd = {}
    for name in mf.tensors:
        if name.endswith(".scales"):
            continue
        if name.endswith(".qweight"):
            base = name[:-len(".qweight")]
            sd[base + ".weight"] = dequantize(mf.tensor(name), mf.tensor(base + ".scales"))
        else:
            sd[name] = mf.tensor(name).float()
    return sd


def greedy_samples(path: Path, requests: list[str], max_new: int, device: str) -> list[dict]:
    from nanoqwen.engine.backends.reference import ReferenceBackend
    from nanoqwen.engine.tokenizer import Tokenizer
    mf = open_model(path)
    tok = Tokenizer.from_model_file(mf)
    out = []
    be = ReferenceBackend.from_model_file(mf, device=device)
    for req in requests:
        be.truncate(0)
        ids = tok.encode_chat([{"role": "user", "content": req}])
        gen, t = [], time.time()
        logits = be.forward(ids)
        for _ in range(max_new):
            nxt = int(torch.argmax(logits))
            gen.append(nxt)
            if nxt in tok.stop_ids:
                break
            logits = be.forward([nxt])
        out.append({"request": req, "reply": tok.decode(gen), "n_tokens": len(gen),
                    "seconds": round(time.time() - t, 2)})
    mf.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=200)
    args = ap.parse_args()
    t0 = time.time()
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ck = torch.load(work / "ckpt.pt", map_location="cpu")
    cfg, sd = ck["config"], ck["state_dict"]
    config = nanoqwen_config(cfg)
    tok_json = (work / "tokenizer.json").read_text()
    from tokenizers import Tokenizer as HFTok
    t = HFTok.from_str(tok_json)
    eos = [t.token_to_id("<|im_end|>"), t.token_to_id("<|endoftext|>")]
    special = {"eos_token_ids": eos, "pad_token_id": eos[1], "bos_token_id": None,
               "im_start_id": t.token_to_id("<|im_start|>")}
    path = out / "tiny.nanoqwen"
    write_model(path, config, file_tensors(sd, config), tokenizer_json=tok_json,
                chat_template=chat.CHAT_TEMPLATE, special_tokens=special, generation=GENERATION)
    size = path.stat().st_size
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    print(f"[export] {path} {size} bytes ({size / 2**20:.2f} MiB) sha256 {sha} ({time.time() - t0:.1f}s)",
          flush=True)

    mf = open_model(path, verify=True)
    q = M.Qwen2(cfg)
    q.load_state_dict(dequantized_state(mf), strict=True)
    q.to(dev).eval()
    metrics = {"file_bytes": size, "file_sha256": sha}
    for k in ("heldout", "heldout_code", "heldout_chat"):
        w = np.load(work / f"eval_{k}.npy")
        metrics[f"{k}_loss_int4"] = round(eval_loss(lambda x, y: q(x, y), w, dev), 5)
    tm = json.loads((work / "train_metrics.json").read_text())
    tm.pop("log", None)
    metrics.update(tm)
    for k in ("heldout", "heldout_code", "heldout_chat"):
        metrics[f"{k}_ppl_bf16"] = round(math.exp(metrics[f"{k}_loss_bf16"]), 3)
        metrics[f"{k}_ppl_int4"] = round(math.exp(metrics[f"{k}_loss_int4"]), 3)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    try:  # the reference backend over the file vs the training module over the dequantized file
        from nanoqwen.engine.backends.reference import ReferenceBackend
        ids = np.load(work / "eval_heldout.npy")[0, :256].astype(np.int64).tolist()
        be = ReferenceBackend.from_model_file(mf, device=dev)
        ref = be.forward_all(ids)
        with torch.no_grad():
            ours = q(torch.tensor([ids], device=dev))[0].float().cpu()
        metrics["reference_backend_max_abs_logit_diff"] = round((ref - ours).abs().max().item(), 6)
        del be
    except Exception as e:  # noqa: BLE001 - the file and metrics matter more than this check
        metrics["reference_backend_check_error"] = f"{type(e).__name__}: {e}"
    mf.close()
    print(f"[export] {json.dumps(metrics)}", flush=True)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")

    reqs = json.loads((work / "heldout_requests.json").read_text())["requests"]
    prompts = (SAMPLE_PROMPTS + [r["request"] for r in reqs])[:args.samples]
    try:
        samples = greedy_samples(path, prompts, args.max_new, dev)
    except Exception as e:  # noqa: BLE001
        print(f"[export] samples failed: {type(e).__name__}: {e}", flush=True)
        samples = []
    (out / "samples.json").write_text(json.dumps(samples, indent=1) + "\n")
    for s in samples:
        print(f"--- {s['request']!r}\n{s['reply']}", flush=True)
    print(f"[export] done ({time.time() - t0:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
