"""`nanoqwen`: the offline commands (convert, info, generate, bench).

Argument parsing lives here; each command's work lives in its module, imported lazily so
`nanoqwen --help` stays fast. Exit statuses, as a Unix tool's:
  0    done
  1    a user error (NanoqwenError: one line on stderr, "nanoqwen CMD: error: ..."), including
       stdout that cannot be written (a full disk: "cannot write to stdout: No space left on
       device")
  130  Ctrl-C
  141  stdout was closed by the reader (`nanoqwen generate ... | head -c 20`): the command
       stops at once, quietly, with 128 + SIGPIPE, the status a shell reports for a C tool
       killed by SIGPIPE (`yes | head`). Python ignores SIGPIPE, so the write raises
       BrokenPipeError instead; we catch it, point stdout at /dev/null (so the interpreter's
       final flush cannot fail again) and return 141. We chose 141 over the 1 of Python's
       documented recipe so that `set -o pipefail` scripts see the same status as from any
       other tool, and a real failure (1) stays distinguishable from a reader that had enough.
"""

from __future__ import annotations

import argparse
import os
import sys

from .errors import NanoqwenError
from .service import BACKENDS, MODES, PREFILL_WEIGHTS
from .spec import SPEC_MODES

EXIT_SIGPIPE = 128 + 13


class OutputError(NanoqwenError):
    """stdout cannot be written (a full disk, an I/O error); a closed pipe is not this."""


def write_stdout(text: str) -> None:
    """Write and flush `text`; BrokenPipeError passes through (main() ends quietly with 141),
    any other OSError becomes one OutputError line."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as e:
        raise OutputError(f"cannot write to stdout: {e.strerror or e}") from e


def _stdout_to_devnull() -> None:
    """After a failed write: what is still buffered can never be written; send it (and the
    interpreter's flush at exit) to /dev/null instead of a second error."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):
        pass  # stdout is not a real file (a test's capture): nothing to protect


def add_sampler_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp-style sampler flags; defaults None mean "the model's / llama.cpp's default"."""
    p.add_argument("--temp", type=float, default=None, help="temperature, >= 0 (0 = greedy)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repeat-penalty", type=float, default=None)
    p.add_argument("--repeat-last-n", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="nanoqwen", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="Hugging Face checkpoint (or a synthetic model) -> .nanoqwen")
    c.add_argument("hf_dir", nargs="?", help="Hugging Face Qwen2 checkpoint directory")
    c.add_argument("-o", "--output", required=True, help="output .nanoqwen file")
    c.add_argument("--synthetic", metavar="PRESET", help="write a random-weight model of a preset")
    c.add_argument("--seed", type=int, default=0, help="seed for --synthetic")
    c.add_argument("--tokenizer", help="tokenizer.json to embed (with --synthetic)")
    c.add_argument("--max-context", type=int, default=None, help="override max_position_embeddings")

    i = sub.add_parser("info", help="print a .nanoqwen file's header")
    i.add_argument("file")
    i.add_argument("--verify", action="store_true", help="also check every tensor's checksum")

    g = sub.add_parser("generate", help="generate a reply, streaming to stdout")
    g.add_argument("--model", "-m", required=True)
    g.add_argument("--prompt", "-p", default=None, help="prompt text (default: read stdin)")
    g.add_argument("--system", default=None, help="system prompt")
    g.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    g.add_argument("-n", "--n-predict", type=int, default=256, help="max new tokens")
    g.add_argument("--backend", choices=BACKENDS, default="auto")
    g.add_argument("-t", "--threads", type=int, default=None,
                    help="CPU threads of the reference backend (default: one per core)")
    g.add_argument("--mode", choices=MODES, default="graph", help="CUDA decode mode")
    g.add_argument("--stats", action="store_true", help="print timing to stderr at the end")
    g.add_argument("--spec", choices=("off",) + SPEC_MODES, default="off",
                   help="speculative decoding: ngram = prompt lookup, draft = a draft model "
                        "(--draft); both backends")
    g.add_argument("--draft", default=None, metavar="FILE",
                   help="the draft model of --spec draft (a .nanoqwen of the same tokenizer)")
    add_sampler_args(g)

    b = sub.add_parser("bench", help="pp/tg benchmark in llama-bench's terms")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--model", "-m", help="a .nanoqwen file (default: the bundled model)")
    src.add_argument("--synthetic", metavar="PRESET", help="random weights on the GPU (CUDA)")
    b.add_argument("-p", "--n-prompt", type=int, default=None, help="prompt tokens (default 512)")
    b.add_argument("-n", "--n-gen", type=int, default=128)
    b.add_argument("-r", "--repetitions", type=int, default=5)
    b.add_argument("-d", "--depth", type=int, default=0,
                   help="tokens already in the cache before each test (llama-bench's -d): "
                        "prompt processing and decode at that context")
    b.add_argument("--mode", default=None,
                   help=f"comma list of {', '.join(MODES)} (default: every mode the backend has)")
    b.add_argument("--backend", choices=BACKENDS, default="auto")
    b.add_argument("-t", "--threads", type=int, default=None,
                    help="CPU threads of the reference backend (default: one per core)")
    b.add_argument("--prefill-weights", choices=PREFILL_WEIGHTS, default="auto",
                   help="the CUDA prefill's weights: fp16 copies kept resident, dequantized a "
                        "layer at a time, or the INT4 weights themselves (gemm_int4); auto: "
                        "resident where it fits with room to spare, else dequant where a "
                        "layer's copy fits, else int4")
    b.add_argument("--json", action="store_true")
    b.add_argument("--spec", choices=SPEC_MODES, default=None,
                   help="speculative decoding on the code-editing workload (engine/"
                        "spec_workload.py): plain and speculative rows per request group, "
                        "-n tokens a reply at most; needs a file with its tokenizer")
    b.add_argument("--draft", default=None, metavar="FILE", help="the draft model of --spec draft")
    add_sampler_args(b)  # decode samples greedily unless one is given (bench.bench_sampler)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "convert":
            from .convert import cli_convert as run
        elif args.command == "info":
            from .format import cli_info as run
        elif args.command == "generate":
            from .cli_generate import cli_generate as run
        else:
            from .bench import cli_bench as run
        rc = run(args) or 0
        write_stdout("")  # flush what print() buffered: a full disk shows here, as one line
        return rc
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_SIGPIPE
    except NanoqwenError as e:
        if isinstance(e, OutputError):
            _stdout_to_devnull()
        print(f"nanoqwen {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
