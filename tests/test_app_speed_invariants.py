"""What keeps the app's cost per batch flat and the CPU engine fast beside the UI, checked as
behaviour (no clock: benchmarks/bench_app.py measures the speed).

* A streamed code block is lexed incrementally and shown in chunks: at every step its
  highlighting equals textual.highlight's of the whole code, the lexer keeps all but the last
  lines for good, the chunks before the last ones are never touched again, and the finished
  block is exactly what a fresh render of the text shows.
* The perf panel redraws at most every REDRAW_INTERVAL while a reply streams (the first text
  and the final figures at once), and without a screen-wide layout pass when a row keeps its
  shape.
* The reference backend runs its CPU work on one thread whoever calls it (one OpenMP team),
  and its TorchScript forward gives exactly the Python forward's logits and cache.
"""

from __future__ import annotations

import asyncio
import gc
import random
import threading

import pytest
import torch
from textual.app import App
from textual.containers import VerticalScroll
from textual.highlight import HighlightTheme
from textual.widgets._markdown import MarkdownBlock, MarkdownFence

from helpers import TINY_TIED, TINY_UNTIED, file_tensors, random_weights
from nanoqwen.app import widgets
from nanoqwen.app.widgets import AssistantMessage, CodeFence, _StreamHighlighter
from nanoqwen.engine.backends import reference
from nanoqwen.engine.backends.reference import ReferenceBackend
from nanoqwen.engine.sampling import SamplerParams

PY_BODY = '''def insert(self, value: int) -> None:
    """Insert `value` at the end.

    A docstring over several lines, with ``` inside it,
    and 'quotes' "of both" kinds.
    """
    node = Node(value)  # a comment
    s = \'\'\'a triple-quoted
string\'\'\'
    if self.head is None:
        self.head = node
        return
    cur = self.head
    while cur.next is not None:
        cur = cur.next
    cur.next = node
    print(f"{value!r:>8} inserted", 0x1F, 3.5e-2, [1, 2], {"k": (None, True)})

@decorator(arg=1)
class Thing(Base, metaclass=Meta):
    pass
'''

SAMPLES = {
    "python": "\n".join(PY_BODY for _ in range(4)),
    "javascript": "function f(a, b) {\n  /* multi\n  line */\n  const s = `t ${a}\nline`;\n"
                  "  return a + b; // c\n}\n" * 6,
    "bash": 'for i in 1 2; do\n  echo "$i" <<EOF\nheredoc $i\nEOF\ndone\n' * 6,
    "rust": 'fn main() {\n    let s = r#"raw\nstring"#;\n    println!("{}", s);\n}\n' * 6,
    "c": '#include <stdio.h>\n/* a\n * b */\nint main(void) {\n  return 0;\n}\n' * 3,
    "": "def f(x):\n    return x\n" * 5,          # no language: guessed, whole each time
}


def spans_of(content) -> list[tuple]:
    return [(s.start, s.end, str(s.style)) for s in content.spans]


@pytest.mark.parametrize("language", list(SAMPLES), ids=lambda x: x or "guess")
def test_streamed_highlighting_equals_the_whole_codes_at_every_step(language):
    code = SAMPLES[language].rstrip()
    for seed in range(2):
        rnd = random.Random(seed)
        hl = _StreamHighlighter(language, HighlightTheme)
        i = 0
        while i < len(code):
            i = min(len(code), i + rnd.randint(1, 15))
            cur = code[:i].rstrip()        # the fence's code, as Textual gives it (rstripped)
            hl.update(cur)
            got = [(s.start, s.end, str(s.style)) for s in hl.between(0, len(cur) + 1)]
            # [0] of Textual's Content is the "$text" base style of stylize_before
            assert got == spans_of(MarkdownFence.highlight(cur, language))[1:], (language, i)
        if language == "python":
            # all but the last lines are lexed for good: the next update lexes only those
            assert hl.resumable and code.count("\n", hl.done) <= 2


def _chunks(fence: CodeFence) -> list[tuple[str, list]]:
    return [(c.content.plain, spans_of(c.content)) for c in fence.query("CodeChunk")]


class Harness(App):
    def compose(self):
        yield VerticalScroll(id="box")


