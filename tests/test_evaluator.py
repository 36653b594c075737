"""The side-car evaluator task (TF_CONFIG task type "evaluator"), run in-process through
scripts/train.py's main(argv) on a finished tiny run's model dir."""

import glob
import json
import os
import shutil

import pytest
import tensorflow as tf
from conftest import PINNED, write_tiny_corpus, load_script

from tfpar.errors import ClusterError
from tfpar.parallel.cluster.tf_config import is_evaluator, tf_config_json
from tfpar.training import checkpoints, sidecar

CLUSTER = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"], "evaluator": ["127.0.0.1:2224"]}


train = load_script("train")
evaluate = load_script("evaluate")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 4-step run checkpointed at steps 2 and 4; its train flags."""
    tmp = tmp_path_factory.mktemp("sidecar")
    corpus = tmp / "corpus"
    corpus.mkdir()
    write_tiny_corpus(corpus)
    argv = ["--data", str(corpus), *PINNED, "--embed-dim", "16", "--hidden-dim", "16",
            "--batch-size", "16", "--epochs", "1", "--max-steps", "4", "--no-progress",
            "--checkpoint-every", "2", "--keep-checkpoints", "5", "--no-export",
            "--model-dir", str(tmp / "run")]
    assert train.main(argv) == 0
    return {"argv": argv, "model_dir": str(tmp / "run"), "tmp": tmp}


def read_scalars(run_dir, tag) -> dict[int, float]:
    out = {}
    for path in sorted(glob.glob(os.path.join(str(run_dir), "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    out[event.step] = float(tf.make_ndarray(value.tensor))
    return out


def evaluate_checkpoint(model_dir, step, tmp, capsys) -> float:
    """tfpar-evaluate's valid perplexity of checkpoint ``step``: a copy of the model dir
    whose latest checkpoint is set to it."""
    copy = tmp / f"at-{step}"
    shutil.copytree(model_dir, copy)
    folder = str(copy / "checkpoints")
    tf.compat.v1.train.update_checkpoint_state(folder, os.path.join(folder, f"ckpt-{step}"))
    capsys.readouterr()
    assert evaluate.main(["--model-dir", str(copy), "--split", "valid", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"].endswith(f"ckpt-{step}")
    return result["perplexity"]


def sidecar_argv(run, strategy="multi_worker", timeout="20"):
    return [*run["argv"], "--strategy", strategy, "--evaluator-timeout", timeout]


def test_the_evaluator_scores_every_checkpoint_like_tfpar_evaluate_and_ends(
        run, monkeypatch, capsys, caplog):
    assert checkpoints.final_step(run["model_dir"]) == 4  # the chief's end-of-run record
    monkeypatch.setenv("TF_CONFIG", tf_config_json(CLUSTER, "evaluator", 0))
    caplog.set_level("INFO")
    # Ends by itself: a missed end would wait out --evaluator-timeout and exit 2.
    assert train.main(sidecar_argv(run)) == 0
    got = read_scalars(os.path.join(run["model_dir"], sidecar.RUN), sidecar.TAG)
    assert sorted(got) == [2, 4]
    monkeypatch.delenv("TF_CONFIG")
    for step, ppl in got.items():
        assert ppl == pytest.approx(evaluate_checkpoint(run["model_dir"], step, run["tmp"],
                                                        capsys), rel=1e-6)
    assert "evaluator: the run ended at step 4; 2 checkpoint(s) evaluated" in caplog.text


def test_without_the_runs_end_the_evaluator_times_out_with_one_line(run, monkeypatch, capsys):
    model_dir = run["tmp"] / "unfinished"
    shutil.copytree(run["model_dir"], model_dir)
    os.remove(model_dir / checkpoints.FINAL_STEP_FILE)  # as while the chief still trains
    argv = [a if a != run["model_dir"] else str(model_dir) for a in sidecar_argv(run,
                                                                                timeout="1")]
    monkeypatch.setenv("TF_CONFIG", tf_config_json(CLUSTER, "evaluator", 0))
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith("error: evaluator: no new checkpoint in ")
    assert "--evaluator-timeout 1 s and the run has not ended (the last evaluated is step 4)" \
        in err[-1]


@pytest.mark.parametrize("strategy,cluster,message", [
    ("multi_worker", dict(CLUSTER, evaluator=["127.0.0.1:2224", "127.0.0.1:2225"]),
     "TF_CONFIG lists 2 evaluator tasks; a cluster has at most one evaluator"),
    ("mirrored", CLUSTER,
     "TF_CONFIG task type 'evaluator' evaluates the checkpoints of a cluster's run, but "
     "--strategy mirrored has no cluster; use --strategy multi_worker or parameter_server"),
    ("parameter_server", CLUSTER,
     "--strategy parameter_server needs a 'chief' task"),
])
def test_a_bad_evaluator_tf_config_is_refused(strategy, cluster, message):
    env = {"TF_CONFIG": tf_config_json(cluster, "evaluator", 0)}
    with pytest.raises(ClusterError, match=message):
        is_evaluator(strategy, env)


def test_the_train_command_refuses_a_bad_evaluator_in_one_line(tiny_args, monkeypatch,
                                                                capsys):
    monkeypatch.setenv("TF_CONFIG", tf_config_json(CLUSTER, "evaluator", 0))
    assert train.main([*tiny_args, "--strategy", "default"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1] == ("error: TF_CONFIG task type 'evaluator' evaluates the checkpoints of a "
                       "cluster's run, but --strategy default has no cluster; use --strategy "
                       "multi_worker or parameter_server")


def test_training_tasks_accept_an_evaluator_in_the_cluster():
    for strategy, cluster, task in (
            ("multi_worker", CLUSTER, "worker"),
            ("parameter_server", {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"],
                                  "ps": ["127.0.0.1:3"], "evaluator": ["127.0.0.1:4"]}, "chief")):
        assert not is_evaluator(strategy, {"TF_CONFIG": tf_config_json(cluster, task, 0)})
        assert is_evaluator(strategy, {"TF_CONFIG": tf_config_json(cluster, "evaluator", 0)})


def test_a_resumed_run_unmarks_the_end_until_it_ends_again(run, monkeypatch):
    """A stop signal (Interrupted, exit 130) in a resumed run leaves no final_step.json:
    the evaluator of the resumed run waits for its new last step."""
    from tfpar.errors import Interrupted
    from tfpar.training import loop

    model_dir = run["tmp"] / "resumed"
    shutil.copytree(run["model_dir"], model_dir)
    argv = [a if a != run["model_dir"] else str(model_dir) for a in run["argv"]]
    argv[argv.index("--max-steps") + 1] = "6"

    def stopped(self):
        raise Interrupted("stopped by a signal after step 4")

    monkeypatch.setattr(loop.Loop, "run", stopped)
    assert checkpoints.final_step(model_dir) == 4
    assert train.main(argv) == 130
    assert checkpoints.final_step(model_dir) is None


def test_the_training_cluster_leaves_the_evaluator_out():
    """What the parameter_server coordinator and servers are given: a coordinator told of
    the evaluator waits for its server, which never starts (a real 4-process run hung)."""
    from tfpar.parallel.cluster.tf_config import parse_tf_config

    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"],
               "evaluator": ["127.0.0.1:4"]}
    config = parse_tf_config(tf_config_json(cluster, "chief", 0))
    assert config.training_cluster == {"chief": ("127.0.0.1:1",), "worker": ("127.0.0.1:2",),
                                       "ps": ("127.0.0.1:3",)}
