"""The real TensorBoard serves a training run: scalars, histograms, text, graph, HParams.

Starts ``.venv/bin/tensorboard`` on the folder that holds a tiny run's model dir (as
``tensorboard --logdir runs/``: the model dir ``run`` is an HParams session, its runs are
``run/train`` and ``run/eval``) and reads everything back over its HTTP API, so what is
checked is what a person would see.
"""

import contextlib
import glob
import json
import math
import os
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request

import pytest

from conftest import load_script
from tfpar.tools.cli import train_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENSORBOARD = os.path.join(REPO, ".venv", "bin", "tensorboard")
POLL_TRIES, POLL_WAIT = 240, 0.5  # at most ~2 minutes for the server to load the run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tensorboard(logdir: str):
    """Runs TensorBoard on a free port; yields ``get(path) -> parsed JSON or text``."""
    port = free_port()
    proc = subprocess.Popen(
        [TENSORBOARD, "--logdir", logdir, "--port", str(port), "--host", "127.0.0.1",
         "--load_fast", "false", "--reload_interval", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))

    def get(path: str, raw: bool = False, post: dict | None = None):
        """GET ``path``, or POST the JSON ``post`` to it (the HParams plugin's API)."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}",
            data=None if post is None else json.dumps(post).encode(),
            headers={} if post is None else {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as r:
            body = r.read().decode("utf-8")
        return body if raw else json.loads(body)

    try:
        yield get, lambda: wait_for(proc, get)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


TRAIN, EVAL = "run/train", "run/eval"  # the model dir "run"'s two runs


def wait_for(proc, get) -> None:
    """Polls until the server answers and has loaded both runs (bounded tries)."""
    for _ in range(POLL_TRIES):
        try:
            if {TRAIN, EVAL} <= set(get("/data/runs")):
                tags = get("/data/plugin/scalars/tags")
                if "perplexity" in tags.get(EVAL, {}) and "samples" in get(
                        "/data/plugin/text/tags").get(TRAIN, []):
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        try:  # waits up to POLL_WAIT, and notices a server that died
            proc.wait(timeout=POLL_WAIT)
            pytest.fail(f"tensorboard exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        except subprocess.TimeoutExpired:
            pass
    pytest.fail(f"tensorboard did not serve the run after {POLL_TRIES} tries")


def q(**params) -> str:
    return urllib.parse.urlencode(params)


def test_tensorboard_serves_scalars_histograms_text_graph_hparams_and_a_profile(tiny_args,
                                                                             tmp_path):
    # One full epoch (no --max-steps), so the per-epoch summaries are written too.
    assert train_main(tiny_args + ["--max-steps", "0", "--profile-steps", "2,3",
                                   "--log-every", "5", "--epoch-inspection"]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    run_dir = str(tmp_path / "run")

    with tensorboard(str(tmp_path)) as (get, ready):
        ready()
        assert {TRAIN, EVAL} <= set(get("/data/runs"))

        # Grouped tags; no chart of one point (no epoch counter, no final_* scalar).
        tags = get("/data/plugin/scalars/tags")
        assert set(tags[TRAIN]) == {
            "perplexity", "loss", "speed/tokens_per_sec", "update/learning_rate",
            "update/gradient_norm", "update/gradient_norm/embedding",
            "update/gradient_norm/rnn_0", "update/gradient_norm/softmax"}
        assert set(tags[EVAL]) == {"perplexity"}  # train's and valid's on one chart

        train_ppl = get("/data/plugin/scalars/scalars?" + q(run=TRAIN, tag="perplexity"))
        train_loss = get("/data/plugin/scalars/scalars?" + q(run=TRAIN, tag="loss"))
        steps = [step for _, step, _ in train_ppl]
        assert steps[:3] == [1, 5, 10] and steps == sorted(steps)
        for (_, _, ppl), (_, _, loss) in zip(train_ppl, train_loss):
            assert ppl == pytest.approx(math.exp(loss), rel=1e-5)
        speed = get("/data/plugin/scalars/scalars?" + q(run=TRAIN, tag="speed/tokens_per_sec"))
        assert all(value > 0 for _, _, value in speed)
        eval_ppl = get("/data/plugin/scalars/scalars?" + q(run=EVAL, tag="perplexity"))
        assert len(eval_ppl) == 1
        assert eval_ppl[0][1] == metrics["steps"]
        # One epoch and no more training: the epoch's valid perplexity is the final one.
        assert eval_ppl[0][2] == pytest.approx(metrics["valid_ppl"], rel=1e-5)

        histograms = get("/data/plugin/histograms/tags")[TRAIN]
        assert "update/variable_gradient_norms" in histograms
        assert "weights/rnn_lm/rnn_0/lstm_cell/kernel" in histograms
        norms = get("/data/plugin/histograms/histograms?" + q(
            run=TRAIN, tag="update/variable_gradient_norms"))
        assert len(norms) == 1 and norms[0][1] == metrics["steps"]
        assert sum(bucket[2] for bucket in norms[0][2]) == pytest.approx(6)  # 6 variables

        text = get("/data/plugin/text/tags")
        assert {"config", "samples"} <= set(text[TRAIN]) and text[EVAL] == ["results"]
        samples = get("/data/plugin/text/text?" + q(run=TRAIN, tag="samples"))
        assert samples[0]["step"] == metrics["steps"]
        for prefix in ("sample 1: ", "sample 2: ", "sample 3: ", "greedy: ["):
            assert prefix in samples[0]["text"]
        (results,) = get("/data/plugin/text/text?" + q(run=EVAL, tag="results"))
        assert "<table>" in results["text"]  # the markdown table, rendered
        assert f"<td>{metrics['test_ppl']:.2f}</td>" in results["text"]

        graphs = get("/data/plugin/graphs/info")[TRAIN]["tags"]
        assert graphs["train_steps"]["op_graph"] is True
        graph = get("/data/plugin/graphs/graph?" + q(run=TRAIN, tag="train_steps"), raw=True)
        # The loss is in it: the fused output layer (the default) under its name scope.
        assert "fused_softmax_nll" in graph

        # HParams: the experiment's columns, and the session "run" with its settings
        # and its valid perplexity (the last point of run/eval's perplexity).
        experiment = get("/data/plugin/hparams/experiment", post={"experimentName": ""})
        assert [(m["name"], m["displayName"]) for m in experiment["metricInfos"]] == [
            ({"group": "eval", "tag": "perplexity"}, "valid perplexity"),
            ({"group": "train", "tag": "perplexity"}, "train perplexity")]
        columns = {h["name"]: h["type"] for h in experiment["hparamInfos"]}
        assert (columns["lr"], columns["cell"], columns["tie_embeddings"]) == (
            "DATA_TYPE_FLOAT64", "DATA_TYPE_STRING", "DATA_TYPE_BOOL")
        (group,) = get("/data/plugin/hparams/session_groups", post={
            "experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN"],
            "colParams": [{"hparam": name, "includeInResult": True} for name in columns] +
            [{"metric": m["name"], "includeInResult": True}
             for m in experiment["metricInfos"]],
            "startIndex": 0, "sliceSize": 10})["sessionGroups"]
        assert group["name"] == "run" and [s["name"] for s in group["sessions"]] == ["run"]
        assert {k: group["hparams"][k] for k in ("strategy", "cell", "layers", "embed_dim",
                                                 "batch_size", "optimizer")} == {
            "strategy": "default", "cell": "lstm", "layers": 1, "embed_dim": 16,
            "batch_size": 16, "optimizer": "adam"}
        valid = {(m["name"]["group"], m["name"]["tag"]): m for m in group["metricValues"]}
        assert valid["eval", "perplexity"]["value"] == pytest.approx(metrics["valid_ppl"],
                                                                   rel=1e-6)
        assert valid["eval", "perplexity"]["trainingStep"] == metrics["steps"]

    traces = glob.glob(os.path.join(run_dir, "train", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1
    with open(traces[0], "rb") as f:
        trace = f.read()
    assert b"Iterator::" in trace  # the input pipeline's events are in the profile


def test_steps_per_execution_writes_the_loop_graph_and_profiles_its_calls(tiny_args, tmp_path):
    """Sentence mode with --steps-per-execution 3: the N-step loop's graph is written once,
    and --profile-steps profiles the calls holding 4..5."""
    from tensorboard.backend.event_processing import event_accumulator

    assert train_main(tiny_args + ["--steps-per-execution", "3", "--profile-steps", "4,5"]) == 0
    run_dir = str(tmp_path / "run")
    acc = event_accumulator.EventAccumulator(os.path.join(run_dir, "train"))
    acc.Reload()
    assert "train_steps" in acc.Tags()["tensors"]  # the N-step loop's graph (trace_export)
    (event,) = acc.Tensors("train_steps")
    assert acc.SummaryMetadata("train_steps").plugin_data.plugin_name == \
        "graph_run_metadata_graph"
    assert b"While" in event.tensor_proto.string_val[0]  # the loop over the iterator
    traces = glob.glob(os.path.join(run_dir, "train", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1


def test_the_screenshot_script_names_a_missing_browser_before_it_trains(tmp_path, capsys):
    """scripts/tensorboard_screenshot.py (tfpar/docs/tensorboard.png): without Chromium
    it says so in one line and exits 1, before any training."""
    script = load_script("tensorboard_screenshot")
    assert script.main(["--chromium", "no-such-browser", "--keep", str(tmp_path / "shot"),
                        "--out", str(tmp_path / "tb.png")]) == 1
    assert capsys.readouterr().err == (
        "error: no browser 'no-such-browser': install Chromium with `apt-get install -y "
        "chromium`, or give --chromium PATH\n")
    assert not (tmp_path / "shot").exists() and not (tmp_path / "tb.png").exists()
