"""``--profile-steps`` and the training calls' graph: the loop's training function, which
writes its graph to TensorBoard once and runs the profiler over steps A..B
(``tfpar.training.summaries.Writer.instrument`` wraps it).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import tensorflow as tf

log = logging.getLogger(__name__)


class CallHooks:
    """The training calls (``steps(iterator, state, n)``, a call that runs steps
    ``next_step()`` .. ``next_step() + n - 1``), writing the calls' graph
    (``train_steps``) once and running the profiler over every call with a step in A..B
    (whole calls: with --steps-per-execution N > 1 a superset of A..B).

    The batches are read inside the call, so the profile of a call holds the fetch of
    its batches from the input pipeline (``Iterator::…`` events). The trace lands in
    ``<model_dir>/train/plugins/profile/<session>/``, where TensorBoard's profile plugin
    finds it.
    """

    graph_name = "train_steps"

    def __init__(self, writer, steps_fn, next_step: Callable[[], int],
                 profile_steps: tuple[int, ...]):
        self.writer, self.steps_fn, self.next_step = writer, steps_fn, next_step
        self.profile = profile_steps
        self.function = getattr(steps_fn, "function", None)
        self._graph_written = False
        self._profiler = _ProfilerState()
        self.logdir = os.path.join(writer.model_dir, "train")

    def __call__(self, iterator, state, n: int):
        first = self.next_step()
        last = first + n - 1
        if self.profile and first <= self.profile[1] and last >= self.profile[0]:
            self.start_profiler()
        if self._graph_written:
            out = self.steps_fn(iterator, state, n)
        else:
            out = self._traced(first, iterator, state, n)
        if self.profile and last >= self.profile[1]:
            self.stop_profiler()
        return out

    def _traced(self, step: int, *args, **kwargs):
        """Runs the first call with graph collection on and writes the graph."""
        tf.summary.trace_on(graph=True, profiler=False)
        try:
            out = self.steps_fn(*args, **kwargs)
        except BaseException:
            tf.summary.trace_off()
            raise
        with self.writer.file_writer("train").as_default(step=step):
            tf.summary.trace_export(self.graph_name, step=step)
        self._graph_written = True
        return out

    def start_profiler(self) -> None:
        p = self._profiler
        if p.running or p.done:
            return
        try:
            tf.profiler.experimental.start(self.logdir)
        except tf.errors.AlreadyExistsError:
            log.warning("another profiler is running in this process; --profile-steps skipped")
            p.done = True
            return
        p.running = True
        log.info("profiling steps %d-%d into %s", self.profile[0], self.profile[1], self.logdir)

    def stop_profiler(self) -> None:
        p = self._profiler
        if p.running:
            tf.profiler.experimental.stop()
            p.running, p.done = False, True


class _ProfilerState:
    """Whether the ``--profile-steps`` session is running, or has run."""

    def __init__(self):
        self.running = False
        self.done = False
