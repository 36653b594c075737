"""Test set-up: 4 logical CPU devices before TensorFlow initialises, small configs.

Every multi-device test runs on logical CPU devices (the same mechanism users get with
``--cpu-devices``), so mirrored, tower and pipeline paths are exercised for real on a
host without GPUs. On a host with GPUs the suite hides them (``CUDA_VISIBLE_DEVICES=``,
inherited by every subprocess), so it tests the same CPU paths there; the GPU suite
(tests/gpu, ``make gpu-check``, TFPAR_GPU_TESTS=1) is collected only when asked for and
sees the GPUs.
"""

import importlib.util
import os
import re

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
GPU_SUITE = os.environ.get("TFPAR_GPU_TESTS") == "1"
if not GPU_SUITE:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before TensorFlow is imported
else:
    # The GPU suite's process starts TensorFlow (and its GPUs) before any run can set
    # memory growth; without growth it would hold nearly all of every GPU's memory, and
    # the train.py processes its kill-and-resume test starts would find none left.
    # TensorFlow's allocator reads this when it creates each GPU; children inherit it.
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
collect_ignore = [] if GPU_SUITE else ["gpu"]

import pytest  # noqa: E402

from tfpar.parallel.devices import configure_cpu_devices  # noqa: E402

NUM_TEST_DEVICES = 4
configure_cpu_devices(NUM_TEST_DEVICES)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def host_has_gpus() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


# For tests of what tfpar does on a host without GPUs (errors for NCCL, one replica per
# multi-worker CPU); on a GPU host those paths are valid and tested by running them.
without_gpus = pytest.mark.skipif(host_has_gpus(), reason="checks the behaviour on a host "
                                  "without GPUs; this host has GPUs")


def shared_data_dir() -> str:
    """The shared corpora folder (``../shared/data``), overridable by TFPAR_SHARED_DATA."""
    return os.environ.get("TFPAR_SHARED_DATA",
                          os.path.join(os.path.dirname(REPO), "shared", "data"))


