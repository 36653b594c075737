"""Parameter-server training's loop: steps scheduled on the workers without waiting,
their results read at sync points (see :class:`AsyncLoop`)."""

from __future__ import annotations

import time

from tfpar.parallel.parameter_server import worker_batches
from tfpar.training.loop import Loop, count_batches

# Parameter-server training: sync points about this often, so a stop signal is acted on
# within seconds (a preemption's grace period is tens of seconds), while each sync point,
# which leaves the workers idle for a moment, stays rare; never fewer steps per worker
# between two than the minimum below.
SECONDS_BETWEEN_SYNCS = 5.0
MIN_STEPS_PER_WORKER_BETWEEN_SYNCS = 16


class AsyncLoop(Loop):
    """Parameter-server training: schedules steps without waiting for any, and reads
    their results only at sync points - every --checkpoint-every steps, at the epoch end
    and about every ``SECONDS_BETWEEN_SYNCS`` (the steps that take, measured) - once the
    coordinator has waited for all of them. Summaries are therefore written per sync
    point that reaches a --log-every multiple. A stop signal on the chief is a preemption
    of the job: the chief checkpoints at the next sync point and exits 75 (the worker and
    ps tasks stop serving when they are sent theirs)."""

    job_chief = True

    def batches_left(self, epoch: int, skip: int) -> int:
        """The batches the workers make of ``epoch``, after the job's first ``skip``: the
        sum of each worker's own (one pass over the corpus when they read their own
        files). More than one input's batches: a worker's share of a bucket fills fewer
        whole batches."""
        workers = self.plugin.num_workers
        return sum(count_batches(self.worker_batches(epoch, 0, workers, i))
                   for i in range(workers)) - skip

    def worker_batches(self, epoch: int, skip: int, workers: int, index):
        return worker_batches(self.data, "train", training=True, epoch=epoch, skip=skip,
                              batch_size=self.config.train.batch_size, workers=workers,
                              index=index)

    def train_epoch(self, epoch: int, skip: int) -> None:
        cfg, coordinator = self.config, self.plugin
        todo = self.batches_left(epoch, skip)
        max_steps = cfg.train.max_steps
        iterators = coordinator.distribute_to_workers(
            lambda workers, index: self.worker_batches(epoch, skip, workers, index))
        self.start_bar(todo, epoch)
        every = cfg.run.checkpoint_every or todo
        least = between_syncs = MIN_STEPS_PER_WORKER_BETWEEN_SYNCS * coordinator.num_workers
        while todo > 0 and not self.done():
            start = time.perf_counter()
            # A sync point at every checkpoint step, and every few seconds between.
            scheduled = min(todo, every - self.step % every, between_syncs)
            if max_steps:
                # At most the updates still missing; a skipped (non-finite) step is not
                # one, so after a sync point with skips the epoch goes on, as in Loop.
                scheduled = min(scheduled, max_steps - self.step)
            self.start_clock()
            futures = [self.train(iterators) for _ in range(scheduled)]
            coordinator.join()
            outputs = [coordinator.fetch(f) for f in futures]  # StepOutputs, as Loop's
            seconds = time.perf_counter() - start
            self.record(outputs, seconds, as_one=True)
            todo -= scheduled
            between_syncs = max(least, int(scheduled * SECONDS_BETWEEN_SYNCS / seconds))

