"""The console: TensorFlow's native chatter filtered off stderr (real errors kept), a
progress bar with a total and an ETA, one line per epoch."""

import os
import re
import subprocess
import sys

import pytest

from conftest import PINNED, REPO
from tfpar.tools.console import NATIVE, PREAMBLE, LineFilter
from tfpar.tools.cli import train_main

TRAIN = os.path.join(REPO, "scripts", "train.py")
CHATTER = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
    b"I0000 00:00:1796134205.642372    5542 port.cc:153] oneDNN custom operations are on.\n",
    b"I0000 00:00:1796134205.642720    5542 cudart_stub.cc:31] Could not find cuda drivers\n",
    b"E0000 00:00:1796134207.619479    5542 cuda_platform.cc:52] failed call to cuInit: "
    b"INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n",
    b"E0000 00:00:1796134209.702606    5542 util.cc:131] oneDNN supports DT_BOOL only on "
    b"platforms with AVX-512. Falling back to the default Eigen-based implementation.\n",
    b"W0000 00:00:1796134209.702606    5542 some_file.cc:7] a warning\n",
]
KEPT = [
    b"I tfpar.training.run: strategy default\n",
    b"E0000 00:00:1796134209.702606    5542 op_kernel.cc:1830] OP_REQUIRES failed: boom\n",
    b"F0000 00:00:1796134209.702606    5542 check.cc:1] Check failed: x\n",
    b"Traceback (most recent call last):\n",
]


def filtered(chunks):
    out = []
    f = LineFilter(out.append)
    for chunk in chunks:
        f.feed(chunk)
    f.close()
    return b"".join(out)


def test_native_chatter_is_left_out_and_real_errors_are_kept():
    text = b"".join(line for pair in zip(CHATTER, KEPT + KEPT[:2]) for line in pair)
    assert filtered([text]) == b"".join(KEPT + KEPT[:2])


def test_lines_split_across_reads_are_filtered_the_same():
    text = b"".join(CHATTER + KEPT)
    assert filtered([text[i:i + 7] for i in range(0, len(text), 7)]) == b"".join(KEPT)


def test_a_progress_bar_update_is_written_before_its_line_ends():
    out = []
    f = LineFilter(out.append)
    f.feed(b"\r 3/60 ==== 12s")
    assert out == [b"\r 3/60 ==== 12s"]  # not held back waiting for a newline
    f.feed(b"\r 4/60 ==== 11s\n")
    assert b"".join(out) == b"\r 3/60 ==== 12s\r 4/60 ==== 11s\n"


def native_lines(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if NATIVE.match(line.encode()) or line.encode().startswith(PREAMBLE)]


