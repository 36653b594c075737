"""Fault injection for two of tfpar's promises: exact resume and portable checkpoints.

``scripts/faults.py kills`` checks that a run killed with SIGKILL at *any* moment and then
started again with the same command ends bit for bit where an uninterrupted run ends. Per
mode it trains once without interruption (the reference, wall time T), then, round after
round, starts the same command on a fresh model dir, kills it at a moment drawn uniformly
from [0, T] (start-up, tracing, steps, checkpoint writes, epoch ends, evaluation, export:
whatever is running then), optionally kills the resumed run too, runs the command once
more to the end, and compares every tensor of the latest checkpoint (weights, optimizer
slots and step count, epoch and batch counters, the carried stream state) with
``np.array_equal``, and the final metrics (steps, valid and test perplexity) with ``==``.
Equal tensors alone would not show a resume (training is deterministic, so a run that
ignored its checkpoint and started from step 0 ends the same), so each relaunch must also
report ("resumed from ... (step N)") the latest checkpoint the kill left.
Each kill is reported with the phase it hit, read from the killed process's output and
what it left in the model dir (see :func:`infer_phase`). A round whose kills all missed
training and checkpoint writes (the phases a resume is most often wrong in) is drawn
again, up to ``--redraws`` times, its kills then coming after one of the run's own
checkpoints (drawn at random, before the last step) by a delay uniform in the
reference's time between two checkpoints in training; a round that still misses
fails the test.

``scripts/faults.py matrix`` checks that a checkpoint moves between strategies and device
counts: for every (source, target) pair it kills a run under the source once the
checkpoint of step ``--kill-at-step`` exists, resumes it under the target to ``--steps``
and reports the largest absolute difference of any checkpointed tensor from an
uninterrupted ``default`` run. Every synchronous strategy computes the one-device update,
so the differences are float rounding (different reduction orders), not drift.
Cluster strategies (multi_worker, parameter_server) need TF_CONFIG and one process per
task, so the matrix leaves them out.

Everything runs ``scripts/train.py`` as real subprocesses and sends real signals. The
shared pieces (:func:`checkpoint_tensors`, :func:`compare_tensors`,
:func:`start_train`) are used by the test suite too. TensorFlow is imported inside the
functions that need it, so ``--help`` and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from tfpar.errors import ConfigError
from tfpar.parallel import registry
from tfpar.tools.parsing import Parser

# The optimizer, clip norm, init and softmax the measured kill and matrix runs use (the
# numbers in tfpar/docs/reliability.md), whatever the CLI's defaults.
PINNED_OPTIMIZER = ["--optimizer", "adam", "--lr", "3e-3", "--clip-norm", "5",
                    "--init-scale", "0", "--no-tie-embeddings"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/faults.py -> the clone
TRAIN_SCRIPT = os.path.join(REPO, "scripts", "train.py")
# Checkpoint entries that say how a checkpoint was written, not what state it holds.
BOOKKEEPING = ("_CHECKPOINTABLE_OBJECT_GRAPH", "save_counter")
MODES = ("sentence", "stream")
# Strategies one process can run (the matrix and the kill test use these); the cluster
# ones need TF_CONFIG and a process per task (scripts/launch_local.py). Read from the one
# registry of strategies; a multi-device one's default count is the devices it needs.
IN_PROCESS = tuple(n for n in registry.names() if not registry.traits(n).cluster)
CLUSTER = tuple(n for n in registry.names() if registry.traits(n).cluster)
MULTI_DEVICE = {n: registry.traits(n).min_cpu_devices for n in IN_PROCESS
                if registry.traits(n).over}
EXPORT_NAME = "tfpar_lm"


# ------------------------------------------------------------------ checkpoints, compare
def _tensorflow():
    """TensorFlow, imported on first use (``scripts/faults.py`` quiets its native
    start-up lines with :mod:`tfpar.tools.console` before anything imports it)."""
    import tensorflow

    return tensorflow


def checkpoint_tensors(model_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of the latest checkpoint of ``model_dir`` (the one its state file
    names): weights ``layers/...``, optimizer slots ``moments/...`` and step count, epoch
    and batch counters, the stream carry ``carry/...``; not the object graph nor the save
    counter (how many saves it took)."""
    tf = _tensorflow()
    reader = tf.train.load_checkpoint(os.path.join(os.fspath(model_dir), "checkpoints"))
    keys = sorted(k for k in reader.get_variable_to_shape_map() if not k.startswith(BOOKKEEPING))
    return {k: np.asarray(reader.get_tensor(k)) for k in keys}


@dataclasses.dataclass
class Difference:
    """One tensor that is not equal: its largest |Δ| and how many elements differ."""

    key: str
    max_abs: float
    count: int
    size: int

    def __str__(self) -> str:
        return f"{short_key(self.key)} max|Δ| {self.max_abs:.3g} ({self.count}/{self.size})"


@dataclasses.dataclass
class Comparison:
    """What :func:`compare_tensors` found."""

    differing: list[Difference]  # worst first
    missing: list[str]  # in the expected tensors only
    extra: list[str]  # in the compared tensors only
    compared: int

    @property
    def exact(self) -> bool:
        return not (self.differing or self.missing or self.extra)

    @property
    def worst(self) -> float:
        """The largest |Δ| of any tensor (inf when the key sets or shapes differ)."""
        if self.missing or self.extra:
            return math.inf
        return max((d.max_abs for d in self.differing), default=0.0)

    def describe(self, limit: int = 4) -> str:
        if self.exact:
            return f"all {self.compared} tensors equal"
        parts = []
        if self.missing:
            parts.append(f"missing {', '.join(map(short_key, self.missing[:limit]))}")
        if self.extra:
            parts.append(f"unexpected {', '.join(map(short_key, self.extra[:limit]))}")
        if self.differing:
            shown = "; ".join(str(d) for d in self.differing[:limit])
            more = len(self.differing) - limit
            parts.append(f"{len(self.differing)}/{self.compared} tensors differ: {shown}"
                         + (f"; {more} more" if more > 0 else ""))
        return "; ".join(parts)


def short_key(key: str) -> str:
    """``layers/softmax:kernel/.ATTRIBUTES/VARIABLE_VALUE`` -> ``layers/softmax:kernel``."""
    return key.replace("/.ATTRIBUTES/VARIABLE_VALUE", "")


