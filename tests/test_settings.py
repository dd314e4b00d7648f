"""App settings: validation messages, the form parser, persistence, conversion to SamplerParams."""

from __future__ import annotations

import json
import os

import pytest

from nanoqwen.app.settings import (LABELS, Settings, SettingsError, default_settings_path,
                                   load_settings, save_settings)
from nanoqwen.engine.sampling import SamplerParams


def test_defaults_are_valid_and_match_the_engine_defaults():
    s = Settings().validate()
    assert s.sampler_params() == SamplerParams()


def test_greedy_means_temperature_zero_for_the_engine():
    p = Settings(greedy=True, temperature=0.7).sampler_params()
    assert p.greedy and p.temperature == 0.0


def test_round_trip_through_the_config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert default_settings_path() == tmp_path / "nanoqwen" / "settings.json"
    s = Settings(temperature=0.3, top_k=5, seed=42, system_prompt="Be terse.",
                 decode_mode="eager", last_model="/m/x.nanoqwen")
    save_settings(s)
    loaded, warning = load_settings()
    assert warning is None and loaded == s


def test_missing_file_gives_defaults_silently(tmp_path):
    assert load_settings(tmp_path / "none.json") == (Settings(), None)


@pytest.mark.parametrize("form, field, words", [
    ({"temperature": "abc"}, "temperature", "Temperature must be a number (got 'abc')"),
    ({"temperature": "-0.5"}, "temperature", "Temperature must be a number >= 0 (0: greedy)"),
    ({"top_k": "2.5"}, "top_k", "Top-k must be a whole number"),
    ({"top_k": "-3"}, "top_k", "Top-k must be a whole number >= 0"),
    ({"top_p": "1.5"}, "top_p", "Top-p must be a number in [0, 1]"),
    ({"min_p": "-0.1"}, "min_p", "Min-p must be a number in [0, 1]"),
    ({"repeat_penalty": "0"}, "repeat_penalty", "Repetition penalty must be a number > 0"),
    ({"repeat_last_n": "-2"}, "repeat_last_n", "Penalty window must be a whole number >= -1"),
    ({"seed": "-5"}, "seed", "Seed must be a whole number from 0 to 2**64 - 1, or -1"),
    ({"max_new_tokens": "0"}, "max_new_tokens", "Max new tokens must be a whole number from 1"),
    ({"decode_mode": "turbo"}, "decode_mode", "Decode mode must be one of graph, eager"),
    ({"speculation": "medusa"}, "speculation",
     "Speculative decoding must be one of auto, off, ngram"),
    ({"temperature": "nan"}, "temperature", "Temperature must be a number >= 0"),
    ({"cpu_threads": "-1"}, "cpu_threads", "CPU threads must be a whole number from 0"),
    ({"cpu_threads": str((os.cpu_count() or 1) + 1)}, "cpu_threads", "this machine's CPUs"),
])
def test_invalid_form_values_are_rejected_with_a_message(form, field, words):
    with pytest.raises(SettingsError) as e:
        Settings.from_form(form)
    assert field in e.value.errors
    assert words in e.value.errors[field]


def test_every_bad_field_is_reported_at_once():
    with pytest.raises(SettingsError) as e:
        Settings.from_form({"top_k": "x", "top_p": "2", "seed": "", "temperature": "0.5"})
    assert set(e.value.errors) == {"top_k", "top_p", "seed"}


def test_form_keeps_fields_it_does_not_mention():
    base = Settings(system_prompt="keep me", last_model="m")
    s = Settings.from_form({"temperature": " 0.25 ", "greedy": True}, base=base)
    assert (s.temperature, s.greedy, s.system_prompt, s.last_model) == (0.25, True, "keep me", "m")


def test_unreadable_file_falls_back_to_defaults_with_a_warning(tmp_path):
    p = tmp_path / "settings.json"
    p.write_text("{not json")
    s, warning = load_settings(p)
    assert s == Settings() and "could not be read" in warning and str(p) in warning


def test_bad_values_in_file_are_reset_one_by_one(tmp_path):
    p = tmp_path / "settings.json"
    p.write_text(json.dumps({"temperature": -1, "top_k": 7, "bogus": 1}))
    s, warning = load_settings(p)
    assert s.top_k == 7 and s.temperature == Settings().temperature
    assert "Temperature" in warning and "reset Temperature to the default" in warning


@pytest.mark.parametrize("field", ["last_model", "draft_model"])
@pytest.mark.parametrize("value", [42, ["a.nanoqwen"], {"p": 1}, "a\0b.nanoqwen"])
def test_a_model_path_that_is_no_path_is_reset_with_a_warning(tmp_path, field, value):
    """A hand-edited file with a number, a list or a NUL byte where a model's path goes: the
    app would fail opening it (Path(42) raises TypeError, Path.exists a ValueError on a NUL);
    the field is reset, the rest kept, and the warning names it."""
    p = tmp_path / "settings.json"
    p.write_text(json.dumps({field: value, "top_k": 7}))
    s, warning = load_settings(p)
    assert getattr(s, field) == getattr(Settings(), field) and s.top_k == 7
    assert LABELS[field] in warning and "must be a file path" in warning


