"""The two figures every speed report is made of, in one place: the session's end-of-turn
Stats, the service's rolling updates, `nanoqwen bench`'s rows and the app's perf panel.

Step times are milliseconds (StepEvent.step_ms); a rate is tokens over the time they took, so
a turn's decode rate is len(steps) / sum(steps), not the mean of per-step rates."""

from __future__ import annotations

import statistics
from collections.abc import Collection


def median_ms(steps_ms: Collection[float]) -> float | None:
    """The median step (ms per token), None when there was no step."""
    return statistics.median(steps_ms) if steps_ms else None


def tokens_per_s(n_tokens: float, total_ms: float) -> float | None:
    """n_tokens made in total_ms milliseconds, per second; None when no time passed."""
    return n_tokens / total_ms * 1e3 if total_ms > 0 else None
