"""``make gpu-check`` tells the truth (tests/gpu/check.py, issue 42's failure 1): it runs the
GPU suite where TensorFlow sees a GPU, fails with one line naming what is missing where an
NVIDIA GPU is expected (tfpar.parallel.host.gpus_expected) and TensorFlow sees none, and
skips with one line only where there is no NVIDIA GPU. The device check and what
TensorFlow sees are patched; this host has neither."""

import importlib.util
import os
import re
import shutil
import subprocess

import pytest

from conftest import REPO

SPEC = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "tests", "gpu",
                                                                          "check.py"))
check = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(check)

NO_GPU = {"gpus": 0, "cuda": True, "version": "2.21.0"}
FAILED = ("gpu-check: failed, this host has an NVIDIA GPU (/dev/nvidia0) but TensorFlow sees "
          "none: ")


@pytest.mark.parametrize("cuda,missing,driver,reason", [
    (False, [], True, "TensorFlow 2.21.0 is built without CUDA; pip install -e '.[gpu]' "
     "installs the build that has it"),
    (True, ["nvidia-cudnn-cu12"], True, "the gpu extra is not installed (nvidia-cudnn-cu12 "
     "missing); pip install -e '.[gpu]'"),
    (True, ["a", "b", "c", "d", "e"], True, "the gpu extra is not installed (a, b, c and 2 more "
     "missing); pip install -e '.[gpu]'"),
    (True, [], False, "the NVIDIA driver's libcuda.so.1 does not load; install the driver or "
     "put its folder on LD_LIBRARY_PATH"),
    (True, [], True, "its CUDA libraries and the driver load, yet it found no GPU; rerun with "
     "TF_CPP_MIN_LOG_LEVEL=0 to read TensorFlow's reason"),
])
def test_an_nvidia_host_where_tensorflow_sees_no_gpu_fails_with_one_line(
        cuda, missing, driver, reason, monkeypatch, capsys):
    monkeypatch.setattr(check, "gpus_expected", lambda: "/dev/nvidia0")
    monkeypatch.setattr(check, "probe_tensorflow", lambda: {**NO_GPU, "cuda": cuda})
    monkeypatch.setattr(check, "missing_cuda_packages", lambda: missing)
    monkeypatch.setattr(check, "driver_loads", lambda: driver)
    monkeypatch.setattr(check, "run_suite", lambda argv: pytest.fail("the suite ran"))
    assert check.main([]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", FAILED + reason + "\n")


@pytest.mark.parametrize("hidden,why", [
    (None, "no NVIDIA device (/dev/nvidia*)"),
    ("", "CUDA_VISIBLE_DEVICES='' hides every GPU"),
])
def test_a_host_without_an_nvidia_gpu_skips_with_one_line(hidden, why, monkeypatch, capsys):
    monkeypatch.setattr(check, "gpus_expected", lambda: None)
    monkeypatch.setattr(check, "probe_tensorflow", lambda: NO_GPU)
    monkeypatch.setattr(check, "run_suite", lambda argv: pytest.fail("the suite ran"))
    if hidden is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    assert check.main([]) == 0
    assert capsys.readouterr() == (f"gpu-check: skipped, {why} and TensorFlow sees no GPU\n", "")


@pytest.mark.parametrize("expected", ["/dev/nvidia0", None])
def test_where_tensorflow_sees_a_gpu_the_suite_runs_and_decides(expected, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(check, "gpus_expected", lambda: expected)
    monkeypatch.setattr(check, "probe_tensorflow", lambda: {**NO_GPU, "gpus": 2})
    monkeypatch.setattr(check, "run_suite", lambda argv: ran.append(argv) or 3)
    assert check.main(["-k", "mirrored"]) == 3
    assert ran == [["-k", "mirrored"]] and capsys.readouterr() == ("", "")


def test_the_and_cuda_packages_are_read_from_tensorflows_metadata():
    """This venv has no gpu extra: every package of TensorFlow's and-cuda extra is missing."""
    missing = check.missing_cuda_packages()
    assert "nvidia-cudnn-cu12" in missing and all(m.startswith("nvidia-") for m in missing)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("visible,status,line", [
    # CUDA_VISIBLE_DEVICES naming a device is gpus_expected's evidence of an NVIDIA GPU;
    # TensorFlow here sees none (no GPU, no CUDA libraries in this venv).
    ("0", 1, "gpu-check: failed, this host has an NVIDIA GPU (CUDA_VISIBLE_DEVICES=0) but "
     "TensorFlow sees none: "),
    ("", 0, "gpu-check: skipped, CUDA_VISIBLE_DEVICES='' hides every GPU and TensorFlow sees "
     "no GPU"),
])
def test_make_gpu_check_exits_with_the_truth_in_one_line(visible, status, line, tmp_path):
    """The Makefile's recipe as a user runs it. Its installs are stamped done (tmp files)
    and pip may not download (PIP_NO_INDEX), so nothing is installed; make's own
    'make: *** ... Error 1' line is make's, not the check's."""
    import sys

    for stamp in ("installed", "installed-gpu"):
        (tmp_path / stamp).touch()
    proc = subprocess.run(
        ["make", "-s", "gpu-check", f"PY={sys.executable}", f"STAMP={tmp_path / 'installed'}",
         f"GPU_STAMP={tmp_path / 'installed-gpu'}"], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": visible, "PIP_NO_INDEX": "1"}, timeout=300)
    # make's own "make: *** ..." line ("make[1]: ..." when the suite itself runs under make,
    # as `make test` does) is make's, not the check's.
    lines = [x for x in (proc.stdout + proc.stderr).splitlines()
             if not re.match(r"make(\[\d+\])?: ", x)]
    assert proc.returncode == (2 if status else 0), proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith(line), lines
