"""Checks that a parallel set-up computes what one device computes.

``scripts/verify_parallel.py`` trains every requested strategy for a few SGD-with-momentum
steps from the same initial weights on the same global batches, then compares each one's
final parameters and momentum slots and its (distributed) evaluation with the
``default`` strategy's. The batches are bucketed sentences of different lengths, so
replicas hold unequal token counts, and a batch row count that the replica counts do not
divide; the clip norm is the median gradient norm of the first steps, so clipped and
unclipped steps are both exercised. Dropout is off unless asked for (``--dropout``,
``--locked-dropout``, ``--embed-dropout``, ``--weight-drop``): its masks are keyed by
each row's place in the global batch (``tfpar.model.noise``), so with dropout on too N
devices must give one device's update. ``--softmax sampled`` trains with the sampled
softmax, whose candidates every replica and micro-batch must draw alike (from the seed and
the step, ``tfpar.objective.sampling``); evaluation stays the full softmax.

Strategies come from the one registry (``tfpar.parallel.registry``): a synchronous
strategy is run by what its N counts (:func:`runner_for`: one device, N data-parallel
devices, N pipeline stages, N worker processes), so a new strategy needs nothing here.
:data:`RUNNERS` holds verify's own variants (``tower_ring``); a :class:`Runner`'s function
trains N steps and returns a :class:`RunResult`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from typing import Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfpar.config import MODES, PRECISIONS, DataConfig, DistConfig, ModelConfig
from tfpar.data import synthetic
from tfpar.data.pipeline import InputData, plain
from tfpar.data.vocab import Vocab
from tfpar.errors import ClusterError, ConfigError
from tfpar.model.lm import build_model
from tfpar.model.precision import with_loss_scaling
from tfpar.objective import step
from tfpar.objective.output import output_loss
from tfpar.objective.losses import perplexity, token_count
from tfpar.parallel import registry
from tfpar.parallel.registry import build_strategy
from tfpar.parallel.rows import Context, per_replica, pipeline_rows, replica_batches, with_rows
from tfpar.parallel.cluster.local_job import plan_job, run_job
from tfpar.parallel.pipeline.stages import even_stages
from tfpar.parallel import devices as devices_lib
from tfpar.tools.cli import run_main, setup_logging
from tfpar.training.loop import evaluate
from tfpar.training.state import build_train_state
from tfpar.objective.step import make_eval_step
from tfpar.training.runner import make_train_steps
from tfpar.tools.parsing import Parser

log = logging.getLogger(__name__)


# The default (parameter, eval perplexity) tolerances per --precision. float32: the
# replicas' sums are added in another order than one device's (a few float32 ulps). With
# 16-bit matmuls a replica's weight-gradient product over its rows is rounded to 16 bits
# before the replicas' products are summed, where one device rounds the whole product
# once: differences up to the 16-bit unit roundoff of a gradient entry (bfloat16 2**-8,
# float16 2**-11). Measured on verify's defaults over 10 steps (mirrored:2, tower:3,
# pipeline:2): at most 3.5e-4 / 2.7e-5 with bfloat16 and 3.6e-5 / 4.4e-6 with float16;
# the tolerances leave about 5x.
TOLERANCES = {
    "fp32": (1e-5, 1e-6),
    "bf16": (2e-3, 2e-4),
    "mixed_bfloat16": (2e-3, 2e-4),
    "mixed_float16": (2e-4, 2e-5),
}


@dataclasses.dataclass(frozen=True)
class VerifySpec:
    """What to train and how closely results must agree."""

    # (strategy name, replicas) pairs, in the order to run them.
    strategies: tuple[tuple[str, int], ...] = (("default", 1), ("mirrored", 2), ("tower", 2))
    # SGD steps every strategy takes.
    steps: int = 10
    # Global batch (sentences); 10 leaves uneven shards for 3 and 4 replicas.
    batch_size: int = 10
    # "sentence" (bucketed, variable length) or "stream" (state carried across windows).
    mode: str = "sentence"
    # Gradient clip norm; 0 picks the median gradient norm of the first ``steps`` batches
    # at the initial weights, so some steps are clipped and some are not.
    clip_norm: float = 0.0
    # SGD learning rate (large, so that parameters move measurably in a few steps).
    lr: float = 0.5
    # SGD momentum: the optimizer has a slot per weight, compared like the weights.
    momentum: float = 0.5
    # Pass when max |param - default's| <= tolerance ...
    tolerance: float | None = None  # None: TOLERANCES[precision]
    # ... and |ppl - default's ppl| / default's ppl <= eval_tolerance.
    eval_tolerance: float | None = None
    # Seeds the corpus and the initial weights.
    seed: int = 0
    # The model: small, so that the check takes seconds.
    embed_dim: int = 32
    hidden_dim: int = 32
    layers: int = 1
    cell: str = "lstm"
    # Regularisation (ModelConfig's fields of the same names); all off by default.
    dropout: float = 0.0
    locked_dropout: bool = False
    embed_dropout: float = 0.0
    weight_drop: float = 0.0
    # The training loss: "full", or "sampled" with num_sampled shared candidates per step
    # (every strategy must draw the same ones); evaluation is always the full softmax.
    softmax: str = "full"
    num_sampled: int = 20
    # Share the embedding with the softmax (the sampled loss then reads the embedding).
    tie_embeddings: bool = False
    # --precision (tfpar.model.precision); mixed_float16 adds loss scaling.
    precision: str = "fp32"
    # Generated corpus size (sentences); words are drawn from a 100-word language.
    train_sentences: int = 400
    valid_sentences: int = 60

    def __post_init__(self) -> None:
        if self.precision not in TOLERANCES:
            raise ConfigError(f"unknown precision {self.precision!r}; expected one of: "
                              f"{', '.join(TOLERANCES)}")
        tolerance, eval_tolerance = TOLERANCES[self.precision]
        if self.tolerance is None:
            object.__setattr__(self, "tolerance", tolerance)
        if self.eval_tolerance is None:
            object.__setattr__(self, "eval_tolerance", eval_tolerance)
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r}; expected one of: {', '.join(MODES)}")
        for flag, value in (("--tolerance", self.tolerance),
                            ("--eval-tolerance", self.eval_tolerance),
                            ("--clip-norm", self.clip_norm)):
            if not value >= 0:
                raise ConfigError(f"{flag} must be >= 0, got {value}")
        if not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")


@dataclasses.dataclass
class Setup:
    """Everything every strategy shares: data, model shape, initial weights, clip norm."""

    spec: VerifySpec
    data: InputData
    model_config: ModelConfig
    initial_weights: list[np.ndarray]
    clip_norm: float
    clip_norm_auto: bool
    # Sentence mode: train on the global batches this many input pipelines make
    # (shared_batches), the reference of a multi_worker run.
    shares: int = 1

    @property
    def vocab_size(self) -> int:
        return len(self.data.vocab)

    def make_optimizer(self) -> keras.optimizers.Optimizer:
        return with_loss_scaling(
            keras.optimizers.SGD(learning_rate=self.spec.lr, momentum=self.spec.momentum),
            self.spec.precision)

    def train_batches(self, plugin, epoch: int):
        size = self.spec.batch_size
        if self.shares > 1 and self.data.reads_own_lines:
            return plugin.distribute(lambda ctx: per_replica(
                shared_batches(self.data, "train", size, self.shares, shuffle=True,
                               epoch=epoch), ctx))
        return plugin.distribute(lambda ctx: replica_batches(
            self.data, "train", training=True, epoch=epoch, input_context=ctx,
            batch_size=size))


def shared_batches(data: InputData, split: str, batch_size: int, shares: int, *,
                   shuffle: bool, epoch: int = 0) -> tf.data.Dataset:
    """Global sentence-mode batches as ``shares`` input pipelines make them: batch k is
    the rows of every pipeline's k-th batch (``tfpar.parallel.rows.pipeline_rows``), in
    pipeline order, keyed by their global rows; a pipeline that has ended adds none.

    What one device trains on to repeat a ``shares``-worker run exactly (the reference
    of a multi_worker run)."""
    ended = tf.data.Dataset.from_tensors(({
        "inputs": tf.zeros([0, 1], tf.int32), "targets": tf.zeros([0, 1], tf.int32),
        "rows": tf.zeros([0], tf.int32)}, False)).repeat()
    parts = []
    for index in range(shares):
        first, rows = pipeline_rows(batch_size, Context(shares, shares, index))
        ds = data.sentence_batches(split, rows, shuffle=shuffle, epoch=epoch,
                                   pipelines=shares, index=index)
        parts.append(ds.map(plain(lambda b, first=first: (with_rows(b, first), True)))
                     .concatenate(ended))

    @plain
    def join(*parts_):
        length = tf.reduce_max([tf.shape(b["targets"])[1] for b, _ in parts_])
        out = {}
        for key in ("inputs", "targets"):
            out[key] = tf.concat([tf.pad(b[key], [[0, 0], [0, length - tf.shape(b[key])[1]]])
                                  for b, _ in parts_], axis=0)
        out["rows"] = tf.concat([b["rows"] for b, _ in parts_], axis=0)
        return out

    return tf.data.Dataset.zip(tuple(parts)).take_while(
        plain(lambda *parts_: tf.reduce_any(tf.stack([alive for _, alive in parts_])))).map(join)


@dataclasses.dataclass
class RunResult:
    """What one strategy's run produced."""

    weights: list[np.ndarray]
    # Totals of the valid split evaluated with the final weights: ppl = exp(nll / count).
    eval_nll: float
    eval_count: float
    # The aggregated gradient norm of every step (before clipping); empty if unknown.
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    # The optimizer's variables (step count, momentum slots) after the last step.
    slots: list[np.ndarray] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Runner:
    """How to run one strategy name and which replica counts it accepts."""

    run: Callable[[Setup, int], RunResult]
    default_replicas: int = 2
    min_replicas: int = 1
    max_replicas: int | None = None