# The model selection's perplexities (selection/best_valid_ppl: a float32 of order 10 to
# 1000, whose ulp reaches 6e-5) differ relatively: |Δ| / max(|x|, 1). Absolute, one ulp of
# a perplexity near 700 would be above the matrix's 1e-5 with every weight within 1e-7.
RELATIVE = ("selection/best_valid_ppl",)


def compare_tensors(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> Comparison:
    """Compares two :func:`checkpoint_tensors` dicts tensor by tensor with
    ``np.array_equal`` (NaNs at the same places count as equal); returns the keys that
    differ, worst first, with their largest absolute difference (relative for the keys
    of :data:`RELATIVE`)."""
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    differing = []
    for key in sorted(set(got) & set(expected)):
        a, b = np.asarray(got[key]), np.asarray(expected[key])
        numeric = a.dtype.kind in "biuf" and b.dtype.kind in "biuf"
        if a.shape == b.shape and np.array_equal(a, b, equal_nan=numeric and a.dtype.kind == "f"):
            continue
        if not numeric or a.shape != b.shape:
            differing.append(Difference(key, math.inf, max(a.size, b.size), max(a.size, b.size)))
            continue
        delta = np.abs(a.astype(np.float64) - b.astype(np.float64))
        delta = np.where(np.isnan(a.astype(np.float64)) & np.isnan(b.astype(np.float64)), 0, delta)
        delta = np.nan_to_num(delta, nan=math.inf)
        if key.startswith(RELATIVE):
            delta = delta / np.maximum(np.abs(b.astype(np.float64)), 1.0)
        differing.append(Difference(key, float(delta.max()), int(np.count_nonzero(delta)),
                                    int(a.size)))
    differing.sort(key=lambda d: -d.max_abs)
    return Comparison(differing, missing, extra, len(set(got) & set(expected)))


# --------------------------------------------------------------------- train processes
def train_env() -> dict[str, str]:
    """The environment of a train.py child: TF's C++ start-up chatter quiet."""
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))


