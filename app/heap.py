"""The app's cyclic garbage collection, kept away from the moments a person waits on.

Measured with a GC callback around benchmarks/bench_app.py (this 2-core machine, the bundled
model, 2026-12-04): after the model is loaded ~294k objects are tracked (torch, the
tokenizer, Textual), and each full (generation 2) collection held the UI thread, and with it
the GIL the engine thread needs, for 180-240 ms: one of them began 185 ms after Enter, inside
the wait for the first text. On the H200's host two of four eager new-chat turns showed their
first text ~180 ms after Enter against ~27 ms for the others. Three rules:

* `settle()` once a model is loaded: what is alive then (the model, the libraries, the app)
  lives as long as the app, so it moves to the permanent generation (`gc.freeze`); a full
  collection then walks only what the chats make (measured ~78k objects, 50-60 ms).
* `pause()` / `resume()`: no collection from Enter until the first text's frame is out
  (chat._FirstFrame; at most its FIRST_TEXT_WAIT plus a frame).
* `collect_soon(app)` when a reply ends: one full collection after its last frame, where
  nobody waits, so the next one is less likely to fall inside a stream or the next Enter.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Freeze what is alive now (after a collection); a previous model's objects, frozen
    with it, become collectable first."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def pause() -> bool:
    """Stop automatic collections; returns whether they were on (for `resume`)."""
    was = gc.isenabled()
    gc.disable()
    return was


def resume(was: bool) -> None:
    if was:
        gc.enable()


def restore() -> None:
    """When the app ends: collections on, nothing frozen (a process that goes on, as a test
    run does, gets Python's own policy back)."""
    gc.enable()
    gc.unfreeze()


def collect_soon(app) -> None:
    """A full collection once the app's next frame is made."""
    app.call_after_refresh(gc.collect)