def test_streamed_reply_renders_like_a_fresh_one_and_keeps_finished_chunks(monkeypatch):
    monkeypatch.setattr(widgets, "PAINT_INTERVAL", 0.0)   # an append per write: many steps
    text = "Here is the code:\n\n```python\n" + SAMPLES["python"] + "```\n\nAnd more text.\n"

    async def run():
        app = Harness()
        async with app.run_test(size=(100, 40)) as pilot:
            box = app.query_one("#box")
            streamed = AssistantMessage("", 1)
            await box.mount(streamed)
            stream = AssistantMessage.get_stream(streamed)
            rnd = random.Random(0)
            i, seen = 0, {}
            while i < len(text):
                j = min(len(text), i + rnd.randint(1, 40))
                await stream.write(text[i:j])
                i = j
                await pilot.pause()
                for fence in streamed.query(CodeFence):
                    chunks = list(fence.query("CodeChunk"))
                    # a chunk that was sealed is the same widget with the same content after
                    for k in range(fence._sealed):
                        key = (id(fence), k)
                        now = (id(chunks[k]), chunks[k].content.plain, spans_of(chunks[k].content))
                        assert seen.setdefault(key, now) == now
                    # while the block grows, only its last chunks are still open
                    if "```\n\n" not in text[:i]:
                        assert len(chunks) - fence._sealed <= 2
            await stream.stop()
            streamed.set_finish("stop")
            await pilot.pause()
            assert streamed.source == text
            fresh = AssistantMessage(text, 2)
            await box.mount(fresh)
            await pilot.pause()
            [a], [b] = streamed.query(CodeFence), fresh.query(CodeFence)
            assert a.code == b.code == SAMPLES["python"].rstrip()
            assert _chunks(a) == _chunks(b)
            # the chunks together are Textual's own highlight of the whole block
            whole = MarkdownFence.highlight(a.code, "python")
            assert "\n".join(t for t, _ in _chunks(a)) == whole.plain
            lines_ours = [line for c in a.query("CodeChunk") for line in c.content.split("\n")]
            lines_textual = whole.split("\n")
            assert [(x.plain, spans_of(x)) for x in lines_ours] == \
                   [(x.plain, spans_of(x)) for x in lines_textual]
            # and the screen shows the same lines for both
            assert a.size == b.size
            assert [s.text for s in a.render_lines(a.region.reset_offset)] == \
                   [s.text for s in b.render_lines(b.region.reset_offset)]

    asyncio.run(run())


class ListHarness(App):
    """The chat's message list, anchored to its end as chat.py has it."""

    def compose(self):
        yield widgets.MessageList(id="messages")

    def on_mount(self):
        self.query_one("#messages").anchor()


def _screen_text(app) -> list[str]:
    return [strip.text for strip in app.screen._compositor.render_strips()]


async def _settled(app, pilot) -> None:
    """Until the screen has nothing left to lay out or paint (a condition, not a clock)."""
    screen = app.screen
    for _ in range(1000):
        await pilot.pause()
        if not (screen._layout_required or screen._scroll_required or screen._dirty_widgets
                or screen._repaint_required):
            await pilot.pause()
            if not (screen._layout_required or screen._dirty_widgets):
                return
    raise AssertionError("the screen did not settle")


