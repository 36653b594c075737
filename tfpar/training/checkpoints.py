"""Checkpoints: ``tf.train.Checkpoint`` + ``CheckpointManager``, config beside them.

``model_dir`` holds ``config.json`` (the run's configuration), ``vocab.txt``,
``checkpoints/``, the TensorBoard event folders and, while a run writes, ``LOCK``. The latest checkpoint is the one the
manager's state file names (never the newest file by time). A re-run with the same
model dir restores it; one whose configuration changes the model is refused.

The model dir is a local folder or a URL of any file system TensorFlow has a plug-in for
(``gs://``, ``s3://`` with tensorflow-io, ``hdfs://``, ``ram://``): everything in it is
read and written through ``tf.io.gfile`` (``tfpar.files``), ``config.json`` and
``vocab.txt`` atomically (a temporary file renamed over the old one).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid

import tensorflow as tf

from tfpar import files
from tfpar.config import Config, resume_conflicts
from tfpar.data.vocab import VOCAB_FILE, Vocab, first_difference
from tfpar.errors import CheckpointError, ConfigError
from tfpar.parallel.registry import ASYNCHRONOUS
from tfpar.training.state import average_slot

log = logging.getLogger(__name__)
CONFIG_FILE = "config.json"
LOCK_FILE = "LOCK"
BEST = "best"  # <model_dir>/best: the state with the best valid perplexity
# Written by the chief once the run has trained its last step (and checkpointed it), not
# on a stop signal or an error: {"step": N}. A side-car evaluator ends after evaluating
# step N's checkpoint; a resumed run removes the file until it ends again.
FINAL_STEP_FILE = "final_step.json"


def write_final_step(model_dir: str, step: int) -> None:
    """Records, atomically, that the run ended after ``step`` (its last checkpoint)."""
    files.write_text(os.path.join(model_dir, FINAL_STEP_FILE), json.dumps({"step": step}))


def clear_final_step(model_dir: str) -> None:
    """Removes the record of an earlier end: this run trains on."""
    path = os.path.join(model_dir, FINAL_STEP_FILE)
    if tf.io.gfile.exists(path):
        tf.io.gfile.remove(path)


def final_step(model_dir: str) -> int | None:
    """The step the run ended after, or None while it has not ended."""
    path = os.path.join(model_dir, FINAL_STEP_FILE)
    if not tf.io.gfile.exists(path):
        return None
    return int(json.loads(files.read_text(path))["step"])


def incompatible(model_dir: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"cannot resume {model_dir}: {what}; use a new --model-dir or the original settings"
    )


@contextlib.contextmanager
def open_model_dir(config: Config, is_chief: bool, *, vocab: Vocab | None = None):
    """Creates the model dir (default ``runs/<strategy>-<timestamp>``), takes its writer
    lock (the chief only), checks its ``config.json`` and ``vocab.txt`` against this run
    and then writes them; yields its path and releases the lock on the way out, however
    the run ends."""
    model_dir = config.run.model_dir or os.path.join(
        "runs", f"{config.dist.strategy}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    )
    try:
        if tf.io.gfile.exists(model_dir) and not tf.io.gfile.isdir(model_dir):
            raise ConfigError(f"--model-dir {model_dir!r} is a file; give a folder (new or a "
                              "previous run's to resume it)")
        tf.io.gfile.makedirs(model_dir)
    except (OSError, tf.errors.OpError) as e:
        raise ConfigError(f"cannot create --model-dir {model_dir!r}: "
                          f"{files.reason(e)}") from None
    lock = WriterLock(model_dir) if is_chief else None
    if lock is not None:
        lock.acquire()
    if config.run.model_dir:
        log.info("model dir %s", model_dir)
    else:
        log.info("model dir %s (none was given: run again with --model-dir %s to resume "
                 "this run)", model_dir, model_dir)
    try:
        check_config_file(model_dir, config, is_chief, vocab=vocab)
        yield model_dir
    finally:
        if lock is not None:
            lock.release()


def check_config_file(model_dir: str, config: Config, is_chief: bool, *,
                      vocab: Vocab | None = None) -> None:
    """Refuses a ``config.json`` (or, given ``vocab``, a ``vocab.txt``) the run cannot
    resume; only then the chief writes this run's configuration there (the latest run's
    is what the next resume is checked against) and saves ``vocab`` if none is saved."""
    path = os.path.join(model_dir, CONFIG_FILE)
    if tf.io.gfile.exists(path):
        stored = Config.from_json(files.read_text(path))
        conflicts = resume_conflicts(stored, config)
        if conflicts:
            raise incompatible(model_dir, conflicts[0])
        check_batch_change(model_dir, stored, config)
        warn_on_exactness_change(stored, config)
    if vocab is not None:
        if tf.io.gfile.exists(os.path.join(model_dir, VOCAB_FILE)):
            check_vocab(model_dir, vocab, config.data.vocab_file)
        elif is_chief:
            vocab.save(model_dir)  # atomically
    if is_chief:
        files.write_text(path, config.to_json())  # atomically


def check_vocab(model_dir: str, vocab: Vocab, vocab_file: str | None) -> None:
    """Ids cannot silently change: a resumed run's vocabulary (built now, or read from
    ``vocab_file``) must hold the tokens of the ``vocab.txt`` saved beside its checkpoints."""
    saved = Vocab.load(os.path.join(model_dir, VOCAB_FILE), tokenizer=vocab.tokenizer)
    difference = first_difference(saved, vocab)
    if difference:
        now = f"--vocab-file {vocab_file}" if vocab_file else "the one built from the train split now"
        raise incompatible(model_dir, f"vocabulary: the saved {VOCAB_FILE} ({len(saved)} "
                                      f"entries) and {now} ({len(vocab)} entries) differ at "
                                      f"{difference}")


def check_batch_change(model_dir: str, stored: Config, config: Config) -> None:
    """A new global batch size is refused where the checkpoint cannot honour it: in the
    middle of an epoch (its position counts batches of the old size) and in stream mode
    (it carries one recurrent state row per batch row). At an epoch end in sentence
    mode the next epoch simply uses the new size."""
    old, new = stored.train.batch_size, config.train.batch_size
    if old == new:
        return
    latest = tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints"))
    if latest is None:
        return
    try:
        reader = tf.train.load_checkpoint(latest)
        epoch = int(reader.get_tensor("epoch/.ATTRIBUTES/VARIABLE_VALUE"))
        position = int(reader.get_tensor("batch_in_epoch/.ATTRIBUTES/VARIABLE_VALUE"))
    except (tf.errors.OpError, ValueError):
        return  # unreadable: restoring reports it and falls back
    field = f"train.batch_size (--batch-size): checkpoint has {old}, this run asks for {new}"
    if config.data.mode == "stream":
        raise incompatible(model_dir, f"{field}, and in stream mode the checkpoint carries "
                                      f"{old} rows of recurrent state")
    if position:
        raise incompatible(model_dir, f"{field} in the middle of epoch {epoch + 1} (after "
                                      f"batch {position}); the global batch can change only "
                                      "at an epoch end")


def warn_on_exactness_change(stored: Config, config: Config) -> None:
    """Moving between parameter_server and a synchronous strategy is allowed, with a
    warning: only synchronous strategies compute the one-device update."""
    before, now = stored.dist.strategy, config.dist.strategy
    if (before in ASYNCHRONOUS) != (now in ASYNCHRONOUS):
        log.warning("resuming a --strategy %s checkpoint under --strategy %s: the updates "
                    "%s asynchronous, so this run no longer repeats one device's updates "
                    "exactly", before, now,
                    "from here on are" if now in ASYNCHRONOUS else "before this point were")


# This process's identity in a lock, beside pid and host: a container restarted after a
# crash usually keeps its hostname and its pid (often 1), so pid and host alone cannot tell
# "this process holds it" from "my previous life held it".
_INCARNATION = uuid.uuid4().hex


# Heartbeats a URL lock's holder waits for a missing or unreadable lock to read again
# before it counts the lock as lost.
UNREADABLE_BEATS = 2


class WriterLock:
    """One writer per model dir: ``<model_dir>/LOCK`` holds the writer's pid, host and a
    token of its process, and the holder renews it every ``heartbeat`` seconds (a lease).

    On a local disk the file is created with ``O_CREAT | O_EXCL``, so of two runs started
    together exactly one gets it, and the holder renews the lease by refreshing the
    file's mtime. On a file system given by a URL (``gs://``, ``s3://``, ``hdfs://``,
    ``ram://``: ``tf.io.gfile`` has no exclusive create) the lock is written to a file of
    its own, ``.LOCK-<token>.tmp``, renamed to ``LOCK`` with ``overwrite=False`` and read
    back: the run holds it only if ``LOCK`` then holds its token. The heartbeat reads
    ``LOCK``, and while it still holds the token rewrites it the same way (temp file,
    renamed over it) with the beat's time in it.

    Either way the other run is refused with a one-line error, and so is a run that
    finds a live holder. A lock is stale, and taken over with a warning, when
      * it was written by this host and this pid but another process (a restarted
        container: same hostname, same pid, new process), or
      * its pid no longer runs on this host (a run killed with SIGKILL), or
      * it comes from another host and its lease has expired: no heartbeat for
        ``lease`` seconds (a job requeued on another node; the old node's clock is not
        read, only the file's mtime on the shared file system, compared with its now;
        on a file system that keeps no modification time, ``ram://``, the time of the
        last beat written in the file, which is the holder's clock).

    What a URL's lock does not guarantee: TensorFlow's ``rename(overwrite=False)`` checks
    that ``LOCK`` is absent and then renames (on an object store a rename is a copy and
    a delete), two steps, so two runs that start within that moment can both pass the
    check. The later rename wins; the earlier run learns it from its read back when the
    other rename landed before it, otherwise from its next heartbeat, which then logs an
    error and stops renewing (the run itself goes on). Exclusive creation would need the
    store's own conditional writes (GCS generation preconditions), which ``tf.io.gfile``
    does not offer. A released lock is deleted only while it holds the run's token.
    """

    def __init__(self, model_dir: str, *, heartbeat: float = 30.0, lease: float = 300.0):
        self.model_dir = model_dir
        self.path = os.path.join(model_dir, LOCK_FILE)
        self.local = files.is_local(model_dir)
        self.heartbeat, self.lease = heartbeat, lease
        self.held = False
        self._me: dict = {}
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "host": socket.gethostname(), "process": _INCARNATION}
        if not self.local:  # this acquisition (one process may try twice), the beat
            me.update(token=uuid.uuid4().hex, beat=time.time())
        for _ in range(3):
            if self._create(me):
                self.held, self._me = True, me
                self._stop.clear()
                self._beat = threading.Thread(target=self._keep_alive, daemon=True,
                                              name="model-dir-lock")
                self._beat.start()
                return
            holder = self._holder()
            why = self._stale(holder, me)
            if not why:
                raise ConfigError(
                    f"--model-dir {self.model_dir!r} is in use by pid {holder['pid']} "
                    f"on {holder['host']} (lock {self.path}); wait for that run to end, "
                    "or use another --model-dir") from None
            log.warning("taking over the stale lock %s of pid %s on %s (%s)", self.path,
                        holder.get("pid"), holder.get("host"), why)
            self._remove()
        raise ConfigError(f"cannot take the lock {self.path}: other runs keep taking it; "
                          "use another --model-dir")

    def release(self) -> None:
        if self.held:
            self._stop.set()
            if self._beat is not None:
                self._beat.join()
            if self.local or self._read().get("token") == self._me["token"]:
                self._remove()
            self.held = False

    def _create(self, me: dict) -> bool:
        """Writes ``me`` as the lock unless a lock exists; True if this run holds it."""
        if self.local:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(me, f)
            return True
        if tf.io.gfile.exists(self.path):
            return False
        tmp = self._write_temporary(me)
        try:
            tf.io.gfile.rename(tmp, self.path, overwrite=False)
        except tf.errors.OpError as e:
            with contextlib.suppress(tf.errors.OpError):
                tf.io.gfile.remove(tmp)
            if isinstance(e, tf.errors.AlreadyExistsError):
                return False
            raise ConfigError(f"cannot write the lock {self.path}: {files.reason(e)}; give "
                              "a writable --model-dir") from None
        return self._read().get("token") == me["token"]

    def _write_temporary(self, me: dict) -> str:
        """``me`` in ``.LOCK-<token>.tmp`` (a URL's lock), ready to be renamed to LOCK.

        Not ``LOCK.<token>``: ``ram://`` says a path exists when it is the prefix of one."""
        tmp = os.path.join(self.model_dir, f".{LOCK_FILE}-{me['token']}.tmp")
        try:
            with tf.io.gfile.GFile(tmp, "w") as f:
                f.write(json.dumps(me))
        except tf.errors.OpError as e:
            raise ConfigError(f"cannot write the lock {self.path}: {files.reason(e)}; give "
                              "a writable --model-dir") from None
        return tmp

    def _remove(self) -> None:
        if self.local:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        else:
            with contextlib.suppress(tf.errors.NotFoundError):
                tf.io.gfile.remove(self.path)

    def _keep_alive(self) -> None:
        """Renews the lease until released: the lock's mtime on a local disk; on a URL a
        rewrite with the beat's time, while the lock still holds this run's token."""
        unreadable = 0
        while not self._stop.wait(self.heartbeat):
            if self.local:
                with contextlib.suppress(OSError):
                    os.utime(self.path)
                continue
            holder = self._read()
            if not holder and unreadable < UNREADABLE_BEATS:
                # Missing or torn: a takeover may be under way (a write that is not a
                # rename leaves the file absent or half-written for a moment); the next
                # beat reads who holds it. The lease is not renewed meanwhile.
                unreadable += 1
                continue
            unreadable = 0
            if holder.get("token") != self._me["token"]:
                if holder:
                    log.error("lost the lock %s to pid %s on %s: another run writes to "
                              "--model-dir %s too; stop one of them", self.path,
                              holder.get("pid"), holder.get("host"), self.model_dir)
                else:
                    log.error("lost the lock %s: it was removed or cannot be read for %d "
                              "heartbeats; another run may write to --model-dir %s; stop "
                              "one of them", self.path, UNREADABLE_BEATS + 1, self.model_dir)
                return
            self._me["beat"] = time.time()
            with contextlib.suppress(ConfigError, tf.errors.OpError):
                tf.io.gfile.rename(self._write_temporary(self._me), self.path, overwrite=True)

    def _read(self) -> dict:
        """The lock file's JSON object ({} when missing, empty or torn)."""
        try:
            if self.local:
                with open(self.path, encoding="utf-8") as f:
                    holder = json.load(f)
            else:
                holder = json.loads(files.read_text(self.path))
        except (OSError, ValueError, tf.errors.OpError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def _holder(self) -> dict:
        holder = self._read()
        try:
            return {"pid": int(holder["pid"]), "host": str(holder["host"]),
                    "process": holder.get("process"), "beat": holder.get("beat")}
        except (ValueError, KeyError, TypeError):
            return {"pid": None, "host": None}  # empty or torn: its writer died at once

    def _idle(self, holder: dict) -> float | None:
        """Seconds since the holder's last heartbeat (None: the lock is gone)."""
        try:
            if self.local:
                return time.time() - os.path.getmtime(self.path)
            beat = files.modified(self.path) or holder.get("beat")
        except (OSError, tf.errors.NotFoundError):
            return None
        return time.time() - float(beat) if isinstance(beat, (int, float)) else math.inf

    def _stale(self, holder: dict, me: dict) -> str:
        """Why ``holder``'s lock is stale ("" when it may still be in use)."""
        if holder["pid"] is None:
            return "empty or torn: its writer died while writing it"
        if holder["host"] != me["host"]:
            idle = self._idle(holder)
            if idle is None:
                return "gone"
            if idle > self.lease:
                return f"another host, no heartbeat for {idle:.0f} s, over the {self.lease:g} s lease"
            return ""
        if holder["pid"] == me["pid"]:
            if holder.get("process") != me["process"]:
                return "written by an earlier process with this pid: a restart"
            return ""
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return "no longer running"
        except PermissionError:
            return ""
        return ""


def holds_averages(path: str) -> bool:
    """Whether checkpoint ``path`` holds moving averages of the weights (moments/*_average).
    (The reader takes the prefix as it is: ``tf.train.list_variables`` takes a ram://
    prefix for a directory.)"""
    keys = tf.compat.v1.train.NewCheckpointReader(path).get_variable_to_shape_map()
    return any(k.startswith("moments/") and "_average/" in k for k in keys)


class Checkpointer:
    """Saves and restores the training state; only the chief writes."""

    def __init__(self, model_dir: str, is_chief: bool, keep: int, **trackables):
        self.checkpoint = tf.train.Checkpoint(**trackables)
        self.trackables = trackables
        # The optimizer's moving averages of the weights (--ema-momentum), by weight name.
        moments = trackables.get("moments", {})
        self.averages = {name: (weight, moments[average_slot(name)])
                         for name, weight in trackables.get("layers", {}).items()
                         if average_slot(name) in moments}
        self.directory = os.path.join(model_dir, "checkpoints")
        self.is_chief = is_chief
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.directory, keep)
        self._last_saved = -1
        # Called before every save (the loop stores the carried stream state there).
        self.before_save = lambda: None

    def restore_latest(self) -> int | None:
        """Restores the newest readable checkpoint; returns its step (None: fresh start).

        A damaged newest checkpoint (truncated or corrupt files) is reported and the one
        before it is used, so a crash while a checkpoint was written loses one interval
        at most.
        """
        for path in reversed(self.manager.checkpoints):
            try:
                status = self.checkpoint.restore(path)
                if self.averages and not holds_averages(path):
                    self.start_averages(status, path)
                else:
                    status.assert_existing_objects_matched()
            except (tf.errors.OpError, ValueError, AssertionError, IndexError, OSError) as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                log.warning("checkpoint %s is unreadable (%s); trying the previous one",
                            path, reason[:200])
                continue
            step = int(path.rsplit("-", 1)[-1])
            self._last_saved = step
            log.info("resumed from %s (step %d)", path, step)
            return step
        if self.manager.checkpoints:
            raise CheckpointError(
                f"no readable checkpoint in {self.directory} (tried "
                f"{len(self.manager.checkpoints)}); remove the folder to start afresh")
        return None

    def start_averages(self, status, path: str) -> None:
        """A checkpoint written without a moving average (before --ema-momentum, or with
        it 0), resumed by a run that keeps one: all but the optimizer must match (asserted
        on a second read), the averages start from the weights just read."""
        status.expect_partial()
        rest = {k: v for k, v in self.trackables.items() if k not in ("optimizer", "moments")}
        tf.train.Checkpoint(**rest).restore(path).assert_existing_objects_matched()
        for weight, average in self.averages.values():
            average.assign(weight)
        log.info("%s holds no moving average of the weights: it starts from them here", path)

    @property
    def best_directory(self) -> str:
        """Where the best epoch's state is kept: ``<model_dir>/best``."""
        return os.path.join(os.path.dirname(self.directory), BEST)

    def save_best(self, step: int) -> None:
        """The state at ``step``, an epoch end with the best valid perplexity so far, as
        ``<model_dir>/best/ckpt-<step>``, the previous best deleted."""
        self.before_save()
        self._write(tf.train.CheckpointManager(self.checkpoint, self.best_directory, 1), step)

    def restore_best(self) -> int:
        """Restores the state kept by :meth:`save_best`; returns its step."""
        path = tf.train.latest_checkpoint(self.best_directory)
        if path is None:
            raise CheckpointError(f"no best checkpoint in {self.best_directory}; run with "
                                  "--final-weights last")
        self.checkpoint.restore(path).assert_existing_objects_matched()
        return int(path.rsplit("-", 1)[-1])

    def save(self, step: int) -> None:
        """Saves the state at ``step`` unless that step is saved already.

        Under MultiWorkerMirroredStrategy saving is a collective every worker must join,
        so a worker that is not the chief saves too, into a temporary folder it deletes.
        """
        if step == self._last_saved:
            return
        self.before_save()
        self._write(self.manager, step)
        self._last_saved = step

    def _write(self, manager: tf.train.CheckpointManager, step: int) -> None:
        """``manager.save`` on the chief; a scratch save other workers join and delete."""
        if self.is_chief:
            try:
                manager.save(checkpoint_number=step)
            except (OSError, tf.errors.OpError) as e:
                # TF writes a checkpoint under temporary names and renames it last, so a
                # failed write leaves the previous checkpoint as the latest one.
                reason = getattr(e, "strerror", None) or getattr(e, "message", None) or str(e)
                raise CheckpointError(
                    f"cannot write the checkpoint of step {step} to {manager.directory}: "
                    f"{reason.strip().splitlines()[0]}; free space or give another "
                    "--model-dir, then run again to resume from the last checkpoint") from None
        else:
            scratch = tempfile.mkdtemp(prefix="tfpar-worker-checkpoint-")
            try:
                tf.train.CheckpointManager(self.checkpoint, scratch, 1).save(checkpoint_number=step)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
