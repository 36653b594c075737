"""``--profile-steps`` and the step's graph: a train step (or a multi-step call) that
writes its graph to TensorBoard once and runs the profiler over steps A..B
(``tfpar.training.summaries.Writer.instrument`` wraps the loop's step functions in them).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import tensorflow as tf

log = logging.getLogger(__name__)


class StepHooks:
    """A train step that writes its graph once and runs the profiler over steps A..B.

    The profiler starts right *after* step A - 1, so the fetch of step A's batch from the
    input pipeline (``Iterator::…`` events) is inside the trace, and stops after step B.
    The trace lands in ``<model_dir>/train/plugins/profile/<session>/``, where TensorBoard's
    profile plugin finds it.
    """

    graph_name = "train_step"

    def __init__(self, writer, step_fn, next_step: Callable[[], int],
                 profile_steps: tuple[int, ...]):
        self.writer, self.step_fn, self.next_step = writer, step_fn, next_step
        self.profile = profile_steps
        self.function = getattr(step_fn, "function", None)
        self._graph_written = False
        self._profiler = _ProfilerState()
        self.logdir = os.path.join(writer.model_dir, "train")

    def share_profiler(self, other: "StepHooks") -> None:
        """One profiler session for both hooks (TF runs one per process)."""
        self._profiler = other._profiler

    def __call__(self, *args, **kwargs):
        step = self.next_step()
        if self.profile and self.profile[0] <= step <= self.profile[1]:
            self.start_profiler()
        if self._graph_written:
            out = self.step_fn(*args, **kwargs)
        else:
            out = self._traced(step, *args, **kwargs)
        if self.profile and step >= self.profile[1]:
            self.stop_profiler()
        elif self.profile and step + 1 == self.profile[0]:
            self.start_profiler()
        return out

    def _traced(self, step: int, *args, **kwargs):
        """Runs the first step with graph collection on and writes the graph."""
        tf.summary.trace_on(graph=True, profiler=False)
        try:
            out = self.step_fn(*args, **kwargs)
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


class CallHooks(StepHooks):
    """:class:`StepHooks` for ``steps(iterator, state, n)``, a call that runs steps
    ``next_step()`` .. ``next_step() + n - 1``: its graph is the multi-step loop's
    (``train_steps``), and the profiler covers every call with a step in A..B."""

    graph_name = "train_steps"

    def __call__(self, iterator, state, n: int):
        first = self.next_step()
        last = first + n - 1
        if self.profile and first <= self.profile[1] and last >= self.profile[0]:
            self.start_profiler()
        if self._graph_written:
            out = self.step_fn(iterator, state, n)
        else:
            out = self._traced(first, iterator, state, n)
        if self.profile and last >= self.profile[1]:
            self.stop_profiler()
        return out