@dataclasses.dataclass
class Row:
    """One line of the report."""

    strategy: str
    replicas: int
    max_abs_param_diff: float  # over the weights and the optimizer's slots
    eval_ppl_rel_diff: float
    clipped_steps: int
    steps: int
    seconds: float
    failures: list[str]

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "replicas": self.replicas,
                "max_abs_param_diff": self.max_abs_param_diff,
                "eval_ppl_rel_diff": self.eval_ppl_rel_diff}


# ------------------------------------------------------------------------- set-up
def build_setup(spec: VerifySpec) -> Setup:
    """The corpus, vocabulary, initial weights and clip norm every strategy uses.

    Deterministic in ``spec``, so a runner in another process can rebuild the same set-up.
    """
    corpus = synthetic.generate_corpus(synthetic.SyntheticSpec(
        vocab_size=100, median_length=10, max_length=30, train_sentences=spec.train_sentences,
        valid_sentences=spec.valid_sentences, test_sentences=1, seed=spec.seed,
    ))
    splits = {"train": corpus.train, "valid": corpus.valid, "test": corpus.test}
    data_config = DataConfig(mode=spec.mode, bptt=12, max_length=30)
    data = InputData(splits, Vocab.build(corpus.train), data_config, seed=spec.seed)
    model_config = ModelConfig(cell=spec.cell, layers=spec.layers, embed_dim=spec.embed_dim,
                               hidden_dim=spec.hidden_dim, dropout=spec.dropout,
                               locked_dropout=spec.locked_dropout,
                               embed_dropout=spec.embed_dropout, weight_drop=spec.weight_drop,
                               tie_embeddings=spec.tie_embeddings, softmax=spec.softmax,
                               num_sampled=spec.num_sampled if spec.softmax == "sampled" else None,
                               precision=spec.precision, init_scale=0.0)
    model_config.check_vocab_size(len(data.vocab))
    with tf.device("/cpu:0"):
        model = build_model(model_config, len(data.vocab), seed=spec.seed)
        weights = model.get_weights()
        clip = spec.clip_norm
        if not clip:
            clip = float(np.median(initial_gradient_norms(model, data, spec.batch_size,
                                                          spec.steps)))
    return Setup(spec, data, model_config, weights, clip, clip_norm_auto=not spec.clip_norm)


