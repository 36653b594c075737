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


def test_progress_bar_has_a_total_and_each_epoch_one_line(tiny_args, capsys):
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
