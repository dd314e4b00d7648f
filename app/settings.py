"""The app's settings: sampler, reply length, system prompt, decode mode, last model.

Persisted as JSON in platformdirs' user_config_dir("nanoqwen")/settings.json, written
atomically (temp file + rename) so a crash never leaves half a file. A file that cannot be
read or holds invalid values does not stop the app: `load_settings` returns the defaults
(keeping whatever fields were valid) and a warning that the app shows.

Validation lives here, not in the screen, so the form and the file share one set of rules
and messages; the messages use the labels the settings screen shows.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

from nanoqwen.engine.sampling import SamplerParams, is_int, sampler_problems
from nanoqwen.engine.service import MODES

DECODE_MODES = MODES  # the engine's decode modes (engine/service.py)
# speculative decoding: off, or a drafter of engine/spec.py ("ngram": prompt lookup, "draft":
# the model file draft_model, a smaller one of the same tokenizer), or "auto": what the loaded
# backend is measured faster with on screen (Backend.spec_auto: prompt lookup on the CPU's
# reference backend and on the CUDA engine, where it runs inside the engine's loop)
SPECULATION = ("auto", "off", "ngram", "draft")
SPECULATION_NAMES = {"auto": "auto", "off": "off", "ngram": "prompt lookup",
                     "draft": "draft model"}
# the perf panel: beside the chat, a one-line summary under it, or hidden (F3 cycles; a
# terminal too narrow for "full" shows "line")
PERF_PANEL = ("full", "line", "hidden")
SAMPLER_FIELDS = ("greedy", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                  "repeat_last_n", "seed")
MAX_NEW_TOKENS_LIMIT = 32768
_DEFAULT_SAMPLER = SamplerParams()


class SettingsError(ValueError):
    """Invalid settings; `.errors` maps each bad field to a message naming its label."""

    def __init__(self, errors: dict[str, str]) -> None:
        self.errors = errors
        super().__init__("; ".join(errors.values()))


# field -> label shown in the settings screen and used in messages
LABELS = {
    "greedy": "Greedy decoding",
    "temperature": "Temperature",
    "top_k": "Top-k",
    "top_p": "Top-p",
    "min_p": "Min-p",
    "repeat_penalty": "Repetition penalty",
    "repeat_last_n": "Penalty window",
    "seed": "Seed",
    "max_new_tokens": "Max new tokens",
    "system_prompt": "System prompt",
    "decode_mode": "Decode mode",
    "speculation": "Speculative decoding",
    "draft_model": "Draft model",
    "last_model": "Last model",
    "model_sampler": "Sampler from the model",
    "cpu_threads": "CPU threads",
    "perf_panel": "Perf panel",
}


@dataclass
class Settings:
    greedy: bool = False
    temperature: float = _DEFAULT_SAMPLER.temperature
    top_k: int = _DEFAULT_SAMPLER.top_k
    top_p: float = _DEFAULT_SAMPLER.top_p
    min_p: float = _DEFAULT_SAMPLER.min_p
    repeat_penalty: float = _DEFAULT_SAMPLER.repeat_penalty
    repeat_last_n: int = _DEFAULT_SAMPLER.repeat_last_n
    seed: int = _DEFAULT_SAMPLER.seed
    max_new_tokens: int = 1024
    system_prompt: str = ""          # empty: the model's chat template default
    decode_mode: str = "graph"       # wanted mode; a backend without it runs its only mode
    speculation: str = "auto"        # wanted; a backend without it decodes plainly
    draft_model: str = ""            # the .nanoqwen file of speculation "draft"
    last_model: str | None = None    # the model to open next time
    cpu_threads: int = 0             # the CPU backend's threads; 0: one per core
    perf_panel: str = "full"         # PERF_PANEL; F3 in the chat cycles it
    # the sampler fields follow the loaded model's generation defaults (with_model_sampler)
    # until the person saves other values
    model_sampler: bool = True

    def with_model_sampler(self, params: SamplerParams) -> Settings:
        """A copy whose sampler fields are `params` (a model's defaults: temperature 0 is
        greedy, the temperature field then keeps its value), marked model_sampler."""
        greedy = params.temperature == 0
        return dataclasses.replace(
            self, greedy=greedy, temperature=self.temperature if greedy else params.temperature,
            top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
            repeat_penalty=params.repeat_penalty, repeat_last_n=params.repeat_last_n,
            seed=params.seed, model_sampler=True)

    def same_sampler(self, other: Settings) -> bool:
        """Whether the two sample alike (what the sampler fields give the engine)."""
        return self.sampler_params() == other.sampler_params()

    def validate(self) -> Settings:
        """Raise SettingsError listing every bad field; return self when all are fine."""
        errors: dict[str, str] = {}

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok and name not in errors:
                errors[name] = f"{LABELS[name]} {rule} (got {getattr(self, name)!r})"

        need(isinstance(self.greedy, bool), "greedy", "must be true or false")
        # the sampler's rules are the engine's own, shared with the CLI (SAMPLER_RULES)
        for name, rule in sampler_problems(self.to_dict()).items():
            need(False, name, f"must be {rule}")
        need(is_int(self.max_new_tokens) and 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT,
             "max_new_tokens", f"must be a whole number from 1 to {MAX_NEW_TOKENS_LIMIT}")
        need(isinstance(self.system_prompt, str), "system_prompt", "must be text")
        need(isinstance(self.model_sampler, bool), "model_sampler", "must be true or false")
        cores = os.cpu_count() or 1
        need(is_int(self.cpu_threads) and 0 <= self.cpu_threads <= cores, "cpu_threads",
             f"must be a whole number from 0 (one per core) to {cores} (this machine's CPUs)")
        need(self.decode_mode in DECODE_MODES, "decode_mode",
             f"must be one of {', '.join(DECODE_MODES)}")
        need(self.perf_panel in PERF_PANEL, "perf_panel", f"must be one of {', '.join(PERF_PANEL)}")
        need(self.speculation in SPECULATION, "speculation",
             f"must be one of {', '.join(SPECULATION)}")
        # paths: text a file name can be (the OS refuses a NUL byte: Path.exists raises)
        need(_is_path(self.draft_model), "draft_model", "must be a file path")
        need(self.last_model is None or _is_path(self.last_model), "last_model",
             "must be a file path")
        need(self.speculation != "draft" or (isinstance(self.draft_model, str)
                                              and self.draft_model.strip() != ""),
             "draft_model", "is needed for speculation with a draft model: a .nanoqwen file "
             "of the same tokenizer")
        if errors:
            raise SettingsError(errors)
        return self

    def sampler_params(self) -> SamplerParams:
        """The engine's SamplerParams; greedy is temperature 0 (the engine's convention)."""
        return SamplerParams(
            temperature=0.0 if self.greedy else float(self.temperature),
            top_k=self.top_k, top_p=float(self.top_p), min_p=float(self.min_p),
            repeat_penalty=float(self.repeat_penalty), repeat_last_n=self.repeat_last_n,
            seed=self.seed).validate()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # --- form input ---------------------------------------------------------------
    @classmethod
    def from_form(cls, form: dict[str, Any], base: Settings | None = None) -> Settings:
        """Settings from the screen's raw values (numbers as typed strings).

        Raises SettingsError with a message for every field that does not parse or is out
        of range, so the screen can mark them all at once.
        """
        values = (base or cls()).to_dict()
        errors: dict[str, str] = {}
        for name, raw in form.items():
            kind = _FIELD_TYPES[name]
            if kind in (int, float) and isinstance(raw, str):
                text = raw.strip()
                try:
                    values[name] = int(text) if kind is int else float(text)
                except ValueError:
                    what = "a whole number" if kind is int else "a number"
                    errors[name] = f"{LABELS[name]} must be {what} (got {raw!r})"
            else:
                values[name] = raw
        try:
            settings = cls(**values).validate()
        except SettingsError as e:
            errors = {**e.errors, **errors}
            settings = None
        if errors:
            raise SettingsError(errors)
        assert settings is not None
        return settings


def _is_path(v: Any) -> bool:
    return isinstance(v, str) and "\0" not in v


_FIELD_TYPES = {f.name: f.type for f in dataclasses.fields(Settings)}
_FIELD_TYPES = {k: {"int": int, "float": float}.get(v, v) if isinstance(v, str) else v
                for k, v in _FIELD_TYPES.items()}


def default_settings_path() -> Path:
    # platformdirs honours XDG_CONFIG_HOME on Linux, which is how tests redirect it.
    return Path(platformdirs.user_config_dir("nanoqwen")) / "settings.json"


def load_settings(path: Path | None = None) -> tuple[Settings, str | None]:
    """(settings, warning). Never raises for a bad file: the app must still start."""
    path = path or default_settings_path()
    if not path.exists():
        return Settings(), None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("the file does not hold a JSON object")
    except (OSError, ValueError) as e:
        return Settings(), f"Settings file {path} could not be read ({e}); using defaults"
    known = {f.name for f in dataclasses.fields(Settings)}
    values = {k: v for k, v in data.items() if k in known}
    # a file from before model_sampler holds sampler values someone chose: keep them
    values.setdefault("model_sampler", False)
    problems = [f"unknown key {k!r}" for k in sorted(set(data) - known)]
    # Keep the valid fields; reset only the bad ones to the default, and say which. A reset
    # can make another field invalid (speculation "draft" without its draft model), so this
    # revalidates until all are fine: each round resets at least one more field.
    defaults = Settings()
    errors: dict[str, str] = {}      # field -> its first message, in the order found
    reset: list[str] = []            # fields reset to the default, in the order reset
    settings = None
    for _ in range(len(known) + 1):
        try:
            settings = Settings(**values).validate()
            break
        except SettingsError as e:
            found = e.errors
        for name, message in found.items():
            errors.setdefault(name, message)
        bad = [n for n in found if n not in reset]
        # speculation "draft" runs the draft model: without a usable one it goes off too
        if "draft_model" in found and values.get("speculation") == "draft":
            bad.append("speculation")
        if not bad:
            break    # bad fields already at their defaults: cannot happen, they are valid
        for name in bad:
            values[name] = getattr(defaults, name)
            reset.append(name)
    notes = [*errors.values(), *([f"ignored {', '.join(problems)}"] if problems else [])]
    if not errors:
        return settings, f"Settings file {path}: {notes[0]}" if notes else None
    if settings is None:   # unreachable while Settings() validates (a test checks it)
        return defaults, f"Settings file {path}: {'; '.join(notes)}; using defaults"
    return settings, (f"Settings file {path}: {'; '.join(notes)}; reset "
                      f"{', '.join(LABELS[n] for n in reset)} to the default"
                      f"{'s' if len(reset) > 1 else ''}")


def save_settings(settings: Settings, path: Path | None = None) -> Path:
    path = path or default_settings_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(settings.to_dict(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