def initial_gradient_norms(model, data: InputData, batch_size: int, count: int) -> list[float]:
    """The global gradient norms of the first ``count`` training batches (epoch 0, in the
    order training reads them) at the initial weights; batch k with step k's sampled-
    softmax candidates, the ones training draws for it (dropout stays off)."""
    batches = data.batches("train", training=True, epoch=0, batch_size=batch_size)
    at = tf.Variable(0, dtype=tf.int64, trainable=False)
    model.noise.step = lambda: at

    @tf.function(autograph=False, reduce_retracing=True)  # Traced, like every train step.
    def norm(batch):
        grads, *_ = step.replica_gradients(model, batch, token_count(batch["targets"]), None,
                                           loss=output_loss(model.config), training=False)
        return tf.linalg.global_norm([step.deduplicate(g) for g in grads])

    norms = []
    for k, batch in enumerate(batches.take(count)):
        at.assign(k)
        norms.append(float(norm(batch)))
    return norms


# ------------------------------------------------------------------------- runners
def run_plugin(setup: Setup, dist: DistConfig) -> RunResult:
    """Trains ``setup.spec.steps`` SGD steps with the plug-in ``dist`` names and evaluates
    valid with its own distributed eval step: the code path ``scripts/train.py`` runs."""
    start = time.perf_counter()
    plugin = build_strategy(dist, setup.model_config)
    state = build_train_state(plugin.scope(), setup.model_config, setup.vocab_size,
                              seed=setup.spec.seed, initial_weights=setup.initial_weights,
                              make_optimizer=lambda epoch, lr_scale: setup.make_optimizer(),
                              fixed_shapes=setup.spec.mode == "stream")
    # Training's own call (tfpar.training.runner), one step per call as on CPUs (worker
    # processes with the sampled softmax must: tfpar.training.run.steps_per_execution);
    # a stream epoch starts from the zero state, so one trace serves every call.
    train_steps = make_train_steps(plugin, state.model, state.optimizer,
                                   clip_norm=setup.clip_norm)
    zeros = (step.zero_state(plugin, state.model, setup.spec.batch_size)
             if setup.spec.mode == "stream" else None)
    norms: list[float] = []
    for epoch in itertools.count():
        iterator, carried = iter(setup.train_batches(plugin, epoch)), zeros
        while len(norms) < setup.spec.steps:
            call = train_steps(iterator, carried, 1)
            norms += [float(out.grad_norm) for out in call.outputs]
            carried = call.state
            if call.exhausted:
                break
        if len(norms) == setup.spec.steps:
            break
    nll, count = evaluate(plugin, make_eval_step(plugin, state.model), setup.data, "valid",
                          setup.spec.batch_size)
    return RunResult(state.model.get_weights(), nll, count, norms,
                     time.perf_counter() - start,
                     slots=[v.numpy() for v in state.optimizer.variables])


