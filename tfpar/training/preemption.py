"""A stop signal on any worker of a multi-worker job stops every worker after one step.

Under ``multi_worker`` every step is a collective of all workers: a worker that stopped
alone would leave its peers waiting in the next all-reduce until they fail. So there a
stop signal (SIGTERM from a scheduler that preempts a pod, or SIGINT), caught by the
loop's ``StopSignal`` as in any run, is not acted on by its worker alone:
``tf.distribute.experimental.PreemptionCheckpointHandler`` agrees on the call of the
train step function after which every worker stops, through the cluster's coordination
service::

    worker 1 gets SIGTERM    its handler sees the StopSignal flag (polled each second);
                             after its next call k it posts "after call k + 1" and waits
                             until every worker's handler has read it
    every worker, after      saves the job's checkpoint of that step (``Checkpointer.save``:
    call k + 1               the chief into checkpoints/, the others into scratch folders,
                             one collective) and raises ``Preempted`` (exit status 75)

A call ends on the same step on every worker: with ``--steps-per-execution N`` a call
runs up to N steps, cut alike everywhere (``Loop.steps_in_next_call``), and no worker is
more than one call ahead of another, since each call's all-reduce needs all of them.
"""

from __future__ import annotations

import os
from typing import Callable

import tensorflow as tf


class StopTogether:
    """Stops every worker of a multi-worker job after the same train call once any of
    them has received a stop signal (see the module docstring).

    Args:
      cluster_resolver: the strategy's ``ClusterResolver`` (the job's workers).
      stop_signal: this worker's ``StopSignal``; its ``received`` flag is the
        termination notice the handler polls.
      save: saves the job's checkpoint of the current step (called by every worker at
        the agreed call, so that saving stays a collective).
      error: the exception to raise once saved, made when it is raised.
      checkpoint_dir: the run's checkpoint folder; nothing is written under it here.
    """

    def __init__(self, cluster_resolver, stop_signal, *, save: Callable[[], None],
                 error: Callable[[], Exception], checkpoint_dir: str):
        self.error = error
        config = tf.distribute.experimental.TerminationConfig(
            termination_watcher_fn=lambda: stop_signal.received is not None,
            exit_fn=self._exit, grace_period=0, save_fn=save)
        # The handler restores its manager's latest checkpoint when built and adds its
        # call counter to that checkpoint. tfpar has restored the run's state already
        # (past a damaged newest checkpoint if need be) and keeps its checkpoints free
        # of strategy-specific tensors, so the handler gets a checkpoint of its own
        # holding only the counter, in a folder no one writes: saving is ``save``.
        # The counter then starts at 0 in every launch, alike on every worker.
        own = tf.train.CheckpointManager(
            tf.train.Checkpoint(), os.path.join(checkpoint_dir, "preemption-unused"), 1)
        self.handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            cluster_resolver, own, termination_config=config)

    def check(self) -> None:
        """After every train call: once every worker has reached the agreed call, saves
        and raises ``error()``; otherwise returns at once (a worker that has just seen
        its own signal waits until every worker has learnt the agreed call)."""
        self.handler.save_checkpoint_if_preempted()

    def close(self) -> None:
        """Once training has ended without a stop: ends the handler's threads (each
        worker posts "no stop" for the call key its peers' watchers wait on). Left
        running, a watcher still waiting when the chief's coordination service goes
        away at exit would fail with a traceback."""
        self.handler.__del__()  # the handler's own clean-up, idempotent

    def _exit(self):
        raise self.error()
