"""The per-epoch inspection: gradient norms of one fixed train batch and text samples,
computed on a copy of the model outside any strategy (see ``tfpar.training.summaries``).
"""

from __future__ import annotations

import tensorflow as tf

from tfpar.model.lm import detached_copy
from tfpar.objective import step
from tfpar.objective.output import output_loss
from tfpar.serving import sample

SAMPLE_TOKENS = 30


class EpochInspector:
    """A copy of the model outside any strategy, for the per-epoch gradient norms of one
    fixed train batch and for text samples (see the module docstring)."""

    def __init__(self, config, vocab, data):
        self.config, self.vocab, self.data = config, vocab, data
        self.copy = detached_copy(config.model, len(vocab), seed=config.train.seed,
                                  fixed_shapes=config.data.mode == "stream")
        self.sampler = sample.Sampler(self.copy, vocab)
        self._batch = None
        copy, loss = self.copy, output_loss(config.model)

        @tf.function(autograph=False, reduce_retracing=True)
        def norms(batch):
            count = tf.reduce_sum(tf.cast(batch["targets"] != 0, tf.float32))
            grads, _, _, _ = step.replica_gradients(copy, batch, count, loss=loss,
                                                    training=False)
            # A sampled softmax's sparse rows: the norm of the summed rows, never densified.
            return tf.stack([tf.sqrt(step.squared_norm(step.deduplicate(g)))
                             if isinstance(g, tf.IndexedSlices) else tf.norm(g) for g in grads])

        self._norms = norms

    def refresh(self, model) -> None:
        """Copies the current weights of the (possibly distributed) model."""
        self.copy.set_weights(model.get_weights())

    def batch(self) -> dict:
        """The first unshuffled global train batch, fetched once."""
        if self._batch is None:
            ds = self.data.batches("train", training=False,
                                   batch_size=self.config.train.batch_size)
            self._batch = next(iter(ds.take(1)))
        return self._batch

    def gradient_norms(self, model) -> dict[str, float]:
        """``variable path -> gradient norm``, named after ``model``'s variables."""
        values = self._norms(self.batch()).numpy()
        return {v.path: float(n) for v, n in zip(model.trainable_variables, values)}

    def samples(self, *, seed: int, count: int = 3) -> list[str]:
        """``count`` sentences sampled from a sentence start (temperature 1), and the
        greedy continuation of the first words of the first valid sentence."""
        drawn = self.sampler([""] * count, max_tokens=SAMPLE_TOKENS, temperature=1.0,
                             seed=seed)
        prompt = " ".join(self.data.first_line("valid").split()[:3])
        greedy = self.sampler([prompt], max_tokens=SAMPLE_TOKENS, temperature=0.0)[0]
        return [f"sample {i + 1}: {t}" for i, t in enumerate(drawn)] + [
            f"greedy: [{prompt}] {greedy}"]