def replica_devices(replicas: int) -> tuple[str, ...]:
    """``replicas`` GPUs when the host has that many, else logical CPU devices."""
    return tuple(devices_lib.default_devices(replicas))


def run_default(setup: Setup, replicas: int, strategy: str = "default") -> RunResult:
    """A one-device strategy (``default``: TF's default strategy, the reference)."""
    return run_plugin(setup, DistConfig(strategy=strategy))


def on_devices(strategy: str, **options) -> Callable[[Setup, int], RunResult]:
    """A runner for a one-process strategy on ``replicas`` devices."""
    def run(setup: Setup, replicas: int) -> RunResult:
        return run_plugin(setup, DistConfig(strategy=strategy,
                                            devices=replica_devices(replicas), **options))
    return run


# Micro-batches in verify_parallel.py: 3 does not divide its default batch of 10 rows.
VERIFY_MICRO_BATCHES = 3


def run_pipeline(setup: Setup, replicas: int, strategy: str = "pipeline") -> RunResult:
    """``verify_parallel.py``'s runner: ``pipeline:N`` cuts the model into N stages on N
    devices (:func:`even_stages`), with :data:`VERIFY_MICRO_BATCHES` micro-batches."""
    stages = even_stages(setup.model_config.layers, list(replica_devices(replicas)))
    return run_plugin(setup, DistConfig(strategy=strategy, stages=stages,
                                        micro_batches=VERIFY_MICRO_BATCHES))


def run_multi_worker(setup: Setup, replicas: int, strategy: str = "multi_worker"
                     ) -> RunResult:
    """``verify_parallel.py``'s runner: ``replicas`` worker processes on loopback.

    Each worker trains the verify setup (the parent's initial weights and clip norm) with
    :func:`tfpar.tools.verify.run_plugin`; the chief writes the result, which is read back here.
    """
    with tempfile.TemporaryDirectory(prefix="tfpar-verify-mw-") as work:
        with open(os.path.join(work, "spec.json"), "w", encoding="utf-8") as f:
            json.dump({"spec": dataclasses.asdict(setup.spec), "clip_norm": setup.clip_norm,
                       "strategy": strategy}, f)
        np.savez(os.path.join(work, "weights.npz"), *setup.initial_weights)
        code = f"from tfpar.tools.verify import multi_worker_task; multi_worker_task({work!r})"
        status = run_job(lambda: plan_job(strategy, workers=replicas),
                         lambda task: [sys.executable, "-c", code], out=sys.stderr)
        if status:
            raise ClusterError(f"the {strategy}:{replicas} verify job failed (status "
                               f"{status}); its log is above")
        with np.load(os.path.join(work, "result.npz")) as r:
            weights = [r[f"w{i}"] for i in range(len(setup.initial_weights))]
            slots = [r[f"s{i}"] for i in range(int(r["num_slots"]))]
            return RunResult(weights, float(r["eval_nll"]), float(r["eval_count"]),
                             [float(n) for n in r["grad_norms"]], float(r["seconds"]), slots)


