"""The whole product against the engine alone: what reaches the screen vs what the engine does.

One process, the same model and the same turns, side by side:
  * engine alone: a `ChatSession` loop over the backend (no app, its event loop blocked, so
    nothing else runs); its rate and TTFT are its own step timings (`Stats`), plus the wall clock
    of the turn;
  * the app: `NanoqwenApp` headless under `App.run_test`, real settings and chat store in a temp
    dir (XDG_CONFIG_HOME / XDG_DATA_HOME), the message typed into the prompt and Enter sent as a
    key event through the driver, as a terminal would; "on screen" is the wall clock at which
    the first screen update (frame) was made after the reply's Markdown widget finished taking
    each piece of text (its `append` completed): headless, the frame is made and dropped, so
    only a terminal's own write of it is left out.

Cases, per repetition (a warm-up repetition is run and left out of the medians):
  new_chat   a new chat, cold cache (the backend's cache emptied first), first user message
  next_turn  a second user message (~40 tokens) in the same chat: only it is prefilled after the
             cached prefix of the first turn (the product's "TTFT of a new turn")
Both sides use greedy decoding, so they produce the same tokens (checked: same_text). With
--sampled, both use the app's default sampler (Settings' temperature, top-k, top-p, min-p and
repetition penalty) with one fixed seed, so they still draw the same tokens: the rate a person
sees with the settings the app ships, sampler launches included.

Printed and written (`--json FILE`): per case the medians of the engine's tok/s (its step
timings) and TTFT (engine-measured), the on-screen tok/s ((tokens - 1) / (last text - first
text on screen)) and TTFT (Enter -> first character on screen), both turns' wall clock, and
the ratios; the JSON has every turn too, with date, device, commit, model, backend and mode.

    .venv/bin/python benchmarks/bench_app.py                                  # CPU, bundled model
    python benchmarks/bench_app.py --model 7b.nanoqwen --backend cuda --mode graph --tokens 1024 \
        --json benchmarks/results/app-vs-engine-h200-graph.json

The app is driven through its own engine object, whatever it is called (the bridge or the
engine service): the benchmark needs only `backend` + `tokenizer` attributes on it to run the
engine-alone loop on the same backend; without them it loads the model a second time.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import datetime as _dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Coding requests (the bundled model answers in a ```python block), taken in turn, so that even
# without a shared backend (no cache emptied) no turn finds its own prompt cached.
FIRST = [  # greedy replies of the bundled model to these run to 256 tokens and more
    "Write a Python class for a linked list with insert, delete and search methods.",
    "Write a Python class for a queue with enqueue and dequeue methods.",
    "Write a Python class for a graph with add_edge, bfs and dfs methods.",
]
SECOND = ("Now add type hints and a docstring to every function, handle the empty input "
          "and invalid arguments by raising ValueError with a clear message, and write "
          "pytest unit tests for the normal case, the empty case and one error case.")


# --- small helpers ---------------------------------------------------------------------------
def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return a / b if a is not None and b not in (None, 0) else None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


class OtherLoad:
    """CPU that processes other than this one used while it ran (in cores; None where
    /proc/stat is missing): a turn measured on a busy machine is marked, not trusted."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), self._own()

    @staticmethod
    def _busy() -> float | None:
        try:
            f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in f[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system

    def cores(self) -> float | None:
        busy = self._busy()
        if busy is None or self.busy0 is None:
            return None
        wall = time.perf_counter() - self.t0
        return max(0.0, (busy - self.busy0) - (self._own() - self.own0)) / wall if wall else None


async def wait_quiet(max_cores: float, timeout: float) -> None:
    """Wait (up to `timeout` s) until other processes use less than `max_cores` CPU."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        load = OtherLoad()
        await asyncio.sleep(1.0)
        cores = load.cores()
        if cores is None or cores < max_cores:
            return


def find_engine(app):
    """(backend, tokenizer) of the engine the app loaded, or (None, None)."""
    for name in ("engine", "service", "bridge"):
        obj = getattr(app, name, None)
        if obj is None:
            continue
        for b, t in (("backend", "tokenizer"), ("_backend", "_tokenizer")):
            be, tok = getattr(obj, b, None), getattr(obj, t, None)
            if be is not None and tok is not None and hasattr(be, "kv_tokens"):
                return be, tok
    return None, None


def app_engine_loaded(app) -> bool:
    return any(getattr(app, n, None) is not None for n in ("engine", "service", "bridge"))


# --- on-screen timing: when the reply widget has taken each piece of text ------------------------
class ScreenClock:
    """When text reached the screen. Wraps AssistantMessage.append (what the Markdown stream
    calls) to record, on each widget, (time the append completed, length of the widget's
    source then), on the widget, not in a dict by id() (a new reply can reuse a freed
    widget's id); and the app's `_display` (called with each screen update the compositor
    made: in a terminal the frame written out, headless the same frame, made and dropped) to
    record when frames were made. Text is on screen with the first frame made after its
    append completed: an append changes the widgets, the next frame shows them."""

    def __init__(self) -> None:
        from textual.await_complete import AwaitComplete
        from nanoqwen.app.widgets import AssistantMessage

        orig = AssistantMessage.append
        self.frames: list[float] = []

        def append(widget, markdown: str):
            aw = orig(widget, markdown)

            async def timed() -> None:
                await aw
                widget.__dict__.setdefault("_bench_marks", []).append(
                    (time.perf_counter(), len(widget.source)))
            return AwaitComplete(timed())

        AssistantMessage.append = append

    def watch(self, app) -> None:
        """Record the frames `app` makes (its _display, called once per screen update)."""
        orig = app._display
        frames = self.frames

        def display(screen, renderable) -> None:
            orig(screen, renderable)
            if renderable is not None and not app._batch_count:
                frames.append(time.perf_counter())
        app._display = display

    def _frame_after(self, t: float | None) -> float | None:
        if t is None:
            return None
        i = bisect.bisect_right(self.frames, t)
        return self.frames[i] if i < len(self.frames) else None

    def first_last(self, widget, final_len: int):
        """(first text on screen, whole text on screen, appends): the first frames made
        after the append that brought the first text and after the one that completed it;
        None while such a frame has not been made yet."""
        m = widget.__dict__.get("_bench_marks", [])
        first = next((t for t, n in m if n > 0), None)
        last = next((t for t, n in m if n >= final_len), None)
        return self._frame_after(first), self._frame_after(last), len(m)


# --- the engine alone ------------------------------------------------------------------------
def engine_turn(session, text: str, params, n: int) -> dict:
    from nanoqwen.engine.session import Stats, TextDelta

    load = OtherLoad()
    t0 = time.perf_counter()
    first = None
    parts: list[str] = []
    stats = None
    for ev in session.generate(text, params, n):
        if isinstance(ev, TextDelta):
            if first is None:
                first = time.perf_counter()
            parts.append(ev.text)
        elif isinstance(ev, Stats):
            stats = ev
    t1 = time.perf_counter()
    n_gen = stats.n_generated if stats else None
    return dict(
        text="".join(parts), n_generated=n_gen, turn_s=t1 - t0,
        ttft_ms=stats.ttft_ms if stats else None,           # engine-measured
        first_text_ms=(first - t0) * 1e3 if first else None,  # wall, call -> first text
        tok_s=stats.tokens_per_s if stats else None,        # decode steps / their time
        wall_tok_s=((n_gen - 1) / (t1 - first) if n_gen and n_gen > 1 and first and t1 > first
                    else None),
        n_prompt=stats.n_prompt if stats else None,
        n_prefilled=getattr(stats, "n_prefilled", None), n_reused=getattr(stats, "n_reused", None),
        mode=stats.mode if stats else None, other_load=load.cores(),
        n_drafted=getattr(stats, "n_drafted", None), n_accepted=getattr(stats, "n_accepted", None))


# --- the app ------------------------------------------------------------------------------------
def _cpu_threads() -> int:
    """The CPU backend's threads, as its compute thread has them."""
    from nanoqwen.engine.backends.reference import set_cpu_threads

    return set_cpu_threads(None)


async def until(cond, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.01)


async def app_turn(app, clock: ScreenClock, text: str, timeout: float) -> dict:
    from textual import events
    from nanoqwen.app.widgets import AssistantMessage, PromptInput

    chat = app.chat
    def replies():   # an app before shown_messages (verify_app_ab_gpu.sh's base) had none hidden
        shown = getattr(chat, "shown_messages", None)
        return shown(AssistantMessage) if shown else list(chat.query(AssistantMessage))
    before = {id(w) for w in replies()}

    def new_reply():
        return next((w for w in replies() if id(w) not in before), None)
    prompt = chat.query_one("#prompt", PromptInput)
    prompt.text = text
    prompt.focus()
    # Enter once the UI is quiet (no frame for 100 ms, at most 5 s), as when a person has
    # read the reply and typed: the end of a reply does its own work after its last frame
    # (a collection, the next turn's widgets), and a frame made within one frame slot
    # (1/60 s) before the first text's pushes that frame to the next slot
    await asyncio.sleep(0.05)
    quiet_from = time.perf_counter()
    while time.perf_counter() - quiet_from < 5.0:
        last = clock.frames[-1] if clock.frames else 0.0
        if time.perf_counter() - last >= 0.1:
            break
        await asyncio.sleep(0.01)
    key = events.Key("enter", "\r")
    key.set_sender(app)
    load = OtherLoad()
    t0 = time.perf_counter()
    app._driver.send_message(key)                    # as the terminal driver delivers a key
    await until(lambda: new_reply() is not None, 30, "the reply to start")
    await until(lambda: not chat.generating, timeout, "the reply to finish")
    widget = new_reply()

    def on_screen():
        # the store has the whole reply before the screen does (chat.py writes it first)
        # and the append that brought its end has completed (the source is set before)
        m = app.store.messages(chat.chat_id)[-1]
        done = (m.finish is not None and widget.source == m.content
                and clock.first_last(widget, len(m.content))[1] is not None)
        return m if done else None
    await until(lambda: on_screen() is not None, 60, "the whole reply on screen")
    msg = on_screen()
    source = widget.source
    first, last, n_appends = clock.first_last(widget, len(source))
    st = msg.stats or {}
    n_gen = st.get("n_generated")
    return dict(
        text=source, n_generated=n_gen, finish=msg.finish,
        turn_s=(last - t0) if last else None,                    # Enter -> whole reply on screen
        screen_ttft_ms=(first - t0) * 1e3 if first else None,    # Enter -> first character
        screen_tok_s=((n_gen - 1) / (last - first) if n_gen and n_gen > 1 and first and last
                      and last > first else None),
        engine_ttft_ms=st.get("ttft_ms"),                        # the engine's, inside the app
        engine_tok_s=st.get("tokens_per_s"),
        appends=n_appends, other_load=load.cores())


async def run(args) -> dict:
    from nanoqwen.app.main import NanoqwenApp
    from nanoqwen.app.settings import Settings, save_settings
    from nanoqwen.engine import loader

    model = Path(args.model) if args.model else loader.default_model_path()
    # model_sampler off: the settings below stand, not the model file's generation defaults
    sampler = (dict(greedy=False, seed=args.seed) if args.sampled else dict(greedy=True))
    save_settings(Settings(model_sampler=False, max_new_tokens=args.tokens,
                           decode_mode=args.mode or "graph", speculation=args.spec, **sampler))
    clock = ScreenClock()
    app = NanoqwenApp(model=model, backend=args.backend, mode=args.mode, threads=args.threads)
    clock.watch(app)
    turns: list[dict] = []
    meta: dict = {}
    async with app.run_test(size=(args.width, args.height)):
        await until(lambda: app_engine_loaded(app), args.load_timeout, "the model to load")
        await asyncio.sleep(0.2)
        backend, tokenizer = find_engine(app)
        separate = None
        if backend is None:  # an engine object that does not expose them: a second copy
            separate = loader.load(model, backend=args.backend, mode=args.mode or "graph")
            backend, tokenizer = separate.backend, separate.tokenizer
        params = app.settings.sampler_params()
        if separate is not None:   # the app set its own backend's; this one gets the same
            separate.backend.spec = None if args.spec == "off" else args.spec
        meta = dict(backend=backend.name, device=backend.device_name, model=backend.config.name,
                    mode=backend.mode, engine_shared_with_app=separate is None,
                    sampler=params.to_dict(), spec=backend.spec)
        from nanoqwen.engine.session import ChatSession

        rep = attempts = 0
        while rep < args.warmup + args.reps:
            first_msg = FIRST[rep % len(FIRST)]
            await wait_quiet(args.max_other_load, args.quiet_wait)
            rows = []
            for side in (("engine", "app") if rep % 2 == 0 else ("app", "engine")):
                if separate is None:
                    backend.truncate(0)      # a new chat on a cold cache, whoever ran before
                if side == "engine":
                    s = ChatSession(backend, tokenizer)
                    r1 = engine_turn(s, first_msg, params, args.tokens)
                    r2 = engine_turn(s, SECOND, params, args.tokens)
                else:
                    app.chat.action_new_chat()
                    await asyncio.sleep(0.2)   # the old chat's widgets go
                    r1 = await app_turn(app, clock, first_msg, args.turn_timeout)
                    r2 = await app_turn(app, clock, SECOND, args.turn_timeout)
                for case, r in (("new_chat", r1), ("next_turn", r2)):
                    rows.append(dict(rep=rep, warmup=rep < args.warmup, side=side, case=case,
                                     **r))
            busy = max((r["other_load"] or 0.0) for r in rows)
            retry = busy > args.max_other_load and attempts < args.retries
            if not args.quiet:
                for r in rows:
                    print(f"  rep {rep}{' (warm-up)' if r['warmup'] else ''} {r['side']:6s} "
                          f"{r['case']:9s} {one_line(r['side'], r)}", flush=True)
                if retry:
                    print(f"  rep {rep}: other processes used {busy:.2f} cores: run again",
                          flush=True)
            if retry:
                attempts += 1
                continue
            turns.extend(rows)
            rep += 1
        if separate is not None:
            separate.close()
    return dict(meta=meta, turns=turns)


def one_line(side: str, r: dict) -> str:
    busy = (f"  [other processes: {r['other_load']:.2f} cores]"
            if r.get("other_load") is not None and r["other_load"] > 0.05 else "")
    return _one_line(side, r) + busy


def _one_line(side: str, r: dict) -> str:
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    if side == "engine":
        return (f"{f(r['n_generated'], 'd')} tok  {f(r['tok_s'], '.1f')} tok/s  TTFT "
                f"{f(r['ttft_ms'], '.1f')} ms  turn {f(r['turn_s'], '.3f')} s  "
                f"(prefilled {r['n_prefilled']})")
    return (f"{f(r['n_generated'], 'd')} tok  {f(r['screen_tok_s'], '.1f')} tok/s on screen  "
            f"Enter->text {f(r['screen_ttft_ms'], '.1f')} ms  turn {f(r['turn_s'], '.3f')} s  "
            f"(engine in app: {f(r['engine_tok_s'], '.1f')} tok/s, TTFT "
            f"{f(r['engine_ttft_ms'], '.1f')} ms; {r['appends']} appends)")


def summarize(turns: list[dict]) -> dict:
    out = {}
    for case in ("new_chat", "next_turn"):
        e = [t for t in turns if t["case"] == case and t["side"] == "engine" and not t["warmup"]]
        a = [t for t in turns if t["case"] == case and t["side"] == "app" and not t["warmup"]]
        same = [x["text"] == y["text"] for x, y in
                zip(sorted(e, key=lambda t: t["rep"]), sorted(a, key=lambda t: t["rep"]))]
        s = dict(
            engine_tok_s=med(t["tok_s"] for t in e),
            engine_wall_tok_s=med(t["wall_tok_s"] for t in e),
            engine_ttft_ms=med(t["ttft_ms"] for t in e),
            engine_first_text_ms=med(t["first_text_ms"] for t in e),
            engine_turn_s=med(t["turn_s"] for t in e),
            screen_tok_s=med(t["screen_tok_s"] for t in a),
            screen_ttft_ms=med(t["screen_ttft_ms"] for t in a),
            app_turn_s=med(t["turn_s"] for t in a),
            engine_in_app_tok_s=med(t["engine_tok_s"] for t in a),
            engine_in_app_ttft_ms=med(t["engine_ttft_ms"] for t in a),
            n_generated=med(t["n_generated"] for t in a),
            n_prefilled=med(t["n_prefilled"] for t in e),
            same_text=all(same) if same else None,
            reps=len(a),
            max_other_load=max((t["other_load"] for t in e + a if t["other_load"] is not None),
                               default=None))
        s["rate_ratio"] = ratio(s["screen_tok_s"], s["engine_tok_s"])
        s["turn_ratio"] = ratio(s["app_turn_s"], s["engine_turn_s"])
        # each rep's app turn over its own engine turn (run back to back): a machine whose
        # speed drifts between reps (seen on the 2-core CI machine: the engine alone 84-173
        # tok/s within one run) moves both sides of a pair alike
        by_rep = {t["rep"]: t for t in e}
        s["turn_ratio_paired"] = med(ratio(t["turn_s"], by_rep[t["rep"]]["turn_s"])
                                     for t in a if t["rep"] in by_rep)
        s["ttft_ratio"] = ratio(s["screen_ttft_ms"], s["engine_ttft_ms"])
        s["ttft_gap_ms"] = (s["screen_ttft_ms"] - s["engine_ttft_ms"]
                            if s["screen_ttft_ms"] is not None and s["engine_ttft_ms"] is not None
                            else None)
        out[case] = s
    return out


def print_summary(meta: dict, summary: dict, args) -> None:
    f = lambda v, fmt=".1f": "-" if v is None else format(v, fmt)  # noqa: E731
    print(f"\n{meta['model']} · {meta['backend']} ({meta['device']}) · mode {meta['mode']} · "
          f"{args.tokens} new tokens · medians of {args.reps} reps · "
          + ("greedy" if meta["sampler"]["temperature"] == 0 else
             "sampled: " + ", ".join(f"{k} {v}" for k, v in meta["sampler"].items()))
          + (f" · speculation {meta['spec']}" if meta.get("spec") else "")
          + ("" if meta.get("engine_shared_with_app") else " · engine loaded separately"))
    print(f"{'case':10s} {'engine tok/s':>12s} {'screen tok/s':>12s} {'ratio':>6s}   "
          f"{'engine TTFT':>11s} {'Enter->text':>11s} {'ratio':>6s}   "
          f"{'engine turn':>11s} {'app turn':>9s} {'ratio':>6s}  same text")
    for case, s in summary.items():
        print(f"{case:10s} {f(s['engine_tok_s']):>12s} {f(s['screen_tok_s']):>12s} "
              f"{f(s['rate_ratio'], '.3f'):>6s}   {f(s['engine_ttft_ms']) + ' ms':>11s} "
              f"{f(s['screen_ttft_ms']) + ' ms':>11s} {f(s['ttft_ratio'], '.2f'):>6s}   "
              f"{f(s['engine_turn_s'], '.3f') + ' s':>11s} {f(s['app_turn_s'], '.3f') + ' s':>9s} "
              f"{f(s['turn_ratio'], '.3f'):>6s}  {s['same_text']}")
        print(f"{'':10s} (app turn / engine turn of the same rep, median: "
              f"{f(s['turn_ratio_paired'], '.3f')})")
        print(f"{'':10s} (engine inside the app: {f(s['engine_in_app_tok_s'])} tok/s, TTFT "
              f"{f(s['engine_in_app_ttft_ms'])} ms; prefilled {f(s['n_prefilled'], '.0f')} tokens; "
              f"{f(s['n_generated'], '.0f')} generated)")
        if s["max_other_load"] is not None and s["max_other_load"] > args.max_other_load:
            print(f"{'':10s} WARNING: other processes used up to {s['max_other_load']:.2f} "
                  "cores during these turns; the figures are not clean")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", metavar="FILE", help="a .nanoqwen file (default: the bundled model)")
    ap.add_argument("--backend", choices=["auto", "cuda", "reference"], default="auto")
    ap.add_argument("--mode", choices=["graph", "eager"], default=None,
                    help="decode mode (default: the backend's; the reference backend has eager)")
    ap.add_argument("--tokens", type=int, default=256, help="max new tokens per turn")
    ap.add_argument("--sampled", action="store_true",
                    help="the app's default sampler (fixed --seed) instead of greedy decoding")
    ap.add_argument("--seed", type=int, default=1234, help="the sampler's seed with --sampled")
    ap.add_argument("--spec", choices=["off", "ngram"], default="off",
                    help="the app's speculative decoding setting, on both sides (the second "
                         "turn asks to rewrite the first reply: prompt lookup's case)")
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions (medians)")
    ap.add_argument("--warmup", type=int, default=1, help="repetitions left out of the medians")
    ap.add_argument("--width", type=int, default=120)
    ap.add_argument("--height", type=int, default=40)
    ap.add_argument("--load-timeout", type=float, default=600.0)
    ap.add_argument("--turn-timeout", type=float, default=600.0)
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU backend threads (default: one per core)")
    ap.add_argument("--max-other-load", type=float, default=0.15, metavar="CORES",
                    help="a repetition during which other processes used more CPU than this "
                         "is run again (up to --retries times); before each one the benchmark "
                         "waits up to --quiet-wait s for the machine to be that quiet")
    ap.add_argument("--retries", type=int, default=10)
    ap.add_argument("--quiet-wait", type=float, default=120.0)
    ap.add_argument("--json", metavar="FILE", help="write the results (and every turn) here")
    ap.add_argument("--quiet", action="store_true", help="no per-turn lines")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench_app-") as tmp:
        # the app's settings and chat store live here, not in the user's own
        os.environ["XDG_CONFIG_HOME"] = str(Path(tmp) / "config")
        os.environ["XDG_DATA_HOME"] = str(Path(tmp) / "data")
        os.environ.pop("NANOQWEN_FREEZE_PERF", None)
        res = asyncio.run(run(args))
    meta, turns = res["meta"], res["turns"]
    summary = summarize(turns)
    print_summary(meta, summary, args)
    if args.json:
        import textual
        import torch

        from nanoqwen.engine.bench import _commit

        device = meta["device"]
        if device == "cpu":
            device = f"cpu: {cpu_name()}, {os.cpu_count()} cores"
        doc = dict(
            date=_dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            device=device, commit=_commit(), model=meta["model"],
            model_file=str(Path(args.model).resolve()) if args.model else "bundled",
            backend=meta["backend"], mode=meta["mode"], sampler=meta["sampler"],
            spec=meta.get("spec"),
            tokens=args.tokens, reps=args.reps,
            warmup=args.warmup, engine_shared_with_app=meta["engine_shared_with_app"],
            torch_threads=_cpu_threads(), python=platform.python_version(),
            max_other_load=args.max_other_load,
            torch=torch.__version__, textual=textual.__version__,
            command=" ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
            summary=summary,
            turns=[{k: v for k, v in t.items() if k != "text"} | {"chars": len(t["text"])}
                   for t in turns])
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