def test_a_streamed_append_reflows_the_screen_once_and_the_list_follows_it(monkeypatch):
    """Each append costs one layout pass (OnePassLayout: Textual would do a second, identical
    one for every widget whose size changed), none when it left the reply as high as it was
    and only extended a paragraph (widgets._SameHeightUpdate), the anchored list still ends
    at the reply's latest text after every append, and the final screen is a fresh render's."""
    from textual.screen import Screen

    monkeypatch.setattr(widgets, "PAINT_INTERVAL", 0.0)
    text = ("Some words first, long enough to wrap on a narrow terminal: " * 3 + "\n\n"
            "```python\n" + PY_BODY * 2 + "```\n\nA closing paragraph with plain words.\n")
    layouts = []
    orig = Screen._refresh_layout

    def counting(self, size=None, scroll=False):
        layouts.append(scroll)
        return orig(self, size, scroll)
    monkeypatch.setattr(Screen, "_refresh_layout", counting)

    async def stream_it():
        app = ListHarness()
        async with app.run_test(size=(110, 20)) as pilot:
            box = app.query_one("#messages")
            reply = AssistantMessage("", 1)
            await box.mount(reply)
            stream = AssistantMessage.get_stream(reply)
            rnd = random.Random(1)
            i, per_append = 0, []    # (layout passes, widgets mounted or a scrollbar came,
            #                            the reply's height changed, a paragraph was last)
            while i < len(text):
                j = min(len(text), i + rnd.randint(5, 60))
                await _settled(app, pilot)
                layouts.clear()
                before = (len(list(reply.walk_children())), box.show_vertical_scrollbar,
                          reply.size.height)
                await stream.write(text[i:j])
                i = j
                await _settled(app, pilot)
                after = (len(list(reply.walk_children())), box.show_vertical_scrollbar,
                         reply.size.height)
                last_block = list(reply.query(MarkdownBlock))[-1]
                per_append.append((len(layouts), after[0] > before[0] or after[1] != before[1],
                                   after[2] != before[2],
                                   type(last_block).__name__ == "MarkdownParagraph"))
                # anchored: at the end (Textual puts a reply shorter than the list at its
                # bottom, with a negative scroll_y)
                assert box.scroll_y == box.max_scroll_y or box.max_scroll_y == 0
                last = text[:i].split()[-1] if text[:i].split() else ""
                if last and "`" not in last and i < len(text):
                    assert any(last in line for line in _screen_text(app)), (
                        last, i, text[i-80:i], "\n".join(_screen_text(app)))
            await stream.stop()
            reply.set_finish("stop")
            await _settled(app, pilot)
            # one pass, unless the append mounted a block or a chunk (their mount and first
            # sizing take their own) or the list's scrollbar appeared
            assert box.max_scroll_y > 0 and len(per_append) > 30
            assert all(n == 1 for n, grew, taller, para in per_append
                       if not grew and (taller or not para)), str(per_append)
            same = [n for n, grew, taller, para in per_append if not grew and not taller and para]
            assert same and all(n == 0 for n in same), str(per_append)
            return _screen_text(app)

    async def fresh():
        app = ListHarness()
        async with app.run_test(size=(110, 20)) as pilot:
            box = app.query_one("#messages")
            await box.mount(AssistantMessage(text, 1))
            box.scroll_end(animate=False)
            await _settled(app, pilot)
            return _screen_text(app)

    assert asyncio.run(stream_it()) == asyncio.run(fresh())


@pytest.mark.parametrize("start", ["paragraph", "fence", "heading"])
def test_a_reply_streams_into_its_open_block_and_ends_as_a_fresh_render(monkeypatch, start):
    """open_block() mounts an empty paragraph before the first text: a reply that starts with
    a paragraph fills that very block (its first append mounts nothing), one that starts
    with another block replaces it, and either way the final screen is a fresh render's."""
    monkeypatch.setattr(widgets, "PAINT_INTERVAL", 0.0)
    head = {"paragraph": "Some words first, long enough to wrap: " * 4 + "\n\n",
            "fence": "", "heading": "## A heading\n\n"}[start]
    text = head + "```python\n" + PY_BODY + "```\n\nA closing paragraph.\n"

    async def stream_it():
        app = ListHarness()
        async with app.run_test(size=(90, 40)) as pilot:
            box = app.query_one("#messages")
            reply = AssistantMessage("", 1)
            await box.mount(reply)
            await reply.open_block()
            [opened] = reply.children
            stream = AssistantMessage.get_stream(reply)
            first = text[:12]
            await stream.write(first)
            await stream.first_append.wait()
            assert reply.source == first
            if start == "paragraph":
                assert list(reply.children) == [opened]     # filled in place, nothing mounted
            else:
                assert opened not in reply.children         # replaced by the reply's block
            rnd = random.Random(2)
            i = len(first)
            while i < len(text):
                j = min(len(text), i + rnd.randint(5, 60))
                await stream.write(text[i:j])
                i = j
                await pilot.pause()
            await stream.stop()
            reply.set_finish("stop")
            await _settled(app, pilot)
            assert reply.source == text
            return _screen_text(app)

    async def fresh():
        app = ListHarness()
        async with app.run_test(size=(90, 40)) as pilot:
            await app.query_one("#messages").mount(AssistantMessage(text, 1))
            await _settled(app, pilot)
            return _screen_text(app)

    assert asyncio.run(stream_it()) == asyncio.run(fresh())


