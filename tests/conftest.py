"""Test set-up: 4 logical CPU devices before TensorFlow initialises, small configs.

Every multi-device test runs on logical CPU devices (the same mechanism users get with
``--cpu-devices``), so mirrored, tower and pipeline paths are exercised for real on a
host without GPUs.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from tfpar.parallel.devices import configure_cpu_devices  # noqa: E402

NUM_TEST_DEVICES = 4
configure_cpu_devices(NUM_TEST_DEVICES)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shared_data_dir() -> str:
    """The shared corpora folder (``../shared/data``), overridable by TFPAR_SHARED_DATA."""
    return os.environ.get("TFPAR_SHARED_DATA",
                          os.path.join(os.path.dirname(REPO), "shared", "data"))


@pytest.fixture
def tiny_corpus_dir(tmp_path):
    """A folder with small train/valid/test splits of varied sentence lengths."""
    import numpy as np

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(40)]
    for split, n in (("train", 300), ("valid", 40), ("test", 40)):
        lines = [" ".join(rng.choice(words, size=int(rng.integers(1, 25))))
                 for _ in range(n)]
        (tmp_path / f"{split}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return tmp_path


@pytest.fixture
def tiny_args(tiny_corpus_dir, tmp_path):
    """Flags for a seconds-long end-to-end run into tmp_path."""
    return [
        "--data", str(tiny_corpus_dir), "--embed-dim", "16", "--hidden-dim", "16",
        "--batch-size", "16", "--epochs", "1", "--max-steps", "6", "--no-progress",
        "--model-dir", str(tmp_path / "run"), "--export-dir", str(tmp_path / "export"),
        "--metrics-json", str(tmp_path / "metrics.json"),
    ]


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