def write_tiny_corpus(folder):
    """Small train/valid/test splits of varied sentence lengths (always the same)."""
    import numpy as np

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    for split, n in (("train", 300), ("valid", 40), ("test", 40)):
        lines = [" ".join(rng.choice(words, size=int(rng.integers(1, 25))))
                 for _ in range(n)]
        (folder / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder


def write_sharded_corpus(folder, sentences=(1000, 50, 50), train_shards=4):
    """The generated corpus of ``--synthetic-sentences`` as a folder of split folders,
    train cut into ``train_shards`` files (line k in file k % train_shards)."""
    from tfpar.data.synthetic import SyntheticSpec, generate_corpus

    corpus = generate_corpus(SyntheticSpec(train_sentences=sentences[0],
                                           valid_sentences=sentences[1],
                                           test_sentences=sentences[2]))
    for split, shards in (("train", train_shards), ("valid", 1), ("test", 1)):
        (folder / split).mkdir(parents=True)
        lines = getattr(corpus, split)
        for k in range(shards):
            (folder / split / f"part-{k:05d}-of-{shards:05d}.txt").write_text(
                "\n".join(lines[k::shards]) + "\n", encoding="utf-8")
    return folder



def load_script(name):
    """A scripts/<name>.py of this clone as a module (its ``main``)."""
    spec = importlib.util.spec_from_file_location(f"{name}_script",
                                                  os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tiny_corpus_dir(tmp_path):
    """A folder with small train/valid/test splits of varied sentence lengths."""
    return write_tiny_corpus(tmp_path)


@pytest.fixture(scope="module")
def module_tiny_corpus(tmp_path_factory):
    """The same corpus, once per test module."""
    return write_tiny_corpus(tmp_path_factory.mktemp("tiny-corpus"))


# The per-epoch gradient norms and text samples trace a copy of the model: 5-7 s of a
# 2-epoch run on the tiny corpus. Runs whose test is not about them go without
# (tests/test_tensorboard.py and tests/test_non_finite.py turn them on).
NO_INSPECTION = ["--no-epoch-inspection"]

# The model and optimizer the suite was written for: one layer, no dropout, untied, Keras'
# initialisers, Adam at 3e-3 clipped at 5, the last step's weights (no moving average:
# tests/test_averaging.py has its own). The defaults a user gets (the dataclasses' and
# the flags', one source: tfpar.config) are tuned for real text and larger; tests pin
# these so that a change of the user defaults changes no test's meaning or duration.
SMALL_MODEL = dict(layers=1, embed_dim=128, hidden_dim=256, dropout=0.0,
                   tie_embeddings=False, init_scale=0.0)
SMALL_TRAIN = dict(optimizer="adam", lr=3e-3, clip_norm=5.0, batch_size=64, ema_momentum=0.0)
PINNED = ["--layers", "1", "--optimizer", "adam", "--lr", "3e-3", "--clip-norm", "5",
          "--dropout", "0", "--no-tie-embeddings", "--init-scale", "0", "--ema-momentum", "0",
          *NO_INSPECTION]


def model_config(**fields):
    """A ``ModelConfig`` of :data:`SMALL_MODEL` with ``fields`` over it."""
    from tfpar.config import ModelConfig

    return ModelConfig(**{**SMALL_MODEL, **fields})


def train_config(**fields):
    """A ``TrainConfig`` of :data:`SMALL_TRAIN` with ``fields`` over it."""
    from tfpar.config import TrainConfig

    return TrainConfig(**{**SMALL_TRAIN, **fields})


def small_config(**sections):
    """A ``Config`` whose model and train sections default to the small ones."""
    from tfpar.config import Config

    sections.setdefault("model", model_config())
    sections.setdefault("train", train_config())
    return Config(**sections)


@pytest.fixture
def tiny_args(tiny_corpus_dir, tmp_path):
    """Flags for a seconds-long end-to-end run into tmp_path."""
    return [
        "--data", str(tiny_corpus_dir), *PINNED, "--embed-dim", "16", "--hidden-dim", "16",
        "--batch-size", "16", "--epochs", "1", "--max-steps", "6", "--no-progress",
        "--model-dir", str(tmp_path / "run"), "--export-dir", str(tmp_path / "export"),
        "--metrics-json", str(tmp_path / "metrics.json"),
    ]


RESUMED = re.compile(r"resumed from (.*?ckpt-(\d+)) \(step (\d+)\)")


def resumed_steps(text) -> list[int]:
    """The steps of every ``resumed from <dir>/ckpt-N (step N)`` line in a run's log (the
    stderr of an in-process ``train_main``, a subprocess's output), in order. Training is
    deterministic, so a run that ignored its checkpoint ends with the same tensors as one
    that resumed: only this line tells them apart."""
    steps = []
    for path, number, step in RESUMED.findall(text):
        assert int(number) == int(step), f"{path} logged as step {step}"
        steps.append(int(step))
    return steps


def resumed_step(text) -> int | None:
    """The step the run whose log is ``text`` resumed from; None: it started at step 0."""
    steps = resumed_steps(text)
    assert len(steps) <= 1, f"more than one resume in one run's log: {steps}"
    return steps[0] if steps else None


def assert_resumed_from(text, step) -> None:
    """The run whose log is ``text`` restored the checkpoint of ``step`` (None: none)."""
    got = resumed_step(text)
    assert got == step, (f"the run resumed from step {got}, expected {step}" if got is not None
                         else f"the run started at step 0, ignoring the checkpoint of step "
                              f"{step}")


def batch_of(rows):
    """Rows of target ids (0 = padding) → a batch whose inputs are the targets shifted."""
    import numpy as np
    import tensorflow as tf

    from tfpar.data.vocab import PAD_ID

    t = np.array(rows, np.int32)
    inputs = np.concatenate([np.full((len(t), 1), 2, np.int32), t[:, :-1]], axis=1)
    inputs[t == PAD_ID] = PAD_ID
    return {"inputs": tf.constant(inputs), "targets": tf.constant(t)}


# Ops the tracer leaves without a device: reads of the weights (TF puts them with the
# variable they read), function arguments and folded constants.
UNPLACED = {"ReadVariableOp", "Placeholder", "Const", "_Arg", "_Retval", "NoOp"}


def replica_of(op_name: str, scope: str, replicas: int = NUM_TEST_DEVICES):
    """The replica ``i`` whose name scope ``<scope>_<i>/`` an op is under (its gradient
    ops, ``gradient_tape/<scope>_<i>/...``, too), or None."""
    for prefix in ("", "gradient_tape/"):
        for i in range(replicas):
            if op_name.startswith(f"{prefix}{scope}_{i}/"):
                return i
    return None


def placed_ops(graph_def, scope: str):
    """``(node, device, replica)`` for every op of a traced step, including the ops inside
    the functions it calls (RNN loops, compiled recurrences, conds); an op with no device
    of its own runs on its caller's device and belongs to its caller's replica (the
    replicas' name scopes are ``<scope>_<i>``: "tower", "replica")."""
    functions = {f.signature.name: f for f in graph_def.library.function}

    def walk(nodes, device, replica):
        for node in nodes:
            node_replica = replica if replica is not None else replica_of(node.name, scope)
            node_device = node.device or device
            yield node, node_device, node_replica
            for value in node.attr.values():
                called = [value.func.name] if value.HasField("func") else []
                called += [f.name for f in value.list.func]
                for name in called:
                    if name in functions:
                        yield from walk(functions[name].node_def, node_device, node_replica)

    return list(walk(graph_def.node, "", None))


def make_lines(n, seed=0, max_words=20):
    """``n`` sentences of 1 to ``max_words - 1`` words drawn from w0 .. w39."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(f"w{int(x)}" for x in rng.integers(0, 40, size=rng.integers(1, max_words)))
            for _ in range(n)]


def max_diff(a, b):
    """The largest absolute difference between two equally long lists of arrays."""
    import numpy as np

    assert len(a) == len(b)
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def slots_of(optimizer):
    """The optimizer's variables (step count, learning rate, momentum slots) as arrays."""
    import numpy as np

    return [np.asarray(v.numpy()) for v in optimizer.variables]


def assert_clipped_and_unclipped(norms, clip):
    """Some steps' gradient norms are above ``clip`` and some are not."""
    clipped = sum(n > clip for n in norms)
    assert 0 < clipped < len(norms), (norms, clip)


def assert_same_training(got, ref, steps):
    """Two verify RunResults: same gradient norms, weights and optimizer slots (SGD
    momentum) after ``steps`` steps."""
    import numpy as np

    assert len(got.grad_norms) == steps
    np.testing.assert_allclose(got.grad_norms, ref.grad_norms, rtol=1e-5)
    assert max_diff(got.weights, ref.weights) <= 1e-5
    assert len(ref.slots) == len(ref.weights) + 2  # iterations, learning rate, momenta
    assert max_diff(got.slots, ref.slots) <= 1e-5


def assert_replicas_placed(ops, devices):
    """``placed_ops`` output: replica i's forward and gradient ops (with a MatMul and the
    loss kernel among them) all on ``devices[i]``."""
    for i, device in enumerate(devices):
        mine = [(node, d) for node, d, r in ops
                if r == i and not (node.op in UNPLACED and not node.device)]
        backward = [node for node, _ in mine if node.name.startswith("gradient_tape/")]
        assert len(mine) > 100 and len(backward) > 20, i
        assert {d for _, d in mine} == {device}, i  # Forward and gradients.
        kinds = {n.op for n, _ in mine}
        # The loss kernel: the fused output layer's (the logits' gradient, its row sums
        # subtracted at the targets), or with --no-fused-softmax TF's cross-entropy kernel
        # or its log-softmax form once an earlier run in this process has enabled op
        # determinism (a process-wide TF setting).
        assert "MatMul" in kinds and kinds & {"TensorScatterSub",
                                              "SparseSoftmaxCrossEntropyWithLogits",
                                              "LogSoftmax"}, i


# ------------------------------------------------ test helpers over the package's data
import numpy as np  # noqa: E402


def sentence_lengths(lines, *, tokenizer: str) -> np.ndarray:
    """[N] lines → [N] int64 predicted tokens per line in sentence mode: tokens + one
    ``<eos>`` (what the vocabulary pass's length histogram counts, computed apart)."""
    import tensorflow as tf

    from tfpar.data.tokenize import split_tokens

    lengths = [split_tokens(tf.constant(list(lines[i:i + 4096]), tf.string),
                            tokenizer).row_lengths().numpy()
               for i in range(0, len(lines), 4096)]
    return np.concatenate([np.zeros([0], np.int64), *lengths]).astype(np.int64) + 1


def length_histogram(lengths) -> np.ndarray:
    """[N] lengths → [HISTOGRAM_BINS] counts, the last bin counting every longer one."""
    from tfpar.data.vocab import HISTOGRAM_BINS

    return np.bincount(np.minimum(np.asarray(lengths, np.int64), HISTOGRAM_BINS - 1),
                       minlength=HISTOGRAM_BINS).astype(np.int64)


def snapshot(state) -> list[np.ndarray]:
    """Copies of a TrainState's variables' values, for exact comparisons."""
    return [np.array(v.numpy()) for v in state.variables()]


def hand_built_loop(config, plugin, data, state, folder, *, clip_norm, poison=None):
    """A ``Loop`` on ``state`` as ``run.py`` builds one (the one training call, the eval
    step, a checkpointer and a silent writer in ``folder``); ``poison``: a word of
    ``data``'s vocabulary whose embedding row is set to NaN first (every window reading
    it is non-finite)."""
    from tfpar.objective.step import make_eval_step
    from tfpar.training import summaries
    from tfpar.training.checkpoints import Checkpointer
    from tfpar.training.loop import Loop
    from tfpar.training.runner import make_train_steps
    from tfpar.training.state import named_weights

    if poison is not None:
        emb = named_weights(state.model)["embedding:embeddings"]
        value = emb.numpy()
        value[data.vocab.tokens.index(poison)] = np.nan
        emb.assign(value)
    return Loop(config, plugin, data, state,
                Checkpointer(str(folder), True, 1, **state.trackables()),
                summaries.Writer(str(folder), is_chief=False),
                make_train_steps(plugin, state.model, state.optimizer, clip_norm=clip_norm),
                make_eval_step(plugin, state.model))


# ---------------------------------------------------------------- coverage floor
@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """The coverage floor (pyproject's ``fail_under``) is the whole suite's: a selection
    (``-k``, ``-m``, some test files: ``PYTEST_ARGS="-k tower" make coverage``) reports its
    coverage but is not failed for it."""
    tests = os.path.join(REPO, "tests")
    whole = not (config.option.keyword or config.option.markexpr) and all(
        os.path.abspath(str(arg)) in (REPO, tests) for arg in config.args)
    plugin = config.pluginmanager.getplugin("_cov")
    if not whole and plugin is not None and getattr(plugin, "options", None) is not None:
        plugin.options.cov_fail_under = 0