def test_unknown_keys_are_ignored_with_a_warning(tmp_path):
    p = tmp_path / "settings.json"
    p.write_text(json.dumps({"top_k": 3, "bogus": 1}))
    s, warning = load_settings(p)
    assert s.top_k == 3 and "unknown key 'bogus'" in warning


def test_save_is_atomic_and_readable(tmp_path):
    p = tmp_path / "sub" / "settings.json"
    save_settings(Settings(top_k=9), p)
    assert json.loads(p.read_text())["top_k"] == 9
    assert [f.name for f in p.parent.iterdir()] == ["settings.json"]  # no temp file left


def test_the_app_and_the_cli_share_one_set_of_sampler_rules():
    """The same value is accepted or refused by the settings form and by `nanoqwen
    generate`'s flags alike, with the same rule in the message (SAMPLER_RULES); temperature
    0 is greedy in both."""
    import argparse

    from nanoqwen.engine.cli_generate import sampler_params
    from nanoqwen.engine.errors import NanoqwenError
    from nanoqwen.engine.sampling import SAMPLER_RULES

    flag = {"temperature": "temp"}
    cases = [("temperature", v) for v in (0.0, 0.5, -0.5, float("nan"))] + \
            [("top_k", v) for v in (0, 7, -1)] + [("top_p", v) for v in (0.0, 1.0, 1.5)] + \
            [("min_p", v) for v in (0.0, 1.0, -0.1)] + \
            [("repeat_penalty", v) for v in (0.5, 0.0)] + \
            [("repeat_last_n", v) for v in (-1, 0, -2)] + [("seed", v) for v in (-1, 2**63, -5)]
    for field, value in cases:
        try:
            s = Settings.from_form({field: str(value)})
            app_error = None
        except SettingsError as e:
            app_error = e.errors[field]
        args = argparse.Namespace(**{flag.get(field, field): value})
        try:
            p = sampler_params(args, None)
            cli_error = None
        except NanoqwenError as e:
            cli_error = str(e)
        assert (app_error is None) == (cli_error is None), (field, value, app_error, cli_error)
        if app_error:
            rule = SAMPLER_RULES[field][1]
            assert rule in app_error and rule in cli_error
        else:
            assert getattr(p, field) == value or (field == "seed" and value == s.seed)
    assert Settings.from_form({"temperature": "0"}).sampler_params().greedy


@pytest.mark.parametrize("draft_model", ["", "   ", 5])
def test_draft_speculation_without_a_draft_model_resets_both_and_keeps_the_rest(tmp_path,
                                                                                draft_model):
    """A hand-edited file asking for a draft model without a usable one: the draft model and
    speculation go back to their defaults, every other field is kept (not Settings())."""
    p = tmp_path / "settings.json"
    p.write_text(json.dumps({"speculation": "draft", "draft_model": draft_model, "top_k": 7,
                             "temperature": 0.3}))
    s, warning = load_settings(p)
    assert (s.top_k, s.temperature) == (7, 0.3)
    assert (s.speculation, s.draft_model) == (Settings().speculation, "")
    assert "reset Draft model, Speculative decoding to the defaults" in warning, warning
    assert "Draft model" in warning and "Speculative decoding" in warning


def test_draft_speculation_reset_is_said_with_the_other_bad_fields(tmp_path):
    p = tmp_path / "settings.json"
    p.write_text(json.dumps({"speculation": "draft", "draft_model": "", "temperature": -1,
                             "top_k": 7, "bogus": 1}))
    s, warning = load_settings(p)
    assert (s.top_k, s.temperature, s.speculation) == (7, Settings().temperature,
                                                        Settings().speculation)
    for words in ("Temperature", "Draft model is needed", "unknown key 'bogus'",
                  "Speculative decoding"):
        assert words in warning, warning


def test_draft_speculation_with_a_draft_model_is_kept(tmp_path):
    p = tmp_path / "settings.json"
    p.write_text(json.dumps({"speculation": "draft", "draft_model": "~/m/small.nanoqwen",
                             "top_k": 7}))
    s, warning = load_settings(p)
    assert warning is None
    assert (s.speculation, s.draft_model, s.top_k) == ("draft", "~/m/small.nanoqwen", 7)


def test_the_form_still_marks_the_draft_model_field_for_draft_speculation():
    with pytest.raises(SettingsError) as e:
        Settings.from_form({"speculation": "draft", "draft_model": ""})
    assert set(e.value.errors) == {"draft_model"}
    assert "Draft model is needed" in e.value.errors["draft_model"]
