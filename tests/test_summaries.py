"""tfpar.training.summaries: what goes into the event files, per step and per epoch."""

import glob
import json
import math
import os
import random

import numpy as np
import pytest
import tensorflow as tf

from conftest import PINNED, model_config, small_config
from tfpar.objective import step as steps
from tfpar.objective.output import output_loss

from tfpar.training import hparams, summaries
from tfpar.data.pipeline import InputData
from tfpar.model.lm import build_model
from tfpar.data.vocab import Vocab

LINES = ["a b c d", "b c", "a a b c d e", "e d c", "c a", "d d e a b"]


def read_events(run_dir) -> dict:
    """tag -> [(step, value as ndarray, plugin name)] from every event file of a run."""
    events = {}
    for path in sorted(glob.glob(os.path.join(str(run_dir), "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                events.setdefault(value.tag, []).append(
                    (event.step, tf.make_ndarray(value.tensor),
                     value.metadata.plugin_data.plugin_name))
    return events


@pytest.fixture
def setup():
    vocab = Vocab.build(LINES)
    config = small_config().replace(model={"embed_dim": 8, "hidden_dim": 8, "layers": 2},
                              train={"batch_size": 4})
    data = InputData({"train": LINES, "valid": LINES[:2], "test": LINES[:2]}, vocab,
                     config.data)
    return config, vocab, data


def test_scalars_text_and_histograms_land_in_their_runs_at_their_steps(tmp_path):
    writer = summaries.Writer(str(tmp_path))
    writer.scalars("train", {"loss": 2.5, "perplexity": math.exp(2.5)}, step=7)
    writer.scalars("eval", {"perplexity": 11.0}, step=9)
    writer.text("train", "samples", ["one", "two"], step=9)
    model = build_model(model_config(embed_dim=4, hidden_dim=4), 10)
    writer.histograms(model, step=9)
    writer.close()
    train, evals = read_events(tmp_path / "train"), read_events(tmp_path / "eval")
    assert train["loss"] == [(7, pytest.approx(2.5), "scalars")]
    assert evals["perplexity"] == [(9, pytest.approx(11.0), "scalars")]
    step, value, plugin = train["samples"][0]
    assert (step, list(value), plugin) == (9, [b"one", b"two"], "text")
    assert {t for t in train if t.startswith("weights/")} == {
        "weights/" + v.path for v in model.trainable_variables}
    assert all(p == "histograms" for t, e in train.items() if t.startswith("weights/")
               for _, _, p in e)


def test_a_diverged_runs_perplexity_past_float32_range_is_written(tmp_path):
    writer = summaries.Writer(str(tmp_path))
    writer.scalars("eval", {"perplexity": 5.9e38, "inf": math.inf}, step=3)
    writer.close()
    evals = read_events(tmp_path / "eval")
    assert evals["perplexity"] == [(3, pytest.approx(5.9e38), "scalars")]
    assert evals["inf"][0][1] == math.inf


def test_gradient_norms_are_a_histogram_and_one_scalar_per_layer(tmp_path):
    writer = summaries.Writer(str(tmp_path))
    writer.gradient_norms({"rnn_lm/embedding/embeddings": 3.0, "rnn_lm/rnn_0/cell/kernel": 1.0,
                           "rnn_lm/rnn_0/cell/bias": 2.0, "rnn_lm/softmax/kernel": 0.5}, step=4)
    writer.close()
    events = read_events(tmp_path / "train")
    assert events["update/gradient_norm/embedding"][0][:2] == (4, pytest.approx(3.0))
    assert events["update/gradient_norm/rnn_0"][0][1] == pytest.approx(math.sqrt(5.0))
    assert events["update/gradient_norm/softmax"][0][1] == pytest.approx(0.5)
    step, histogram, plugin = events["update/variable_gradient_norms"][0]
    assert (step, plugin) == (4, "histograms")
    assert histogram[:, 2].sum() == pytest.approx(4)  # four variables counted


def test_a_process_that_is_not_the_chief_writes_and_profiles_nothing(tmp_path, setup):
    writer = summaries.Writer(str(tmp_path), is_chief=False)
    writer.enable_inspection(*setup)
    model = build_model(setup[0].model, len(setup[1]))
    writer.scalars("train", {"loss": 1.0}, step=1)
    writer.text("train", "config", "x")
    writer.session({"lr": 1.0})
    writer.results([("test perplexity", "9.00")], step=1)
    writer.end_epoch(model, step=1)
    steps_fn = lambda iterator, state, n: None  # noqa: E731
    assert writer.instrument(steps_fn, lambda: 1, (1, 2)) is steps_fn
    writer.close()
    assert os.listdir(tmp_path) == []


def test_epoch_gradient_norms_are_those_of_the_first_unshuffled_train_batch(setup):
    config, vocab, data = setup
    inspector = summaries.EpochInspector(config, vocab, data)
    model = build_model(config.model, len(vocab), seed=9)  # other weights than the copy's
    inspector.refresh(model)
    batch = next(iter(data.batches("train", training=False, batch_size=4)))
    count = tf.reduce_sum(tf.cast(batch["targets"] != 0, tf.float32))
    grads, _, _, _ = steps.replica_gradients(model, batch, count, training=False,
                                              loss=output_loss(model.config))
    norms = inspector.gradient_norms(model)
    assert list(norms) == [v.path for v in model.trainable_variables]
    np.testing.assert_allclose(list(norms.values()), [float(tf.norm(g)) for g in grads],
                               rtol=1e-5)


def test_the_inspector_reads_a_mirrored_model_like_a_plain_one(setup):
    config, vocab, data = setup
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        mirrored = build_model(config.model, len(vocab), seed=4)
    plain = build_model(config.model, len(vocab), seed=4)
    inspector = summaries.EpochInspector(config, vocab, data)
    inspector.refresh(mirrored)
    from_mirrored = inspector.gradient_norms(mirrored)
    samples = inspector.samples(seed=1)
    inspector.refresh(plain)
    assert inspector.gradient_norms(plain) == pytest.approx(from_mirrored, rel=1e-6)
    assert inspector.samples(seed=1) == samples


def test_samples_are_three_draws_and_a_greedy_continuation_fixed_by_the_seed(setup):
    inspector = summaries.EpochInspector(*setup)
    texts = inspector.samples(seed=3)
    assert [t.split(":")[0] for t in texts] == ["sample 1", "sample 2", "sample 3", "greedy"]
    assert texts[3].startswith("greedy: [a b c] ")  # the first valid sentence's first words
    assert inspector.samples(seed=3) == texts
    words = set(setup[1].tokens[3:])
    for text in texts:
        assert set(text.split(": ", 1)[1].replace("[", "").replace("]", "").split()) <= words


def test_the_copy_leaves_every_global_random_state_alone(setup):
    def draws():
        return (random.random(), np.random.random(), float(tf.random.uniform([])))

    random.seed(1), np.random.seed(1), tf.random.set_seed(1)
    expected = draws()
    random.seed(1), np.random.seed(1), tf.random.set_seed(1)
    summaries.EpochInspector(*setup)
    assert draws() == expected


class FakeProfiler:
    def __init__(self, monkeypatch, log):
        self.log = log
        monkeypatch.setattr(tf.profiler.experimental, "start",
                            lambda logdir: log.append(("start", logdir)))
        monkeypatch.setattr(tf.profiler.experimental, "stop", lambda: log.append(("stop",)))


@pytest.mark.parametrize("first_step,n,window,expected", [
    # One step per call (the default): the profiler runs over the calls of steps A..B,
    # whose batches are read inside them.
    (1, 1, (3, 4), "ran1 ran2 START ran3 ran4 STOP ran5"),
    (1, 1, (1, 1), "START ran1 STOP ran2 ran3 ran4 ran5"),
    # A run resumed inside the window profiles the rest of it.
    (4, 1, (3, 5), "START ran4 ran5 STOP ran6 ran7 ran8"),
    # Calls of 2 steps: the whole calls holding a step of A..B.
    (1, 2, (4, 5), "ran1 ran2 START ran3 ran4 ran5 ran6 STOP ran7 ran8 ran9 ran10"),
])
def test_profiler_window_and_graph_written_once(tmp_path, monkeypatch, first_step, n, window,
                                                expected):
    log = []
    FakeProfiler(monkeypatch, log)
    counter = {"step": first_step}

    @tf.function
    def train_steps(x):
        return x * 2.0

    def steps_fn(iterator, state, n):
        for _ in range(n):
            log.append(("ran", counter["step"]))
            counter["step"] += 1
        return train_steps(next(iterator))

    writer = summaries.Writer(str(tmp_path))
    hooked = writer.instrument(steps_fn, lambda: counter["step"], window)
    iterator = iter([tf.constant(1.5)] * 5)
    for _ in range(5):
        assert float(hooked(iterator, None, n)) == 3.0
    writer.close()
    assert " ".join(f"{e[0]}{e[1]}" if len(e) == 2 and isinstance(e[1], int)
                    else e[0].upper() for e in log) == expected
    assert {e[1] for e in log if e[0] == "start"} == {str(tmp_path / "train")}
    graphs = read_events(tmp_path / "train")["train_steps"]
    assert [(step, plugin) for step, _, plugin in graphs] == [(first_step,
                                                               "graph_run_metadata_graph")]


def test_close_stops_a_profiler_the_run_did_not_reach_the_end_of(tmp_path, monkeypatch):
    log = []
    FakeProfiler(monkeypatch, log)
    writer = summaries.Writer(str(tmp_path))
    counter = {"step": 1}

    def steps_fn(iterator, state, n):
        counter["step"] += n

    hooked = writer.instrument(steps_fn, lambda: counter["step"], (2, 100))
    for _ in range(3):
        hooked(None, None, 1)
    assert [e[0] for e in log] == ["start"]
    writer.close()
    assert [e[0] for e in log] == ["start", "stop"]


@pytest.fixture(scope="module")
def short_run(module_tiny_corpus, tmp_path_factory):
    """A 25-step run of the tiny corpus (its epochs are 19 steps): an epoch end at step
    19, then the run ends mid-epoch 2. Returns (model dir, metrics)."""
    from tfpar.tools.cli import train_main

    tmp = tmp_path_factory.mktemp("short-run")
    assert train_main(["--data", str(module_tiny_corpus), *PINNED, "--embed-dim", "16",
                       "--hidden-dim", "16", "--batch-size", "16", "--epochs", "2",
                       "--max-steps", "25", "--no-progress", "--no-export",
                       "--model-dir", str(tmp / "run"),
                       "--metrics-json", str(tmp / "metrics.json")]) == 0
    return tmp / "run", json.loads((tmp / "metrics.json").read_text())


def session_events(model_dir) -> dict:
    """The HParams summaries in a model dir's root: {"settings": {name: value},
    "experiment": api_pb2.Experiment, "files": count}."""
    from tensorboard.plugins.hparams import metadata

    paths = glob.glob(os.path.join(str(model_dir), "events.out.tfevents.*"))
    out = {"files": len(paths), "sessions": 0}
    for path in paths:
        for event in events_up_to_a_cut(path):
            for value in event.summary.value:
                content = value.metadata.plugin_data.content
                if value.tag == metadata.SESSION_START_INFO_TAG:
                    info = metadata.parse_session_start_info_plugin_data(content)
                    out["sessions"] += 1
                    out["group"] = info.group_name
                    out["settings"] = {k: getattr(v, v.WhichOneof("kind"))
                                       for k, v in info.hparams.items()}
                elif value.tag == metadata.EXPERIMENT_TAG:
                    out["experiment"] = metadata.parse_experiment_plugin_data(content)
    return out


def events_up_to_a_cut(path):
    try:
        yield from tf.compat.v1.train.summary_iterator(path)
    except tf.errors.DataLossError:
        return


def test_a_runs_scalars_are_grouped_and_none_is_a_one_point_chart(short_run):
    """Per step: perplexity, loss, speed/, update/ (no flat grad_norm, learning_rate,
    tokens_per_sec); eval: the valid perplexity of the epoch end and of the last
    weights, no epoch counter and no final_* scalar; the final figures are a text table.
    TensorBoard opens on the curves: its Time Series tab sorts the sections (a tag's
    part before "/") by name and opens the first two, which are loss and perplexity."""
    model_dir, metrics = short_run
    train, evals = read_events(model_dir / "train"), read_events(model_dir / "eval")
    scalars = {run: {t for t, e in events.items() if e[0][2] == "scalars"}
               for run, events in (("train", train), ("eval", evals))}
    charted = {t for events in (train, evals) for t, e in events.items()
               if e[0][2] in ("scalars", "histograms", "images")}
    sections = sorted({t.split("/", 1)[0] for t in charted})
    assert sections[:2] == ["loss", "perplexity"], sections
    assert scalars == {"train": {"perplexity", "loss", "update/learning_rate",
                                 "speed/tokens_per_sec", "update/gradient_norm"},
                       "eval": {"perplexity"}}
    assert [step for step, _, _ in train["perplexity"]] == [1, 10, 20]
    assert [step for step, _, _ in evals["perplexity"]] == [19, 25]  # epoch end, the end
    assert float(evals["perplexity"][-1][1]) == pytest.approx(metrics["valid_ppl"], rel=1e-6)
    (step, table, plugin), = evals["results"]
    table = table.item().decode()
    assert (step, plugin) == (25, "text")
    for row in (f"| valid perplexity | {metrics['valid_ppl']:.2f} |",
                f"| test perplexity | {metrics['test_ppl']:.2f} |",
                "| weights | last (step 25, mid-epoch) |", "| epochs trained | 1 |",
                "| steps | 25 |"):
        assert row in table


def test_a_run_records_its_settings_once_for_the_hparams_dashboard(short_run):
    model_dir, metrics = short_run
    session = session_events(model_dir)
    assert (session["files"], session["sessions"]) == (1, 1)
    assert session["group"] == "run"  # the model dir's name: one row per run
    settings = session["settings"]
    assert {k: settings[k] for k in ("strategy", "replicas", "cell", "layers", "embed_dim",
                                     "hidden_dim", "optimizer", "batch_size", "epochs",
                                     "dropout", "tie_embeddings", "mode", "precision")} == {
        "strategy": "default", "replicas": 1, "cell": "lstm", "layers": 1, "embed_dim": 16,
        "hidden_dim": 16, "optimizer": "adam", "batch_size": 16, "epochs": 2, "dropout": 0,
        "tie_embeddings": False, "mode": "sentence", "precision": "fp32"}
    assert settings["lr"] == pytest.approx(3e-3)
    assert "bptt" not in settings  # sentence mode: no window length
    assert set(settings) | {"bptt", "num_sampled"} == {c[0] for c in hparams.COLUMNS}
    experiment = session["experiment"]
    assert sorted(h.name for h in experiment.hparam_infos) == sorted(
        c[0] for c in hparams.COLUMNS)
    assert [(m.name.group, m.name.tag, m.display_name) for m in experiment.metric_infos] == [
        ("eval", "perplexity", "valid perplexity"), ("train", "perplexity", "train perplexity")]


def test_a_resumed_run_keeps_the_first_session_and_says_what_changed(tmp_path, caplog):
    """One session per model dir: a second writer (a resumed run) writes none and names
    the settings it changes. A session file cut short by a kill is no session: the next
    run writes one."""
    first, killed = tmp_path / "first", tmp_path / "killed"
    summaries.Writer(str(first)).session({"lr": 0.5, "cell": "lstm", "tie_embeddings": True})
    (written,) = glob.glob(str(first / "events.out.tfevents.*"))
    cut = open(written, "rb").read()[:30]  # inside the first record
    killed.mkdir()
    for folder in (first, killed):
        (folder / "events.out.tfevents.0.cut.hparams").write_bytes(cut)  # read first
    with caplog.at_level("INFO"):
        summaries.Writer(str(first)).session({"lr": 0.25, "cell": "lstm",
                                              "tie_embeddings": True})
    assert hparams.recorded(str(first)) == {"lr": 0.5, "cell": "lstm", "tie_embeddings": True}
    assert session_events(first)["sessions"] == 1
    assert "this run changes lr 0.5 -> 0.25" in caplog.text
    assert hparams.recorded(str(killed)) is None
    summaries.Writer(str(killed)).session({"lr": 0.25})
    assert hparams.recorded(str(killed)) == {"lr": 0.25}


def test_without_epoch_inspection_an_epoch_end_writes_no_norms_or_samples(short_run):
    """--no-epoch-inspection (the suite's runs, see conftest.NO_INSPECTION): an epoch's
    end writes the weight histograms but neither the gradient norms nor text samples;
    with it on (the default) tests/test_tensorboard.py reads the samples back."""
    assert "--no-epoch-inspection" in PINNED
    tags = read_events(short_run[0] / "train")
    assert [t for t in tags if t == "samples" or t.startswith("update/gradient_norm/") or
            t == "update/variable_gradient_norms"] == []
    assert [t for t in tags if tags[t][0][2] == "histograms"]
