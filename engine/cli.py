"""`nanoqwen`: the offline commands (convert, info, generate, bench).

Argument parsing lives here; each command's work lives in its module, imported lazily so
`nanoqwen --help` stays fast. User errors (NanoqwenError) go to stderr with exit code 1;
Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import sys

from .errors import NanoqwenError


def add_sampler_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp-style sampler flags; defaults None mean "the model's / llama.cpp's default"."""
    p.add_argument("--temp", type=float, default=None, help="temperature (0 = greedy)")
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
    g.add_argument("--backend", choices=["auto", "cuda", "reference"], default="auto")
    g.add_argument("--mode", choices=["graph", "eager"], default="graph", help="CUDA decode mode")
    g.add_argument("--stats", action="store_true", help="print timing to stderr at the end")
    add_sampler_args(g)

    b = sub.add_parser("bench", help="pp/tg benchmark in llama-bench's terms")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", "-m")
    src.add_argument("--synthetic", metavar="PRESET")
    b.add_argument("-p", "--n-prompt", type=int, default=512)
    b.add_argument("-n", "--n-gen", type=int, default=128)
    b.add_argument("-r", "--repetitions", type=int, default=5)
    b.add_argument("--mode", default="graph,eager", help="comma list of graph, eager")
    b.add_argument("--backend", choices=["auto", "cuda", "reference"], default="auto")
    b.add_argument("--json", action="store_true")
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
        return run(args) or 0
    except NanoqwenError as e:
        print(f"nanoqwen {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