@pytest.mark.parametrize("case", ["text", "text_after_the_deadline", "no_text"])
def test_the_first_texts_frame_is_made_at_once_and_the_new_messages_are_not_held(monkeypatch,
                                                                               case):
    """_FirstFrame: the new messages get their frame while the engine prefills (no hold);
    the first text's frame is made as soon as it is in its widget, not at the next tick of
    the screen's update timer (the timer is stopped here once the messages are shown: a
    frame with the text can then only come from _FirstFrame), also when it comes after
    FIRST_TEXT_WAIT; no collection until then; the `after` callbacks run after that frame,
    or after FIRST_TEXT_WAIT when no text has come by then."""
    from nanoqwen.app import chat

    text_comes = case != "no_text"
    wait_s = 3600.0 if case == "text" else 0.05   # "text": the deadline must not end it
    monkeypatch.setattr(chat, "FIRST_TEXT_WAIT", wait_s)

    async def run():
        app = ListHarness()
        frames, after = [], []
        async with app.run_test(size=(80, 24)) as pilot:
            orig = app._display

            def display(screen, renderable):
                orig(screen, renderable)
                if renderable is not None:
                    frames.append("\n".join(_screen_text(app)))
            app._display = display
            await _settled(app, pilot)
            box = app.query_one("#messages")
            reply = AssistantMessage("", 1)
            stream = AssistantMessage.get_stream(reply)
            chat._FirstFrame(app, stream, [lambda: after.append(len(frames))])
            frames.clear()
            await box.mount(widgets.UserMessage("the question"), reply)
            await reply.open_block()
            for _ in range(1000):                             # a condition, with a 10 s bound
                if any("the question" in f for f in frames):
                    break
                await asyncio.sleep(0.01)
            assert any("the question" in f for f in frames)   # not held for the text
            if case == "text_after_the_deadline":
                for _ in range(1000):                         # the deadline's callbacks
                    if after:
                        break
                    await asyncio.sleep(0.01)
                assert after
            if case == "text":
                assert not gc.isenabled() and after == []     # until the first text's frame
            if text_comes:
                timer = app.screen._update_timer              # no tick makes a frame now
                timer.pause()
                monkeypatch.setattr(timer, "resume", lambda: None)
                n = len(frames)
                await stream.write("First words")
                await stream.first_append.wait()
                assert "First words" in frames[-1] and len(frames) == n + 1   # made at once
            for _ in range(1000):
                if after and gc.isenabled():
                    break
                await asyncio.sleep(0.01)
            assert gc.isenabled()
            assert after and after[0] >= 1                   # after a frame
            await stream.stop()

    asyncio.run(run())


class CountingMessage(AssistantMessage):
    """The real widget, counting the appends its stream makes."""

    appends: list

    def append(self, markdown):
        self.appends.append(markdown)
        return super().append(markdown)


@pytest.mark.parametrize("stop_after", [1, 2, 7, 30])
def test_paced_stream_sends_the_first_text_at_once_joins_the_rest_and_flushes_on_stop(
        monkeypatch, stop_after):
    """With an interval that never passes in the test, the first write is appended at once,
    every later one waits and goes out joined with the others when the stream stops; nothing
    is lost or reordered, whenever stop() comes (mid-wait included)."""
    monkeypatch.setattr(widgets, "PAINT_INTERVAL", 3600.0)
    parts = [f"word{i} " + ("\n\n" if i % 5 == 4 else "") for i in range(stop_after)]

    async def run():
        app = Harness()
        async with app.run_test() as pilot:
            w = CountingMessage("", 1)
            w.appends = []
            await app.query_one("#box").mount(w)
            stream = CountingMessage.get_stream(w)
            await stream.write(parts[0])
            await pilot.pause()
            assert w.appends == [parts[0]] and w.source == parts[0]   # no wait for the first
            for p in parts[1:]:
                await stream.write(p)
            await pilot.pause()
            assert w.appends == [parts[0]]                            # the rest waits ...
            await stream.stop()
            assert w.source == "".join(parts)                         # ... and is all there
            assert w.appends == [parts[0]] + (["".join(parts[1:])] if parts[1:] else [])

    asyncio.run(run())


