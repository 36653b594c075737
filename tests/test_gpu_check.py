"""``make gpu-check`` tells the truth (tests/gpu/check.py, issue 42's failure 1): it runs the
GPU suite where TensorFlow sees a GPU, fails with one line naming what is missing where an
NVIDIA GPU is expected (tfpar.parallel.host.gpus_expected) and TensorFlow sees none, and
skips with one line only where there is no NVIDIA GPU. The device check and what
TensorFlow sees are patched; this host has neither."""

import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys

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


TWO_GPUS = {**NO_GPU, "gpus": 2, "keras": "3.15.1", "cuda_version": "12.5.1",
            "cudnn_version": "9", "devices": [["NVIDIA A100-SXM4-80GB", "8.0"]] * 2}


@pytest.mark.parametrize("expected", ["/dev/nvidia0", None])
def test_where_tensorflow_sees_a_gpu_the_suite_runs_and_decides(expected, monkeypatch, capsys):
    """The suite's exit status is gpu-check's; its report follows the suite's output,
    built from the suite's JUnit XML (here none was written: pytest stopped early)."""
    ran = []
    monkeypatch.setattr(check, "gpus_expected", lambda: expected)
    monkeypatch.setattr(check, "probe_tensorflow", lambda: TWO_GPUS)
    monkeypatch.setattr(check, "run_suite", lambda argv, junit: ran.append(argv) or 3)
    monkeypatch.setattr(check, "driver_version", lambda: "550.54.15")
    monkeypatch.setattr(check, "driver_cuda_version", lambda: "12.4")
    assert check.main(["-k", "mirrored"]) == 3
    out, err = capsys.readouterr()
    assert ran == [["-k", "mirrored"]] and err == ""
    lines = out.splitlines()
    assert lines[0] == "------------------------ gpu-check report ------------------------"
    assert lines[4] == "suite: no results (pytest exited 3 before writing them)"
    assert lines[5:] == ["tokens/s: not measured", "strategy mirrored: not logged",
                         "resume: not checked", "-" * 66]


# A suite of three tests as the GPU suite's are written: one records each figure.
FAKE_SUITE = """
import pytest

def test_measures(record_testsuite_property):
    record_testsuite_property("tokens_per_sec", "tokens/s (mirrored, 64 rows per GPU, weak "
                              "scaling): 1 GPU 41,200; 2 GPUs 80,300 (1.95x)")

def test_logs(record_testsuite_property):
    record_testsuite_property("all_reduce", "strategy mirrored: 2 replica(s) on "
                              "/device:GPU:0, /device:GPU:1; all-reduce NcclAllReduce")
    assert False, "a failure after the record"

@pytest.mark.parametrize("n", [1, 2])
def test_skips(n):
    pytest.skip("needs 4 GPUs")
"""


def test_the_report_reads_the_suites_junit_xml(tmp_path, monkeypatch):
    """A real pytest run writes the XML the report is built from: its counts, the failed
    test, the figures recorded (a missing one says so), the host and versions."""
    (tmp_path / "test_fake.py").write_text(FAKE_SUITE)
    junit = str(tmp_path / "results.xml")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", "test_fake.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout
    results = check.read_junit(junit)
    assert (results.passed, results.failed, results.errors, results.skipped) == (1, 1, 0, 2)
    report = check.format_report(TWO_GPUS, results, 1, driver="550.54.15", driver_cuda="12.4",
                                 tfpar="0.1.0 (commit 7fe0cd4abc)")
    python = platform.python_version()
    assert report.splitlines() == [
        "------------------------ gpu-check report ------------------------",
        "host: 2 GPU(s): 2x NVIDIA A100-SXM4-80GB (compute 8.0)",
        "driver: 550.54.15 (runs CUDA up to 12.4); TensorFlow built for CUDA 12.5.1, cuDNN 9",
        f"versions: TensorFlow 2.21.0, Keras 3.15.1, tfpar 0.1.0 (commit 7fe0cd4abc), "
        f"Python {python}",
        "suite: 1 passed, 1 failed, 0 errors, 2 skipped (exit 1)",
        "failed: test_fake::test_logs",
        "tokens/s (mirrored, 64 rows per GPU, weak scaling): 1 GPU 41,200; 2 GPUs 80,300 "
        "(1.95x)",
        "strategy mirrored: 2 replica(s) on /device:GPU:0, /device:GPU:1; all-reduce "
        "NcclAllReduce",
        "resume: not checked",
        "-" * 66,
    ]
    assert check.read_junit(str(tmp_path / "none.xml")) is None


def test_the_probe_reports_what_the_report_needs():
    """TensorFlow asked in a child on this host (no GPU): the build's CUDA and cuDNN,
    TensorFlow's and Keras' versions (this process's), no devices."""
    import keras
    import tensorflow as tf

    seen = check.probe_tensorflow()
    build = tf.sysconfig.get_build_info()
    assert seen == {"gpus": 0, "cuda": tf.test.is_built_with_cuda(), "version": tf.__version__,
                    "keras": keras.__version__, "cuda_version": build.get("cuda_version"),
                    "cudnn_version": build.get("cudnn_version"), "devices": []}
    assert check.driver_version() == "unknown (no nvidia-smi)" or shutil.which("nvidia-smi")
    assert check.tfpar_version().startswith("0.")


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
