"""tfpar.serving.export: versioned atomic layout, the three signatures, loading without tfpar."""

import errno
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfpar import compat
from tfpar.serving import export

from tfpar.serving import sample
from tfpar.config import DistConfig
from tfpar.errors import CheckpointError
from tfpar.data.pipeline import InputData
from tfpar.model.lm import build_model
from tfpar.parallel.registry import build_strategy
from tfpar.training.loop import evaluate
from tfpar.data.vocab import Vocab
from tfpar.objective.step import make_eval_step
import conftest
from conftest import PINNED

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(REPO, ".venv", "bin")
LINES = ["the cat sat", "a dog ran far away", "the dog sat", "cat", "a cat ran after the dog"]
SIGNATURE_IO = {
    "serving_default": ({"token_ids": tf.int32}, {"log_probs": tf.float32}),
    "score": ({"text": tf.string},
              {"nll": tf.float32, "tokens": tf.int32, "perplexity": tf.float32}),
    "generate": ({"prompt": tf.string, "max_tokens": tf.int32, "temperature": tf.float32,
                  "top_k": tf.int32, "seed": tf.int32, "stop_at_eos": tf.bool},
                 {"text": tf.string}),
}


def small_config(tmp, **run):
    return conftest.small_config().replace(model={"embed_dim": 8, "hidden_dim": 8, "layers": 2},
                                           run={"export_dir": str(tmp), **run})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(in-process model, vocab, config, loaded SavedModel, its path), no training."""
    tmp = tmp_path_factory.mktemp("export")
    vocab = Vocab.build(LINES)
    config = small_config(tmp)
    model = build_model(config.model, len(vocab), seed=1)
    path = export.export_model(model, vocab, config.run)
    return model, vocab, config, tf.saved_model.load(path), path


def gen(loaded, prompts, *, max_tokens=8, temperature=1.0, top_k=0, seed=0, stop_at_eos=True):
    return export.generate_text(loaded, prompts, max_tokens=max_tokens,
                                temperature=temperature, top_k=top_k, seed=seed,
                                stop_at_eos=stop_at_eos)


# ----------------------------------------------------------------------------- layout
def test_each_export_is_the_next_version_and_nothing_else_is_left(exported, tmp_path):
    model, vocab, _, _, _ = exported
    config = small_config(tmp_path, export_name="lm")
    paths = [export.export_model(model, vocab, config.run) for _ in range(2)]
    assert paths == [str(tmp_path / "lm" / "1"), str(tmp_path / "lm" / "2")]
    assert sorted(os.listdir(tmp_path / "lm")) == ["1", "2"]  # no .staging-* left
    assert sorted(os.listdir(paths[1])) == ["assets", "fingerprint.pb", "saved_model.pb",
                                            "variables"]
    assert (tmp_path / "lm" / "2" / "assets" / "vocab.txt").read_text().split("\n")[:3] == [
        "<pad>", "<unk>", "<eos>"]


def test_unwritable_export_dir_is_a_one_line_error_and_writes_nothing(exported, tmp_path):
    model, vocab, _, _, _ = exported
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match=r"^cannot write to --export-dir '.*a_file': "
                                              r".*; give a writable folder or --no-export$"):
        export.export_model(model, vocab, small_config(blocker).run)
    assert os.listdir(tmp_path) == ["a_file"]


def test_a_full_disk_during_the_save_leaves_no_version_and_no_staging(exported, tmp_path,
                                                                      monkeypatch):
    model, vocab, _, _, _ = exported
    config = small_config(tmp_path, export_name="lm")
    (tmp_path / "lm" / "1").mkdir(parents=True)  # an earlier version, which must survive

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tf.saved_model, "save", disk_full)
    with pytest.raises(CheckpointError, match=r"^export to '.*lm' failed: No space left on "
                                              r"device; nothing was written$"):
        export.export_model(model, vocab, config.run)
    assert os.listdir(tmp_path / "lm") == ["1"]
    # A first export that fails removes the folders it created.
    with pytest.raises(CheckpointError):
        export.export_model(model, vocab, small_config(tmp_path / "new" / "deeper").run)
    assert os.listdir(tmp_path) == ["lm"]


def test_next_version_ignores_non_numeric_entries(tmp_path):
    assert export.next_version(str(tmp_path / "missing")) == 1
    for name in ("1", "7", ".staging-x", "notes"):
        (tmp_path / name).mkdir()
    assert export.next_version(str(tmp_path)) == 8


# ----------------------------------------------------------------------------- signatures
def test_signature_names_inputs_and_outputs_are_the_contract(exported):
    loaded = exported[3]
    assert set(loaded.signatures) == set(SIGNATURE_IO)
    for name, (inputs, outputs) in SIGNATURE_IO.items():
        fn = loaded.signatures[name]
        _, kwargs = fn.structured_input_signature
        assert {k: v.dtype for k, v in kwargs.items()} == inputs, name
        assert {k: v.dtype for k, v in fn.structured_outputs.items()} == outputs, name


def test_serving_default_equals_the_model_and_rejects_ids_out_of_range(exported):
    model, vocab, _, loaded, _ = exported
    ids = tf.constant([[2, 3, 4, 0], [2, 5, 6, 7]])
    served = loaded.signatures["serving_default"](token_ids=ids)["log_probs"]
    np.testing.assert_allclose(served.numpy(), tf.nn.log_softmax(model(ids)[0]).numpy(),
                               atol=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"token_ids must be < the vocabulary size {len(vocab)}"):
        loaded.signatures["serving_default"](token_ids=tf.constant([[2, len(vocab)]]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"token_ids must be >= 0"):
        loaded.signatures["serving_default"](token_ids=tf.constant([[2, -1]]))


def test_score_equals_tfpar_evaluation_of_the_same_sentences(exported):
    model, vocab, config, loaded, _ = exported
    out = loaded.signatures["score"](text=tf.constant(LINES))
    np.testing.assert_array_equal(out["tokens"].numpy(), [len(l.split()) + 1 for l in LINES])
    plugin = build_strategy(DistConfig())
    eval_step = make_eval_step(plugin, model)
    for i, line in enumerate(LINES[:3]):  # sentence by sentence
        data = InputData({"train": LINES, "valid": [line], "test": [line]}, vocab,
                         config.data)
        nll, count = evaluate(plugin, eval_step, data, "valid", batch_size=4)
        assert count == out["tokens"].numpy()[i]
        np.testing.assert_allclose(out["nll"].numpy()[i], nll, rtol=1e-5)
    data = InputData({"train": LINES, "valid": LINES, "test": LINES}, vocab, config.data)
    nll, count = evaluate(plugin, eval_step, data, "valid", batch_size=2)  # whole split
    assert count == out["tokens"].numpy().sum()
    np.testing.assert_allclose(out["nll"].numpy().sum(), nll, rtol=1e-5)
    np.testing.assert_allclose(out["perplexity"].numpy(),
                               np.exp(out["nll"].numpy() / out["tokens"].numpy()), rtol=1e-6)


def test_score_does_not_depend_on_the_batch_and_maps_unknown_words_to_unk(exported):
    score = exported[3].signatures["score"]
    together = score(text=tf.constant(["a cat ran after the dog", "cat"]))["nll"].numpy()
    alone = [score(text=tf.constant([t]))["nll"].numpy()[0]
             for t in ("a cat ran after the dog", "cat")]
    np.testing.assert_allclose(together, alone, rtol=1e-6)
    unknown = score(text=tf.constant(["zebra <pad> sat", "<unk> <unk> sat"]))["nll"].numpy()
    assert unknown[0] == pytest.approx(unknown[1], rel=1e-6)


def test_generate_is_seeded_greedy_at_temperature_0_and_matches_the_live_model(exported):
    model, vocab, _, loaded, _ = exported
    prompts = ["the cat", "", "zebra"]
    first = gen(loaded, prompts, max_tokens=12, seed=5)
    assert first == gen(loaded, prompts, max_tokens=12, seed=5)
    assert [gen(loaded, prompts, max_tokens=12, seed=s) for s in range(1, 4)] != [first] * 3
    for text in first:
        assert len(text.split()) <= 12
        assert set(text.split()) <= set(vocab.tokens[3:])  # no <pad>, <unk>, <eos>
    greedy = gen(loaded, prompts, temperature=0.0, seed=1)
    assert greedy == gen(loaded, prompts, top_k=1, seed=2)
    live = sample.Sampler(model, vocab)
    assert live(prompts, max_tokens=12, seed=5) == first
    assert live(prompts, max_tokens=8, temperature=0.0) == greedy
    assert gen(loaded, prompts, max_tokens=0) == ["", "", ""]


@pytest.mark.parametrize("kwargs,message", [
    ({"max_tokens": -1}, "max_tokens must be >= 0"),
    ({"temperature": -0.5}, r"temperature must be >= 0 \(0 is greedy\)"),
    ({"top_k": -2}, r"top_k must be >= 0 \(0 keeps every token, 1 is greedy\)"),
])
def test_generate_rejects_negative_arguments(exported, kwargs, message):
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        gen(exported[3], ["the"], **kwargs)


# ----------------------------------------------------------------------------- loading
def saved_op_types(path) -> set:
    """Every op type in a SavedModel's graph and its functions (the signatures' bodies)."""
    graph = compat.read_saved_model(str(path)).meta_graphs[0].graph_def
    return {n.op for n in graph.node} | {n.op for f in graph.library.function
                                         for n in f.node_def}


def test_an_export_traced_on_a_gpu_has_no_cudnn_op_and_serves_without_a_gpu(tmp_path,
                                                                              monkeypatch):
    """Issue 42, failure 4: the export traces with no device set, where a layer asks
    whether TensorFlow sees a GPU; CudnnRNNV3 has GPU kernels only, so a signature traced
    with it on a GPU host could not be served on CPUs. "On a GPU": TensorFlow's logical
    GPU list patched (what tfpar's runs_on_gpu and Keras' cudnn_ok ask)."""
    vocab = Vocab.build(LINES)
    config = small_config(tmp_path)
    real = tf.config.list_logical_devices
    fake_gpu = [tf.config.LogicalDevice("/device:GPU:0", "GPU")]
    with monkeypatch.context() as on_a_gpu:
        on_a_gpu.setattr(tf.config, "list_logical_devices",
                         lambda kind=None: fake_gpu if kind == "GPU" else real(kind))
        model = build_model(config.model, len(vocab), seed=1)
        train_like = tf.function(lambda ids: model(ids, training=True)).get_concrete_function(
            tf.TensorSpec([None, None], tf.int32))
        assert "CudnnRNNV3" in {op.type for op in train_like.graph.get_operations()}
        path = export.export_model(model, vocab, config.run)
    assert not [op for op in saved_op_types(path) if op.startswith("Cudnn")]
    loaded = tf.saved_model.load(path)  # and no GPU (this host has none)
    ids = tf.constant([[2, 3, 4, 0], [2, 5, 6, 7]])
    np.testing.assert_allclose(
        loaded.signatures["serving_default"](token_ids=ids)["log_probs"].numpy(),
        tf.nn.log_softmax(model(ids)[0]).numpy(), atol=1e-6)
    assert loaded.signatures["score"](text=tf.constant(["the cat sat"]))["tokens"].numpy() \
        .tolist() == [4]


def test_resolve_saved_model_takes_a_version_or_the_highest_version(exported, tmp_path):
    path = exported[4]
    name_dir = os.path.dirname(path)
    assert export.resolve_saved_model(path) == path
    assert export.resolve_saved_model(name_dir) == path
    with pytest.raises(CheckpointError, match=r"^--model '.*nope' does not exist; give a "):
        export.resolve_saved_model(str(tmp_path / "nope"))
    (tmp_path / "3").mkdir()  # a numbered folder without saved_model.pb does not count
    with pytest.raises(CheckpointError, match=r"^--model '.*' holds no SavedModel"):
        export.resolve_saved_model(str(tmp_path))


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short scripts/train.py run; returns its metrics dict."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import train as train_script

    tmp = tmp_path_factory.mktemp("trained")
    corpus = tmp / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(30)]
    for split, n in (("train", 200), ("valid", 30), ("test", 30)):
        lines = [" ".join(rng.choice(words, size=int(rng.integers(1, 15)))) for _ in range(n)]
        (corpus / f"{split}.txt").write_text("\n".join(lines) + "\n")
    argv = ["--data", str(corpus), *PINNED, "--embed-dim", "16", "--hidden-dim", "16",
            "--batch-size", "16", "--epochs", "1", "--max-steps", "4", "--no-progress",
            "--model-dir", str(tmp / "run"), "--export-dir", str(tmp / "export"),
            "--metrics-json", str(tmp / "metrics.json")]
    assert train_script.main(argv) == 0
    return json.loads((tmp / "metrics.json").read_text())


WITHOUT_TFPAR = r"""
import json, sys
sys.modules["tfpar"] = None  # any import of tfpar now fails
try:
    import tfpar
    raise SystemExit("tfpar was importable")
