"""One typed configuration for a tfpar run.

Every field holds the default a user gets and its flag's help text (:func:`flag`;
tfpar.tools.cli makes the command's flags from the fields), and is validated on
construction, so a bad value fails at the start of a run with a one-line
:class:`~tfpar.errors.ConfigError` that names it.
Batch sizes are *global* (summed over every replica) unless a name says otherwise.
The whole config round-trips through JSON; a copy is stored beside the checkpoints so a
resumed run can refuse an incompatible configuration.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from tfpar.errors import ConfigError

MODES = ("sentence", "stream")
LONG_SENTENCES = ("split", "truncate")
CELLS = ("lstm", "gru")
# --cell MODULE:NAME: a user's Keras RNN cell (tfpar.model.cells; tfpar/docs/cells.md).
_CUSTOM_CELL = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*")
# Keras mixed-precision policies (tfpar.model.precision) and the CPU bf16 matmul option.
MIXED_PRECISIONS = ("mixed_bfloat16", "mixed_float16")
PRECISIONS = ("fp32", "bf16", *MIXED_PRECISIONS)
OPTIMIZERS = ("sgd", "adam", "adagrad")
SOFTMAXES = ("full", "sampled")
# The fused softmax's largest block of logits (rows = tokens, columns = vocabulary
# entries) when --softmax-blocks does not give it: measured (tfpar/docs/benchmarks.md,
# "The fused output layer"). On the 2-core AVX-512 host it was measured on, TensorFlow's
# matmuls over fewer rows or words run well below its rate for the whole product, which
# costs more than cache-sized blocks save: training is fastest with a row's words in one
# block (V = 100k: 0.84 of the products' limit in one block, 0.62 in two, 0.46 in seven;
# the logits then computed twice), evaluation barely cares (V = 793,471: 0.65-0.67 for
# 16k to 64k columns). So every vocabulary up to 131,072 words trains in one column
# block, and a larger one evaluates in blocks of at most 1024 x 131,072 floats (512 MB).
DEFAULT_SOFTMAX_BLOCKS = (1024, 131072)
# --num-sampled when --softmax sampled does not give it (Jozefowicz et al. 2016: 8192).
DEFAULT_NUM_SAMPLED = 8192
# --forget-bias when an LSTM run does not give it: the forget gate's initial bias. Chosen
# by one epoch on words and characters beside 1.0 (tfpar/docs/quality.md).
DEFAULT_FORGET_BIAS = 0.0
# The weights a run evaluates, keeps and exports: the moving average of its steps' weights
# with this momentum (tfpar/docs/training.md, Averaged weights; tfpar/docs/quality.md).
DEFAULT_EMA_MOMENTUM = 0.99
ALL_REDUCE = ("auto", "nccl", "hierarchical_copy", "reduce_to_one")
SCALE_LR = ("none", "linear")
ON_NAN = ("stop", "skip")
FINAL_WEIGHTS = ("best", "last")
# --init-weights: a trained run's latest checkpoint or its best epoch's.
INIT_WEIGHTS = ("latest", "best")
# The model fields that decide its weights' shapes (and names): a checkpoint fits only a
# model with the same values.
MODEL_SHAPE = ("cell", "layers", "embed_dim", "hidden_dim", "tie_embeddings", "softmax")
TOWER_REDUCE = ("controller", "ring")
COMMUNICATION = ("auto", "ring", "nccl")
# Where a cluster strategy learns its cluster: TF_CONFIG if set else a Slurm job step
# (auto), or only one of them.
CLUSTER_SOURCES = ("auto", "tf_config", "slurm")
# How text becomes tokens; defined in tfpar/data/tokenize.py.
TOKENIZERS = ("whitespace", "punct", "char")
# How a one-file corpus is cut into train, valid and test by default.
SPLIT_FRACTIONS = (0.9, 0.05, 0.05)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"unknown {name} {value!r}; expected one of: {', '.join(allowed)}")


def is_custom_cell(cell: str) -> bool:
    """Whether ``--cell`` names a user's cell (``MODULE:NAME``) rather than a built-in."""
    return ":" in cell


def check_cell(cell: str) -> None:
    """Raises ConfigError unless ``cell`` is lstm, gru or of the form MODULE:NAME (only
    its form: nothing is imported here; tfpar.model.cells imports it)."""
    if cell in CELLS or _CUSTOM_CELL.fullmatch(cell):
        return
    raise ConfigError(f"unknown cell {cell!r}; expected one of: {', '.join(CELLS)}, or "
                      "MODULE:NAME for a Keras RNN cell of your own (e.g. "
                      "tfpar.examples.layer_norm_lstm:LayerNormLSTMCell)")


