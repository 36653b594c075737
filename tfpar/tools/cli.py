"""Command-line plumbing shared by the commands: flags → Config, logging, error handling.

Nothing here imports TensorFlow at module level (the imports of tfpar's TF modules sit in
the functions that need them): scripts must set TF's log level before TensorFlow is
imported and split the CPU into logical devices before it initialises.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Callable, Sequence

from tfpar import config as cfg
from tfpar.errors import ConfigError, TfparError

# The defaults a user gets are the dataclasses' (one source: a flag's default is its
# field's, so ``Config()`` trains what ``tfpar-train`` with no flags trains).
_DATA, _MODEL, _TRAIN = cfg.DataConfig(), cfg.ModelConfig(), cfg.TrainConfig()
_DIST, _RUN = cfg.DistConfig(), cfg.RunConfig()


def add_preset_flag(p: argparse.ArgumentParser) -> None:
    from tfpar.tools.presets import PRESETS

    p.add_argument("--preset", default="",
                   help="a named configuration; flags given override its values: "
                        + "; ".join(f"{name}: {desc}" for name, (desc, _) in PRESETS.items()))


def add_distribution_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("distribution")
    g.add_argument("--strategy", default=_DIST.strategy,
                   help="default | one_device | mirrored | tower | pipeline | parallel_do | "
                        "multi_worker | parameter_server (default: %(default)s)")
    g.add_argument("--devices", default=",".join(_DIST.devices),
                   help="comma-separated devices, e.g. /gpu:0,/gpu:1 or /cpu:0,/cpu:1 "
                        "(default: all GPUs, else logical CPU devices)")
    g.add_argument("--cpu-devices", type=int, default=_DIST.cpu_devices,
                   help="split the host CPU into N logical devices (default: 2 for "
                        "multi-device strategies on a host without GPUs)")
    g.add_argument("--all-reduce", default=_DIST.all_reduce, choices=None,
                   help="mirrored cross-device reduction: auto | nccl | hierarchical_copy | "
                        "reduce_to_one (auto: NCCL with >=2 GPUs, else reduce_to_one)")
    g.add_argument("--variable-device", default=_DIST.variable_device,
                   help="tower: where variables live, a device or cpu (the host CPU, as "
                        "TF1's cifar10_multi_gpu_train; default: the first tower's device)")
    g.add_argument("--tower-reduce", default=_DIST.tower_reduce,
                   help="tower: controller (gather on the variable device) | ring (chunked "
                        "ring all-reduce across towers)")
    g.add_argument("--communication", default=_DIST.communication,
                   help="multi_worker collectives: auto | ring | nccl")
    g.add_argument("--cluster", default=_DIST.cluster,
                   help="multi_worker / parameter_server: where the cluster comes from: "
                        "tf_config (the TF_CONFIG variable, as Kubernetes' TFJob writes it) | "
                        "slurm (the srun job step's SLURM_* variables; multi_worker) | auto "
                        "(TF_CONFIG if set, else the Slurm step; default: %(default)s)")
    g.add_argument("--stages", default=_DIST.stages,
                   help="pipeline: part=device list, e.g. embedding=/cpu:0,rnn=/cpu:1,"
                        "softmax=/cpu:1")
    g.add_argument("--micro-batches", type=int, default=_DIST.micro_batches,
                   help="pipeline: micro-batches per global batch (default: %(default)s)")
    g.add_argument("--log-device-placement", action="store_true",
                   help="log the device every op runs on (TensorFlow's placement log)")
    g.add_argument("--soft-placement", action=argparse.BooleanOptionalAction, default=None,
                   help="let ops with no kernel on the requested device run elsewhere "
                        "(default: TensorFlow's, on; --no-soft-placement makes such an op "
                        "an error, to find ops that leave their device)")
    g.add_argument("--cpu-only", action="store_true",
                   help="hide every GPU and train on CPUs (without it, a host with NVIDIA "
                        "devices or CUDA_VISIBLE_DEVICES where TensorFlow finds no GPU "
                        "stops with an error)")
    g.add_argument("--intra-op-threads", type=int, default=_DIST.intra_op_threads,
                   help="threads one op may use (default 0: with N logical CPU devices "
                        "working at once, the host's cores / N, so replicas or stages run "
                        "side by side instead of sharing every core; else TF's default)")


def add_data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", default=_DATA.source,
                   help="synthetic | ptb | wikitext-2 | tfds:NAME | a folder with "
                        "train/valid/test splits | one UTF-8 text file, cut into "
                        "train/valid/test by --split-fractions (default: %(default)s)")
    g.add_argument("--split-fractions", default=",".join(map(str, _DATA.split_fractions)),
                   metavar="TRAIN,VALID,TEST",
                   help="a one-file --data: the train,valid,test shares of its non-blank "
                        "lines, taken as contiguous blocks in that order; each > 0, summing "
                        "to 1 (default: %(default)s)")
    g.add_argument("--tokenizer", default=_DATA.tokenizer,
                   help="how lines become tokens: whitespace (split at spaces and tabs) | "
                        "punct (words and punctuation apart: 'sir!' -> 'sir !') | char "
                        "(every character, spaces included; a line end is <eos>) "
                        "(default: %(default)s)")
    g.add_argument("--input-dir", default=_DATA.input_dir,
                   help="folder holding named corpora as <input-dir>/<name>/ "
                        "(default: %(default)s)")
    g.add_argument("--tfds-data-dir", default=None,
                   help="TensorFlow Datasets data_dir for tfds:NAME (never downloaded here)")
    g.add_argument("--mode", default=_DATA.mode,
                   help="sentence (bucketed sentences) | stream (contiguous BPTT windows)")
    g.add_argument("--bptt", type=int, default=_DATA.bptt, help="stream mode window length")
    g.add_argument("--vocab-size", type=int, default=_DATA.vocab_size,
                   help="keep at most N vocabulary entries incl. <pad> <unk> <eos> (0: all)")
    g.add_argument("--min-count", type=int, default=_DATA.min_count,
                   help="words seen fewer times in train become <unk>")
    g.add_argument("--vocab-file", default=None, metavar="PATH",
                   help="use this vocabulary instead of counting the train split: one "
                        "token per line, line number = id, the first three lines <pad> "
                        "<unk> <eos> (e.g. a previous run's <model-dir>/vocab.txt); copied "
                        "to <model-dir>/vocab.txt. It is used whole: --vocab-size and "
                        "--min-count do not apply (giving either is an error). It has no "
                        "train counts, so unigram_valid_ppl is not reported")
    g.add_argument("--max-length", type=int, default=_DATA.max_length,
                   help="longest sentence-mode example in tokens (default: %(default)s)")
    g.add_argument("--long-sentences", default=_DATA.long_sentences,
                   help="split | truncate sentences longer than --max-length")
    g.add_argument("--max-pad-fraction", type=float, default=_DATA.max_pad_fraction,
                   help="bucket boundaries keep expected padding below this share")
    g.add_argument("--shuffle-buffer", type=int, default=_DATA.shuffle_buffer, metavar="LINES",
                   help="sentence mode: each epoch shuffles the shard order, then lines "
                        "through a buffer of this many lines (memory stays bounded; the "
                        "default shuffles PTB or WikiText-2 whole) (default: %(default)s)")
    g.add_argument("--synthetic-sentences", default=f"{_DATA.synthetic_train},{_DATA.synthetic_valid},{_DATA.synthetic_test}",
                   help="synthetic corpus size: train,valid,test sentences")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--cell", default=_MODEL.cell, help="lstm | gru")
    g.add_argument("--layers", type=int, default=_MODEL.layers, help="stacked RNN layers (default: %(default)s)")
    g.add_argument("--embed-dim", type=int, default=_MODEL.embed_dim, help="embedding width (default: %(default)s)")
    g.add_argument("--hidden-dim", type=int, default=_MODEL.hidden_dim, help="RNN state width (default: %(default)s)")
    g.add_argument("--dropout", type=float, default=_MODEL.dropout,
                   help="dropout rate on the embedding output, between layers and before "
                        "the softmax (default %(default)s; 0: off); the next three flags override it "
                        "per site")
    for site, where in (("input", "the embedding output"), ("hidden", "between layers"),
                        ("output", "the last layer's output (before the softmax)")):
        g.add_argument(f"--dropout-{site}", type=float, default=None,
                       help=f"dropout rate on {where} (default: --dropout)")
    g.add_argument("--locked-dropout", action="store_true",
                   help="variational dropout: one mask per sequence for all its time steps "
                        "(default: one per token)")
    g.add_argument("--embed-dropout", type=float, default=_MODEL.embed_dropout,
                   help="word-type dropout: drop a word's vector everywhere it occurs in a "
                        "step (default 0: off)")
    g.add_argument("--weight-drop", type=float, default=_MODEL.weight_drop,
                   help="DropConnect on the recurrent matrices, one mask per step "
                        "(default 0: off)")
    g.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=_MODEL.tie_embeddings,
                   help="share the embedding with the softmax (a learned hidden-dim x "
                        "embed-dim projection before it when the two differ) (default: %(default)s)")
    g.add_argument("--init-scale", type=float, default=_MODEL.init_scale,
                   help="uniform init in [-s, s] for every weight (default %(default)s; 0: Keras "
                        "defaults)")
    g.add_argument("--precision", default=_MODEL.precision,
                   help="fp32 | bf16 (large matmuls in bfloat16 on float32 layers, for CPUs "
                        "with AMX/AVX512-BF16) | mixed_bfloat16 | mixed_float16 (Keras "
                        "mixed-precision policies: float32 variables, 16-bit compute, float32 "
                        "softmax and loss; mixed_float16 with dynamic loss scaling; for "
                        "GPUs: bfloat16 on A100/H100, float16 on V100/T4) "
                        "(default: %(default)s)")
    g.add_argument("--softmax", default=_MODEL.softmax,
                   help="the training loss: full (every word's logit) | sampled "
                        "(tf.nn.sampled_softmax_loss over each target and --num-sampled "
                        "log-uniform candidates, one draw per step shared by every replica; "
                        "for vocabularies of 100k+ words; gradients of the embedding and "
                        "softmax stay sparse). Evaluation, score, generate and the export "
                        "always use the full softmax (default: %(default)s)")
    g.add_argument("--num-sampled", type=int, default=None, metavar="K",
                   help="--softmax sampled: candidates per step, 1 <= K < vocabulary size "
                        f"(default: {cfg.DEFAULT_NUM_SAMPLED}; an error without "
                        "--softmax sampled)")
    g.add_argument("--fused-softmax", action=argparse.BooleanOptionalAction, default=_MODEL.fused_softmax,
                   help="compute the full softmax's loss block by block from the hidden "
                        "states, without the [tokens, V] logits (evaluation at any "
                        "vocabulary size); --no-fused-softmax: the logits, then the "
                        "cross-entropy (default: %(default)s)")
    g.add_argument("--softmax-blocks", default=None, metavar="ROWSxCOLUMNS",
                   help="the fused softmax's largest block of logits, tokens x vocabulary "
                        "entries (default: %dx%d, measured: tfpar/docs/benchmarks.md)"
                        % cfg.DEFAULT_SOFTMAX_BLOCKS)


def add_train_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--optimizer", default=_TRAIN.optimizer,
                   help="sgd | adam | adagrad (default: %(default)s). With --softmax sampled the "
                        "embedding and softmax gradients are sparse: sgd (no momentum) and "
                        "adagrad update only the rows a step touched; adam updates every "
                        "row (its moments decay everywhere), and so does --weight-decay"),
    g.add_argument("--lr", type=float, default=_TRAIN.lr,
                   help="learning rate (default: %(default)g, for plain SGD on the per-token mean "
                        "loss; Adam wants about 1e-3)")
    g.add_argument("--lr-decay", type=float, default=_TRAIN.lr_decay, help="per-epoch LR factor")
    g.add_argument("--decay-after", type=int, default=_TRAIN.decay_after,
                   help="epochs at the base LR before --lr-decay applies")
    g.add_argument("--scale-lr", default=_TRAIN.scale_lr,
                   help="none | linear (multiply LR by the replica count; use warm-up)")
    g.add_argument("--warmup-steps", type=int, default=_TRAIN.warmup_steps, help="linear LR warm-up steps")
    g.add_argument("--weight-decay", type=float, default=_TRAIN.weight_decay,
                   help="decoupled weight decay: each step w -= lr * wd * w (default 0: off)")
    g.add_argument("--clip-norm", type=float, default=_TRAIN.clip_norm,
                   help="clip the aggregated gradient's global norm (default %(default)s; 0: off)")
    g.add_argument("--epochs", type=int, default=_TRAIN.epochs, help="passes over train (default: %(default)s; keeps `make train` under 3 minutes)")
    g.add_argument("--max-steps", type=int, default=_TRAIN.max_steps, help="stop after N steps (0: no limit)")
    g.add_argument("--time-limit", type=float, default=_TRAIN.time_limit,
                   help="stop training after this many minutes (checkpoint, then evaluate "
                        "and export as at the end; 0: no limit)")
    g.add_argument("--steps-per-execution", type=int, default=None, metavar="N",
                   help="run N training steps per tf.function call, in a loop inside the "
                        "graph (losses come back once per call; checkpoints, summaries, "
                        "--max-steps and the non-finite guard keep their meaning) "
                        "(default: 1 on CPUs, 20 when the strategy's devices are GPUs, "
                        "where a step is short against the host's ~1 ms per call)")
    g.add_argument("--batch-size", type=int, default=_TRAIN.batch_size,
                   help="GLOBAL batch: sentences (or stream columns) over all replicas "
                        "(default: %(default)s)")
    g.add_argument("--eval-batch-size", type=int, default=_TRAIN.eval_batch_size,
                   help="global eval batch (0: --batch-size)")
    g.add_argument("--seed", type=int, default=_TRAIN.seed, help="seed for weights, shuffling, dropout")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic TF kernels for the whole process (slower; exact resumes)")
    g.add_argument("--on-nan", default=_TRAIN.on_nan, help="stop | skip a non-finite step")
    g.add_argument("--nan-patience", type=int, default=_TRAIN.nan_patience,
                   help="--on-nan skip gives up after N non-finite batches in a row "
                        "(0: never; default: %(default)s)")
    g.add_argument("--early-stop", type=int, default=_TRAIN.early_stop, metavar="EPOCHS",
                   help="stop training after this many epochs in a row without a better "
                        "valid perplexity (default 0: never)")
    g.add_argument("--init-from", default=_RUN.init_from, metavar="DIR",
                   help="fine-tune: start this run from the model weights of the trained run "
                        "in model dir DIR (not its optimizer, step, epoch or input position). "
                        "The model's shape (--cell, --layers, --embed-dim, --hidden-dim, "
                        "--tie-embeddings, --softmax, --num-sampled), --tokenizer and the "
                        "vocabulary (DIR/vocab.txt, used as --vocab-file is) are DIR's: those "
                        "flags are not used (the log names any that differed). Only for a "
                        "fresh --model-dir: one with a checkpoint resumes it, as always")
    g.add_argument("--init-weights", default=_RUN.init_weights, choices=cfg.INIT_WEIGHTS,
                   help="--init-from: latest (DIR's last checkpoint) | best (its best "
                        "epoch's, kept in DIR/best) (default: %(default)s)")
    g.add_argument("--lr-decay-on-plateau", type=float, default=_TRAIN.lr_decay_on_plateau, metavar="FACTOR",
                   help="multiply the learning rate by FACTOR after each epoch whose valid "
                        "perplexity is not the best so far (0.25: divide by 4, as PyTorch's "
                        "word_language_model; default 0: off)")


def add_output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("outputs")
    g.add_argument("--model-dir", default=_RUN.model_dir,
                   help="checkpoints + TensorBoard events; re-use to resume. A local folder "
                        "or a URL: gs://, ram://, and with tensorflow-io s3://, hdfs:// "
                        "(default: runs/<strategy>-<timestamp>)")
    g.add_argument("--export-dir", default=_RUN.export_dir,
                   help="SavedModels go to <export-dir>/<export-name>/<version>/ (a local "
                        "folder or a URL, as --model-dir)")
    g.add_argument("--export-name", default=_RUN.export_name, help="SavedModel name")
    g.add_argument("--no-export", action="store_true", help="skip the SavedModel export")
    g.add_argument("--checkpoint-every", type=int, default=_RUN.checkpoint_every,
                   help="checkpoint every N steps (0: each epoch end)")
    g.add_argument("--keep-checkpoints", type=int, default=_RUN.keep_checkpoints, help="checkpoints kept")
    g.add_argument("--evaluator-timeout", type=float, default=_RUN.evaluator_timeout, metavar="SECONDS",
                   help="a side-car evaluator task (TF_CONFIG task type evaluator) stops "
                        "with an error after this long without a new checkpoint "
                        "(default: %(default)g)")
    g.add_argument("--log-every", type=int, default=_RUN.log_every, help="summary interval in steps")
    g.add_argument("--metrics-json", default=_RUN.metrics_json,
                   help="write final metrics to this JSON file (a local path or a URL)")
    g.add_argument("--final-weights", default=_RUN.final_weights,
                   help="best | last: the weights the final valid/test evaluation and the "
                        "export use: those of the epoch with the best valid perplexity (kept "
                        "in <model-dir>/best) or the last ones (default: %(default)s)")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bar and no progress lines")
    g.add_argument("--progress-every", type=float, default=_RUN.progress_every, metavar="SECONDS",
                   help="when stdout is not a terminal (a file, a pipe, a job's log), "
                        "progress is a plain log line every SECONDS (the epoch's step, "
                        "loss, ppl and tok/s so far, and an ETA) instead of a redrawn bar; "
                        "0: one line at each epoch end (default: %(default)s)")
    g.add_argument("--profile-steps", default=",".join(map(str, _RUN.profile_steps)),
                   help="A,B: profile steps A..B into the TensorBoard log")
    g.add_argument("-v", "--verbose", action="store_true", help="TensorFlow's own logs too")


def train_parser(prog: str = "tfpar-train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Train an RNN language model on one or many devices, evaluate it, "
                    "write TensorBoard events and export a SavedModel.",
        # No abbreviations: a preset merges with the flags given by their full names, so
        # "--epoch 3" would be accepted here and then lose to the preset's epochs.
        allow_abbrev=False,
    )
    add_preset_flag(p)
    add_distribution_flags(p)
    add_data_flags(p)
    add_model_flags(p)
    add_train_flags(p)
    add_output_flags(p)
    return p


def _int_list(flag: str, text: str, count: int | None = None) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} {text!r} must be comma-separated integers") from None
    if count is not None and len(values) != count:
        raise ConfigError(f"{flag} {text!r} must have {count} comma-separated integers")
    return values


def split_fractions(text: str) -> tuple[float, ...]:
    """``"0.9,0.05,0.05"`` → ``(0.9, 0.05, 0.05)``; ConfigError if not numbers (the
    values themselves are checked by ``DataConfig``)."""
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            f"--split-fractions {text!r} must be three comma-separated numbers "
            f"train,valid,test, e.g. {','.join(map(str, cfg.SPLIT_FRACTIONS))}") from None


def dist_config_from_args(a: argparse.Namespace) -> cfg.DistConfig:
    """The DistConfig of :func:`add_distribution_flags`' flags (every script that takes
    them)."""
    from tfpar.parallel.devices import parse_device_list

    return cfg.DistConfig(
        strategy=a.strategy, devices=parse_device_list(a.devices),
        cpu_devices=a.cpu_devices, all_reduce=a.all_reduce,
        intra_op_threads=a.intra_op_threads,
        variable_device=a.variable_device, tower_reduce=a.tower_reduce,
        communication=a.communication, stages=a.stages, micro_batches=a.micro_batches,
        log_device_placement=a.log_device_placement, soft_placement=a.soft_placement,
        cpu_only=a.cpu_only, cluster=a.cluster,
    )


def config_from_args(a: argparse.Namespace) -> cfg.Config:
    """Builds and validates the Config the flags describe."""
    s_train, s_valid, s_test = _int_list("--synthetic-sentences", a.synthetic_sentences, 3)
    profile = _int_list("--profile-steps", a.profile_steps)
    if profile and (len(profile) != 2 or not 0 < profile[0] <= profile[1]):
        raise ConfigError(f"--profile-steps {a.profile_steps!r} must be A,B with 0 < A <= B")
    return cfg.Config(
        data=cfg.DataConfig(
            source=a.data, split_fractions=split_fractions(a.split_fractions),
            tokenizer=a.tokenizer, input_dir=a.input_dir, tfds_data_dir=a.tfds_data_dir,
            mode=a.mode,
            bptt=a.bptt, vocab_size=a.vocab_size, min_count=a.min_count,
            vocab_file=a.vocab_file,
            max_length=a.max_length, long_sentences=a.long_sentences,
            max_pad_fraction=a.max_pad_fraction, shuffle_buffer=a.shuffle_buffer,
            synthetic_train=s_train,
            synthetic_valid=s_valid, synthetic_test=s_test,
        ),
        model=cfg.ModelConfig(
            cell=a.cell, layers=a.layers, embed_dim=a.embed_dim, hidden_dim=a.hidden_dim,
            dropout=a.dropout, dropout_input=a.dropout_input,
            dropout_hidden=a.dropout_hidden, dropout_output=a.dropout_output,
            locked_dropout=a.locked_dropout, embed_dropout=a.embed_dropout,
            weight_drop=a.weight_drop, tie_embeddings=a.tie_embeddings, init_scale=a.init_scale,
            precision=a.precision, softmax=a.softmax, num_sampled=a.num_sampled,
            fused_softmax=a.fused_softmax, softmax_blocks=a.softmax_blocks,
        ),
        train=cfg.TrainConfig(
            optimizer=a.optimizer, lr=a.lr, lr_decay=a.lr_decay, decay_after=a.decay_after,
            scale_lr=a.scale_lr, warmup_steps=a.warmup_steps, clip_norm=a.clip_norm,
            epochs=a.epochs, max_steps=a.max_steps, batch_size=a.batch_size,
            eval_batch_size=a.eval_batch_size, seed=a.seed, deterministic=a.deterministic,
            on_nan=a.on_nan, nan_patience=a.nan_patience, weight_decay=a.weight_decay,
            time_limit=a.time_limit, steps_per_execution=a.steps_per_execution,
            early_stop=a.early_stop, lr_decay_on_plateau=a.lr_decay_on_plateau,
        ),
        dist=dist_config_from_args(a),
        run=cfg.RunConfig(
            model_dir=a.model_dir, export_dir=a.export_dir, export_name=a.export_name,
            export=not a.no_export, checkpoint_every=a.checkpoint_every,
            keep_checkpoints=a.keep_checkpoints, log_every=a.log_every,
            metrics_json=a.metrics_json, progress=not a.no_progress, progress_every=a.progress_every,
            profile_steps=profile, evaluator_timeout=a.evaluator_timeout,
            final_weights=a.final_weights, init_from=a.init_from, init_weights=a.init_weights,
        ),
    )


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of each record."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging(verbose: bool = False) -> None:
    """Human logs on stderr; TensorFlow's C++ chatter only with --verbose.

    tfpar's records go to one handler on the ``tfpar`` logger, which writes to the
    current ``sys.stderr``.
    """
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logger = logging.getLogger("tfpar")
    logger.setLevel(logging.INFO)
    # Libraries imported later may configure the root logger; tfpar's records go to
    # this one handler only, so they are never printed twice.
    logger.propagate = False
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname).1s %(name)s: %(message)s"))
        logger.addHandler(handler)
    if not verbose:
        for name in ("absl", "tensorflow", "h5py"):
            logging.getLogger(name).setLevel(logging.ERROR)


def prepare_runtime(dist: cfg.DistConfig,
                    too_late: str = "set --cpu-devices before anything runs on TensorFlow"
                    ) -> None:
    """Logical CPU devices and placement options; must run before TF initialises.

    Raises:
      DeviceError: TensorFlow was initialised with fewer logical CPU devices than ``dist``
        needs (the message ends with ``too_late``: what to do instead).
    """
    from tfpar.parallel import devices, registry

    # First: TF reads the placement log setting only when its runtime initialises (and
    # configure_cpu_devices initialises it); set later, the log stays silent.
    devices.set_placement_options(log_placement=dist.log_device_placement,
                                  soft_placement=dist.soft_placement)
    devices.configure_gpus(dist.cpu_only)  # GPUs hidden, or memory growth; usable or error
    # Cluster strategies configure TF's collective/gRPC runtime, which must happen before
    # it initialises (listing devices would); they use one CPU device per task.
    count = registry.cpu_devices_needed(dist)
    # Thread pools too are fixed when the runtime initialises: before the devices.
    devices.configure_threads(registry.intra_op_threads(dist, count),
                              requested=bool(dist.intra_op_threads))
    if not registry.traits(dist.strategy).cluster:
        devices.configure_cpu_devices(count, too_late=too_late)


def run_main(body: Callable[[], int | None]) -> int:
    """Runs a script body: a user error becomes one line on stderr and exit status 2."""
    try:
        return body() or 0
    except TfparError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def train_config(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 argv: Sequence[str]) -> cfg.Config:
    """The Config of training flags ``argv`` parsed into ``args``: ``--preset``'s values
    for the flags not given, then :func:`config_from_args`; a preset is logged with what
    it set. What ``tfpar-train`` and :func:`tfpar.make_config` both run.

    Raises:
      ConfigError: an unknown preset, or values the Config refuses.
    """
    from tfpar.tools import presets

    taken = presets.apply_preset(args, parser, argv)
    config = config_from_args(args)
    if args.preset:
        log = logging.getLogger("tfpar.tools.cli")
        log.info("preset %s (%s): %s; flags given override it", args.preset,
                 presets.PRESETS[args.preset][0], presets.describe(parser, taken))
        log.info("configuration: %s", json.dumps(
            {k: config.to_dict()[k] for k in ("data", "model", "train")},
            separators=(",", ":")))
    return config


def train_main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``tfpar-train``: flags (over ``--preset``) → Config → ``train_and_evaluate``;
    ``prog`` names the command in usage lines (default ``tfpar-train``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = train_parser(prog or "tfpar-train")
    args = parser.parse_args(argv)
    setup_logging(args.verbose or args.log_device_placement)

    def body():
        config = train_config(parser, args, argv)
        prepare_runtime(config.dist)
        from tfpar.training.run import train_and_evaluate

        train_and_evaluate(config)

    return run_main(body)
