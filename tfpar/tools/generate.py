"""``tfpar-generate``: continue prompts with an exported SavedModel.

    tfpar-generate --model saved_models/tfpar_lm --prompt "the cat" --seed 1

Prints ``[prompt] continuation`` per prompt; a continuation runs over several lines when
the model writes sentence ends (each ``<eos>`` is a line break). Only TensorFlow and the
SavedModel's ``generate`` signature are used, so this is exactly what a served model
returns.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from tfpar.errors import ConfigError
from tfpar.tools.cli import run_main, setup_logging

DESCRIPTION = "Continue prompts with an exported SavedModel."


def parser(prog: str = "tfpar-generate") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    p.add_argument("--model", required=True,
                   help="a SavedModel version dir (saved_models/<name>/<version>) or its name "
                        "dir (the highest version is used)")
    p.add_argument("--prompt", action="append", default=None,
                   help="text to continue, split by the model's own tokenizer (words, or "
                        "characters for a char model); repeat for several (default: one "
                        "sentence start)")
    p.add_argument("--max-tokens", type=int, default=30,
                   help="most tokens per continuation, sentence ends included "
                        "(default: %(default)s)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="end each continuation at its first sentence end (default: go on "
                        "across sentences, one line each)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k most likely tokens (0: all; 1: greedy)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same text")
    p.add_argument("-v", "--verbose", action="store_true", help="TensorFlow's own logs too")
    return p


def check(args: argparse.Namespace) -> None:
    for flag, value in (("--max-tokens", args.max_tokens), ("--temperature", args.temperature),
                        ("--top-k", args.top_k)):
        if not value >= 0:
            raise ConfigError(f"{flag} must be >= 0, got {value!r}")
    if not -2**31 <= args.seed < 2**31:
        raise ConfigError(f"--seed must fit in 32 bits, got {args.seed}")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``tfpar-generate``: 0, or 2 on a usage error."""
    args = parser(prog or "tfpar-generate").parse_args(argv)
    setup_logging(args.verbose)

    def body():
        check(args)
        from tfpar.serving import export

        loaded, _ = export.load_saved_model(args.model)
        prompts = args.prompt or [""]
        texts = export.generate_text(loaded, prompts, max_tokens=args.max_tokens,
                                     temperature=args.temperature, top_k=args.top_k,
                                     seed=args.seed, stop_at_eos=args.stop_at_eos)
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            if i and args.stop_at_eos is False:
                print()  # continuations span lines: a blank line between prompts
            print(f"[{prompt}] {text.rstrip()}")

    return run_main(body)


if __name__ == "__main__":
    from tfpar.tools.commands import start

    sys.exit(start("tfpar.tools.generate"))