class FakeClock:
    """time.monotonic and time.thread_time for widgets.py, moved by the test."""

    def __init__(self):
        self.wall = self.cpu = 100.0

    def monotonic(self):
        return self.wall

    def thread_time(self):
        return self.cpu


@pytest.mark.parametrize("share", [None, 0.05, 0.08, 0.5])
def test_paced_stream_keeps_the_ui_cpu_under_its_share(monkeypatch, share):
    """The interval after an append is the UI-thread CPU spent since the previous one over
    `cpu_share`, within [PAINT_INTERVAL, PAINT_INTERVAL_MAX]; without a share it is
    PAINT_INTERVAL whatever the cost."""
    clock = FakeClock()
    monkeypatch.setattr(widgets, "time", clock)
    stream = widgets.PacedMarkdownStream(None, share)   # _pace needs no widget
    rnd = random.Random(2)
    stream._pace()                              # the first append: nothing measured yet
    assert stream.interval == widgets.PAINT_INTERVAL
    assert stream._next == clock.wall + widgets.PAINT_INTERVAL
    for _ in range(50):
        cost = rnd.choice([0.0, 0.001, 0.004, 0.012, 0.03, 0.2]) * rnd.random()
        clock.cpu += cost
        clock.wall += stream.interval + cost
        stream._pace()
        want = widgets.PAINT_INTERVAL if share is None else min(
            max(cost / share, widgets.PAINT_INTERVAL), widgets.PAINT_INTERVAL_MAX)
        assert stream.interval == pytest.approx(want)
        assert stream._next == pytest.approx(clock.wall + want)
        # the UI's share of the wall time until the next append, when that cost repeats
        if share is not None and cost / share <= widgets.PAINT_INTERVAL_MAX:
            assert cost / stream.interval <= share + 1e-12


# --- the perf panel ------------------------------------------------------------------------------
def _update(n: int, final: bool = False, ms: float = 5.0):
    from nanoqwen.engine.service import StatsUpdate

    return StatsUpdate(ttft_ms=12.5, ms_per_token=ms, median_ms=ms if final else None,
                       tokens_per_s=1e3 / ms, step_ms=(ms,), n_generated=n, kv_len=40 + n,
                       max_context=4096, mode="eager", final=final,
                       rolling_tokens_per_s=1e3 / ms, rolling_median_ms=ms)


class PanelHarness(App):
    def compose(self):
        from nanoqwen.app.perf import PerfPanel

        yield PerfPanel(id="perf")


@pytest.mark.parametrize("device, interval", [("cpu", "REDRAW_INTERVAL_CPU"),
                                              ("NVIDIA H200", "REDRAW_INTERVAL")])
