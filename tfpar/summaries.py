"""TensorBoard summaries, written in cross-replica context with explicit steps.

Two event folders under the model dir: ``train/`` (per-step scalars, histograms) and
``eval/`` (per-epoch perplexity). Processes that are not the chief write nothing.
"""

from __future__ import annotations

import os

import tensorflow as tf


class Writer:
    """Thin wrapper over ``tf.summary`` file writers; a no-op when not the chief."""

    def __init__(self, model_dir: str, is_chief: bool = True):
        self._writers = {}
        if is_chief:
            for name in ("train", "eval"):
                self._writers[name] = tf.summary.create_file_writer(os.path.join(model_dir, name))

    def scalars(self, run: str, values: dict[str, float], step: int) -> None:
        writer = self._writers.get(run)
        if writer is None:
            return
        with writer.as_default(step=step):
            for name, value in values.items():
                tf.summary.scalar(name, value)

    def text(self, run: str, name: str, value: str, step: int = 0) -> None:
        writer = self._writers.get(run)
        if writer is None:
            return
        with writer.as_default(step=step):
            tf.summary.text(name, value)

    def config_text(self, config) -> None:
        self.text("train", "config", "```\n" + config.to_json() + "\n```")

    def histograms(self, model, step: int) -> None:
        writer = self._writers.get("train")
        if writer is None:
            return
        with writer.as_default(step=step):
            for var in model.trainable_variables:
                tf.summary.histogram("weights/" + var.path, var.value)

    def close(self) -> None:
        for writer in self._writers.values():
            writer.flush()
            writer.close()