def check_tokenizer(name: str) -> None:
    """Raises ConfigError unless ``name`` is one of :data:`TOKENIZERS`."""
    _choice("tokenizer", name, TOKENIZERS)


def check_split_fractions(fractions: tuple[float, ...]) -> None:
    """Raises ConfigError unless ``fractions`` are three positive numbers summing to 1."""
    shown = ",".join(f"{f:g}" for f in fractions)
    if len(fractions) != 3:
        raise ConfigError(
            f"split-fractions {shown!r} must be three numbers train,valid,test, "
            f"e.g. {_joined(SPLIT_FRACTIONS)}")
    for split, f in zip(("train", "valid", "test"), fractions):
        if not f > 0:
            raise ConfigError(
                f"split-fractions {shown!r}: the {split} fraction must be > 0, got {f:g}; "
                "every split needs lines")
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise ConfigError(
            f"split-fractions {shown!r} sum to {sum(fractions):.6g}, not 1; give three "
            f"fractions that sum to 1, e.g. {_joined(SPLIT_FRACTIONS)}")


def softmax_block_sizes(text: str) -> tuple[int, int]:
    """``"ROWSxCOLUMNS"`` → ``(rows, columns)``, two positive integers; ConfigError
    naming ``text`` otherwise."""
    rows, sep, columns = str(text).lower().partition("x")
    if sep and rows.isdigit() and columns.isdigit() and int(rows) > 0 and int(columns) > 0:
        return int(rows), int(columns)
    raise ConfigError(f"softmax-blocks {text!r} must be ROWSxCOLUMNS, two positive integers "
                      "(tokens x vocabulary entries of logits at a time), e.g. 1024x16384")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")


def flag(default: Any, help: str, **spec: Any) -> Any:
    """A config field with its command-line flag (tfpar.tools.cli makes the flags from the
    fields: one default, one help text, both here).

    ``help`` is the flag's help; the flag is ``--<field-name>`` with dashes unless ``spec``
    says otherwise: ``name`` (the flag's name), ``group`` (its --help group, default the
    section's), ``metavar``, ``parse`` (text -> value, for a tuple field; ConfigError
    naming the text when it cannot), ``cli=False`` (no flag of its own), ``names`` (a
    list --help ends the help with, kept where the names live: ``"strategies"``, the
    registry's, tfpar.parallel.registry).
    """
    return dataclasses.field(default=default, metadata={"help": help, **spec})


def _joined(values: tuple) -> str:
    return ",".join(map(str, values))


