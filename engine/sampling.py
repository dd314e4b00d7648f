"""Sampler settings and the reference sampler (plain torch, CPU).

The chain is llama.cpp's default, in this order (the GPU sampler must do the same):
  1. repetition penalty over the distinct ids among the last `repeat_last_n` history ids
     (logit > 0 ? logit / p : logit * p)
  2. greedy (temperature <= 0): argmax, lowest id on ties — done
  3. top-k (k <= 0 or k >= V: off)
  4. top-p on the softmax of what is left: keep the smallest prefix of the sorted
     distribution whose cumulative probability is >= p (always at least one token)
  5. min-p: keep tokens with p >= min_p * p_max (a ratio, so done on logits:
     logit >= max_logit + log(min_p))
  6. temperature, softmax, one draw from a seeded torch.Generator

Steps 3-5 each keep a prefix of the same descending order, so they reduce to logit
thresholds; only top-p needs sorted values, and only of min-p's survivors. A [152064] fp32
row takes about 0.5 ms with the defaults and under 3 ms with every filter but top-p off
(2-core CPU).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import NanoqwenError

if TYPE_CHECKING:   # the annotations' torch (imported lazily where the code runs)
    import torch

# torch and numpy are imported inside the sampler functions, not here: SamplerParams is what
# the app's settings need, and the app must start without loading torch (the engine service
# loads it with the model). Annotations are strings (`from __future__ import annotations`).

class SamplerError(NanoqwenError, ValueError):
    """A sampler setting outside its allowed range; the message names the field."""


def is_int(x: Any) -> bool:
    """An int that is not a bool (shared with the app's settings checks)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """A finite int or float that is not a bool."""
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


# The rules every sampler value follows, wherever a person gives it (the app's settings form
# and file, `nanoqwen generate`'s flags, a model file's generation config): field ->
# (check, what the value must be). SamplerParams.validate applies them; the app's settings
# name the same rules with their labels (sampler_problems). Temperature 0 is greedy
# everywhere; a negative one is a mistake, not greedy (llama.cpp takes it as greedy).
SAMPLER_RULES: dict[str, tuple[Any, str]] = {
    "temperature": (lambda v: is_real(v) and v >= 0, "a number >= 0 (0: greedy)"),
    "top_k": (lambda v: is_int(v) and v >= 0, "a whole number >= 0 (0: off)"),
    "top_p": (lambda v: is_real(v) and 0 <= v <= 1,
              "a number in [0, 1] (1: off; 0 keeps only the most likely token)"),
    "min_p": (lambda v: is_real(v) and 0 <= v <= 1, "a number in [0, 1] (0: off)"),
    "repeat_penalty": (lambda v: is_real(v) and v > 0, "a number > 0 (1: off)"),
    "repeat_last_n": (lambda v: is_int(v) and v >= -1,
                      "a whole number >= -1 (0: off, -1: the whole context)"),
    "seed": (lambda v: is_int(v) and -1 <= v < 2**64,
             "a whole number from 0 to 2**64 - 1, or -1 for a fresh random seed each time"),
}


def sampler_problems(values: Mapping[str, Any]) -> dict[str, str]:
    """{field: what it must be} for each of `values`' sampler fields that breaks its rule."""
    return {name: rule for name, (ok, rule) in SAMPLER_RULES.items()
            if name in values and not ok(values[name])}


@dataclass(frozen=True)
class SamplerParams:
    """Sampling settings; defaults are llama.cpp's."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = -1

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @classmethod
    def greedy_params(cls) -> SamplerParams:
        return cls(temperature=0.0)

    def validate(self) -> SamplerParams:
        """Raise SamplerError naming the first bad field and what it must be (SAMPLER_RULES,
        the one set of rules the app and the CLI share); return self."""
        for name, rule in sampler_problems(self.to_dict()).items():
            raise SamplerError(f"sampler setting {name}={getattr(self, name)!r} is invalid: "
                               f"must be {rule}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplerParams:
        """Inverse of to_dict; missing keys take the defaults, unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SamplerError(f"unknown sampler setting(s) {', '.join(map(repr, unknown))}; "
                               f"known settings: {', '.join(sorted(known))}")
        return cls(**dict(d)).validate()

    @classmethod
    def model_defaults(cls, generation: Mapping[str, Any] | None) -> SamplerParams:
        """A model's sampler defaults: its file's generation config (from_generation_config),
        or ours when the file has none. The CLI's and the app's starting point."""
        return cls.from_generation_config(generation) if generation else cls()

    @classmethod
    def from_generation_config(cls, gc: Mapping[str, Any]) -> SamplerParams:
        """Settings from a Hugging Face generation_config.json dict.

        Keys the dict lacks take transformers' GenerationConfig defaults (temperature 1.0,
        top_k 50, top_p 1.0, no min-p, repetition_penalty 1.0, do_sample False), because
        that is what the file's authors tuned against; like transformers, do_sample False
        (or absent) means greedy. HF penalises the whole context; we keep llama.cpp's
        64-token window, which HF has no key for. Other keys (eos ids, max length) are not
        sampler settings and are ignored.
        """
        def get(key: str, default: Any) -> Any:
            v = gc.get(key)
            return default if v is None else v

        def num(key: str, default: float) -> float:
            v = get(key, default)
            if not is_real(v):
                raise SamplerError(f"generation_config {key}={v!r} is not a finite number")
            return float(v)

        top_k = get("top_k", 50)
        if isinstance(top_k, float) and top_k.is_integer():
            top_k = int(top_k)
        if not is_int(top_k):
            raise SamplerError(f"generation_config top_k={top_k!r} is not an integer")
        do_sample = bool(get("do_sample", False))
        params = cls(
            temperature=num("temperature", 1.0) if do_sample else 0.0,
            top_k=top_k,
            top_p=num("top_p", 1.0),
            min_p=num("min_p", 0.0),
            repeat_penalty=num("repetition_penalty", 1.0),
        )
        try:
            return params.validate()
        except SamplerError as e:
            raise SamplerError(f"generation_config: {e}") from e


def apply_repeat_penalty(logits: torch.Tensor, history: Sequence[int], penalty: float,
                         last_n: int) -> torch.Tensor:
    """Penalised copy of `logits` [V] (or `logits` itself when the penalty is off)."""
    if penalty == 1.0 or last_n == 0 or len(history) == 0:
        return logits
    import torch

    window = history if last_n < 0 else history[-last_n:]
    ids = torch.as_tensor(list(window), dtype=torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= logits.shape[0]:
        raise ValueError(f"history holds ids outside [0, {logits.shape[0]}): "
                         f"{int(ids.min())}..{int(ids.max())}")
    out = logits.clone()
    # Duplicate ids gather the same original logit and write the same value, so each
    # distinct id is penalised exactly once.
    sel = logits[ids]
    out[ids] = torch.where(sel > 0, sel / penalty, sel * penalty)
    return out


def _candidates(logits: torch.Tensor, p: SamplerParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, ids) of the tokens surviving top-k -> top-p -> min-p (in no particular order).

    top-p and min-p both keep a prefix of the descending order, so each becomes a logit
    threshold and the survivors are `vals >= max(top-p cut, min-p cut)`. Ties at the top-p
    cut are kept together (llama.cpp's unstable sort keeps an arbitrary one of them).
    """
    import numpy as np
    import torch

    V = logits.shape[0]
    if 0 < p.top_k < V:
        vals, ids = torch.topk(logits, p.top_k)
    else:
        vals, ids = logits, None
    vmax = float(vals.max())
    thr = -math.inf
    if p.min_p > 0:
        thr = vmax + math.log(p.min_p)      # p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p)
    if p.top_p < 1.0:
        # top-p normalises over the current set (the top-k survivors, or all V).
        log_z = float(torch.logsumexp(vals, 0))
        # If the top-p cut lies inside the min-p set only min-p's survivors matter; if it
        # lies beyond, min-p decides alone. Either way sorting the min-p survivors suffices.
        pool = vals if thr == -math.inf else vals[vals >= thr]
        # np.sort of plain values is ~15x faster than torch.sort on a 152k row (no index
        # payload); sorting the negation gives descending order with positive strides.
        desc = -torch.from_numpy(np.sort(-pool.numpy()))
        # exp in fp32 (fast), cumsum in fp64 so rounding cannot move the cut on a large
        # flat distribution.
        cum = torch.cumsum(torch.exp(desc - log_z).double(), 0)
        # First index whose cumulative probability reaches top_p, inclusive; if rounding
        # keeps the total below top_p, everything stays.
        n = min(int(torch.searchsorted(cum, torch.tensor(p.top_p, dtype=torch.float64))) + 1,
                len(desc))
        thr = max(thr, float(desc[n - 1]))
    if thr == -math.inf:
        return vals, ids if ids is not None else torch.arange(V)
    keep = torch.nonzero(vals >= thr).squeeze(1)
    return vals[keep], (ids[keep] if ids is not None else keep)


class Sampler:
    """The reference sampler: one token id per call, reproducible for a fixed seed."""

    def __init__(self, params: SamplerParams):
        import torch

        self.params = params.validate()
        # seed -1: a fresh random seed, kept in .seed so a run can be reproduced.
        self.seed: int = int.from_bytes(os.urandom(8), "little") if params.seed < 0 \
            else params.seed
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(self.seed)

    def sample(self, logits: torch.Tensor, history: Sequence[int] = ()) -> int:
        """Draw the next id from fp32 `logits` [V]; `history` is the context so far."""
        import torch

        logits = self._penalised(logits, history)
        if self.params.greedy:
            return int(torch.argmax(logits))              # first maximum = lowest id on ties
        ids, probs = self._kept(logits)
        return self._draw(ids, probs)

    def draw_seed(self) -> int:
        """A 63-bit seed from this sampler's generator, for draws made elsewhere from it (the
        CUDA engine's verify rows, CudaBackend.forward_all_sample): each call its own, and
        the same sequence for the same seed."""
        import torch

        return int(torch.randint(0, (1 << 63) - 1, (), generator=self._gen, dtype=torch.int64))

    def verify(self, logits: torch.Tensor, history: Sequence[int], draft: int
               ) -> tuple[int, bool]:
        """Speculative decoding's rule for one drafted id (engine/spec.py), as (token, kept):
        the token is sample()'s own draw, and the draft is kept iff it is that token.

        The drafter is deterministic, so its distribution q is a point mass at `draft`, and the
        standard rule (keep the draft with probability min(1, p(d) / q(d)) = p(d), else draw
        from the residual max(p - q, 0) renormalised, p without d) emits x with probability
        p(d) [x = d] + (1 - p(d)) p(x) / (1 - p(d)) [x != d] = p(x), keeping the draft with
        probability p(d). One draw from p that keeps the draft iff it equals it has that same
        law, jointly in (token, kept): so speculation changes no reply's distribution, greedy
        is its special case (the argmax, kept iff it is the draft), and the CUDA engine applies
        it to rows sampled on the device by the decode step's own sampler
        (CudaBackend.forward_all_sample), with no logits brought to the host.
        """
        token = self.sample(logits, history)
        return token, token == int(draft)

    def _penalised(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """fp32 CPU `logits` [V] with the repetition penalty over `history` applied."""
        import torch

        if logits.dim() != 1:
            raise ValueError(f"logits must be 1-D [V], got shape {tuple(logits.shape)}")
        p = self.params
        logits = logits.detach().to(device="cpu", dtype=torch.float32)
        return apply_repeat_penalty(logits, history, p.repeat_penalty, p.repeat_last_n)

    def _kept(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, fp64 probabilities) of the tokens top-k / top-p / min-p keep, at the
        temperature. softmax in fp32 is exact to ~1e-7 per token; the draw sums in fp64."""
        import torch

        vals, ids = _candidates(logits, self.params)
        return ids, torch.softmax(vals / self.params.temperature, 0).double()

    def _draw(self, ids: torch.Tensor, probs: torch.Tensor) -> int:
        """Inverse-CDF draw: one uniform from the seeded generator against the cumulative
        distribution (torch.multinomial takes ~4 ms on a full 152k row; this ~0.4 ms). The cdf
        is summed in fp64 so a long row does not accumulate rounding; a zero-probability token
        is never picked: its cdf equals its predecessor's."""
        import torch

        cdf = torch.cumsum(probs, 0)
        u = torch.rand((), generator=self._gen, dtype=torch.float64) * cdf[-1]
        i = min(int(torch.searchsorted(cdf, u, right=True)), len(cdf) - 1)
        return int(ids[i])
