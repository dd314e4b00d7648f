"""nanoqwen-chat headless on the CUDA backend: the perf panel shows graph and eager figures.

One reply in graph mode, ctrl+g, one reply in eager mode: each reply's figures come from the
engine's own timing (CUDA events) and are labelled with the mode the backend ran.
"""

from __future__ import annotations

import pytest

from test_app import SIZE, aio, dirs, loaded, reply_done, send, use_settings  # noqa: F401

from nanoqwen.app.main import NanoqwenApp

pytestmark = [pytest.mark.cuda]


@aio
async def test_perf_panel_shows_graph_and_eager_figures(dirs, tiny_model_path):
    use_settings(max_new_tokens=64, decode_mode="graph")
    app = NanoqwenApp(model=tiny_model_path, backend="cuda")
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        perf = app.chat.perf
        assert perf.info.backend == "cuda" and set(perf.info.modes) == {"graph", "eager"}
        assert app.engine.mode == "graph"

        figures = {}
        for mode in ("graph", "eager"):
            await send(app, pilot, f"reply in {mode} mode")
            await reply_done(app, pilot)
            last = perf.last
            assert last.final and last.mode == mode
            assert last.ttft_ms > 0 and last.median_ms > 0 and last.tokens_per_s > 0
            assert len(perf.steps_ms) == last.n_generated - 1 > 0
            shown = str(perf.query_one("#perf-decode").render())
            assert "ms/tok" in shown and f"({mode})" in shown
            figures[mode] = last.median_ms
            if mode == "graph":
                await pilot.press("ctrl+g")   # switch without a reload
                await pilot.pause()
                assert app.engine.mode == "eager" and app.settings.decode_mode == "eager"
        print(f"median ms/token: graph {figures['graph']:.3f}, eager {figures['eager']:.3f}")


@aio
@pytest.mark.parametrize("on_device", [True, False], ids=["device-loop", "host-loop"])
async def test_auto_speculation_is_prompt_lookup_inside_the_engine(
        dirs, tiny_model_path, monkeypatch, on_device):
    """The settings' default "auto" on the CUDA engine: prompt lookup where it runs inside the
    engine's loop (NANOQWEN_SPEC_DEVICE on, the default), measured faster on screen there; with
    the switch off (the host loop, slower on screen) nothing. A reply that repeats its prompt
    drafts and keeps ids, and the perf panel says so. That the speculative reply is the plain
    one token for token, with any sampler, is tests/gpu/test_spec_device.py's."""
    monkeypatch.setenv("NANOQWEN_SPEC_DEVICE", "1" if on_device else "0")
    use_settings(max_new_tokens=96, decode_mode="graph")
    app = NanoqwenApp(model=tiny_model_path, backend="cuda")
    assert app.settings.speculation == "auto"
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        assert app.engine.info.spec_auto == ("ngram" if on_device else None)
        assert app.engine.spec == ("ngram" if on_device else None)
        await send(app, pilot,
                   "def add(a, b): return a + b\ndef add(a, b): return a + b\ndef add")
        await reply_done(app, pilot)
        st = app.store.messages(app.chat.chat_id)[1].stats
        decode = str(app.chat.perf.query_one("#perf-decode").render())
        if on_device:
            assert st["spec"] == "ngram" and st["n_drafted"] > 0
            assert 0 < st["n_accepted"] <= st["n_drafted"]
            assert f"of {st['n_drafted']} drafted kept (prompt lookup)" in decode, decode
        else:
            assert not st.get("spec") and "drafted" not in decode, decode