def multi_worker_task(work: str) -> None:
    """One worker of :func:`run_multi_worker` (runs in a child process)."""
    setup_logging()
    with open(os.path.join(work, "spec.json"), encoding="utf-8") as f:
        stored = json.load(f)
    fields = stored["spec"]
    fields["strategies"] = tuple(tuple(s) for s in fields["strategies"])
    # The parent's clip norm: build_setup then skips measuring the gradient norms again.
    fields["clip_norm"] = stored["clip_norm"]
    # The strategy before any TF op (see build_multi_worker); run_plugin gets the same one.
    dist = DistConfig(strategy=stored["strategy"])
    plugin = build_strategy(dist)
    setup = build_setup(VerifySpec(**fields))
    with np.load(os.path.join(work, "weights.npz")) as w:
        weights = [w[f"arr_{i}"] for i in range(len(w.files))]
    setup = dataclasses.replace(setup, initial_weights=weights)
    with without_tf32():  # as in the parent (verify)
        result = run_plugin(setup, dist)
    if plugin.is_chief:
        np.savez(os.path.join(work, "result.npz"), eval_nll=result.eval_nll,
                 eval_count=result.eval_count, grad_norms=np.array(result.grad_norms),
                 seconds=result.seconds, num_slots=len(result.slots),
                 **{f"w{i}": w for i, w in enumerate(result.weights)},
                 **{f"s{i}": s for i, s in enumerate(result.slots)})


# Verify's own variants of a registered strategy (name -> Runner), and stand-ins tests
# add; every other name is a registered synchronous strategy (:func:`runner_for`).
RUNNERS: dict[str, Runner] = {
    "tower_ring": Runner(on_devices("tower", tower_reduce="ring")),
}
# How a registered strategy runs, by what its N counts (tfpar.parallel.registry).
BY_SPREAD: dict[str, Callable[[str], Runner]] = {
    "": lambda name: Runner(functools.partial(run_default, strategy=name),
                            default_replicas=1, max_replicas=1),
    "devices": lambda name: Runner(on_devices(name)),
    "stages": lambda name: Runner(functools.partial(run_pipeline, strategy=name)),
    # One worker process per replica.
    "workers": lambda name: Runner(functools.partial(run_multi_worker, strategy=name)),
}


def runners() -> dict[str, Runner]:
    """Every name ``--strategies`` takes: the registry's synchronous strategies, then
    :data:`RUNNERS` (which wins on a name both have)."""
    out = {name: BY_SPREAD[registry.traits(name).over](name) for name in registry.STRATEGIES}
    return {**out, **RUNNERS}


REFERENCE = "default"


def parse_strategies(text: str) -> tuple[tuple[str, int], ...]:
    """'default,mirrored:2,tower:3' → (("default", 1), ("mirrored", 2), ("tower", 3)).

    Raises:
      ConfigError: an unknown name, a replica count that is not an integer, or one the
        strategy does not accept.
    """
    out = []
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, _, count_text = item.partition(":")
        runner = runners().get(name)
        if runner is None:
            raise ConfigError(f"unknown strategy {name!r} in --strategies; expected one of: "
                              f"{', '.join(runners())} (optionally NAME:REPLICAS)")
        try:
            count = int(count_text) if count_text else runner.default_replicas
        except ValueError:
            raise ConfigError(f"replica count {count_text!r} of {item!r} is not an integer; "
                              f"use NAME:REPLICAS, e.g. {name}:2") from None
        high = runner.max_replicas
        if count < runner.min_replicas or (high is not None and count > high):
            allowed = (f"exactly {high}" if high == runner.min_replicas else
                       f">= {runner.min_replicas}" if high is None else
                       f"{runner.min_replicas}..{high}")
            raise ConfigError(f"{item!r}: {name} takes {allowed} replica(s), got {count}")
        out.append((name, count))
    if not out:
        raise ConfigError(f"--strategies {text!r} names no strategy; e.g. default,mirrored:2")
    return tuple(dict.fromkeys(out))


