"""``tfpar-generate``: continue prompts with an exported SavedModel or a training run's
weights.

    tfpar-generate --model saved_models/tfpar_lm --prompt "the cat" --seed 1
    tfpar-generate --model-dir runs/mirrored-... --weights best --prompt "the cat" --seed 1

Prints ``[prompt] continuation`` per prompt; a continuation runs over several lines when
the model writes sentence ends (each ``<eos>`` is a line break). ``--model``: only
TensorFlow and the SavedModel's ``generate`` signature are used, so this is exactly what
a served model returns. ``--model-dir``: the run's model is rebuilt from its config.json
and vocab.txt, its latest checkpoint (``--weights best``: the best epoch's) restored, and
the same signature traced around it, so the text is what the export of those weights
would generate with the same seed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from tfpar.errors import ConfigError
from tfpar.tools.cli import run_main, setup_logging
from tfpar.tools.model_dir import (add_cell_flag, add_weights_flag, check_weights,
                                   restored_model)
from tfpar.tools.parsing import Parser

DESCRIPTION = "Continue prompts with an exported SavedModel or a training run's weights."


def parser(prog: str = "tfpar-generate") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=DESCRIPTION, allow_abbrev=False)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model",
                       help="a SavedModel version dir (saved_models/<name>/<version>) or its "
                            "name dir (the highest version is used)")
    which.add_argument("--model-dir", help="a training run's model dir (config.json, "
                                           "vocab.txt, checkpoints/, best/)")
    add_weights_flag(p)
    add_cell_flag(p)
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
    check_weights(args)


def model_dir_module(model_dir: str, weights: str, cell: str | None = None):
    """What the export of the run's ``weights`` would hold, in memory: a
    :class:`~tfpar.serving.export.LanguageModelModule` around the restored model
    (``cell``: the command line's ``--cell``)."""
    import logging

    from tfpar.serving.export import LanguageModelModule

    model, vocab, path = restored_model(model_dir, weights, cell)
    logging.getLogger(__name__).info("weights: %s (%s)", path, weights)
    return LanguageModelModule(model, os.path.join(model_dir, "vocab.txt"),
                               tokenizer=vocab.tokenizer)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``tfpar-generate``: 0, or 2 on a usage error."""
    args = parser(prog or "tfpar-generate").parse_args(argv)
    setup_logging(args.verbose)

    def body():
        check(args)
        from tfpar.serving import export

        if args.model_dir:
            loaded = model_dir_module(args.model_dir, args.weights, args.cell)
        else:
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