@pytest.mark.parametrize("verbose", [False, True])
def test_train_script_stderr_has_no_native_chatter_unless_verbose(verbose, tiny_corpus_dir,
                                                                  tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    proc = subprocess.run(
        [sys.executable, TRAIN, "--data", str(tiny_corpus_dir), *PINNED, "--embed-dim", "8",
         "--hidden-dim", "8", "--batch-size", "16", "--max-steps", "2", "--no-progress",
         "--no-export", "--model-dir", str(tmp_path / "run"), *(["-v"] if verbose else [])],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "I tfpar.training.run: throughput:" in proc.stderr
    if verbose:
        assert native_lines(proc.stderr)  # TensorFlow does talk: the filter is what hides it
    else:
        assert native_lines(proc.stderr) == []


def test_progress_bar_has_a_total_and_each_epoch_one_line(tiny_args, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # the bar is for a terminal
    args = [a for a in tiny_args if a != "--no-progress"]
    args[args.index("--max-steps") + 1] = "0"
    args[args.index("--epochs") + 1] = "2"
    assert train_main(args + ["--no-export"]) == 0
    captured = capsys.readouterr()
    bar = captured.out  # Keras's bar writes to stdout, the log to stderr
    assert "Unknown" not in bar
    totals = {int(t) for t in re.findall(r"\b\d+/(\d+)\b", bar)}
    assert totals and min(totals) > 1  # every update knows the epoch's batches
    epochs = re.findall(r"epoch (\d)/2: train ppl [\d.]+, valid ppl [\d.]+, [\d,]+ tokens/s, "
                        r"[\dhms.]+", captured.err)
    assert epochs == ["1", "2"]


# ------------------------------------------------------------- a host that should have GPUs
GPU_TROUBLE = [
    b"I0000 00:00:1796134205.642720    5542 cudart_stub.cc:31] Could not find cuda drivers "
    b"on your machine, GPU will not be used.\n",
    b"E0000 00:00:1796134207.619479    5542 cuda_platform.cc:52] failed call to cuInit: "
    b"INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n",
    b"W0000 00:00:1796134207.619479    5542 gpu_device.cc:2344] Cannot dlopen some GPU "
    b"libraries. Please make sure the missing libraries mentioned above are installed "
    b"properly. Skipping registering GPU devices...\n",
]
REGISTRATION_NOISE = (b"E0000 00:00:1796134207.619479    5542 cuda_dnn.cc:8579] Unable to "
                      b"register cuDNN factory: Attempting to register factory for plugin "
                      b"cuDNN when one has already been registered\n")


def test_gpu_driver_and_library_lines_pass_where_gpus_are_expected():
    """Where GPUs are expected the failures that explain a missing GPU pass (the other
    chatter and the factory-registration noise stay out); elsewhere they are noise."""
    chunks = GPU_TROUBLE + [REGISTRATION_NOISE, CHATTER[1], CHATTER[5]] + KEPT
    out = []
    f = LineFilter(out.append, show_gpu=True)
    for chunk in chunks:
        f.feed(chunk)
    f.close()
    assert b"".join(out) == b"".join(GPU_TROUBLE + KEPT)
    assert filtered(chunks) == b"".join(KEPT)


@pytest.mark.parametrize("env,nodes,want", [
    ({}, [], None),
    ({}, ["nvidia0", "nvidiactl"], "/dev/nvidia0"),
    ({}, ["nvidiactl"], None),  # the control node alone: no device
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, [], "CUDA_VISIBLE_DEVICES=0,1"),
    ({"CUDA_VISIBLE_DEVICES": ""}, ["nvidia0"], None),  # hidden on purpose
    ({"CUDA_VISIBLE_DEVICES": "-1"}, ["nvidia0"], None),
])
def test_gpus_are_expected_from_device_nodes_or_cuda_visible_devices(env, nodes, want,
                                                                     tmp_path):
    from tfpar.parallel.host import gpus_expected

    for name in nodes:
        (tmp_path / name).touch()
    got = gpus_expected(env, dev=str(tmp_path))
    assert got == (want.replace("/dev", str(tmp_path)) if want and "/dev" in want else want)


def test_expected_gpus_that_tensorflow_cannot_use_stop_the_run(monkeypatch, capsys, tmp_path):
    """CUDA_VISIBLE_DEVICES names a GPU, TensorFlow has none (this host): one line, exit
    2, nothing written; --cpu-only is the explicit way to train on CPUs anyway."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    model_dir = tmp_path / "run"
    argv = ["--synthetic-sentences", "40,8,8", *PINNED, "--embed-dim", "8", "--hidden-dim", "8",
            "--max-steps", "1", "--no-progress", "--no-export", "--model-dir", str(model_dir)]
    assert train_main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: this host should have GPUs (CUDA_VISIBLE_DEVICES=0) but TensorFlow found "
        "none; its log lines above say what failed (driver, CUDA libraries: pip install "
        "'tfpar[gpu]' brings them); pass --cpu-only to train on CPUs")
    assert not model_dir.exists()
    assert train_main(argv + ["--cpu-only"]) == 0
    assert "--cpu-only: GPUs hidden, training on CPUs" in capsys.readouterr().err