# ------------------------------------------------------------------------- compare
def structure_failures(result: RunResult, reference: RunResult) -> list[str]:
    """Why ``result``'s tensors cannot be compared one by one with ``reference``'s: another
    count of weights or of optimizer variables, or a tensor of another shape (tensors are
    compared in order, so one missing would pair every later one with the wrong one)."""
    failures = []
    for kind, mine, ref in (("weight tensors", result.weights, reference.weights),
                            ("optimizer variables", result.slots, reference.slots)):
        if len(mine) != len(ref):
            failures.append(f"{len(mine)} {kind}, default {len(ref)}")
            continue
        for i, (a, b) in enumerate(zip(mine, ref)):
            if np.shape(a) != np.shape(b):
                failures.append(f"{kind[:-1]} {i} has shape {tuple(np.shape(a))}, default "
                                f"{tuple(np.shape(b))}")
    if not reference.weights:
        failures.append("default has 0 weight tensors: nothing to compare")
    return failures


def untrained(who: str, norms: Sequence[float]) -> list[str]:
    """A run whose every gradient norm is 0 did not train: matching it proves nothing."""
    if norms and all(n == 0 for n in norms):
        return [f"{who}'s {len(norms)} gradient norms are all 0 (it did not train); a run "
                "that trains has some norm > 0"]
    return []


def compare(spec: VerifySpec, setup: Setup, name: str, replicas: int, result: RunResult,
            reference: RunResult) -> Row:
    """One report row: ``result`` against ``reference`` (the default strategy's run).

    It fails when the two runs' tensors differ in count or shape (max |dtheta| is then
    inf), when either run's gradient norms are all 0, and when a difference passes a
    tolerance.
    """
    failures = structure_failures(result, reference)
    if failures:
        diff = float("inf")
    else:
        diff = max((float(np.max(np.abs(a - b))) if a.size else 0.0
                    for a, b in zip(result.weights + result.slots,
                                    reference.weights + reference.slots)), default=0.0)
    ppl, ref_ppl = (perplexity(result.eval_nll, result.eval_count),
                    perplexity(reference.eval_nll, reference.eval_count))
    rel = abs(ppl - ref_ppl) / ref_ppl
    if not failures and not diff <= spec.tolerance:  # "not <=" also catches NaN.
        failures.append(f"max |dtheta| {diff:.3g} > tolerance {spec.tolerance:g}")
    if not rel <= spec.eval_tolerance:
        failures.append(f"eval perplexity relative difference {rel:.3g} > eval-tolerance "
                        f"{spec.eval_tolerance:g}")
    if result.eval_count != reference.eval_count:
        failures.append(f"eval saw {result.eval_count:.0f} tokens, default "
                        f"{reference.eval_count:.0f}")
    if len(result.grad_norms) not in (0, spec.steps):
        failures.append(f"trained {len(result.grad_norms)} steps, not {spec.steps}")
    failures += untrained(f"{name}:{replicas}", result.grad_norms)
    failures += untrained("default", reference.grad_norms)
    clipped = sum(n > setup.clip_norm for n in result.grad_norms)
    return Row(name, replicas, diff, rel, clipped, len(result.grad_norms), result.seconds,
               failures)


@contextlib.contextmanager
def without_tf32():
    """Float32 matmuls computed in float32 inside the block (TensorFlow's TF32 switch off).

    On Ampere and later GPUs TensorFlow runs float32 matmuls (cuDNN's RNN included) in TF32
    by default: inputs rounded to 10 mantissa bits, a relative error near 5e-4, fifty times
    the float32 tolerance, and each strategy sums differently rounded products. The
    :data:`TOLERANCES` were measured where no TF32 exists (CPUs), for the float32 parts of
    every precision alike; on CPUs the switch changes nothing.
    """
    was = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        yield
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(was)


def verify(spec: VerifySpec) -> tuple[Setup, list[Row]]:
    """Runs ``default`` and every strategy of ``spec``; returns the rows of the report."""
    log.info("TF32 off: float32 matmuls compute in float32 on every GPU (the tolerances "
             "assume it; Ampere and later GPUs otherwise round them to 10 bits)")
    with without_tf32():
        return verify_all(spec)


