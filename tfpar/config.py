"""One typed configuration for a tfpar run.

Every field carries a comment and is validated on construction, so a bad value fails at
the start of a run with a one-line :class:`~tfpar.errors.ConfigError` that names it.
Batch sizes are *global* (summed over every replica) unless a name says otherwise.
The whole config round-trips through JSON; a copy is stored beside the checkpoints so a
resumed run can refuse an incompatible configuration.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tfpar.errors import ConfigError

MODES = ("sentence", "stream")
LONG_SENTENCES = ("split", "truncate")
CELLS = ("lstm", "gru")
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


def check_tokenizer(name: str) -> None:
    """Raises ConfigError unless ``name`` is one of :data:`TOKENIZERS`."""
    _choice("tokenizer", name, TOKENIZERS)


def check_split_fractions(fractions: tuple[float, ...]) -> None:
    """Raises ConfigError unless ``fractions`` are three positive numbers summing to 1."""
    shown = ",".join(f"{f:g}" for f in fractions)
    if len(fractions) != 3:
        raise ConfigError(
            f"split-fractions {shown!r} must be three numbers train,valid,test, "
            f"e.g. {','.join(map(str, SPLIT_FRACTIONS))}")
    for split, f in zip(("train", "valid", "test"), fractions):
        if not f > 0:
            raise ConfigError(
                f"split-fractions {shown!r}: the {split} fraction must be > 0, got {f:g}; "
                "every split needs lines")
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise ConfigError(
            f"split-fractions {shown!r} sum to {sum(fractions):.6g}, not 1; give three "
            f"fractions that sum to 1, e.g. {','.join(map(str, SPLIT_FRACTIONS))}")


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


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where text comes from and how it becomes batches."""

    # "synthetic" (generated, with an exact oracle), "ptb" / "wikitext-2" (found in
    # input_dir), "tfds:NAME" (TensorFlow Datasets, never downloaded here), a folder path,
    # or the path of one text file (cut into train/valid/test by split_fractions).
    source: str = "synthetic"
    # A one-file source's train, valid and test shares of its non-blank lines, taken as
    # contiguous blocks in that order (ignored by other sources).
    split_fractions: tuple[float, float, float] = SPLIT_FRACTIONS
    # How lines become tokens: "whitespace", "punct" or "char" (tfpar/data/tokenize.py).
    tokenizer: str = "whitespace"
    # Folder that holds named corpora: input/<name>/.
    input_dir: str = "input"
    # TensorFlow Datasets data_dir for tfds:NAME sources (None: TFDS's default).
    tfds_data_dir: str | None = None
    # "sentence": one line per example, bucketed and padded; "stream": the split as
    # contiguous columns cut into bptt windows, RNN state carried across windows.
    mode: str = "sentence"
    # Window length in stream mode (time steps per training example).
    bptt: int = 35
    # Keep at most this many vocabulary entries, specials included (0: keep every word).
    vocab_size: int = 0
    # Words seen fewer times than this in train become <unk>.
    min_count: int = 1
    # A vocabulary file (one token per line, line number = id, starting <pad> <unk> <eos>,
    # e.g. a previous run's vocab.txt) used whole instead of counting the train split
    # (None: count it). vocab_size and min_count do not apply to it. A resume compares
    # its contents, not its path, with the run's saved vocab.txt.
    vocab_file: str | None = None
    # Longest example in sentence mode, in predicted tokens (words + <eos>).
    max_length: int = 80
    # What to do with a longer sentence: "split" it into max_length pieces (every token is
    # still predicted once) or "truncate" it (the tail is dropped and counted in the log).
    long_sentences: str = "split"
    # Bucket boundaries are chosen from the train length histogram so that the expected
    # share of pad tokens stays below this fraction.
    max_pad_fraction: float = 0.02
    # Sentence-mode training shuffles each epoch's file (shard) order and then lines
    # through a buffer of this many lines (bounded memory, whatever the corpus size). The
    # default holds all of PTB (42,068 lines) or WikiText-2 (23,767), a full shuffle.
    shuffle_buffer: int = 100_000
    # Synthetic corpus size, in sentences per split.
    synthetic_train: int = 20000
    synthetic_valid: int = 2000
    synthetic_test: int = 2000

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

    # Recurrent cell: "lstm" or "gru".
    cell: str = "lstm"
    # Number of stacked recurrent layers.
    layers: int = 2
    # Word embedding width.
    embed_dim: int = 200
    # Recurrent state width of every layer.
    hidden_dim: int = 200
    # Dropout rate after the embedding and after every recurrent layer (0: off); the
    # three sites below override it one by one (None: this rate).
    dropout: float = 0.2
    # ... on the embedding output (AWD-LSTM's dropouti),
    dropout_input: float | None = None
    # ... between recurrent layers (dropouth),
    dropout_hidden: float | None = None
    # ... on the last layer's output, before the softmax (dropout).
    dropout_output: float | None = None
    # Variational ("locked") dropout: one mask per sequence, shared by all its time steps
    # (Gal & Ghahramani 2016), instead of one per token.
    locked_dropout: bool = False
    # Embedding (word-type) dropout: a whole word's vector is dropped for a step, in
    # every position it appears (Gal & Ghahramani 2016; AWD-LSTM's dropoute).
    embed_dropout: float = 0.0
    # Weight drop (DropConnect) on every recurrent matrix, one mask per step (Wan et al.
    # 2013; Merity et al. 2017's wdrop).
    weight_drop: float = 0.0
    # Share the embedding matrix with the softmax (a learned hidden_dim x embed_dim
    # projection before it when the two differ).
    tie_embeddings: bool = True
    # Initialise every weight uniformly in [-init_scale, init_scale] (0: Keras defaults).
    init_scale: float = 0.1
    # "fp32"; "bf16": the large matmuls (the RNN input projections and their weight
    # gradients, the softmax) run in bfloat16 on float32 weights; recurrent state, loss
    # and optimizer stay float32 (pays off on CPUs with AMX/AVX512-BF16); or a Keras
    # mixed-precision policy, "mixed_bfloat16" or "mixed_float16" (with loss scaling):
    # see tfpar.model.precision.
    precision: str = "fp32"
    # The training loss: "full" (every word's logit) or "sampled" (tf.nn.sampled_softmax_loss
    # over each target and num_sampled log-uniform candidates shared by the whole global
    # batch; tfpar.objective.sampling). Evaluation, scoring, generation and the export
    # always use the full softmax. Untied, a sampled model's softmax kernel is stored
    # [V, H] (one row per word, so its gradient stays sparse), a full one's [H, V].
    softmax: str = "full"
    # Candidates per step with softmax "sampled" (None there: DEFAULT_NUM_SAMPLED);
    # 1 <= num_sampled < the vocabulary size. Must be None with softmax "full".
    num_sampled: int | None = None
    # How the full softmax's loss is computed (training, evaluation, score): True block by
    # block from the hidden states, each block's logits in cache and never all [N, V] of
    # them (tfpar.objective.fused); False: the logits, then the cross-entropy (the
    # unfused path, kept for comparison). The same weights and loss either way.
    fused_softmax: bool = True
    # The fused loss's largest block of logits, "ROWSxCOLUMNS" (tokens x vocabulary
    # entries, e.g. "512x16384"); None: DEFAULT_SOFTMAX_BLOCKS.
    softmax_blocks: str | None = None

    def __post_init__(self) -> None:
        _choice("cell", self.cell, CELLS)
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

    def dropout_at(self, site: str) -> float:
        """The rate at ``site``: "input", "hidden" or "output"."""
        rate = getattr(self, f"dropout_{site}")
        return self.dropout if rate is None else rate


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation and the training loop."""

    # "sgd", "adam" or "adagrad" (with sparse gradients, SGD and Adagrad update only the
    # rows a step touched; Adam every row: tfpar/docs/models.md, "Huge vocabularies").
    optimizer: str = "sgd"
    # Base learning rate (before decay, warm-up and linear scaling).
    lr: float = 20.0
    # Multiply the learning rate by this after every epoch past decay_after.
    lr_decay: float = 1.0
    # Epochs trained at the base learning rate before the decay starts.
    decay_after: int = 0
    # "linear": multiply lr by num_replicas (the linear scaling rule); "none": keep it.
    scale_lr: str = "none"
    # Ramp the learning rate linearly from 0 over this many steps (0: no warm-up).
    warmup_steps: int = 0
    # Clip the aggregated gradient to this global norm (0: no clipping).
    clip_norm: float = 0.25
    # Passes over the training split.
    epochs: int = 1
    # Stop after this many optimizer steps in total (0: no limit).
    max_steps: int = 0
    # Global batch size: sentences (sentence mode) or columns (stream mode), all replicas.
    batch_size: int = 20
    # Global batch size for evaluation (0: same as batch_size).
    eval_batch_size: int = 0
    # Seed for initial weights, shuffling and dropout.
    seed: int = 0
    # Ask TensorFlow for deterministic kernels (slower; bit-exact resumes where TF allows).
    deterministic: bool = False
    # What a non-finite loss or gradient does: "stop" the run or "skip" the update.
    on_nan: str = "stop"
    # --on-nan skip gives up after this many non-finite batches in a row (0: never).
    nan_patience: int = 10
    # Decoupled weight decay (Loshchilov & Hutter): each step w -= lr * weight_decay * w,
    # on every weight (Keras optimizers' weight_decay).
    weight_decay: float = 0.0
    # Stop training after this many minutes of the loop (0: no limit), then evaluate and
    # export as at the end; a run resumed later gets the limit anew.
    time_limit: float = 0.0
    # Training steps per tf.function call (a loop over the input iterator inside the
    # graph, no host round trip between them); 1: one step per call. None: chosen by the
    # run from where it trains (tfpar.training.run.steps_per_execution: 1 on CPUs, more
    # on GPUs, whose short steps the host's per-call overhead would otherwise slow).
    steps_per_execution: int | None = None
    # Stop training after this many epochs in a row without a better valid perplexity
    # (0: never).
    early_stop: int = 0
    # Multiply the learning rate by this after every epoch whose valid perplexity is not
    # the best so far (PyTorch's word_language_model divides by 4: 0.25); 0: off.
    lr_decay_on_plateau: float = 0.0

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

    # A name from tfpar.parallel.registry.STRATEGIES.
    strategy: str = "default"
    # Explicit devices, e.g. ("/gpu:0", "/gpu:1") or ("/cpu:0", "/cpu:1"); empty: automatic.
    devices: tuple[str, ...] = ()
    # Split the host CPU into this many logical devices (0: automatic).
    cpu_devices: int = 0
    # Cross-device reduction of MirroredStrategy.
    all_reduce: str = "auto"
    # Tower strategy: where the variables live, a device or "cpu" (empty: the first
    # tower's device).
    variable_device: str = ""
    # Tower strategy: "controller" gathers gradients on the variable device; "ring" runs
    # a chunked ring all-reduce across the tower devices.
    tower_reduce: str = "controller"
    # Multi-worker collective communication.
    communication: str = "auto"
    # Pipeline strategy: part=device assignments, e.g. "embedding=/cpu:0,rnn=/cpu:1".
    stages: str = ""
    # Pipeline strategy: micro-batches per global batch.
    micro_batches: int = 4
    # Log where every op runs (TensorFlow's placement log).
    log_device_placement: bool = False
    # Let ops without a kernel on the requested device fall back to another device (the
    # sampled softmax's accidental-hit removal has only a CPU kernel). None: TensorFlow's
    # default, on.
    soft_placement: bool | None = None
    # Threads one op may use (TF's intra-op pool); 0: automatic (see
    # tfpar.parallel.devices.intra_op_threads).
    intra_op_threads: int = 0
    # Hide every GPU and train on CPUs (tfpar.parallel.devices.configure_gpus); without
    # it, a host that should have GPUs where TensorFlow finds none is an error.
    cpu_only: bool = False
    # multi_worker / parameter_server: where the cluster comes from (CLUSTER_SOURCES).
    cluster: str = "auto"

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

    # Checkpoints, TensorBoard events, vocabulary and config live here; re-using the
    # folder resumes the run.
    model_dir: str = ""
    # SavedModels go to <export_dir>/<export_name>/<version>/.
    export_dir: str = "saved_models"
    export_name: str = "tfpar_lm"
    # Write a SavedModel at the end of training.
    export: bool = True
    # Save a checkpoint every this many steps (0: at the end of every epoch only).
    checkpoint_every: int = 0
    # Checkpoints kept on disk.
    keep_checkpoints: int = 3
    # Write step summaries every this many steps.
    log_every: int = 10
    # Write the run's final figures to this JSON file ("" for none).
    metrics_json: str = ""
    # Show progress: a bar on a terminal, else a log line every progress_every seconds.
    progress: bool = True
    # Off a terminal: seconds between two progress lines (0: one line at each epoch end).
    progress_every: float = 30.0
    # Profile these steps (first, last) into the TensorBoard log (empty: no profile).
    profile_steps: tuple[int, ...] = ()
    # The weights the final evaluation and the export use: "best", those of the epoch
    # with the best valid perplexity (kept in <model_dir>/best), or "last".
    final_weights: str = "best"
    # Fine-tuning: a fresh run starts from the model weights of this trained run's model
    # dir ("": none) and takes its model shape, tokenizer and vocabulary
    # (tfpar.training.run.init_source); a model dir with a checkpoint resumes instead.
    init_from: str = ""
    # Which of init_from's checkpoints: "latest" or "best" (its best epoch's).
    init_weights: str = "latest"
    # A side-car evaluator task (TF_CONFIG task type "evaluator") gives up, with an
    # error, after this many seconds without a new checkpoint.
    evaluator_timeout: float = 3600.0

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
