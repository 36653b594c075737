"""``tfpar-evaluate``: perplexity of a corpus split, from a SavedModel or from a training
run's model dir.

    tfpar-evaluate --model saved_models/tfpar_lm --data ptb --split test
    tfpar-evaluate --model-dir runs/mirrored-... --strategy mirrored --json

``--model``: scores every sentence with the SavedModel's ``score`` signature (what a
served model computes; a sentence longer than the run's --max-length is scored whole).
``--model-dir``: rebuilds the model from the run's config.json, vocab.txt and latest
checkpoint (``--weights best``: the best epoch's, in best/) and evaluates it exactly as
training does (``tfpar.training.run.evaluate``),
distributed over --strategy / --cpu-devices if asked. Either way perplexity is
exp(total nll / total tokens) over the whole split.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Sequence

from tfpar.config import Config, DataConfig, DistConfig, parse_fractions
from tfpar.errors import ConfigError
from tfpar.tools import cli
from tfpar.tools.model_dir import (add_cell_flag, add_weights_flag, check_cell_named,
                                   check_weights, checkpoint_path, restore_weights,
                                   stored_run)
from tfpar.tools.parsing import Parser

SPLITS = ("train", "valid", "test")
DESCRIPTION = ("Perplexity of a corpus split, from a SavedModel or from a training run's "
               "model dir.")


def parser(prog: str = "tfpar-evaluate") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=DESCRIPTION, allow_abbrev=False)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="a SavedModel version dir or its name dir (highest "
                                       "version)")
    which.add_argument("--model-dir", help="a training run's model dir (config.json, "
                                           "vocab.txt, checkpoints/)")
    p.add_argument("--data", default=None,
                   help="corpus, as for tfpar-train (default: the run's own with --model-dir, "
                        "synthetic with --model)")
    p.add_argument("--input-dir", default=None, help="folder of named corpora (default: "
                                                     "the run's, else 'input')")
    p.add_argument("--split-fractions", default=None, metavar="TRAIN,VALID,TEST",
                   help="a one-file --data: the train,valid,test shares of its lines, as for "
                        "tfpar-train (default: the run's with --model-dir, else 0.9,0.05,0.05)")
    p.add_argument("--synthetic-sentences", default="20000,2000,2000",
                   help="--model with synthetic data: train,valid,test sentences")
    p.add_argument("--seed", type=int, default=0,
                   help="--model with synthetic data: the training run's --seed")
    p.add_argument("--split", default="valid", choices=SPLITS, help="(default: %(default)s)")
    add_weights_flag(p)
    add_cell_flag(p)
    p.add_argument("--batch-size", type=int, default=0,
                   help="global eval batch (default: the run's, or 64 with --model)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    cli.add_distribution_flags(p)
    p.add_argument("-v", "--verbose", action="store_true", help="TensorFlow's own logs too")
    return p


def evaluate_model_dir(args) -> dict:
    """Rebuilds the run's model from its ``--weights`` checkpoint and evaluates it like
    training."""
    config, vocab_path = stored_run(args.model_dir)
    check_cell_named(config, args.cell, args.model_dir)
    data_fields = {k: v for k, v in (("source", args.data), ("input_dir", args.input_dir))
                   if v is not None}
    if args.split_fractions is not None:
        data_fields["split_fractions"] = parse_fractions(args.split_fractions)
    config = config.replace(data=data_fields)
    config = Config(data=config.data, model=config.model, train=config.train,
                    dist=cli.dist_config_from_args(args), run=config.run)
    cli.prepare_runtime(config.dist)  # Logical CPU devices: before TensorFlow starts.
    from tfpar.data.pipeline import InputData
    from tfpar.data.sources import load_corpus
    from tfpar.data.vocab import Vocab
    from tfpar.objective.step import make_eval_step
    from tfpar.parallel.registry import build_strategy
    from tfpar.training.loop import evaluate
    from tfpar.training.state import build_train_state

    ckpt = checkpoint_path(args.model_dir, args.weights)
    plugin = build_strategy(config.dist, config.model)  # placed as training placed it
    batch = args.batch_size or config.train.global_eval_batch_size
    if batch < plugin.num_replicas:
        raise ConfigError(f"--batch-size {batch} is smaller than the {plugin.num_replicas} "
                          f"replicas of --strategy {plugin.name}; use >= {plugin.num_replicas}")
    vocab = Vocab.load(vocab_path, tokenizer=config.data.tokenizer)
    state = build_train_state(plugin.scope(), config.model, len(vocab),
                              seed=config.train.seed, fixed_shapes=config.data.mode == "stream")
    model = state.model
    restore_weights(state.trackables()["layers"], ckpt)
    corpus = load_corpus(config.data, seed=config.train.seed)
    data = InputData(corpus.splits, vocab, config.data, seed=config.train.seed)
    nll, tokens = evaluate(plugin, make_eval_step(plugin, model), data, args.split, batch)
    return {"model": ckpt, "corpus": corpus.name, "strategy": plugin.name,
            "replicas": plugin.num_replicas, "nll": nll, "tokens": tokens}


def evaluate_saved_model(args) -> dict:
    """Scores every sentence of the split with the SavedModel's ``score`` signature."""
    if args.strategy != DistConfig().strategy or args.cpu_devices or args.devices:
        raise ConfigError("--strategy, --devices and --cpu-devices apply to --model-dir only; "
                          "a SavedModel is scored on one device")
    check_weights(args)
    fractions = {} if args.split_fractions is None else {
        "split_fractions": parse_fractions(args.split_fractions)}
    data = DataConfig(source=args.data or "synthetic", input_dir=args.input_dir or "input",
                      **cli.synthetic_sentences(args.synthetic_sentences), **fractions)
    from tfpar.serving import export
    from tfpar.data.sources import load_corpus

    loaded, version_dir = export.load_saved_model(args.model)
    corpus = load_corpus(data, seed=args.seed)
    nll, tokens = export.score_lines(loaded, corpus.splits[args.split], args.batch_size or 64)
    return {"model": version_dir, "corpus": corpus.name, "nll": nll, "tokens": tokens}


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``tfpar-evaluate``: 0, or 2 on a usage error."""
    args = parser(prog or "tfpar-evaluate").parse_args(argv)
    cli.setup_logging(args.verbose)

    def body():
        if args.batch_size < 0:
            raise ConfigError(f"--batch-size must be >= 0, got {args.batch_size}")
        result = evaluate_model_dir(args) if args.model_dir else evaluate_saved_model(args)
        result["split"] = args.split
        result["perplexity"] = math.exp(result["nll"] / result["tokens"])
        if args.json:
            print(json.dumps(result, indent=2, sort_keys=True))
        else:
            print(f"{args.split} perplexity {result['perplexity']:.3f} over "
                  f"{result['tokens']:.0f} tokens ({result['model']})")

    return cli.run_main(body)


if __name__ == "__main__":
    from tfpar.tools.commands import start

    sys.exit(start("tfpar.tools.evaluate"))