def test_perf_panel_draws_first_text_and_final_at_once_the_rest_throttled(monkeypatch, device,
                                                                           interval):
    """While a reply streams the panel redraws at most every REDRAW_INTERVAL (an engine on
    the CPU: REDRAW_INTERVAL_CPU, the other's setting has no say): an update inside the
    interval changes the figures but not the screen, until the interval's timer or the final
    update draws them. Rows whose shape is unchanged are redrawn without a layout pass
    (Static.update(layout=False)); a row that gains a line gets one."""
    from nanoqwen.app import perf as perf_mod
    from nanoqwen.app.perf import ModelInfo, PerfPanel
    from textual.widgets import Static

    def shown(panel, row):
        return str(panel.query_one(f"#{row}", Static).render())

    async def run():
        app = PanelHarness()
        async with app.run_test(size=(80, 30)) as pilot:
            panel = app.query_one(PerfPanel)
            panel.set_model(ModelInfo("reference", device, "tiny", ("eager",), "eager", 4096,
                                      None))
            await pilot.pause()
            layouts: list[tuple[str, bool]] = []
            orig = Static.update

            def spy(self, content="", *, layout=True):
                layouts.append((self.id, layout))
                return orig(self, content, layout=layout)
            monkeypatch.setattr(Static, "update", spy)

            monkeypatch.setattr(perf_mod, interval, 3600.0)   # never passes here
            other = "REDRAW_INTERVAL" if interval != "REDRAW_INTERVAL" else "REDRAW_INTERVAL_CPU"
            monkeypatch.setattr(perf_mod, other, 0.0)         # not this panel's setting
            panel.start_reply(0.0)
            panel.record(_update(1), shown_at=0.010)          # the first text: drawn at once
            assert "12.50 ms engine" in shown(panel, "perf-ttft")
            assert "10.00 ms seen" in shown(panel, "perf-ttft")
            assert "context   41 / 4096" in shown(panel, "perf-context")
            layouts.clear()
            panel.record(_update(2, ms=4.0), shown_at=0.020)  # inside the interval: held
            assert panel.decode_median_ms == 4.0
            assert "context   41 / 4096" in shown(panel, "perf-context") and layouts == []
            panel.record(_update(3, final=True, ms=4.0))      # the final one: drawn at once
            assert "context   43 / 4096" in shown(panel, "perf-context")
            assert "4.00 ms/tok" in shown(panel, "perf-decode")
            assert layouts and all(not layout for _, layout in layouts), layouts
            assert panel._redraw_timer is None                # the held redraw is dropped

            # A held redraw is drawn by the timer once the interval is up.
            monkeypatch.setattr(perf_mod, interval, 0.05)
            panel.start_reply(0.0)
            panel.record(_update(1), shown_at=0.010)
            panel.record(_update(7, ms=2.0), shown_at=0.030)
            for _ in range(200):
                if "context   47 / 4096" in shown(panel, "perf-context"):
                    break
                await pilot.pause(0.02)
            assert "context   47 / 4096" in shown(panel, "perf-context")

            # A row that changes shape (one more line) gets a layout pass.
            layouts.clear()
            panel.set_model(ModelInfo("reference", device, "tiny", ("eager",), "eager", 4096,
                                      "no CUDA device"))
            assert ("perf-backend", True) in layouts

    asyncio.run(run())


# --- the reference backend ----------------------------------------------------------------------
class ThreadRecording(ReferenceBackend):
    """The real backend, recording which threads ran its load and its forwards."""

    threads: set

    def _load(self, tensors, progress):
        type(self).threads.add(threading.get_ident())
        return super()._load(tensors, progress)

    def _run(self, tokens, pos0, all_logits):
        type(self).threads.add(threading.get_ident())
        return super()._run(tokens, pos0, all_logits)


def test_reference_cpu_work_runs_on_one_thread_whoever_calls():
    ThreadRecording.threads = set()
    tensors = file_tensors(TINY_UNTIED, random_weights(TINY_UNTIED, seed=3))
    made = []
    loader = threading.Thread(target=lambda: made.append(ThreadRecording(TINY_UNTIED, tensors)))
    loader.start()
    loader.join()
    be = made[0]
    be.forward([1, 2, 3])                                         # the main thread
    out = []
    worker = threading.Thread(target=lambda: out.extend(
        s.token_id for s in be.generate([4, 5], SamplerParams.greedy_params(), 6)))
    worker.start()
    worker.join()
    assert len(out) == 6 and len(be.kv_tokens) == 3 + 2 + 5
    assert ThreadRecording.threads == {reference._COMPUTE._thread.ident}
    # a failure inside the model reaches the caller, the cache stays consistent
    w = be.layers[0].w["mlp.down_proj"]
    be.layers[0].w["mlp.down_proj"] = w[:, :-1]
    with pytest.raises(RuntimeError):
        be.forward([7, 8])
    be.layers[0].w["mlp.down_proj"] = w
    assert len(be.kv_tokens) == be.cache.length == 10


@pytest.mark.parametrize("cfg", [TINY_UNTIED, TINY_TIED], ids=lambda c: c.name)
def test_torchscript_forward_gives_the_python_forwards_results(cfg):
    tensors = file_tensors(cfg, random_weights(cfg, seed=1))
    scripted, plain = ReferenceBackend(cfg, tensors), ReferenceBackend(cfg, tensors)
    assert scripted._forward_fn is not reference.forward_tokens   # TorchScript is in use here
    plain._forward_fn = reference.forward_tokens
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(0))
    ids = ids.tolist()
    assert torch.equal(scripted.forward_all(ids[:21]), plain.forward_all(ids[:21]))  # 2 pages
    for i in ids[21:]:
        assert torch.equal(scripted.forward([i]), plain.forward([i]))
    assert torch.equal(scripted.cache.k, plain.cache.k)
    assert torch.equal(scripted.cache.v, plain.cache.v)
