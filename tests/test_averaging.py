"""--ema-momentum: a run evaluates, keeps and exports the moving average of its weights,
and trains on from its own (tfpar/docs/training.md, Averaged weights)."""

import json

import numpy as np
import pytest
import tensorflow as tf
from conftest import PINNED, load_script

train = load_script("train")
evaluate = load_script("evaluate")

M = 0.6  # a short average, so that 8 steps leave it far from the last weights
STEPS = 8


def run_args(corpus, out, *extra):
    return ["--data", str(corpus), *PINNED, "--ema-momentum", str(M), "--embed-dim", "16",
            "--hidden-dim", "16", "--batch-size", "16", "--epochs", "1",
            "--max-steps", str(STEPS), "--checkpoint-every", "1", "--keep-checkpoints", "20",
            "--no-progress", "--model-dir", str(out / "run"),
            "--export-dir", str(out / "export"), "--metrics-json", str(out / "metrics.json"),
            *extra]


def tensors(path, prefix):
    """{name: value} of the checkpoint's entries under ``prefix``/."""
    reader = tf.train.load_checkpoint(path)
    return {k.split("/")[1]: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
            if k.startswith(prefix + "/") and k.endswith("VARIABLE_VALUE")}


def checkpoint(run_dir, step):
    return str(run_dir / "checkpoints" / f"ckpt-{step}")


@pytest.fixture(scope="module")
def averaged_run(module_tiny_corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("averaged")
    assert train.main(run_args(module_tiny_corpus, out)) == 0
    return {"dir": out, "corpus": module_tiny_corpus,
            "metrics": json.loads((out / "metrics.json").read_text())}


def test_the_average_is_the_moving_average_of_the_steps_weights(averaged_run):
    """Computed here from each step's own weights (every step is checkpointed):
    avg_1 = w_1, avg_k = M avg_(k-1) + (1 - M) w_k; the run's last checkpoint keeps it
    beside the last weights, which training resumes from."""
    run_dir = averaged_run["dir"] / "run"
    steps = [tensors(checkpoint(run_dir, k), "layers") for k in range(1, STEPS + 1)]
    average = dict(steps[0])
    for weights in steps[1:]:
        average = {k: M * average[k] + (1 - M) * weights[k] for k in average}
    kept = tensors(checkpoint(run_dir, STEPS), "moments")
    slot = lambda name: name.replace(":", "_") + "_average"  # noqa: E731
    trained = [name for name in average if slot(name) in kept]  # (not the dropout RNG)
    assert len(trained) == 6  # embedding; kernel, recurrent kernel, bias; softmax kernel, bias
    for name in trained:
        np.testing.assert_allclose(kept[slot(name)], average[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        assert np.abs(average[name] - steps[-1][name]).max() > 1e-3  # the last ones differ


def test_the_run_reports_and_exports_the_average_and_every_tool_reads_it(averaged_run, capsys):
    run, metrics = averaged_run, averaged_run["metrics"]

    def perplexity(argv):
        assert evaluate.main([*argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["perplexity"]

    rebuilt = perplexity(["--model-dir", str(run["dir"] / "run")])
    served = perplexity(["--model", metrics["export_path"], "--data", str(run["corpus"])])
    assert rebuilt == pytest.approx(metrics["valid_ppl"], rel=1e-6)
    assert served == pytest.approx(metrics["valid_ppl"], rel=1e-5)
    # ... and they are not the last step's weights: with the average dropped from the
    # checkpoint, the same tool scores another perplexity.
    from tfpar.training import state

    real = state.average_slot
    try:
        state.average_slot = lambda name: "no such slot"
        last = perplexity(["--model-dir", str(run["dir"] / "run")])
    finally:
        state.average_slot = real
    assert abs(last - metrics["valid_ppl"]) > 1e-4 * metrics["valid_ppl"]  # (100x the match)


def test_a_resumed_run_keeps_its_average(averaged_run, tmp_path):
    """Half the steps, then the rest from the checkpoint: every tensor of the last
    checkpoint (weights, averages, slots) equals the uninterrupted run's."""
    half = run_args(averaged_run["corpus"], tmp_path)
    half[half.index("--max-steps") + 1] = str(STEPS // 2)
    assert train.main(half) == 0
    assert train.main(run_args(averaged_run["corpus"], tmp_path)) == 0
    want = tf.train.load_checkpoint(checkpoint(averaged_run["dir"] / "run", STEPS))
    got = tf.train.load_checkpoint(checkpoint(tmp_path / "run", STEPS))
    names = [k for k in want.get_variable_to_shape_map() if k.endswith("VARIABLE_VALUE")]
    assert any("_average" in k for k in names)
    for k in names:
        np.testing.assert_array_equal(got.get_tensor(k), want.get_tensor(k), err_msg=k)


def test_mirrored_keeps_the_average_one_device_keeps(averaged_run, tmp_path):
    assert train.main(run_args(averaged_run["corpus"], tmp_path, "--strategy", "mirrored",
                               "--no-export")) == 0
    want = tensors(checkpoint(averaged_run["dir"] / "run", STEPS), "moments")
    got = tensors(checkpoint(tmp_path / "run", STEPS), "moments")
    averages = [k for k in want if k.endswith("_average")]
    assert len(averages) == 6
    for k in averages:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
