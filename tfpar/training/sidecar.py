"""The side-car evaluator: a cluster task that evaluates each new checkpoint of a run.

Kubernetes' TFJob (and TensorFlow's own estimator-era convention) may add one task of
type ``evaluator`` to ``TF_CONFIG``. It is no part of the training cluster
(``MultiWorkerMirroredStrategy`` and ``ParameterServerStrategy`` leave it out), so a
tfpar process given it, with the run's own flags, does not train. It:

1. waits for checkpoints in ``<model-dir>/checkpoints`` (``tf.train.checkpoints_iterator``);
2. restores each new one's model weights (optimizer slots and counters left unread), all
   the checkpoints still kept when it falls behind, oldest first;
3. computes the valid perplexity as training does (``tfpar.training.loop.evaluate``, on
   this process's default strategy) and writes it as the TensorBoard scalar
   ``perplexity`` under ``<model-dir>/eval_sidecar`` at the checkpoint's step (drawn in
   the ``perplexity`` chart beside the train and eval runs' lines), plus a log line;
4. ends after the checkpoint of the run's last step: the chief writes
   ``<model-dir>/final_step.json`` once it has trained and checkpointed that step
   (``tfpar.training.checkpoints.write_final_step``; not on a stop signal or an error,
   and a resumed run removes it). Without a new checkpoint for ``--evaluator-timeout``
   seconds it ends with a one-line error.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import tensorflow as tf

from tfpar.config import Config, DistConfig
from tfpar.data.pipeline import InputData
from tfpar.data.sources import load_corpus
from tfpar.data.vocab import VOCAB_FILE, Vocab
from tfpar.errors import CheckpointError, ClusterError
from tfpar.objective.losses import perplexity
from tfpar.parallel.registry import build_strategy
from tfpar.training import checkpoints, stored, summaries
from tfpar.training.loop import evaluate
from tfpar.training.state import build_train_state
from tfpar.objective.step import make_eval_step

log = logging.getLogger(__name__)

RUN = "eval_sidecar"  # <model-dir>/eval_sidecar: its TensorBoard run
TAG = summaries.PERPLEXITY  # one chart with the train and eval runs' perplexity
# How often (seconds without a new checkpoint) the evaluator looks for the run's end.
POLL_SECONDS = 2.0


def step_of(path: str) -> int:
    """``.../ckpt-12`` → 12 (tfpar numbers a checkpoint by its step)."""
    return int(path.rsplit("-", 1)[-1])


def kept_after(directory: str, step: int) -> list[str]:
    """The checkpoints ``directory``'s state lists with a step past ``step``, oldest first."""
    state = tf.train.get_checkpoint_state(directory)
    paths = list(state.all_model_checkpoint_paths) if state else []
    return sorted((p for p in paths if step_of(p) > step), key=step_of)


class Evaluator:
    """The model of ``config`` on one device, and the run's valid split, ready to score
    checkpoints of ``config.run.model_dir``."""

    def __init__(self, config: Config):
        self.config = config
        # One process, its default device.
        self.plugin = build_strategy(DistConfig(), config.model)
        vocab = Vocab.load(os.path.join(config.run.model_dir, VOCAB_FILE),
                           tokenizer=config.data.tokenizer)
        corpus = load_corpus(config.data, seed=config.train.seed)
        self.data = InputData(corpus.splits, vocab, config.data, seed=config.train.seed)
        self.state = build_train_state(self.plugin.scope(), config.model, len(vocab),
                                       seed=config.train.seed,
                                       fixed_shapes=config.data.mode == "stream")
        self.eval_step = make_eval_step(self.plugin, self.state.model)

    def valid_perplexity(self, path: str) -> float:
        """Restores checkpoint ``path``'s weights and evaluates them on valid."""
        stored.restore_weights(self.state.trackables()["layers"], path)
        nll, count = evaluate(self.plugin, self.eval_step, self.data, "valid",
                              self.config.train.global_eval_batch_size)
        return perplexity(nll, count)


def run_sidecar(config: Config) -> dict[str, Any]:
    """Evaluates each new checkpoint of the run until its last; returns
    ``{"evaluated": {step: valid perplexity}}``.

    Raises:
      ClusterError: no --model-dir, or no new checkpoint for --evaluator-timeout seconds
        before the run's end was seen.
    """
    model_dir, timeout = config.run.model_dir, config.run.evaluator_timeout
    if not model_dir:
        raise ClusterError("the evaluator task needs the run's --model-dir (the one every "
                           "training task is given) to find its checkpoints")
    directory = os.path.join(model_dir, "checkpoints")
    log.info("evaluator: waiting for checkpoints in %s", directory)
    evaluated: dict[int, float] = {}
    last = {"step": -1, "seen": time.monotonic()}
    evaluator = None
    writer = None

    def ended() -> bool:
        final = checkpoints.final_step(model_dir)
        return final is not None and last["step"] >= final

    def stop_waiting() -> bool:  # called after POLL_SECONDS without a new checkpoint
        return ended() or time.monotonic() - last["seen"] >= timeout

    for _ in tf.train.checkpoints_iterator(directory, timeout=min(POLL_SECONDS, timeout),
                                           timeout_fn=stop_waiting):
        if evaluator is None:  # the chief saves the vocabulary before any checkpoint
            evaluator = Evaluator(config)
            writer = tf.summary.create_file_writer(os.path.join(model_dir, RUN))
        for path in kept_after(directory, last["step"]):
            step = step_of(path)
            try:
                ppl = evaluator.valid_perplexity(path)
            except CheckpointError as e:  # deleted (--keep-checkpoints) since listed
                log.warning("evaluator: skipped step %d: %s", step, e)
                continue
            with writer.as_default(step=step):
                # float64: a diverged run's perplexity may pass float32's range.
                tf.summary.scalar(TAG, tf.constant(ppl, tf.float64))
            writer.flush()
            evaluated[step], last["step"] = ppl, step
            log.info("evaluator: step %d (%s): valid perplexity %.3f", step, path, ppl)
        last["seen"] = time.monotonic()  # the wait for the next one starts now
        if ended():
            break
    if writer is not None:
        writer.close()
    if not ended():
        seen = f"the last evaluated is step {last['step']}" if evaluated else "none came"
        raise ClusterError(f"evaluator: no new checkpoint in {directory} for --evaluator-timeout "
                           f"{timeout:g} s and the run has not ended ({seen}); is the chief "
                           "training into this --model-dir?")
    log.info("evaluator: the run ended at step %d; %d checkpoint(s) evaluated",
             last["step"], len(evaluated))
    return {"evaluated": evaluated}