def verify_all(spec: VerifySpec) -> tuple[Setup, list[Row]]:
    """:func:`verify`'s runs, TF32 already off."""
    setup = build_setup(spec)
    log.info("clip-norm %.4g%s", setup.clip_norm,
             " (auto: the median gradient norm of the first --steps batches)" if setup.clip_norm_auto else "")
    every = runners()
    reference = every[REFERENCE].run(setup, 1)
    rows = []
    for name, replicas in spec.strategies:
        # The default row runs again: one device repeats itself exactly.
        log.info("running %s:%d", name, replicas)
        result = every[name].run(setup, replicas)
        against = reference
        if registry.traits(name).cluster and spec.mode == "sentence":
            # Each worker's pipeline reads its own share of the lines: one device
            # repeats the run on the global batches those shares make.
            against = every[REFERENCE].run(dataclasses.replace(setup, shares=replicas), 1)
        rows.append(compare(spec, setup, name, replicas, result, against))
    return setup, rows


def format_table(rows: list[Row]) -> str:
    header = (f"{'strategy':<12} {'replicas':>8} {'max |dtheta|':>13} {'eval ppl rel diff':>18} "
              f"{'clipped':>8} {'seconds':>8}  status")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.strategy:<12} {r.replicas:>8d} {r.max_abs_param_diff:>13.3e} "
            f"{r.eval_ppl_rel_diff:>18.3e} {f'{r.clipped_steps}/{r.steps}':>8} "
            f"{r.seconds:>8.1f}  {'FAIL' if r.failures else 'ok'}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------- command line
def parser(prog: str = "tfpar-verify") -> argparse.ArgumentParser:
    p = Parser(
        allow_abbrev=False, prog=prog,
        description=(
            "Train each strategy for a few steps from the same initial weights on the same "
            "global batches (bucketed, variable-length sentences, so replicas hold unequal "
            "token counts; some steps clipped and some not) and check that its "
            "final parameters, its momentum slots and its distributed eval perplexity match "
            "the default strategy's (one device). Exits 1 when any strategy is outside the "
            "tolerances. The optimizer is SGD with momentum: Adam divides by the root of the "
            "squared gradients, which can turn float-rounding differences of near-zero "
            "gradients into full-size steps."
        ),
    )
    p.add_argument("--strategies", default="default,mirrored:2,tower:2",
                   help="comma-separated NAME[:REPLICAS]; names: " + ", ".join(runners()) +
                        " (tower_ring: --tower-reduce ring) (default: %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="SGD steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=10,
                   help="GLOBAL batch in sentences (default: %(default)s)")
    p.add_argument("--mode", default="sentence", choices=("sentence", "stream"),
                   help="sentence: bucketed sentences; stream: BPTT windows with the RNN "
                        "state carried (default: %(default)s)")
    p.add_argument("--clip-norm", type=float, default=0.0,
                   help="gradient clip norm (default 0: the median gradient norm of the "
                        "first --steps batches, so some steps are clipped and some not)")
    p.add_argument("--lr", type=float, default=0.5, help="SGD learning rate (default: %(default)s)")
    p.add_argument("--momentum", type=float, default=0.5,
                   help="SGD momentum; its slots are compared like the weights "
                        "(default: %(default)s)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max |parameter difference| allowed (default: 1e-5 with fp32, 2e-3 "
                        "with bf16 and mixed_bfloat16, 2e-4 with mixed_float16)")
    p.add_argument("--eval-tolerance", type=float, default=None,
                   help="max relative eval perplexity difference (default: 1e-6 with fp32, "
                        "2e-4 with bf16 and mixed_bfloat16, 2e-5 with mixed_float16)")
    p.add_argument("--seed", type=int, default=0, help="corpus and weights seed")
    p.add_argument("--hidden-dim", type=int, default=32, help="LSTM width (default: %(default)s)")
    p.add_argument("--embed-dim", type=int, default=32, help="embedding width (default: %(default)s)")
    p.add_argument("--layers", type=int, default=1, help="LSTM layers (default: %(default)s)")
    p.add_argument("--cell", default="lstm", metavar="CELL",
                   help="lstm | gru | MODULE:NAME, a Keras RNN cell of your own, as "
                        "tfpar-train's --cell (default: %(default)s)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout on the embedding output, between layers and before the "
                        "softmax (default 0: off)")
    p.add_argument("--locked-dropout", action="store_true",
                   help="one dropout mask per sequence (variational dropout)")
    p.add_argument("--embed-dropout", type=float, default=0.0,
                   help="word-type dropout rate (default 0: off)")
    p.add_argument("--weight-drop", type=float, default=0.0,
                   help="DropConnect rate on the recurrent matrices (default 0: off)")
    p.add_argument("--softmax", default="full", choices=("full", "sampled"),
                   help="the training loss: full | sampled (tf.nn.sampled_softmax_loss with "
                        "--num-sampled log-uniform candidates per step, which every replica "
                        "and micro-batch must draw alike); eval is always the full softmax "
                        "(default: %(default)s)")
    p.add_argument("--num-sampled", type=int, default=None, metavar="K",
                   help="--softmax sampled: candidates per step, 1 <= K < the vocabulary "
                        "(about 100 words) (default: 20)")
    p.add_argument("--tie-embeddings", action="store_true",
                   help="share the embedding with the softmax (default: untied)")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS,
                   help="as train.py's --precision; 16-bit rounding depends on how rows are "
                        "split, so mixed policies need looser tolerances (README, 'Mixed "
                        "precision') (default: %(default)s)")
    p.add_argument("--json", default="", metavar="PATH",
                   help="also write the rows as a JSON list of {strategy, replicas, "
                        "max_abs_param_diff, eval_ppl_rel_diff}")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="TensorFlow's Python logs too (its C++ logs: TF_CPP_MIN_LOG_LEVEL=0)")
    return p