def start_train(args: Sequence[str], env: dict | None = None) -> subprocess.Popen:
    """Starts ``scripts/train.py args`` with stdout and stderr merged into one text pipe."""
    return subprocess.Popen([sys.executable, TRAIN_SCRIPT, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or train_env())


LIVE: set = set()  # TrainProcesses not yet waited for (killed if the tool is stopped)


def stop_all() -> None:
    """SIGKILLs every train.py this module started that is still running."""
    for p in list(LIVE):
        if p.proc.poll() is None:
            p.proc.kill()
        p.proc.wait()
        LIVE.discard(p)


class TrainProcess:
    """A running ``scripts/train.py`` whose output is collected (with the time each line
    arrived) by a thread, so the pipe never fills, and whose checkpoints are timed as
    they appear while :meth:`kill_at` waits."""

    def __init__(self, args: Sequence[str], model_dir: str):
        self.model_dir = model_dir
        self.initial = set(index_steps(model_dir))  # checkpoints of earlier processes
        self.started = time.monotonic()
        self.proc = start_train(args)
        LIVE.add(self)
        self.lines: list[tuple[float, str]] = []
        self.seen: dict[int, float] = {}  # checkpoint step -> when its index appeared
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((self.elapsed(), line.rstrip("\n")))

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def watch(self) -> None:
        """Notes the checkpoints that have appeared since the last call."""
        for step in index_steps(self.model_dir):
            self.seen.setdefault(step, self.elapsed())

    def wait(self, timeout: float) -> int:
        """Waits for the end (killing it after ``timeout`` s); returns its exit status."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            self.watch()
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                self._reader.join(5)
                raise TimeoutError(f"train.py ran longer than {timeout:.0f} s:\n{self.output}")
            time.sleep(0.02)
        self._reader.join(10)
        LIVE.discard(self)
        return self.proc.returncode

    def kill_at(self, moment: float) -> bool:
        """SIGKILL at ``moment`` s after the start; False if the process had ended before."""
        while self.elapsed() < moment and self.proc.poll() is None:
            self.watch()
            time.sleep(min(0.01, max(0.0, moment - self.elapsed())))
        return self.kill_now()

    def kill_after_checkpoint(self, step: int, delay: float,
                              timeout: float) -> tuple[bool, float]:
        """SIGKILL ``delay`` s after this process's checkpoint of ``step`` appeared (at its
        own pace, whatever its start-up took); returns (alive, the kill's moment)."""
        deadline = time.monotonic() + timeout
        while step not in self.seen and self.proc.poll() is None and \
                time.monotonic() < deadline:
            self.watch()
            time.sleep(0.005)
        moment = self.seen.get(step, self.elapsed()) + delay
        return self.kill_at(moment), moment

    def kill_when(self, predicate, timeout: float, interval: float = 0.005) -> bool:
        """SIGKILL as soon as ``predicate()`` is true; False if the process ended first."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                self.kill_now()
                raise TimeoutError(f"kill point not reached within {timeout:.0f} s:\n{self.output}")
            time.sleep(interval)
        return self.kill_now()

    def kill_now(self) -> bool:
        alive = self.proc.poll() is None
        if alive:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._reader.join(10)
        LIVE.discard(self)
        self.watch()  # nothing changes any more: what the kill left
        return alive


def index_steps(model_dir: str) -> list[int]:
    """Steps of the complete checkpoint files (``ckpt-N.index``) in ``model_dir``."""
    names = _listdir(os.path.join(model_dir, "checkpoints"))
    return sorted(int(m.group(1)) for m in map(re.compile(r"ckpt-(\d+)\.index$").match, names) if m)


def latest_step(model_dir: str) -> int | None:
    """The step of the checkpoint the state file names (what a resume restores first)."""
    try:
        with open(os.path.join(model_dir, "checkpoints", "checkpoint"), encoding="utf-8") as f:
            m = re.search(r'^model_checkpoint_path: ".*?ckpt-(\d+)"', f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


RESUMED = re.compile(r"resumed from .*\(step (\d+)\)")


def resumed_step(output: str) -> int | None:
    """The step a train.py run restored, from its ``resumed from <path> (step N)`` log
    line; None: it started from step 0 (or had not restored yet)."""
    m = RESUMED.search(output)
    return int(m.group(1)) if m else None


def resume_mismatch(resumed: int | None, expected: int | None) -> str:
    """'' when a run restored ``expected``, the step of the latest checkpoint in its
    model dir when it started (None: there was none), else what it did instead."""
    if resumed == expected:
        return ""
    if resumed is None:
        return f"started from step 0, ignoring the checkpoint of step {expected}"
    if expected is None:
        return f"resumed from step {resumed} with no checkpoint left"
    return f"resumed from step {resumed}, not the latest checkpoint (step {expected})"


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def read_metrics(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def epoch_end_steps(model_dir: str) -> list[int]:
    """The steps at which a (reference) run finished an epoch, from its
    ``metrics.jsonl`` (a line per finished epoch, tfpar.training.loop.EPOCH_METRICS)."""
    try:
        with open(os.path.join(model_dir, "metrics.jsonl"), encoding="utf-8") as f:
            return sorted({int(json.loads(line)["step"]) for line in f if line.strip()})
    except FileNotFoundError:  # no epoch finished
        return []


# ------------------------------------------------------------------------------- phases
@dataclasses.dataclass(frozen=True)
class Phase:
    """What a killed process was doing: a category (counted in the summary) and details."""

    category: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.category} ({self.detail})" if self.detail else self.category


PHASES = ("start-up", "tracing + first steps", "training", "checkpoint write",
          "epoch-end evaluation", "final evaluation", "export", "after export",
          "finished already", "exited by itself")


@dataclasses.dataclass
class Schedule:
    """When a run checkpoints: every ``every`` steps, at each epoch end, at its last step
    ``max_steps`` (its ``--max-steps``, or its last epoch's end when that comes first)."""

    max_steps: int
    every: int
    epoch_ends: tuple[int, ...] = ()

    def crosses_epoch_end(self, a: int, b: int) -> bool:
        """Whether an epoch ends after step ``a``, at or before step ``b``."""
        return any(a < e <= b for e in self.epoch_ends)

    def next_save(self, step: int) -> int:
        candidates = [step - step % self.every + self.every, self.max_steps]
        candidates += [e for e in self.epoch_ends if e > step]
        return min(c for c in candidates if c > step)


def infer_phase(proc: TrainProcess, export_dir: str, schedule: Schedule, moment: float,
                alive: bool) -> Phase:
    """The phase a kill at ``moment`` hit, read (after the process is dead, so nothing
    changes) from its output, the files it left and the times its checkpoints appeared:

    - ``export``: ``<export-dir>/tfpar_lm/.staging-*`` exists;
    - ``checkpoint write``: ``ckpt-N_temp`` files, a ``checkpoint`` state file being
      replaced, or a complete ``ckpt-N`` the state file does not name yet;
    - ``start-up``: no ``corpus`` line printed (imports, devices, corpus, vocabulary);
    - ``tracing + first steps``: this process wrote no checkpoint yet (model build,
      restore, tracing the step, the steps up to its first checkpoint);
    - ``final evaluation``: the last step is checkpointed, no export started;
    - ``epoch-end evaluation`` / ``training``: between two checkpoints, the next being an
      epoch end: more time has passed since the last checkpoint appeared than the steps
      up to the epoch end take (at this process's own pace) -> the valid evaluation.
    """
    if not alive:
        code = proc.proc.returncode
        last = f"last output at {proc.lines[-1][0]:.1f} s" if proc.lines else ""
        return Phase("finished already", last) if code == 0 else Phase("exited by itself",
                                                                  f"status {code}")
    names = _listdir(os.path.join(proc.model_dir, "checkpoints"))
    if glob.glob(os.path.join(export_dir, EXPORT_NAME, ".staging-*")):
        return Phase("export")
    temps = sorted({int(m.group(1)) for m in map(re.compile(r"ckpt-(\d+)_temp").match, names) if m})
    latest = latest_step(proc.model_dir)
    complete = index_steps(proc.model_dir)
    if temps:
        return Phase("checkpoint write", f"ckpt-{temps[-1]} being written")
    if any(n.startswith("checkpoint.tmp") for n in names) or \
            (complete and (latest is None or complete[-1] > latest)):
        return Phase("checkpoint write", f"ckpt-{complete[-1] if complete else '?'} written, "
                                         "state file not yet updated")
    text = proc.output
    if "tfpar.training.run: corpus " not in text:
        return Phase("start-up", "imports, devices, corpus")
    if "tfpar.serving.export: exported SavedModel" in text:
        return Phase("after export", "metrics JSON, closing")
    resumed = RESUMED.search(text)
    own = {s: t for s, t in proc.seen.items() if s not in proc.initial}
    base = latest or 0
    if latest is not None and latest >= schedule.max_steps:
        return Phase("final evaluation", "valid + test")
    nxt = schedule.next_save(base)
    steps = f"steps {base + 1}-{nxt}" if nxt > base + 1 else f"step {nxt}"
    if not own:
        where = f"restored step {base}" if resumed else "fresh"
        return Phase("tracing + first steps", f"{where}; {steps}")
    if nxt in schedule.epoch_ends:
        epoch = schedule.epoch_ends.index(nxt) + 1
        if re.search(rf"epoch {epoch}/\d+: train ppl .*, valid ppl ", text):
            return Phase("epoch-end evaluation", f"epoch {epoch} valid done; histograms, "
                                                 f"gradient norms, text samples, ckpt-{nxt} next")
        pace = step_pace(own, schedule)
        since = moment - proc.seen.get(base, moment)
        if pace is not None and since > 2.0 * pace * (nxt - base) + 0.05:
            return Phase("epoch-end evaluation", f"epoch {epoch} valid, {since:.2f} s after "
                                                 f"ckpt-{base}")
    return Phase("training", f"after ckpt-{base}; {steps}")


def step_pace(seen: dict[int, float], schedule: Schedule) -> float | None:
    """Seconds per step between the last two checkpoints a process wrote with no epoch end
    (and so no evaluation) in between; None when there are no such two."""
    steps = sorted(seen)
    for a, b in reversed(list(zip(steps, steps[1:]))):
        if not schedule.crosses_epoch_end(a, b):
            return max(seen[b] - seen[a], 1e-3) / (b - a)
    return None


# --------------------------------------------------------------------------- strategies
def strategy_flags(spec: str) -> list[str]:
    """``name[:devices]`` -> train.py flags: ``mirrored:2`` -> ``--strategy mirrored
    --cpu-devices 2``; ``default``, ``one_device`` take no count.

    Raises:
      ConfigError: an unknown or cluster strategy, or a bad device count.
    """
    name, _, count_text = spec.strip().partition(":")
    if name in CLUSTER:
        raise ConfigError(f"{name} needs TF_CONFIG and one process per task "
                          "(scripts/launch_local.py); use one of: " + ", ".join(IN_PROCESS))
    if name not in IN_PROCESS:
        raise ConfigError(f"unknown strategy {name!r} in {spec!r}; expected one of: "
                          + ", ".join(IN_PROCESS))
    if name not in MULTI_DEVICE:
        if count_text:
            raise ConfigError(f"{spec!r}: {name} runs on one device; give it without a count")
        return ["--strategy", name]
    try:
        count = int(count_text) if count_text else MULTI_DEVICE[name]
    except ValueError:
        raise ConfigError(f"device count {count_text!r} of {spec!r} is not an integer; "
                          f"e.g. {name}:2") from None
    if count < 1:
        raise ConfigError(f"{spec!r}: the device count must be >= 1, got {count}")
    return ["--strategy", name, "--cpu-devices", str(count)]


def parse_list(flag: str, text: str, allowed: Iterable[str] | None = None) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ConfigError(f"{flag} {text!r} names nothing; e.g. {flag} sentence,stream")
    if allowed is not None:
        allowed = tuple(allowed)
        for item in items:
            if item not in allowed:
                raise ConfigError(f"unknown {flag.lstrip('-').rstrip('s')} {item!r} in {flag}; "
                                  f"expected one of: {', '.join(allowed)}")
    if len(set(items)) != len(items):
        raise ConfigError(f"{flag} {text!r} names an entry twice")
    return items


def prepare_workdir(path: str) -> str:
    """The folder runs go to: ``path`` (new, or empty), else a new temporary folder."""
    if not path:
        return tempfile.mkdtemp(prefix="tfpar-faults-")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--workdir {path!r} is a file; give a new or empty folder")
    if os.path.isdir(path) and os.listdir(path):
        raise ConfigError(f"--workdir {path!r} is not empty; give a new or empty folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create --workdir {path!r}: {e.strerror}") from None
    return os.path.abspath(path)


def clean_workdir(root: str, given: str) -> None:
    """Deletes what the runs wrote: the temporary folder, or the given one's contents."""
    if not given:
        shutil.rmtree(root, ignore_errors=True)
        return
    for name in _listdir(root):
        path = os.path.join(root, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def start_cpu_hog(seed: int) -> subprocess.Popen:
    """A process that burns one core in bursts of random length (0.05-0.5 s, pauses up to
    0.3 s), so the training processes' timing differs from round to round."""
    code = ("import random, time\n"
            f"r = random.Random({seed})\n"
            "while True:\n"
            "    end = time.monotonic() + r.uniform(0.05, 0.5)\n"
            "    while time.monotonic() < end:\n"
            "        pass\n"
            "    time.sleep(r.uniform(0.0, 0.3))\n")
    return subprocess.Popen([sys.executable, "-c", code])


def stop_process(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- kill test
@dataclasses.dataclass
class KillSpec:
    """The ``kills`` subcommand's settings (see :func:`kills_parser` for each one)."""

    kills: int = 16
    modes: tuple[str, ...] = MODES
    seed: int = 0
    kills_per_run: int = 1
    cpu_hog: bool = False
    strategy: str = "default"
    cpu_devices: int = 0
    max_steps: int = 100
    checkpoint_every: int = 5
    workdir: str = ""
    keep: bool = False
    redraws: int = 3

    def validate(self) -> None:
        if self.redraws < 0:
            raise ConfigError(f"--redraws must be >= 0, got {self.redraws}")
        if self.kills < 1:
            raise ConfigError(f"--kills must be >= 1, got {self.kills}")
        if self.kills_per_run < 1:
            raise ConfigError(f"--kills-per-run must be >= 1, got {self.kills_per_run}")
        if self.strategy in CLUSTER:
            raise ConfigError(f"--strategy {self.strategy} needs TF_CONFIG and one process "
                              "per task; use one of: " + ", ".join(IN_PROCESS))
        if self.strategy not in IN_PROCESS:
            raise ConfigError(f"unknown --strategy {self.strategy!r}; expected one of: "
                              + ", ".join(IN_PROCESS))
        if self.cpu_devices < 0:
            raise ConfigError(f"--cpu-devices must be >= 0, got {self.cpu_devices}")
        if self.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.max_steps <= self.checkpoint_every:
            raise ConfigError(f"--max-steps must be > --checkpoint-every "
                              f"({self.checkpoint_every}), got {self.max_steps}")


def kill_run_args(spec: KillSpec, mode: str, root: str, name: str) -> list[str]:
    """train.py flags of one kill-test run: ~10-20 s on two cores, with an epoch end in
    the middle (57 steps of sentence mode, 89 of stream mode per epoch), dropout (its
    RNG state must resume too) and an export at the end."""
    args = ["--data", "synthetic", "--synthetic-sentences", "600,60,60", "--mode", mode,
            "--bptt", "10", "--layers", "1", *PINNED_OPTIMIZER,
            "--embed-dim", "16", "--hidden-dim", "64", "--dropout", "0.1",
            "--batch-size", "16", "--epochs", "2", "--max-steps", str(spec.max_steps),
            "--checkpoint-every", str(spec.checkpoint_every), "--deterministic", "--seed", "3",
            "--no-progress", "--strategy", spec.strategy,
            "--model-dir", os.path.join(root, name),
            "--export-dir", os.path.join(root, name + "-export"),
            "--metrics-json", os.path.join(root, name + ".json")]
    if spec.cpu_devices:
        args += ["--cpu-devices", str(spec.cpu_devices)]
    return args


@dataclasses.dataclass
class Reference:
    seconds: float
    tensors: dict
    metrics: dict
    schedule: Schedule
    # How long after a checkpoint a redrawn kill may come: see training_interval.
    checkpoint_interval: float = 0.0


@dataclasses.dataclass
class Kill:
    moment: float
    phase: Phase


@dataclasses.dataclass
class Round:
    mode: str
    index: int
    kills: list[Kill]
    comparison: Comparison | None = None
    metrics_diff: list[str] = dataclasses.field(default_factory=list)
    error: str = ""
    seconds: float = 0.0
    resumed_from: int | None = None  # the step the final run restored (None: step 0)
    resume_error: str = ""  # a relaunch that did not restore the checkpoint it found
    redrawn: int = 0  # earlier draws of this round whose kills missed AIMED phases
    required_aim: bool = False  # whether missing AIMED phases fails the round

    @property
    def aimed(self) -> bool:
        """Whether a kill of this round hit training or a checkpoint write."""
        return any(k.phase.category in AIMED for k in self.kills)

    @property
    def exact(self) -> bool:
        return not self.error and self.comparison is not None and self.comparison.exact \
            and not self.metrics_diff and not self.resume_error

    @property
    def passed(self) -> bool:
        return self.exact and (self.aimed or not self.required_aim)

    def line(self, total: int) -> str:
        kills = ", then ".join(f"killed at {k.moment:5.2f} s: {k.phase}" for k in self.kills)
        verdict = "exact" if self.exact else "NOT EXACT: " + "; ".join(
            x for x in [self.error, self.resume_error, *self.metrics_diff,
                        self.comparison.describe() if self.comparison and
                        not self.comparison.exact else ""] if x)
        if self.comparison is None:  # the final run did not end
            start = ""
        elif self.resumed_from is None:
            start = "started at step 0; "
        else:
            start = f"resumed from step {self.resumed_from}; "
        redrawn = f"redrawn {self.redrawn}x; " if self.redrawn else ""
        missed = ("; MISSED: no kill hit " + " or ".join(AIMED)
                  if self.required_aim and not self.aimed else "")
        return (f"[{self.mode} {self.index}/{total}] {kills} -> {verdict}{missed} "
                f"({redrawn}{start}{self.seconds:.1f} s)")


FINAL_METRICS = ("steps", "valid_ppl", "test_ppl")
# The phases every round must hit with one of its kills (else it is drawn again).
AIMED = ("training", "checkpoint write")


def run_reference(spec: KillSpec, mode: str, root: str, timeout: float = 900) -> Reference:
    args = kill_run_args(spec, mode, root, "reference")
    proc = TrainProcess(args, os.path.join(root, "reference"))
    code = proc.wait(timeout)
    seconds = proc.elapsed()
    if code != 0:
        raise RuntimeError(f"the {mode} reference run failed (status {code}):\n{proc.output}")
    model_dir = os.path.join(root, "reference")
    metrics = read_metrics(os.path.join(root, "reference.json"))
    # The run's last step: --max-steps, or the last epoch's end when that comes first.
    schedule = Schedule(int(metrics["steps"]), spec.checkpoint_every,
                        tuple(epoch_end_steps(model_dir)))
    return Reference(seconds, checkpoint_tensors(model_dir), metrics, schedule,
                     training_interval(proc.seen, schedule))


def training_interval(seen: dict[int, float], schedule: Schedule) -> float:
    """The median seconds between two checkpoints ``schedule.every`` steps apart with no
    epoch end between them: the time a redrawn kill may come after a checkpoint and
    still land in training or the next checkpoint's write. (The mean over all
    checkpoints counts the epoch-end evaluations in, and a kill that late landed in the
    next one.) 0.0 when there are no two such checkpoints."""
    steps = sorted(seen)
    gaps = [seen[b] - seen[a] for a, b in zip(steps, steps[1:])
            if b - a == schedule.every and not schedule.crosses_epoch_end(a, b)]
    return statistics.median(gaps) if gaps else 0.0


def redraw_anchors(ref: Reference, after: int) -> list[int]:
    """The checkpoints a redrawn kill may follow: those of the reference after step
    ``after`` that a whole interval of training follows (no epoch end inside it, not past
    the reference's last step), so a kill up to one interval later lands in training or
    in the next checkpoint's write. (Every multiple of ``--checkpoint-every`` below
    ``--max-steps`` offered checkpoints past a run's last epoch end, which never come,
    and ones an epoch-end evaluation follows.)"""
    schedule = ref.schedule
    return [c for c in range(schedule.every, schedule.max_steps, schedule.every)
            if c > after and schedule.next_save(c) == c + schedule.every]


def kill_round(spec: KillSpec, mode: str, index: int, ref: Reference, root: str,
               rng: random.Random, draw: int = 0) -> Round | None:
    """One round: start, SIGKILL at a uniform moment of [0, T] (``kills_per_run`` times,
    each time on the resumed run), run to the end, compare with the reference.

    ``draw`` > 0: a redraw, each kill coming after one of the process's own checkpoints
    (:func:`redraw_anchors` still ahead of it), later by a delay uniform in the
    reference's time between two checkpoints in training (so a slow start-up on a loaded
    host does not push it back before training); while redraws are left
    (``draw < spec.redraws``) a round whose kills all missed the AIMED phases is
    abandoned (None) before its resume."""
    started = time.monotonic()
    name = f"{mode}-{index}" + (f"-redraw{draw}" if draw else "")
    args = kill_run_args(spec, mode, root, name)
    model_dir, export_dir = os.path.join(root, name), os.path.join(root, name + "-export")
    result = Round(mode, index, [], redrawn=draw, required_aim=spec.redraws > 0)
    timeout = max(300.0, 20 * ref.seconds)
    for _ in range(spec.kills_per_run):
        left = latest_step(model_dir)  # what this run must restore
        proc = TrainProcess(args, model_dir)
        ahead = redraw_anchors(ref, left or 0)
        if draw and ahead:
            alive, moment = proc.kill_after_checkpoint(
                rng.choice(ahead), rng.uniform(0.0, ref.checkpoint_interval), timeout)
        else:
            moment = rng.uniform(0.0, ref.seconds)
            alive = proc.kill_at(moment)
        result.kills.append(Kill(moment, infer_phase(proc, export_dir, ref.schedule, moment,
                                                     alive)))
        if not alive and proc.proc.returncode != 0:
            result.error = f"the run ended with status {proc.proc.returncode} before the " \
                           f"kill: {last_line(proc.output)}"
            result.seconds = time.monotonic() - started
            return result
        resumed = resumed_step(proc.output)
        if resumed is not None or not alive:  # (a kill may come before the restore)
            result.resume_error = result.resume_error or resume_mismatch(resumed, left)
        if not alive:
            break  # finished already: a further kill would hit nothing new
    if not result.aimed and draw < spec.redraws:
        for path in (model_dir, export_dir):
            shutil.rmtree(path, ignore_errors=True)
        return None
    left = latest_step(model_dir)
    proc = TrainProcess(args, model_dir)
    code = proc.wait(timeout)
    if code != 0:
        result.error = f"the resumed run failed (status {code}): {last_line(proc.output)}"
    else:
        result.resumed_from = resumed_step(proc.output)
        result.resume_error = result.resume_error or resume_mismatch(result.resumed_from, left)
        result.comparison = compare_tensors(checkpoint_tensors(model_dir), ref.tensors)
        metrics = read_metrics(os.path.join(root, name + ".json"))
        result.metrics_diff = [f"{k} {metrics.get(k)!r} != {ref.metrics.get(k)!r}"
                               for k in FINAL_METRICS if metrics.get(k) != ref.metrics.get(k)]
        if not glob.glob(os.path.join(export_dir, EXPORT_NAME, "*", "saved_model.pb")):
            result.error = "no complete SavedModel after the resume"
    if not spec.keep:
        for path in (model_dir, export_dir):
            shutil.rmtree(path, ignore_errors=True)
    result.seconds = time.monotonic() - started
    return result


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    return (errors or lines or ["(no output)"])[-1][:300]


def kill_test(spec: KillSpec, out=None) -> list[Round]:
    """Runs the kill test as ``spec`` says, printing a line per round and the summary."""
    out = out or sys.stdout
    spec.validate()
    root = prepare_workdir(spec.workdir)
    rng = random.Random(spec.seed)
    hog = start_cpu_hog(spec.seed) if spec.cpu_hog else None
    rounds: list[Round] = []
    try:
        print(f"workdir {root}; strategy {spec.strategy}"
              f"{f' on {spec.cpu_devices} CPU devices' if spec.cpu_devices else ''}; "
              f"{spec.kills} round(s) per mode, {spec.kills_per_run} kill(s) per round; "
              f"seed {spec.seed}{'; cpu hog on' if spec.cpu_hog else ''}", file=out, flush=True)
        for mode in spec.modes:
            mode_root = os.path.join(root, mode)
            os.makedirs(mode_root)
            ref = run_reference(spec, mode, mode_root)
            print(f"{mode} reference: {ref.seconds:.1f} s, {ref.metrics['steps']} steps, "
                  f"epoch ends at step(s) {', '.join(map(str, ref.schedule.epoch_ends)) or '-'}, "
                  f"valid ppl {ref.metrics['valid_ppl']:.4f}, test ppl "
                  f"{ref.metrics['test_ppl']:.4f}", file=out, flush=True)
            for i in range(1, spec.kills + 1):
                r, draw = None, 0
                while r is None:
                    r = kill_round(spec, mode, i, ref, mode_root, rng, draw)
                    draw += 1
                rounds.append(r)
                print(r.line(spec.kills), file=out, flush=True)
    finally:
        stop_all()
        stop_process(hog)
        if not spec.keep:
            clean_workdir(root, spec.workdir)
    for line in kill_summary(rounds, spec.modes):
        print(line, file=out, flush=True)
    return rounds


def kill_summary(rounds: list[Round], modes: Sequence[str]) -> list[str]:
    """The per-phase counts and the final summary line."""
    kills = [k for r in rounds for k in r.kills]
    counts = Counter(k.phase.category for k in kills)
    per_phase = ", ".join(f"{p} {counts[p]}" for p in PHASES if counts[p])
    exact = sum(r.exact for r in rounds)
    per_mode = ", ".join(f"{m} {sum(r.exact for r in rounds if r.mode == m)}/"
                         f"{sum(r.mode == m for r in rounds)}" for m in modes)
    extra = f" (SIGKILLs sent {len(kills)})" if len(kills) != len(rounds) else ""
    redrawn = sum(r.redrawn for r in rounds)
    lines = [f"phases hit: {per_phase}",
             f"rounds with a kill in {' or '.join(AIMED)}: {sum(r.aimed for r in rounds)}/"
             f"{len(rounds)} ({redrawn} redraw(s))"]
    for r in rounds:
        if not r.passed:
            lines.append(f"failed: {r.line(0).split('] ', 1)[1]}")
    lines.append(f"kills tried {len(rounds)}{extra}, exact {exact}, not exact "
                 f"{len(rounds) - exact} ({per_mode})")
    return lines


# ------------------------------------------------------------------------------ matrix
SOURCES = ("default", "mirrored:2", "tower:3", "pipeline")
TARGETS = ("default", "one_device", "mirrored:2", "tower:3", "pipeline")


@dataclasses.dataclass
class MatrixSpec:
    """The ``matrix`` subcommand's settings (see :func:`matrix_parser`)."""

    modes: tuple[str, ...] = MODES
    sources: tuple[str, ...] = SOURCES
    targets: tuple[str, ...] = TARGETS
    kill_at_step: int = 12
    steps: int = 40
    checkpoint_every: int = 4
    tolerance: float = 1e-5
    workdir: str = ""
    keep: bool = False

    def validate(self) -> None:
        for s in (*self.sources, *self.targets):
            strategy_flags(s)
        if self.checkpoint_every < 1:
            raise ConfigError(f"--checkpoint-every must be >= 1, got {self.checkpoint_every}")
        if self.kill_at_step < 1 or self.kill_at_step % self.checkpoint_every:
            raise ConfigError(f"--kill-at-step {self.kill_at_step} must be a positive multiple "
                              f"of --checkpoint-every {self.checkpoint_every}")
        if self.steps <= self.kill_at_step:
            raise ConfigError(f"--steps must be > --kill-at-step ({self.kill_at_step}), "
                              f"got {self.steps}")
        if not self.tolerance >= 0:
            raise ConfigError(f"--tolerance must be >= 0, got {self.tolerance}")
        if not any(t != s for s in self.sources for t in self.targets):
            raise ConfigError("--sources and --targets leave no pair (a strategy is not "
                              "paired with itself)")


def write_tiny_corpus(directory: str, seed: int = 0) -> str:
    """Small train/valid/test splits (300/40/40 sentences of 1-24 words of w0..w39), the
    test suite's ``tiny_corpus_dir``."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(40)]
    os.makedirs(directory, exist_ok=True)
    for split, n in (("train", 300), ("valid", 40), ("test", 40)):
        lines = [" ".join(rng.choice(words, size=int(rng.integers(1, 25)))) for _ in range(n)]
        with open(os.path.join(directory, f"{split}.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return directory


def matrix_run_args(corpus: str, model_dir: str, strategy: str, steps: int, mode: str,
                    every: int) -> list[str]:
    """tests/test_portable_checkpoints.py's configuration, checkpointing every ``every``."""
    return ["--data", corpus, "--mode", mode, "--bptt", "8", "--layers", "2",
            *PINNED_OPTIMIZER, "--dropout", "0",
            "--embed-dim", "16", "--hidden-dim", "16", "--batch-size", "12", "--epochs", "5",
            "--max-steps", str(steps), "--checkpoint-every", str(every), "--no-progress",
            "--no-export", "--deterministic", "--seed", "5", "--model-dir", model_dir,
            *strategy_flags(strategy)]


@dataclasses.dataclass
class Pair:
    mode: str
    source: str
    target: str
    resumed_from: int | None = None
    comparison: Comparison | None = None
    error: str = ""

    @property
    def worst(self) -> float:
        return math.inf if self.error or self.comparison is None else self.comparison.worst


def run_to_end(args: Sequence[str], model_dir: str, what: str, timeout: float = 600) -> str:
    proc = TrainProcess(args, model_dir)
    code = proc.wait(timeout)
    if code != 0:
        raise RuntimeError(f"{what} failed (status {code}): {last_line(proc.output)}")
    return proc.output


def killed_source(corpus: str, root: str, mode: str, source: str, spec: MatrixSpec) -> str:
    """Runs ``source`` and SIGKILLs it once ``ckpt-<kill_at_step>.index`` exists; returns
    the model dir it left."""
    model_dir = os.path.join(root, f"{mode}-from-{source.replace(':', '')}")
    proc = TrainProcess(matrix_run_args(corpus, model_dir, source, spec.steps, mode,
                                        spec.checkpoint_every), model_dir)
    index = os.path.join(model_dir, "checkpoints", f"ckpt-{spec.kill_at_step}.index")
    if not proc.kill_when(lambda: os.path.exists(index), timeout=600):
        raise RuntimeError(f"the {source} run ended (status {proc.proc.returncode}) before "
                           f"ckpt-{spec.kill_at_step}: {last_line(proc.output)}")
    return model_dir


def move_checkpoint(corpus: str, root: str, mode: str, source_dir: str, source: str,
                    target: str, spec: MatrixSpec, expected: dict) -> Pair:
    """Resumes a copy of ``source_dir`` under ``target`` to ``spec.steps`` and compares
    its checkpoint with ``expected``."""
    pair = Pair(mode, source, target)
    model_dir = f"{source_dir}-to-{target.replace(':', '')}"
    shutil.copytree(source_dir, model_dir)
    left = latest_step(model_dir)  # the checkpoint the kill left, what must be restored
    try:
        output = run_to_end(matrix_run_args(corpus, model_dir, target, spec.steps, mode,
                                            spec.checkpoint_every), model_dir,
                            f"the resume under {target}")
    except RuntimeError as e:
        pair.error = str(e)
        return pair
    pair.resumed_from = resumed_step(output)
    if pair.resumed_from is None or pair.resumed_from != left:
        pair.error = resume_mismatch(pair.resumed_from, left) or \
            "the target run did not resume from a checkpoint"
        return pair
    pair.comparison = compare_tensors(checkpoint_tensors(model_dir), expected)
    if not spec.keep:
        shutil.rmtree(model_dir, ignore_errors=True)
    return pair


def portability_matrix(spec: MatrixSpec, out=None) -> list[Pair]:
    """Every (source, target) pair of every mode; prints a table per mode and a summary."""
    out = out or sys.stdout
    spec.validate()
    root = prepare_workdir(spec.workdir)
    pairs: list[Pair] = []
    try:
        corpus = write_tiny_corpus(os.path.join(root, "corpus"))
        print(f"workdir {root}; kill at ckpt-{spec.kill_at_step}, resume to step {spec.steps}",
              file=out, flush=True)
        for mode in spec.modes:
            started = time.monotonic()
            still = os.path.join(root, f"{mode}-still")
            run_to_end(matrix_run_args(corpus, still, "default", spec.steps, mode,
                                       spec.checkpoint_every), still, f"the {mode} reference")
            expected = checkpoint_tensors(still)
            mode_pairs = []
            for source in spec.sources:
                source_dir = killed_source(corpus, root, mode, source, spec)
                for target in spec.targets:
                    if target == source:
                        continue
                    pair = move_checkpoint(corpus, root, mode, source_dir, source, target,
                                           spec, expected)
                    mode_pairs.append(pair)
                    print(f"  {mode} {source} -> {target}: resumed from step "
                          f"{pair.resumed_from}, "
                          + (pair.error or f"max |Δ| {pair.worst:.1e}"
                             + ("" if pair.comparison.worst <= spec.tolerance else
                                f"; {pair.comparison.describe()}")),
                          file=out, flush=True)
                if not spec.keep:
                    shutil.rmtree(source_dir, ignore_errors=True)
            pairs += mode_pairs
            print(f"\n{mode} mode (max |Δ| of any checkpointed tensor vs an uninterrupted "
                  f"default run, {spec.steps} steps; {time.monotonic() - started:.0f} s):\n",
                  file=out)
            print(format_matrix(mode_pairs, spec.sources, spec.targets), file=out)
            print(file=out, flush=True)
    finally:
        stop_all()
        if not spec.keep:
            clean_workdir(root, spec.workdir)
    print(matrix_summary(pairs, spec.tolerance), file=out, flush=True)
    return pairs


def format_matrix(pairs: list[Pair], sources: Sequence[str], targets: Sequence[str]) -> str:
    """A markdown table: rows are sources, columns targets, cells max |Δ|."""
    cells = {(p.source, p.target): p for p in pairs}
    lines = ["| source \\ target | " + " | ".join(targets) + " |",
             "|---|" + "---|" * len(targets)]
    for s in sources:
        row = []
        for t in targets:
            p = cells.get((s, t))
            row.append("—" if p is None else "error" if p.error else f"{p.worst:.1e}")
        lines.append(f"| {s} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def matrix_summary(pairs: list[Pair], tolerance: float) -> str:
    if not pairs:
        return "matrix: no pairs"
    worst = max(pairs, key=lambda p: p.worst)
    above = sum(not p.worst <= tolerance for p in pairs)
    return (f"matrix: {len(pairs)} pairs, worst max |Δ| {worst.worst:.1e} ({worst.mode} "
            f"{worst.source} -> {worst.target}), {above} above {tolerance:g}")


# ------------------------------------------------------------------------- command line
DESCRIPTION = __doc__.split("\n\n")[0]


def parser() -> argparse.ArgumentParser:
    p = Parser(
        allow_abbrev=False, prog="faults.py", description=DESCRIPTION,
        epilog="Exit status: 0 all exact / within the tolerance, 1 a failure, 2 a usage error.")
    sub = p.add_subparsers(dest="command", metavar="{kills,matrix}")
    sub.required = True
    k = sub.add_parser(
        "kills", allow_abbrev=False,
        help="SIGKILL runs at random moments, resume, compare with a reference",
        description="Train once uninterrupted (the reference, wall time T); then per round "
                    "start the same command, SIGKILL it at a moment uniform in [0, T], run "
                    "it again to the end and compare every checkpointed tensor (np.array_equal) "
                    "and the final steps/valid/test perplexity with the reference. A round "
                    "whose kills all missed training and checkpoint writes is drawn again "
                    "(--redraws). Exits 1 when a resume is not exact or a round missed.")
    k.add_argument("--kills", type=int, default=16,
                   help="killed-and-resumed rounds per mode (default: %(default)s)")
    k.add_argument("--modes", default="sentence,stream",
                   help="comma-separated: sentence, stream (default: %(default)s)")
    k.add_argument("--seed", type=int, default=0,
                   help="seed of the kill moments (the training seed is fixed; "
                        "default: %(default)s)")
    k.add_argument("--kills-per-run", type=int, default=1,
                   help="kill each round this many times (the later kills hit the resumed "
                        "run) before the final resume (default: %(default)s)")
    k.add_argument("--cpu-hog", action="store_true",
                   help="run a process burning one core in random bursts for the duration, "
                        "so timing varies from round to round")
    k.add_argument("--strategy", default="default",
                   help="train.py --strategy: " + " | ".join(IN_PROCESS) +
                        " (default: %(default)s)")
    k.add_argument("--cpu-devices", type=int, default=0,
                   help="train.py --cpu-devices, e.g. 2 with --strategy mirrored "
                        "(default 0: train.py's default)")
    k.add_argument("--max-steps", type=int, default=100,
                   help="steps of every run; an epoch is 57 (sentence) / 89 (stream) "
                        "steps (default: %(default)s)")
    k.add_argument("--checkpoint-every", type=int, default=5,
                   help="train.py --checkpoint-every (default: %(default)s)")
    k.add_argument("--redraws", type=int, default=3,
                   help="draw a round again, its kills now after a random one of the "
                        "run's checkpoints (by up to the reference's time between two in "
                        "training), "
                        "while none of its kills hit training or "
                        "a checkpoint write, up to this many times; a round that still "
                        "misses fails (0: keep every draw, none required; "
                        "default: %(default)s)")
    k.add_argument("--workdir", default="",
                   help="new or empty folder for the runs (default: a temporary folder)")
    k.add_argument("--keep", action="store_true",
                   help="keep the runs' model and export dirs (default: deleted)")
    m = sub.add_parser(
        "matrix", allow_abbrev=False, help="move checkpoints between strategies and device counts",
        description="For every source and target strategy: kill a run under the source "
                    "once its checkpoint of --kill-at-step exists, resume it under the "
                    "target to --steps and print max |Δ| of every checkpointed tensor "
                    "against an uninterrupted default run, as a markdown table per mode. "
                    "Exits 1 when a cell is above --tolerance. Cluster strategies "
                    "(multi_worker, parameter_server) need TF_CONFIG and a process per task "
                    "and are not offered.")
    m.add_argument("--modes", default="sentence,stream",
                   help="comma-separated: sentence, stream (default: %(default)s)")
    m.add_argument("--sources", default=",".join(SOURCES),
                   help="comma-separated NAME[:DEVICES] the checkpoint is written under "
                        "(default: %(default)s)")
    m.add_argument("--targets", default=",".join(TARGETS),
                   help="comma-separated NAME[:DEVICES] it is resumed under; a source is "
                        "not paired with itself (default: %(default)s)")
    m.add_argument("--kill-at-step", type=int, default=12,
                   help="SIGKILL the source run once this step's checkpoint exists; a "
                        "multiple of --checkpoint-every (default: %(default)s)")
    m.add_argument("--steps", type=int, default=40,
                   help="steps the resumed run and the reference train (default: %(default)s)")
    m.add_argument("--checkpoint-every", type=int, default=4,
                   help="train.py --checkpoint-every (default: %(default)s)")
    m.add_argument("--tolerance", type=float, default=1e-5,
                   help="largest |Δ| a cell may show (default: %(default)s)")
    m.add_argument("--workdir", default="",
                   help="new or empty folder for the runs (default: a temporary folder)")
    m.add_argument("--keep", action="store_true",
                   help="keep the runs' model dirs (default: deleted)")
    return p


def kill_spec_from_args(a: argparse.Namespace) -> KillSpec:
    return KillSpec(kills=a.kills, modes=tuple(parse_list("--modes", a.modes, MODES)),
                    seed=a.seed, kills_per_run=a.kills_per_run, cpu_hog=a.cpu_hog,
                    strategy=a.strategy, cpu_devices=a.cpu_devices, max_steps=a.max_steps,
                    checkpoint_every=a.checkpoint_every, workdir=a.workdir, keep=a.keep,
                    redraws=a.redraws)


def matrix_spec_from_args(a: argparse.Namespace) -> MatrixSpec:
    return MatrixSpec(modes=tuple(parse_list("--modes", a.modes, MODES)),
                      sources=tuple(parse_list("--sources", a.sources)),
                      targets=tuple(parse_list("--targets", a.targets)),
                      kill_at_step=a.kill_at_step, steps=a.steps,
                      checkpoint_every=a.checkpoint_every, tolerance=a.tolerance,
                      workdir=a.workdir, keep=a.keep)


def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/faults.py``: 0 all exact / within the tolerance, 1 not, 2 a usage error."""
    from tfpar.tools.cli import run_main, setup_logging

    args = parser().parse_args(argv)
    setup_logging()
    previous = None
    if threading.current_thread() is threading.main_thread():
        # SIGTERM stops like Ctrl-C: the train.py children are killed on the way out.
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)

    def body():
        try:
            if args.command == "kills":
                spec = kill_spec_from_args(args)
                spec.validate()  # before anything starts
                return 0 if all(r.passed for r in kill_test(spec)) else 1
            spec = matrix_spec_from_args(args)
            spec.validate()
            pairs = portability_matrix(spec)
            return 0 if all(p.worst <= spec.tolerance for p in pairs) else 1
        except (RuntimeError, TimeoutError) as e:  # a run that should not fail did
            print(f"error: {e}", file=sys.stderr)
            return 1

    try:
        return run_main(body)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
