"""``parameter_server``: asynchronous training (ParameterServerStrategy, ClusterCoordinator).

Tasks (``TF_CONFIG``, see ``tfpar.parallel.cluster``): ``ps`` tasks hold the variables, ``worker``
tasks compute steps, and the ``chief`` is the coordinator: it runs the training loop,
schedules steps, evaluates and writes checkpoints, events, metrics and the export.
Worker and ps processes run ``tfpar-train`` too, with the same flags; they only
serve (:class:`ServerTask`, chosen before anything else is built) until they are stopped.

Asynchrony. The coordinator queues steps (``coordinator.schedule``); whichever worker is
free takes the next one: it reads the current parameters from the ps tasks, computes
the gradient of one whole batch (``--batch-size`` rows) and applies it at once, without
waiting for the other workers. Meanwhile the others may have updated the parameters, so a
gradient can be a few updates stale; which worker runs which step, and the order in which
updates land, depend on timing, so two runs are not bit-identical. The loop reads results
only at sync points (``coordinator.join()``: every ``--checkpoint-every`` steps and at the
end of each epoch), never after every step.

Input. A worker makes whole batches of its own share of the lines (its own shard files,
or every W-th line of fewer files than workers; in stream mode every W-th global batch),
picked by its index (``experimental_get_current_worker_index``), repeated: an epoch is as
many scheduled steps as the epoch has batches, but a faster worker may take more steps
than its share and re-read some of its batches while a slower one leaves a few unread.

Evaluation runs on the coordinator, exactly (every valid/test batch once): after a sync
point it copies the parameters into a local model and evaluates that copy, so training
workers are never slowed or raced by evaluation.

Sharding. With more than one ps task, variables are spread over them: large tables
(the embedding: at least as many rows as columns) are partitioned by rows
(``MinSizePartitioner``: shards of at least 256 KiB, at most one per ps task); weight
matrices and small variables are placed whole, round-robin. A matrix is read whole by
every step anyway, and the fast RNN layers hand their recurrent kernel to a custom
gradient, which cannot take a partitioned variable.

Why the update is not ``optimizer.apply_gradients``. Keras 3 does not support
parameter-server training (keras-team/keras#18624), and its ``apply_gradients`` fails
here: it dispatches through ``distribution.extended.update``, which cannot colocate with a
partitioned (``ShardedVariable``) parameter, and it counts steps with a read-then-assign
``iterations.assign_add`` that loses increments when workers overlap (37 of 40 steps
were counted in a trial). The step computes gradients per shard itself, then calls the
optimizer's public per-variable ``update_step`` (Keras's own SGD/Adam math and slots, so
checkpoints look like every other strategy's) and counts the step with one atomic
``assign_add`` on the ps. Two more Keras 3 gaps are patched in :meth:`scope`: optimizer
slots asked to be colocated with their variable would land on the coordinator (TF ignores
colocation in eager mode), and a Keras variable cannot checkpoint a ``ShardedVariable``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

import tensorflow as tf

from tfpar import compat
from tfpar.config import DistConfig, ModelConfig
from tfpar.errors import ClusterError, ConfigError, command
from tfpar.model.lm import detached_copy
from tfpar.objective import losses, step
from tfpar.objective.output import output_loss
from tfpar.objective.step import StepOutput
from tfpar.parallel.cluster.tf_config import ClusterConfig, check_port_free, require_cluster

log = logging.getLogger(__name__)
ShardedVariable = compat.sharded_variable_type()
# A ShardedVariable a Keras 3 variable can checkpoint (see compat).
CheckpointedShards = compat.checkpointed_shards_type()
# Partition a variable only into shards of at least this many bytes (TF's default).
MIN_SHARD_BYTES = 256 << 10


def worker_batches(data, split: str, *, training: bool, batch_size: int, workers: int,
                   index, epoch: int = 0, skip: int = 0) -> tf.data.Dataset:
    """The whole batches parameter-server worker ``index`` of ``workers`` trains on.

    Sentence mode: batches of its own share of the lines (``tfpar.data.pipeline
    .shares_files``), ``skip`` counting the job's batches, dealt to the workers in turn.
    Stream mode: global batches ``index, index + workers, ...`` after the first ``skip``.
    ``index`` is an int or a tensor (a worker knows its own index only as a tensor).
    """
    index = tf.cast(index, tf.int64)
    if not data.reads_own_lines:
        return data.batches(split, training=training, epoch=epoch, skip=skip,
                            batch_size=batch_size).shard(workers, index)
    # Of the job's first ``skip`` batches, dealt in turn, this worker had these.
    mine = tf.maximum(tf.constant(skip, tf.int64) - index + workers - 1, 0) // workers
    return data.batches(split, training=training, epoch=epoch, batch_size=batch_size,
                        pipelines=workers, index=index).skip(mine)


class FailureReports(logging.Filter):
    """Brings TF's coordinator's own worker-failure and recovery lines into tfpar's log.

    ``ClusterCoordinator`` handles a lost worker itself - it puts the steps that worker
    was running back in the queue, keeps the other workers busy and, once the worker
    answers again, re-creates its datasets and uses it - but says so only at INFO level
    on TF's logger, which tfpar's console keeps at ERROR. This filter, on that logger,
    re-logs those lines as tfpar warnings and lets every other record through only if
    it reaches the level the logger had.
    """

    KEEP = ("Worker ", "[Worker ", "Parameter server failure", "Cluster ")

    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.module == "cluster_coordinator":
            message = record.getMessage()
            if message.startswith(self.KEEP):
                log.warning("coordinator: %s", message.splitlines()[0][:300])
                return False
        return record.levelno >= self.level

    @classmethod
    def install(cls) -> None:
        logger = logging.getLogger("tensorflow")
        if not any(isinstance(f, cls) for f in logger.filters):
            logger.addFilter(cls(logger.getEffectiveLevel()))
            logger.setLevel(min(logger.getEffectiveLevel(), logging.INFO))


class TablePartitioner(tf.distribute.experimental.partitioners.Partitioner):
    """``MinSizePartitioner`` for tables (rank 1, or rows >= columns); matrices stay whole."""

    def __init__(self, max_shards: int, min_shard_bytes: int = MIN_SHARD_BYTES):
        self._tables = tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=min_shard_bytes, max_shards=max_shards)

    def __call__(self, shape, dtype, axis=0):
        shape = tf.TensorShape(shape)
        if shape.rank == 2 and shape[0] < shape[1]:
            return [1, 1]
        return self._tables(shape, dtype, axis)


def _ps_variable_creator(next_creator, **kwargs):
    """Variables created in :meth:`ParameterServerPlugin.scope` (see the module docstring)."""
    # Keras colocates optimizer slots with their variable; ParameterServerStrategy honours
    # colocation only in graphs, so in eager mode the slot would land on the coordinator.
    # Without the request the strategy places it on the ps tasks like any variable.
    kwargs.pop("colocate_with", None)
    variable = next_creator(**kwargs)
    if isinstance(variable, ShardedVariable) and not isinstance(variable, CheckpointedShards):
        variable = CheckpointedShards(variable.variables, name=variable.name)
    return variable


def shard_parts(variable) -> list:
    """What a gradient is taken with respect to: the shards of a partitioned variable, or
    the variable itself."""
    inner = getattr(variable, "value", variable)
    return list(inner.variables) if isinstance(inner, ShardedVariable) else [variable]


def loss_and_grads(model, batch: dict):
    """One worker's step on one whole batch: :func:`tfpar.objective.step.replica_gradients`
    with the batch's own token count, taken per shard of a partitioned variable and
    concatenated (a Keras variable cannot be differentiated through a
    ``ShardedVariable``).

    Args:
      batch: {"inputs": [B, T], "targets": [B, T]}, a whole global batch.

    Returns:
      ``(grads, nll_sum, count)``, one gradient per ``model.trainable_variables``
      (``tf.IndexedSlices`` with unique rows for the sampled softmax's tables).
    """
    parts = [shard_parts(v) for v in model.trainable_variables]
    flat, nll_sum, count, _ = step.replica_gradients(
        model, batch, losses.token_count(batch["targets"]), None,
        loss=output_loss(model.config), training=True,
        variables=[p for group in parts for p in group])
    grads, i = [], 0
    for group in parts:
        pieces = flat[i:i + len(group)]
        i += len(group)
        grads.append(step.deduplicate(_join_shards(pieces, group)))
    return grads, nll_sum, count


def _join_shards(pieces: list, shards: list):
    """One variable's gradient from its shards' (concatenated by rows): dense pieces
    concatenated, ``tf.IndexedSlices`` pieces with their row ids moved by the shards'
    offsets."""
    if len(pieces) == 1:
        return pieces[0]
    if not all(isinstance(p, tf.IndexedSlices) for p in pieces):
        return tf.concat([tf.convert_to_tensor(p) for p in pieces], axis=0)
    offsets, rows = [], 0
    for shard in shards:
        offsets.append(rows)
        rows += int(shard.shape[0])
    shape = tf.constant([rows] + [int(d) for d in shards[0].shape[1:]], tf.int64)
    return tf.IndexedSlices(
        tf.concat([p.values for p in pieces], 0),
        tf.concat([tf.cast(p.indices, tf.int64) + o for p, o in zip(pieces, offsets)], 0),
        shape)


def apply_update(optimizer, grads, variables) -> None:
    """One optimizer step with Keras's own math, dispatched per variable, and an atomic
    step count (see the module docstring)."""
    learning_rate = optimizer.learning_rate
    for grad, variable in zip(grads, variables):
        optimizer.update_step(grad, variable, learning_rate)
    optimizer.iterations.value.assign_add(1)


def check_config(config) -> None:
    """Refuses the run settings asynchronous training cannot honour (before the
    coordinator is built: the registry's ``check``).

    Raises:
      ConfigError: naming the setting and what to use instead.
    """
    if config.model.custom_cell:
        raise ConfigError(f"--cell {config.model.cell}: parameter_server's partitioner "
                          "may shard a cell's weights along rows the cell does not know "
                          "of; train a cell of your own with a synchronous strategy "
                          "(default, mirrored, tower, parallel_do, pipeline, multi_worker)")
    if config.data.mode == "stream":
        raise ConfigError("--mode stream carries the RNN state from one window to the next, "
                          "which asynchronous workers cannot do; use --mode sentence with "
                          "--strategy parameter_server")
    if config.train.weight_decay:
        raise ConfigError(f"--weight-decay {config.train.weight_decay}: parameter_server "
                          "updates variables one by one with the optimizer's update_step, "
                          "which leaves weight decay out; use a synchronous strategy or "
                          "--weight-decay 0")
    if config.train.ema_momentum:
        raise ConfigError(f"--ema-momentum {config.train.ema_momentum:g}: parameter_server "
                          "updates variables one by one with the optimizer's update_step, "
                          "which keeps no moving average; use a synchronous strategy or "
                          "--ema-momentum 0")
    # Given (unset, the run decides: one step per call for scheduled steps).
    if config.train.steps_per_execution not in (None, 1):
        raise ConfigError(f"--steps-per-execution {config.train.steps_per_execution}: "
                          "parameter_server schedules every step on a worker without "
                          "waiting for it already; use --steps-per-execution 1")
    if config.model.precision == "mixed_float16":
        raise ConfigError("--precision mixed_float16: parameter_server updates variables "
                          "one by one with the optimizer's update_step, which has no "
                          "loss scaling; use --precision mixed_bfloat16 or a synchronous "
                          "strategy")
    if config.run.profile_steps:
        raise ConfigError("--profile-steps profiles steps in the training process, but "
                          "parameter_server steps run on the workers; profile a "
                          "single-process strategy instead")


class Coordinator:
    """The chief's side of parameter-server training: schedules steps, evaluates.

    Not a :class:`~tfpar.parallel.base.StrategyPlugin`: there is no synchronous update
    to place and aggregate. It offers what the asynchronous loop
    (``tfpar.training.async_loop.AsyncLoop``) needs: a scope for the variables, per-worker input,
    a step that schedules, ``join`` and ``fetch``, and an exact evaluation.
    """

    name = "parameter_server"
    is_chief = True
    # A stop signal to the chief stops the job from here (the loop's ``job_chief``); the
    # workers and ps tasks have no step of their own to agree on.
    cluster_resolver = None

    def __init__(self, strategy: tf.distribute.ParameterServerStrategy,
                 coordinator: tf.distribute.coordinator.ClusterCoordinator,
                 config: ClusterConfig):
        self.strategy, self.coordinator, self.cluster = strategy, coordinator, config
        # Bumped by every scheduled step; an eval step copies the parameters again when
        # its copy is older.
        self._version = 0

    @property
    def num_replicas(self) -> int:
        # One step = one worker on one whole batch; workers do not split batches.
        return 1

    @property
    def num_workers(self) -> int:
        return self.cluster.count("worker")

    @property
    def devices(self) -> list[str]:
        return [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(self.num_workers)]

    def describe(self) -> str:
        return (f"parameter_server: coordinator {self.cluster.address}, "
                f"{self.num_workers} worker(s), {self.cluster.count('ps')} ps task(s)")

    @contextlib.contextmanager
    def scope(self):
        with self.strategy.scope(), tf.variable_creator_scope(_ps_variable_creator):
            yield

    # -- input
    def distribute(self, dataset_fn):
        """The coordinator's own batches (evaluation runs on the coordinator)."""
        return dataset_fn(None)

    def distribute_to_workers(self, dataset_fn):
        """Per-worker iterators, repeated: ``dataset_fn(workers, index)`` on worker
        ``index`` (:func:`worker_batches`), a tensor only that worker's dataset knows."""
        workers = self.num_workers

        def worker_dataset(input_context):
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            return dataset_fn(workers, index).repeat()

        @tf.function(autograph=False)
        def per_worker():
            return self.strategy.distribute_datasets_from_function(worker_dataset)

        return iter(self.coordinator.create_per_worker_dataset(per_worker))

    # -- steps
    def make_schedule_step(self, model, optimizer, *, clip_norm):
        """``schedule(iterator) -> future`` of one step's StepOutput fields."""
        strategy = self.strategy
        sharded = [v.path for v in model.trainable_variables if len(shard_parts(v)) > 1]
        log.info("variables on %d ps task(s); partitioned: %s", self.cluster.count("ps"),
                 ", ".join(sharded) or "none (tables are partitioned into shards of >= %d KiB)"
                 % (MIN_SHARD_BYTES >> 10))

        # The step that keys dropout and the candidates: the count on the ps when a
        # worker starts its step.
        step.key_noise_by_step(model, optimizer)

        def replica_step(batch):
            grads, nll_sum, count = loss_and_grads(model, batch)
            norm = tf.linalg.global_norm(grads)
            # The one update (clip, finite guard): a non-finite gradient never reaches
            # the parameters, nor the step count.
            applied, scale_skipped = step.update(
                norm, nll_sum, clip_norm, lambda factor: apply_update(
                    optimizer, [step.scale(g, factor) for g in grads],
                    model.trainable_variables))
            return dict(nll_sum=nll_sum, count=count, grad_norm=norm, applied=applied,
                        scale_skipped=scale_skipped)

        @tf.function(autograph=False)
        def worker_step(iterator):
            return strategy.run(replica_step, args=(next(iterator),))

        def schedule(iterator):
            """Schedules one step on a free worker; returns its future at once."""
            self._version += 1
            return self.coordinator.schedule(worker_step, args=(iterator,))

        return schedule

    def make_eval_step(self, model):
        copy = detached_copy(model.config, model.vocab_size,  # on the coordinator
                             fixed_shapes=model.fixed_shapes)
        copied = [-1]  # the version of the parameters in ``copy``
        loss = output_loss(model.config)

        @tf.function(autograph=False, reduce_retracing=True)
        def eval_step(batch):
            nll_sum, count, _ = step.forward(copy, batch, None, loss=loss)
            return dict(nll_sum=nll_sum, count=count)

        def evaluate(batch, state=None):
            if copied[0] != self._version:
                self.join()
                copy.set_weights(model.get_weights())
                copied[0] = self._version
            return StepOutput(**eval_step(batch))

        return evaluate

    def join(self) -> None:
        self.coordinator.join()

    def fetch(self, output) -> StepOutput:
        return StepOutput(**output.fetch())


class ServerTask:
    """A worker or ps task of a parameter-server cluster: it serves, it does not train."""

    def __init__(self, config: ClusterConfig):
        self.cluster = config

    def describe(self) -> str:
        return f"parameter_server: {self.cluster.task_name} serving at {self.cluster.address}"

    def serve(self) -> None:
        """Serves this task until SIGTERM or SIGINT, then returns (exit status 0): a
        stopped job's servers end cleanly, with one line saying so."""
        check_port_free(self.cluster.address)
        stopped = threading.Event()
        received: list[str] = []

        def stop(signum, frame):
            received.append(signal.Signals(signum).name)
            stopped.set()

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            server = tf.distribute.Server(  # noqa: F841 (serves while referenced)
                tf.train.ClusterSpec({job: list(a) for job, a in
                                      self.cluster.training_cluster.items()}),
                job_name=self.cluster.task_type, task_index=self.cluster.task_index,
                protocol="grpc", start=True)
            log.info("%s serving; it runs until it is stopped (SIGTERM)",
                     self.cluster.task_name)
            while not stopped.wait(1.0):  # a timed wait: signal handlers run meanwhile
                pass
            log.info("%s received: %s stops serving", received[0], self.cluster.task_name)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _cluster(dist: DistConfig) -> ClusterConfig:
    """The parameter-server cluster TF_CONFIG describes, checked against ``dist``.

    Raises:
      ClusterError: TF_CONFIG is unset or malformed, has no chief, workers or ps.
      ConfigError: --devices or --cpu-devices > 1 (a worker computes a step on its CPU:0
        or its GPU).
    """
    config = require_cluster("parameter_server", source=dist.cluster)
    if dist.devices or dist.cpu_devices > 1:
        flag = f"--devices {','.join(dist.devices)}" if dist.devices else \
            f"--cpu-devices {dist.cpu_devices}"
        raise ConfigError(f"{flag}: parameter_server runs each step on one worker's GPU or "
                          f"CPU; add workers instead: {command('tfpar-launch', '--workers N')}")
    # Fail fast instead of hanging when a worker or ps task is gone (TF's recommendation).
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    return config


def server_task(dist: DistConfig) -> ServerTask | None:
    """This process's :class:`ServerTask` when it is a worker or ps task, else None (the
    chief, which builds the :class:`Coordinator`)."""
    config = _cluster(dist)
    return None if config.task_type == "chief" else ServerTask(config)


def build_coordinator(dist: DistConfig, model: ModelConfig | None = None) -> Coordinator:
    """The coordinator, on the chief of the cluster TF_CONFIG describes.

    Raises:
      ClusterError: see :func:`_cluster`; this task is not the chief, or its port is
        taken.
      ConfigError: see :func:`_cluster`.
    """
    config = _cluster(dist)
    if config.task_type != "chief":
        raise ClusterError(f"{config.task_name} of a parameter_server cluster only serves; "
                           "the coordinator runs on the chief task")
    check_port_free(config.address)
    # The steps the coordinator sends to workers leave their outputs on "/device:CPU:0",
    # which without soft placement matches the CPU of every task and fails.
    if not tf.config.get_soft_device_placement():
        log.info("parameter_server: soft device placement on (its worker functions need it)")
        tf.config.set_soft_device_placement(True)
    partitioner = None
    if config.count("ps") > 1:
        partitioner = TablePartitioner(max_shards=config.count("ps"))
    # TF_CONFIG's cluster less a side-car evaluator, which is no part of training.
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({job: list(a) for job, a in config.training_cluster.items()}),
        task_type=config.task_type, task_id=config.task_index, rpc_layer="grpc")
    strategy = tf.distribute.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    FailureReports.install()
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    return Coordinator(strategy, coordinator, config)