def spec_from_args(a: argparse.Namespace) -> VerifySpec:
    if a.num_sampled is not None and a.softmax != "sampled":
        raise ConfigError(f"--num-sampled {a.num_sampled} only applies to the sampled "
                          "softmax; add --softmax sampled or drop --num-sampled")
    return VerifySpec(
        strategies=parse_strategies(a.strategies), steps=a.steps, batch_size=a.batch_size,
        mode=a.mode, clip_norm=a.clip_norm, lr=a.lr, momentum=a.momentum, tolerance=a.tolerance,
        eval_tolerance=a.eval_tolerance, seed=a.seed, embed_dim=a.embed_dim,
        hidden_dim=a.hidden_dim, layers=a.layers, cell=a.cell, dropout=a.dropout,
        locked_dropout=a.locked_dropout, embed_dropout=a.embed_dropout,
        weight_drop=a.weight_drop, softmax=a.softmax, tie_embeddings=a.tie_embeddings,
        precision=a.precision,
        **({} if a.num_sampled is None else {"num_sampled": a.num_sampled}),
    )


def report(setup: Setup, rows: list[Row], json_path: str = "") -> int:
    """Prints the table and the verdict; writes the JSON; returns the exit status."""
    print(format_table(rows))
    how = " (auto: the median gradient norm of the first --steps batches)" if setup.clip_norm_auto else ""
    print(f"clip-norm {setup.clip_norm:.4g}{how}")
    for r in rows:
        if r.steps and not r.clipped_steps:
            print(f"warning: {r.strategy}:{r.replicas}: clipping never fired (every gradient "
                  f"norm <= {setup.clip_norm:.4g}); lower --clip-norm to check it")
    if json_path:
        directory = os.path.dirname(os.path.abspath(json_path))
        os.makedirs(directory, exist_ok=True)
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump([r.to_json() for r in rows], f, indent=2)
    failed = [r for r in rows if r.failures]
    for r in failed:
        print(f"FAIL {r.strategy}:{r.replicas}: {'; '.join(r.failures)}")
    if failed:
        return 1
    print(f"all {len(rows)} strategies match default (parameters within "
          f"{setup.spec.tolerance:g}, eval perplexity within {setup.spec.eval_tolerance:g})")
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``tfpar-verify``; exit 0 all match, 1 a mismatch, 2 a usage error."""
    args = parser(prog or "tfpar-verify").parse_args(argv)
    setup_logging(args.verbose)

    def body():
        spec = spec_from_args(args)
        # Before TF initialises: logical CPU devices stand in for missing GPUs.
        devices_lib.configure_cpu_devices(max(n for _, n in spec.strategies))
        setup, rows = verify(spec)
        return report(setup, rows, args.json)

    return run_main(body)
