"""scripts/cluster/: the Kubernetes TFJob and the Slurm batch script start tfpar-train
with flags tfpar's own parser accepts."""

import json
import os
import re
import shlex

import pytest

from tfpar.errors import TfparError
from tfpar.tools import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(REPO, "scripts", "cluster")
TRAIN = "scripts/train.py"
# One #SBATCH option: --name or --name=value (long form), or -X value (short form).
SBATCH_OPTION = re.compile(r"--[a-z][a-z-]*(=\S+)?|-[A-Za-z]")


def train_config(command):
    """The Config of a command line ``python scripts/train.py FLAGS``.

    Raises:
      SystemExit: a flag the train parser does not know or a bad value (argparse).
      TfparError: flags that make no valid config.
    """
    assert command[:2] == ["python", TRAIN], command
    return cli.config_from_args(cli.train_parser().parse_args(command[2:]))


def read_tfjob(text):
    """The manifest: full-line ``#`` comments, then JSON (YAML's flow style)."""
    return json.loads("\n".join(line for line in text.splitlines()
                                if not line.lstrip().startswith("#")))


def check_tfjob(text):
    """The TFJob's roles and commands; returns {role: Config}."""
    job = read_tfjob(text)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "TFJob")
    replicas = job["spec"]["tfReplicaSpecs"]
    assert set(replicas) == {"Worker", "Evaluator"}
    assert replicas["Worker"]["replicas"] >= 2
    assert replicas["Evaluator"]["replicas"] == 1
    commands = {role: spec["template"]["spec"]["containers"][0]["command"]
                for role, spec in replicas.items()}
    # The evaluator must be given the training flags: it rebuilds the run's model and data.
    assert commands["Evaluator"] == commands["Worker"]
    return {role: train_config(command) for role, command in commands.items()}


def check_sbatch(text):
    """The batch script's #SBATCH lines and its srun line; returns the srun's Config."""
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    first_command = next(i for i, line in enumerate(lines)
                         if line.strip() and not line.startswith("#"))
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    assert sbatch
    for line in sbatch:  # Slurm reads #SBATCH lines only before the first command
        assert lines.index(line) < first_command, line
        tokens = line.split()[1:]
        assert tokens, line
        while tokens:  # --name[=value], or -X value
            option = tokens.pop(0)
            assert SBATCH_OPTION.fullmatch(option), (line, option)
            if not option.startswith("--"):
                assert tokens and not tokens.pop(0).startswith("-"), (line, option)
    script = "\n".join(lines[first_command:]).replace("\\\n", " ")
    (srun,) = [shlex.split(line) for line in script.splitlines() if line.startswith("srun ")]
    return train_config(srun[1:])


def read(name):
    with open(os.path.join(FOLDER, name), encoding="utf-8") as f:
        return f.read()


def test_the_tfjob_has_workers_and_an_evaluator_that_run_tfpar_train():
    configs = check_tfjob(read("tfjob.yaml"))
    for config in configs.values():
        assert config.dist.strategy == "multi_worker"
        assert config.run.model_dir == "/shared/runs/lm"


def test_the_slurm_script_runs_tfpar_train_under_srun():
    config = check_sbatch(read("slurm.sbatch"))
    assert (config.dist.strategy, config.dist.cluster) == ("multi_worker", "slurm")
    assert config.train.batch_size == 160


@pytest.mark.parametrize("name,check,good,bad", [
    ("tfjob.yaml", check_tfjob, '"--checkpoint-every", "500"]', '"--checkpoint-evry", "500"]'),
    ("tfjob.yaml", check_tfjob, '"replicas": 1,', '"replicas": 2,'),
    ("slurm.sbatch", check_sbatch, "--scale-lr linear", "--scale-lr linaer"),
    ("slurm.sbatch", check_sbatch, "#SBATCH --nodes=2", "#SBATCH nodes=2"),
    ("slurm.sbatch", check_sbatch, "#SBATCH --nodes=2", "#SBATCH -N"),
    ("slurm.sbatch", check_sbatch, "#SBATCH --nodes=2", "srun true\n#SBATCH --nodes=2"),
    ("slurm.sbatch", check_sbatch, "--batch-size 160", "--batch-size 0"),
])
def test_the_checks_fail_on_a_broken_file(name, check, good, bad):
    text = read(name)
    assert good in text
    with pytest.raises((AssertionError, SystemExit, TfparError)):
        check(text.replace(good, bad, 1))
