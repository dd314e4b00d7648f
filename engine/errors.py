"""The engine's error types. Every error a user can cause (a bad file, a bad flag, a prompt
that does not fit) is a NanoqwenError whose message says what and where; the CLI prints it
to stderr and exits non-zero, the app shows it in a dialog. Anything else is a bug."""


class NanoqwenError(Exception):
    """Base class of user-facing errors."""


class FormatError(NanoqwenError):
    """A .nanoqwen file that cannot be used (wrong magic, newer version, truncated, corrupt)."""


class ContextFullError(NanoqwenError):
    """A prompt (or prompt + reply) longer than the model's context."""


class BackendUnavailable(NanoqwenError):
    """The CUDA backend cannot run here (no device, no compiler, build failed)."""


class GenerationCancelled(NanoqwenError):
    """Raised inside a backend when the caller cancelled; sessions turn it into a done event."""