def parse_fractions(text: str) -> tuple[float, ...]:
    """``"0.9,0.05,0.05"`` → ``(0.9, 0.05, 0.05)``; ConfigError if not numbers (the
    values themselves are checked by :class:`DataConfig`)."""
    try:
        return tuple(float(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(
            f"--split-fractions {text!r} must be three comma-separated numbers "
            f"train,valid,test, e.g. {_joined(SPLIT_FRACTIONS)}") from None


def parse_ints(flag_name: str, text: str, count: int | None = None) -> tuple[int, ...]:
    """``"1,2,3"`` → ``(1, 2, 3)``; ConfigError naming ``flag_name`` and ``text`` if they
    are not integers (or not ``count`` of them)."""
    try:
        values = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag_name} {text!r} must be comma-separated integers") from None
    if count is not None and len(values) != count:
        raise ConfigError(f"{flag_name} {text!r} must have {count} comma-separated integers")
    return values


def parse_devices(text: str) -> tuple[str, ...]:
    """``'/gpu:0,/gpu:1'`` → ``('/gpu:0', '/gpu:1')``; empty text → ``()``."""
    items = tuple(p.strip() for p in str(text).split(",") if p.strip())
    if str(text).strip() and not items:
        raise ConfigError(f"--devices {text!r} names no device; use a form like /cpu:0,/cpu:1")
    return items


def parse_profile_steps(text: str) -> tuple[int, ...]:
    """``"A,B"`` → ``(A, B)`` with ``0 < A <= B``; empty → ``()``."""
    steps = parse_ints("--profile-steps", text)
    if steps and (len(steps) != 2 or not 0 < steps[0] <= steps[1]):
        raise ConfigError(f"--profile-steps {text!r} must be A,B with 0 < A <= B")
    return steps


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes batches."""

    source: str = flag(
        "synthetic", "synthetic (generated, with an exact oracle) | ptb | wikitext-2 (found "
        "in --input-dir) | tfds:NAME (TensorFlow Datasets, never downloaded here) | a folder "
        "with train/valid/test splits | one UTF-8 text file, cut into train/valid/test by "
        "--split-fractions", name="data")
    split_fractions: tuple[float, float, float] = flag(
        SPLIT_FRACTIONS, "a one-file --data: the train,valid,test shares of its non-blank "
        "lines, taken as contiguous blocks in that order; each > 0, summing to 1",
        metavar="TRAIN,VALID,TEST", parse=parse_fractions)
    tokenizer: str = flag(
        "whitespace", "how lines become tokens (tfpar/data/tokenize.py): whitespace (split at "
        "spaces and tabs) | punct (words and punctuation apart: 'sir!' -> 'sir !') | char "
        "(every character, spaces included; a line end is <eos>)")
    input_dir: str = flag("input", "folder holding named corpora as <input-dir>/<name>/")
    tfds_data_dir: str | None = flag(
        None, "TensorFlow Datasets data_dir for tfds:NAME (never downloaded here; default: "
        "TFDS's own)")
    mode: str = flag(
        "sentence", "sentence (one line per example, bucketed and padded) | stream (the split "
        "as contiguous columns cut into --bptt windows, the RNN state carried across them)")
    bptt: int = flag(35, "stream mode: window length in time steps")
    vocab_size: int = flag(
        0, "keep at most N vocabulary entries, <pad> <unk> <eos> included (0: every word)")
    min_count: int = flag(1, "words seen fewer times than this in train become <unk>")
    # A resume compares the vocabulary file's contents, not its path, with the run's
    # saved vocab.txt.
    vocab_file: str | None = flag(
        None, "use this vocabulary instead of counting the train split: one token per line, "
        "line number = id, the first three lines <pad> <unk> <eos> (e.g. a previous run's "
        "<model-dir>/vocab.txt); copied to <model-dir>/vocab.txt. It is used whole: "
        "--vocab-size and --min-count do not apply (giving either is an error). It has no "
        "train counts, so unigram_valid_ppl is not reported (default: count the train split)",
        metavar="PATH")
    max_length: int = flag(
        80, "sentence mode: the longest example, in predicted tokens (words + <eos>)")
    long_sentences: str = flag(
        "split", "a sentence longer than --max-length: split (into --max-length pieces; every "
        "token is still predicted once) | truncate (the tail is dropped and counted in the log)")
    max_pad_fraction: float = flag(
        0.02, "bucket boundaries are chosen from the train length histogram so that the "
        "expected share of pad tokens stays below this")
    shuffle_buffer: int = flag(
        100_000, "sentence mode: each epoch shuffles the shard order, then lines through a "
        "buffer of this many lines (memory stays bounded; the default holds PTB's 42,068 "
        "lines or WikiText-2's 23,767: a full shuffle)", metavar="LINES")
    # One flag for the three: --synthetic-sentences TRAIN,VALID,TEST (tfpar.tools.cli).
    synthetic_train: int = flag(20000, "synthetic corpus: train sentences", cli=False)
    synthetic_valid: int = flag(2000, "synthetic corpus: valid sentences", cli=False)
    synthetic_test: int = flag(2000, "synthetic corpus: test sentences", cli=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "split_fractions", tuple(self.split_fractions))
        check_split_fractions(self.split_fractions)
        check_tokenizer(self.tokenizer)
        _choice("mode", self.mode, MODES)
        _choice("long-sentences policy", self.long_sentences, LONG_SENTENCES)
        _positive("bptt", self.bptt)
        _positive("shuffle-buffer", self.shuffle_buffer)
        _non_negative("vocab-size", self.vocab_size)
        if 0 < self.vocab_size < 4:
            raise ConfigError(
                f"vocab-size {self.vocab_size} is too small: it must hold <pad>, <unk>, "
                "<eos> and at least one word (>= 4), or be 0 for no limit"
            )
        _positive("min-count", self.min_count)
        if self.vocab_file is not None:
            for flag, value, default in (("vocab-size", self.vocab_size, 0),
                                         ("min-count", self.min_count, 1)):
                if value != default:
                    raise ConfigError(
                        f"{flag} {value} does not apply to vocab-file {self.vocab_file!r}, "
                        f"which is used whole; drop --{flag} (or --vocab-file to count the "
                        "train split)")
        if self.max_length < 2:
            raise ConfigError(f"max-length must be >= 2, got {self.max_length!r}")
        if not 0 < self.max_pad_fraction < 1:
            raise ConfigError(f"max-pad-fraction must be in (0, 1), got {self.max_pad_fraction!r}")
        for name in ("synthetic_train", "synthetic_valid", "synthetic_test"):
            _positive(name.replace("_", "-"), getattr(self, name))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The RNN language model's architecture."""

    cell: str = flag(
        "lstm", "recurrent cell: lstm | gru | MODULE:NAME, your own Keras RNN cell: NAME in "
        "the importable MODULE is a cell class or a factory, called with --hidden-dim, whose "
        "cell has call(inputs, states) -> (output [B, H], new states) and a state_size of one "
        "or several widths (e.g. tfpar.examples.layer_norm_lstm:LayerNormLSTMCell; runs "
        "Keras' own loop, slower than the built-in cells: tfpar/docs/cells.md)",
        metavar="CELL")
    layers: int = flag(2, "stacked recurrent layers")
    embed_dim: int = flag(200, "word embedding width")
    hidden_dim: int = flag(200, "recurrent state width of every layer")
    dropout: float = flag(
        0.2, "dropout rate on the embedding output, between layers and before the softmax "
        "(0: off); the next three flags override it per site")
    dropout_input: float | None = flag(
        None, "dropout rate on the embedding output, AWD-LSTM's dropouti (default: --dropout)")
    dropout_hidden: float | None = flag(
        None, "dropout rate between recurrent layers, dropouth (default: --dropout)")
    dropout_output: float | None = flag(
        None, "dropout rate on the last layer's output, before the softmax (default: "
        "--dropout)")
    locked_dropout: bool = flag(
        False, "variational dropout: one mask per sequence for all its time steps (Gal & "
        "Ghahramani 2016; default: one per token)")
    embed_dropout: float = flag(
        0.0, "word-type dropout: drop a word's vector everywhere it occurs in a step "
        "(AWD-LSTM's dropoute; 0: off)")
    weight_drop: float = flag(
        0.0, "DropConnect on every recurrent matrix, one mask per step (Wan et al. 2013; "
        "AWD-LSTM's wdrop; 0: off)")
    tie_embeddings: bool = flag(
        True, "share the embedding with the softmax (a learned hidden-dim x embed-dim "
        "projection before it when the two differ)")
    init_scale: float = flag(
        0.1, "initialise every weight uniformly in [-s, s] (0: Keras' defaults); each "
        "weight draws from its own stream, keyed by --seed and the weight's role")
    forget_bias: float | None = flag(
        None, f"LSTM: the initial value of the forget gate's bias, learned from there "
        f"(default: {DEFAULT_FORGET_BIAS:g}, chosen by measurement: tfpar/docs/quality.md; "
        f"Keras' unit_forget_bias is 1.0; an error with --cell gru)")
    precision: str = flag(
        "fp32", "fp32 | bf16 (the large matmuls in bfloat16 on float32 weights; recurrent "
        "state, loss and optimizer stay float32; for CPUs with AMX/AVX512-BF16) | "
        "mixed_bfloat16 | mixed_float16 (Keras mixed-precision policies: float32 variables, "
        "16-bit compute, float32 softmax and loss; mixed_float16 with dynamic loss scaling; "
        "for GPUs: bfloat16 on A100/H100, float16 on V100/T4; tfpar.model.precision)")
    # Untied, a sampled model's softmax kernel is stored [V, H] (one row per word, so its
    # gradient stays sparse), a full one's [H, V].
    softmax: str = flag(
        "full", "the training loss: full (every word's logit) | sampled "
        "(tf.nn.sampled_softmax_loss over each target and --num-sampled log-uniform "
        "candidates, one draw per step shared by every replica: tfpar.objective.sampling; "
        "for vocabularies of 100k+ words; gradients of the embedding and softmax stay "
        "sparse). Evaluation, score, generate and the export always use the full softmax")
    num_sampled: int | None = flag(
        None, f"--softmax sampled: candidates per step, 1 <= K < vocabulary size (default: "
        f"{DEFAULT_NUM_SAMPLED}; an error without --softmax sampled)", metavar="K")
    fused_softmax: bool = flag(
        True, "compute the full softmax's loss (training, evaluation, score) block by block "
        "from the hidden states, each block's logits in cache, never all [tokens, V] of them "
        "(tfpar.objective.fused); --no-fused-softmax: the logits, then the cross-entropy "
        "(the unfused path, kept for comparison). The same weights and loss either way")
    softmax_blocks: str | None = flag(
        None, "the fused softmax's largest block of logits, tokens x vocabulary entries "
        "(default: %dx%d, measured: tfpar/docs/benchmarks.md)" % DEFAULT_SOFTMAX_BLOCKS,
        metavar="ROWSxCOLUMNS")

    def __post_init__(self) -> None:
        check_cell(self.cell)
        if self.softmax_blocks is not None:
            softmax_block_sizes(self.softmax_blocks)
        _choice("precision", self.precision, PRECISIONS)
        _choice("softmax", self.softmax, SOFTMAXES)
        if self.softmax == "full":
            if self.num_sampled is not None:
                raise ConfigError(f"num-sampled {self.num_sampled} only applies to the sampled "
                                  "softmax; add --softmax sampled or drop --num-sampled")
        elif self.num_sampled is None:
            object.__setattr__(self, "num_sampled", DEFAULT_NUM_SAMPLED)
        elif self.num_sampled < 1:
            raise ConfigError(f"num-sampled must be >= 1, got {self.num_sampled!r}")
        _positive("layers", self.layers)
        _positive("embed-dim", self.embed_dim)
        _positive("hidden-dim", self.hidden_dim)
        for name in ("dropout", "dropout_input", "dropout_hidden", "dropout_output",
                     "embed_dropout", "weight_drop"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1:
                raise ConfigError(f"{name.replace('_', '-')} must be in [0, 1), got {value!r}")
        _non_negative("init-scale", self.init_scale)
        if self.cell != "lstm" and self.forget_bias is not None:
            raise ConfigError(f"forget-bias {self.forget_bias!r} applies to the LSTM's "
                              f"forget gate; --cell {self.cell} has none: drop --forget-bias")
        if self.custom_cell:
            # Both act inside the built-in layers' recurrence, which a cell of one's own
            # does not run (tfpar.model.layers).
            if self.weight_drop:
                raise ConfigError(f"weight-drop {self.weight_drop!r} drops the built-in "
                                  f"cells' recurrent matrix; --cell {self.cell} is your own: "
                                  "drop --weight-drop or use --cell lstm | gru")
            if self.precision != "fp32":
                raise ConfigError(f"precision {self.precision!r} needs a built-in cell; "
                                  f"--cell {self.cell} runs in fp32: drop --precision or "
                                  "use --cell lstm | gru")

    def check_vocab_size(self, vocab_size: int) -> None:
        """Raises ConfigError when the sampled softmax cannot draw ``num_sampled``
        distinct negatives from a vocabulary of ``vocab_size`` entries."""
        if self.softmax == "sampled" and self.num_sampled >= vocab_size:
            raise ConfigError(
                f"num-sampled {self.num_sampled} must be smaller than the vocabulary size "
                f"{vocab_size}; use --num-sampled {vocab_size - 1} or less, or --softmax full")

    def softmax_block_sizes(self) -> tuple[int, int]:
        """The fused softmax's ``(rows, columns)``: ``softmax_blocks`` or the default."""
        if self.softmax_blocks is None:
            return DEFAULT_SOFTMAX_BLOCKS
        return softmax_block_sizes(self.softmax_blocks)

    @property
    def custom_cell(self) -> bool:
        """Whether ``cell`` names a user's cell (``MODULE:NAME``), not lstm or gru."""
        return is_custom_cell(self.cell)

    @property
    def initial_forget_bias(self) -> float:
        """An LSTM's forget-gate bias at initialisation: ``forget_bias`` or the default."""
        return DEFAULT_FORGET_BIAS if self.forget_bias is None else self.forget_bias

    def dropout_at(self, site: str) -> float:
        """The rate at ``site``: "input", "hidden" or "output"."""
        rate = getattr(self, f"dropout_{site}")
        return self.dropout if rate is None else rate


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and the training loop."""

    optimizer: str = flag(
        "sgd", "sgd | adam | adagrad. With --softmax sampled the embedding and softmax "
        "gradients are sparse: sgd (no momentum) and adagrad update only the rows a step "
        "touched; adam updates every row (its moments decay everywhere), and so does "
        "--weight-decay (tfpar/docs/models.md, Huge vocabularies)")
    lr: float = flag(
        20.0, "base learning rate, before decay, warm-up and --scale-lr (20 is for plain SGD "
        "on the per-token mean loss; Adam wants about 1e-3)")
    lr_decay: float = flag(1.0, "multiply the learning rate by this after every epoch past "
                           "--decay-after")
    decay_after: int = flag(0, "epochs trained at the base learning rate before --lr-decay "
                            "applies")
    scale_lr: str = flag(
        "none", "none | linear (multiply the learning rate by the replica count, the linear "
        "scaling rule; use warm-up)")
    warmup_steps: int = flag(0, "ramp the learning rate linearly from 0 over this many "
                             "steps (0: no warm-up)")
    clip_norm: float = flag(0.25, "clip the aggregated gradient to this global norm "
                            "(0: no clipping)")
    epochs: int = flag(1, "passes over the training split (1 keeps `make train` under 3 "
                       "minutes)")
    max_steps: int = flag(0, "stop after this many optimizer steps in total (0: no limit)")
    batch_size: int = flag(
        20, "GLOBAL batch size: sentences (sentence mode) or stream columns, over all "
        "replicas")
    eval_batch_size: int = flag(0, "global batch size for evaluation (0: --batch-size)")
    seed: int = flag(0, "seed for the initial weights, shuffling and dropout")
    deterministic: bool = flag(
        False, "deterministic TensorFlow kernels for the whole process (slower; bit-exact "
        "resumes where TensorFlow allows)")
    on_nan: str = flag("stop", "what a non-finite loss or gradient does: stop the run | "
                       "skip the update")
    nan_patience: int = flag(
        10, "--on-nan skip gives up after this many non-finite batches in a row (0: never)")
    weight_decay: float = flag(
        0.0, "decoupled weight decay (Loshchilov & Hutter): each step w -= lr * wd * w, on "
        "every weight (Keras optimizers' weight_decay; 0: off)")
    time_limit: float = flag(
        0.0, "stop training after this many minutes of the loop (checkpoint, then evaluate "
        "and export as at the end; a run resumed later gets the limit anew; 0: no limit)")
    steps_per_execution: int | None = flag(
        None, "run N training steps per tf.function call, in a loop inside the graph "
        "(losses come back once per call; checkpoints, summaries, --max-steps and the "
        "non-finite guard keep their meaning) (default: chosen by the run, "
        "tfpar.training.run.steps_per_execution: 1 on CPUs, 20 when the strategy's devices "
        "are GPUs, where a step is short against the host's ~1 ms per call; always 1 for "
        "multi_worker with --softmax sampled)", metavar="N")
    early_stop: int = flag(
        0, "stop training after this many epochs in a row without a better valid "
        "perplexity (0: never)", metavar="EPOCHS")
    lr_decay_on_plateau: float = flag(
        0.0, "multiply the learning rate by FACTOR after each epoch whose valid perplexity "
        "is not the best so far (0.25: divide by 4, as PyTorch's word_language_model; "
        "0: off)", metavar="FACTOR")
    ema_momentum: float | None = flag(
        None, "evaluate, keep as best and export the moving average of the weights, "
        "avg = M * avg + (1 - M) * w after every update (Keras optimizers' use_ema); "
        "training goes on from the weights themselves (0: off, the last step's weights; "
        f"default: {DEFAULT_EMA_MOMENTUM:g}, off under parameter_server)", metavar="M")

    def __post_init__(self) -> None:
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        if self.steps_per_execution is not None:
            _positive("steps-per-execution", self.steps_per_execution)
        _choice("scale-lr", self.scale_lr, SCALE_LR)
        _choice("on-nan", self.on_nan, ON_NAN)
        _non_negative("nan-patience", self.nan_patience)
        _non_negative("weight-decay", self.weight_decay)
        _non_negative("time-limit", self.time_limit)
        _non_negative("early-stop", self.early_stop)
        if not 0.0 <= self.lr_decay_on_plateau < 1.0:
            raise ConfigError(f"--lr-decay-on-plateau must be in [0, 1) (0: off; 0.25 divides "
                              f"the rate by 4), got {self.lr_decay_on_plateau}")
        if self.ema_momentum is not None and not 0.0 <= self.ema_momentum < 1.0:
            raise ConfigError(f"--ema-momentum must be in [0, 1) (0: off; 0.99 averages "
                              f"about the last 100 steps), got {self.ema_momentum}")
        _positive("lr", self.lr)
        _positive("lr-decay", self.lr_decay)
        _non_negative("decay-after", self.decay_after)
        _non_negative("warmup-steps", self.warmup_steps)
        _non_negative("clip-norm", self.clip_norm)
        _positive("epochs", self.epochs)
        _non_negative("max-steps", self.max_steps)
        _positive("batch-size", self.batch_size)
        _non_negative("eval-batch-size", self.eval_batch_size)

    @property
    def global_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.batch_size


@dataclasses.dataclass(frozen=True)
class DistConfig:
    """How the work is spread over devices and processes."""

    strategy: str = flag(
        "default", "how the work is spread, a strategy of tfpar.parallel.registry:",
        names="strategies")  # --help lists the registry's names after this
    devices: tuple[str, ...] = flag(
        (), "comma-separated devices, e.g. /gpu:0,/gpu:1 or /cpu:0,/cpu:1 (default: every "
        "GPU, else logical CPU devices)", parse=parse_devices)
    cpu_devices: int = flag(
        0, "split the host CPU into N logical devices (default 0: 2 for multi-device "
        "strategies on a host without GPUs)")
    all_reduce: str = flag(
        "auto", "mirrored's cross-device reduction: auto | nccl | hierarchical_copy | "
        "reduce_to_one (auto: NCCL with >= 2 GPUs, else reduce_to_one)")
    variable_device: str = flag(
        "", "tower: where the variables live, a device or cpu (the host CPU, as TF1's "
        "cifar10_multi_gpu_train; default: the first tower's device)")
    tower_reduce: str = flag(
        "controller", "tower: controller (gather the gradients on the variable device) | "
        "ring (a chunked ring all-reduce across the towers)")
    communication: str = flag("auto", "multi_worker collectives: auto | ring | nccl")
    cluster: str = flag(
        "auto", "multi_worker / parameter_server: where the cluster comes from: tf_config "
        "(the TF_CONFIG variable, as Kubernetes' TFJob writes it) | slurm (the srun job "
        "step's SLURM_* variables; multi_worker) | auto (TF_CONFIG if set, else the Slurm "
        "step)")
    stages: str = flag(
        "", "pipeline: part=device list, e.g. embedding=/cpu:0,rnn=/cpu:1,softmax=/cpu:1 "
        "(default: the parts spread over the devices)")
    micro_batches: int = flag(4, "pipeline: micro-batches per global batch")
    log_device_placement: bool = flag(
        False, "log the device every op runs on (TensorFlow's placement log)")
    # The sampled softmax's accidental-hit removal has only a CPU kernel.
    soft_placement: bool | None = flag(
        None, "let ops with no kernel on the requested device run elsewhere (default: "
        "TensorFlow's, on; --no-soft-placement makes such an op an error, to find ops that "
        "leave their device)")
    intra_op_threads: int = flag(
        0, "threads one op may use (default 0: with N logical CPU devices working at once, "
        "the host's cores / N, so replicas or stages run side by side instead of sharing "
        "every core, tfpar.parallel.devices.intra_op_threads; else TensorFlow's default)")
    cpu_only: bool = flag(
        False, "hide every GPU and train on CPUs (without it, a host with NVIDIA devices or "
        "CUDA_VISIBLE_DEVICES where TensorFlow finds no GPU stops with an error: "
        "tfpar.parallel.devices.configure_gpus)")

    def __post_init__(self) -> None:
        _choice("cluster", self.cluster, CLUSTER_SOURCES)
        _choice("all-reduce", self.all_reduce, ALL_REDUCE)
        _choice("tower-reduce", self.tower_reduce, TOWER_REDUCE)
        _choice("communication", self.communication, COMMUNICATION)
        _non_negative("cpu-devices", self.cpu_devices)
        _non_negative("intra-op-threads", self.intra_op_threads)
        _positive("micro-batches", self.micro_batches)
        object.__setattr__(self, "devices", tuple(self.devices))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Where a run writes and how often."""

    model_dir: str = flag(
        "", "checkpoints, TensorBoard events, vocabulary and config; re-use it to resume. A "
        "local folder or a URL: gs://, ram://, and with tensorflow-io s3://, hdfs:// "
        "(default: runs/<strategy>-<timestamp>)")
    export_dir: str = flag(
        "saved_models", "SavedModels go to <export-dir>/<export-name>/<version>/ (a local "
        "folder or a URL, as --model-dir)")
    export_name: str = flag("tfpar_lm", "the SavedModel's name")
    export: bool = flag(True, "write a SavedModel at the end of training")
    checkpoint_every: int = flag(
        0, "save a checkpoint every N steps (0: at the end of every epoch only)")
    keep_checkpoints: int = flag(3, "checkpoints kept on disk")
    evaluator_timeout: float = flag(
        3600.0, "a side-car evaluator task (TF_CONFIG task type evaluator) stops with an "
        "error after this many seconds without a new checkpoint", metavar="SECONDS")
    log_every: int = flag(10, "write step summaries every this many steps")
    epoch_inspection: bool = flag(
        True, "at each epoch end, write to TensorBoard the gradient norms of a fixed train "
        "batch and text sampled from the model, computed on a copy of the model on the host "
        "(its weights' memory again; tracing it adds a few seconds to a run)")
    metrics_json: str = flag(
        "", "write the run's final metrics to this JSON file (a local path or a URL; "
        "default: none)")
    final_weights: str = flag(
        "best", "best | last: the weights the final valid/test evaluation and the export "
        "use: those of the epoch with the best valid perplexity (kept in <model-dir>/best) "
        "or the last ones")
    progress: bool = flag(
        True, "show progress: a bar on a terminal, else a log line every --progress-every "
        "seconds")
    progress_every: float = flag(
        30.0, "when stdout is not a terminal (a file, a pipe, a job's log), progress is a "
        "plain log line every SECONDS (the epoch's step, loss, ppl and tok/s so far, and an "
        "ETA) instead of a redrawn bar; 0: one line at each epoch end", metavar="SECONDS")
    profile_steps: tuple[int, ...] = flag(
        (), "A,B: profile steps A..B into the TensorBoard log (default: none)",
        parse=parse_profile_steps)
    init_from: str = flag(
        "", "fine-tune: start this run from the model weights of the trained run in model "
        "dir DIR (not its optimizer, step, epoch or input position). The model's shape "
        "(--cell, --layers, --embed-dim, --hidden-dim, --tie-embeddings, --softmax, "
        "--num-sampled), --tokenizer and the vocabulary (DIR/vocab.txt, used as --vocab-file "
        "is) are DIR's: those flags are not used (the log names any that differed; "
        "tfpar.training.run.init_source). Only for a fresh --model-dir: one with a "
        "checkpoint resumes it, as always", metavar="DIR", group="training")
    init_weights: str = flag(
        "latest", "--init-from: latest (DIR's last checkpoint) | best (its best epoch's, "
        "kept in DIR/best)", group="training")

    def __post_init__(self) -> None:
        _choice("final-weights", self.final_weights, FINAL_WEIGHTS)
        _choice("init-weights", self.init_weights, INIT_WEIGHTS)
        if not self.evaluator_timeout > 0:
            raise ConfigError(f"--evaluator-timeout must be > 0 seconds, got "
                              f"{self.evaluator_timeout:g}")
        _non_negative("checkpoint-every", self.checkpoint_every)
        _positive("keep-checkpoints", self.keep_checkpoints)
        _positive("log-every", self.log_every)
        _non_negative("progress-every", self.progress_every)
        object.__setattr__(self, "profile_steps", tuple(self.profile_steps))


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a run needs."""

    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        types = {
            "data": DataConfig, "model": ModelConfig, "train": TrainConfig,
            "dist": DistConfig, "run": RunConfig,
        }
        kwargs = {}
        for name in sections:
            known = {f.name for f in dataclasses.fields(types[name])}
            given = d.get(name, {})
            unknown = set(given) - known
            if unknown:
                raise ConfigError(f"unknown {name} config field(s): {', '.join(sorted(unknown))}")
            kwargs[name] = types[name](**given)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        return cls.from_dict(json.loads(text))

    def replace(self, **sections: Any) -> "Config":
        """Returns a copy with fields of sections replaced: ``cfg.replace(train={"lr": 1})``."""
        updated = {
            name: dataclasses.replace(getattr(self, name), **fields)
            for name, fields in sections.items()
        }
        return dataclasses.replace(self, **updated)


# The model-shaping fields: a checkpoint made with one value cannot be resumed with another.
INCOMPATIBLE_ON_RESUME = (
    *(("model", field) for field in MODEL_SHAPE), ("data", "source"), ("data", "vocab_size"),
    ("data", "min_count"), ("data", "tokenizer"), ("data", "split_fractions"),
    ("train", "optimizer"),
)


def resume_conflicts(stored: Config, requested: Config) -> list[str]:
    """Names the fields that make ``requested`` unable to resume ``stored``'s checkpoints."""
    conflicts = []
    for section, field in INCOMPATIBLE_ON_RESUME:
        old = getattr(getattr(stored, section), field)
        new = getattr(getattr(requested, section), field)
        if old != new:
            conflicts.append(f"{section}.{field}: checkpoint has {old!r}, this run asks for {new!r}")
    # Loss scaling wraps the optimizer (its slots are checkpointed under the wrapper).
    old, new = stored.model.precision, requested.model.precision
    if (old == "mixed_float16") != (new == "mixed_float16"):
        conflicts.append(f"model.precision: checkpoint has {old!r}, this run asks for {new!r} "
                         "(only mixed_float16 scales its loss)")
    return conflicts