except ImportError:
    pass
import tensorflow as tf
m = tf.saved_model.load(sys.argv[1])
score = m.signatures["score"](text=tf.constant(["w1 w2 w3", "w4"]))
def gen(seed):
    out = m.signatures["generate"](
        prompt=tf.constant(["w1 w2", ""]), max_tokens=tf.constant(10),
        temperature=tf.constant(1.0), top_k=tf.constant(5), seed=tf.constant(seed),
        stop_at_eos=tf.constant(True))
    return [t.decode() for t in out["text"].numpy()]
print(json.dumps({
    "nll": score["nll"].numpy().tolist(), "tokens": score["tokens"].numpy().tolist(),
    "perplexity": score["perplexity"].numpy().tolist(),
    "text": gen(3), "again": gen(3), "modules": sorted(k for k in sys.modules
                                                     if k.startswith("tfpar.")),
}))
"""


def test_a_trained_export_serves_in_a_process_without_tfpar(trained):
    path = trained["export_path"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-c", WITHOUT_TFPAR, path], capture_output=True,
                          text=True, env=env, cwd="/", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["modules"] == []
    assert np.isfinite(got["nll"]).all() and np.isfinite(got["perplexity"]).all()
    assert got["tokens"] == [4, 2]
    assert got["text"] == got["again"]
    # The same numbers as the in-process model.
    loaded = tf.saved_model.load(path)
    here = loaded.signatures["score"](text=tf.constant(["w1 w2 w3", "w4"]))
    np.testing.assert_allclose(got["nll"], here["nll"].numpy(), rtol=1e-6)
    assert got["text"] == gen(loaded, ["w1 w2", ""], max_tokens=10, top_k=5, seed=3)


def test_saved_model_cli_lists_the_three_signatures(trained):
    proc = subprocess.run(
        [os.path.join(BIN, "saved_model_cli"), "show", "--all", "--dir", trained["export_path"]],
        capture_output=True, text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"),
        timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for name, (inputs, outputs) in SIGNATURE_IO.items():
        assert f"signature_def['{name}']:" in out
        block = out.split(f"signature_def['{name}']:")[1].split("signature_def[")[0]
        for kind, specs in (("inputs", inputs), ("outputs", outputs)):
            for key, dtype in specs.items():
                enum = {tf.int32: "DT_INT32", tf.float32: "DT_FLOAT", tf.string: "DT_STRING",
                        tf.bool: "DT_BOOL"}
                assert f"{kind}['{key}'] tensor_info:\n        dtype: {enum[dtype]}\n" in block


def test_a_model_trained_under_mirrored_exports_the_same_way(tiny_args, tmp_path):
    from tfpar.tools.cli import train_main

    assert train_main(tiny_args + ["--strategy", "mirrored", "--cpu-devices", "2"]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    loaded = tf.saved_model.load(metrics["export_path"])
    assert set(loaded.signatures) == set(SIGNATURE_IO)
    vocab = Vocab.load(tmp_path / "run" / "vocab.txt")
    config = conftest.small_config().replace(model={"embed_dim": 16, "hidden_dim": 16})
    model = build_model(config.model, len(vocab))
    tf.train.Checkpoint(model=model).restore(
        tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints"))).expect_partial()
    texts = ["w1 w2 w3", "w5"]
    served = loaded.signatures["score"](text=tf.constant(texts))["nll"].numpy()
    module = export.LanguageModelModule(model, str(tmp_path / "run" / "vocab.txt"),
                                        tokenizer="whitespace")
    np.testing.assert_allclose(served, module.score(tf.constant(texts))["nll"].numpy(),
                               rtol=1e-6)
