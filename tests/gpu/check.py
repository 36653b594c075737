"""``make gpu-check``: run the GPU suite where there are GPUs; fail where there should be.

    TensorFlow sees a GPU?   NVIDIA GPU expected?                 gpu-check
    yes                      (either)                             runs tests/gpu: its exit status
    no                       yes (tfpar.parallel.host's           one line naming what is missing,
                             gpus_expected, as training asks)     exit status 1
    no                       no                                   one line, skipped, 0

What is missing is asked in the order a GPU run needs it: a TensorFlow built with CUDA,
the CUDA and cuDNN libraries of TensorFlow's ``and-cuda`` extra (tfpar's ``gpu`` extra;
the Makefile installs it where an NVIDIA GPU is expected), the driver's ``libcuda.so.1``.
TensorFlow is asked in a child process whose stderr is dropped: its start-up lines are
many and some ignore ``TF_CPP_MIN_LOG_LEVEL``; the one line says which of them matters.
``main(argv)`` is called in-process by tests/test_gpu_check.py.

Where the suite runs, it ends with one block a person can paste into an issue
(:func:`format_report`): the host (GPUs, driver, the CUDA and cuDNN TensorFlow was built
with), the versions, the suite's counts and the figures its tests recorded with pytest's
``record_testsuite_property`` (tokens/s on 1 and every GPU, the all-reduce line, the
kill-and-resume result), read back from the suite's JUnit XML.
"""

from __future__ import annotations

import collections
import ctypes
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree

from tfpar.parallel.host import gpus_expected

SUITE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(SUITE))
# What TensorFlow sees and was built with; the GPUs' names and compute capabilities are
# asked only where there are GPUs (get_device_details starts them).
PROBE = """
import json, keras, tensorflow as tf
gpus = tf.config.list_physical_devices("GPU")
details = [tf.config.experimental.get_device_details(g) for g in gpus]
build = tf.sysconfig.get_build_info()
print(json.dumps(dict(
    gpus=len(gpus), cuda=tf.test.is_built_with_cuda(), version=tf.__version__,
    keras=keras.__version__, cuda_version=build.get("cuda_version"),
    cudnn_version=build.get("cudnn_version"),
    devices=[[d.get("device_name", g.name), ".".join(map(str, d.get("compute_capability") or ()))]
             for g, d in zip(gpus, details)])))
"""


def probe_tensorflow() -> dict:
    """From a child: ``{"gpus": physical GPUs, "cuda": built with CUDA, "version":
    TensorFlow's, "keras": Keras', "cuda_version", "cudnn_version": what TensorFlow was
    built with, "devices": [[name, compute capability], ...] per GPU}``."""
    child = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                           env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=600)
    if child.returncode:
        last = (child.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"gpu-check: failed, TensorFlow does not start: {last}")
    return json.loads(child.stdout.strip().splitlines()[-1])


def missing_cuda_packages() -> list[str]:
    """The distributions of TensorFlow's ``and-cuda`` extra that are not installed."""
    from importlib import metadata

    missing = []
    for requirement in metadata.requires("tensorflow") or []:
        name, _, marker = requirement.partition(";")
        if not re.search(r"""extra\s*==\s*["']and-cuda["']""", marker):
            continue
        dist = re.match(r"[A-Za-z0-9._-]+", name.strip()).group(0)
        try:
            metadata.version(dist)
        except metadata.PackageNotFoundError:
            missing.append(dist)
    return missing


def driver_loads() -> bool:
    """Whether the NVIDIA driver's user-space library (what TensorFlow opens) loads."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def what_is_missing(tf_seen: dict) -> str:
    """Why TensorFlow sees no GPU on a host that has one: the first missing piece."""
    if not tf_seen["cuda"]:
        return (f"TensorFlow {tf_seen['version']} is built without CUDA; "
                "pip install -e '.[gpu]' installs the build that has it")
    missing = missing_cuda_packages()
    if missing:
        named = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more"
                                          if len(missing) > 3 else "")
        return f"the gpu extra is not installed ({named} missing); pip install -e '.[gpu]'"
    if not driver_loads():
        return ("the NVIDIA driver's libcuda.so.1 does not load; install the driver or put "
                "its folder on LD_LIBRARY_PATH")
    return ("its CUDA libraries and the driver load, yet it found no GPU; rerun "
            "with TF_CPP_MIN_LOG_LEVEL=0 to read TensorFlow's reason")


def run_suite(argv: list[str], junit: str) -> int:
    """The GPU suite (tests/gpu) in a fresh process, its results written to the JUnit XML
    file ``junit``; its exit status."""
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-s", "-p",
                            "no:cacheprovider", f"--junitxml={junit}", SUITE, *argv], cwd=REPO,
                           env={**os.environ, "TFPAR_GPU_TESTS": "1"})


# ------------------------------------------------------------------------- the report
Results = collections.namedtuple("Results", "passed failed errors skipped failing properties")


def read_junit(path: str) -> Results | None:
    """The suite's counts, the tests that failed or errored (``file::name``), and the
    properties its tests recorded (``record_testsuite_property``); None when pytest
    wrote no results (it stopped before collecting)."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    count = collections.Counter()
    failing, properties = [], {}
    for suite in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            count[key] += int(suite.get(key, 0))
        for prop in suite.iter("property"):
            properties[prop.get("name")] = prop.get("value")
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                where = case.get("classname", "").rsplit(".", 1)[-1]
                failing.append(f"{where}::{case.get('name')}")
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    return Results(passed, count["failures"], count["errors"], count["skipped"], failing,
                   properties)


def driver_version() -> str:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it (TensorFlow does not)."""
    if shutil.which("nvidia-smi") is None:
        return "unknown (no nvidia-smi)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    return out[0] if out else "unknown (nvidia-smi answered nothing)"


def driver_cuda_version() -> str | None:
    """The newest CUDA the driver runs (``cuDriverGetVersion``: 12040 is 12.4); TensorFlow
    built for a newer CUDA than this sees no GPU. None where the driver does not load."""
    try:
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)):
            return None
    except (OSError, AttributeError):
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"


def tfpar_version() -> str:
    """tfpar's installed version and, in a clone, the commit (``+`` when changed)."""
    from importlib import metadata

    try:
        version = metadata.version("tfpar")
    except metadata.PackageNotFoundError:
        version = "not installed"
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty=+", "--abbrev=10"],
                                cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return version
    return f"{version} (commit {commit.stdout.strip()})" if commit.returncode == 0 else version


# The lines the suite's tests record (property name, the line when no test recorded it:
# deselected, or failed before it got there).
FIGURES = (("tokens_per_sec", "tokens/s: not measured"),
           ("all_reduce", "strategy mirrored: not logged"),
           ("resume", "resume: not checked"))
RULE = "-" * 24


def format_report(tf_seen: dict, results: Results | None, status: int, *, driver: str,
                  driver_cuda: str | None, tfpar: str) -> str:
    """The block ``make gpu-check`` ends with, one fact a line, to paste into an issue."""
    gpus = collections.Counter(f"{name} (compute {cc or '?'})" for name, cc in tf_seen["devices"])
    host = ", ".join(f"{n}x {name}" if n > 1 else name for name, n in gpus.items())
    lines = [f"{RULE} gpu-check report {RULE}",
             f"host: {tf_seen['gpus']} GPU(s): {host}",
             f"driver: {driver}" + (f" (runs CUDA up to {driver_cuda})" if driver_cuda else "")
             + f"; TensorFlow built for CUDA {tf_seen['cuda_version']}, cuDNN "
             f"{tf_seen['cudnn_version']}",
             f"versions: TensorFlow {tf_seen['version']}, Keras {tf_seen['keras']}, tfpar "
             f"{tfpar}, Python {platform.python_version()}"]
    if results is None:
        lines.append(f"suite: no results (pytest exited {status} before writing them)")
    else:
        lines.append(f"suite: {results.passed} passed, {results.failed} failed, "
                     f"{results.errors} errors, {results.skipped} skipped (exit {status})")
        if results.failing:
            lines.append(f"failed: {', '.join(results.failing)}")
    recorded = results.properties if results else {}
    lines += [recorded.get(name) or missing for name, missing in FIGURES]
    lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``argv``: extra pytest arguments for the suite. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    tf_seen = probe_tensorflow()
    if tf_seen["gpus"]:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
            junit = os.path.join(tmp, "results.xml")
            status = run_suite(argv, junit)
            results = read_junit(junit)
        print(format_report(tf_seen, results, status, driver=driver_version(),
                            driver_cuda=driver_cuda_version(), tfpar=tfpar_version()))
        return status
    evidence = gpus_expected()
    if evidence:
        print(f"gpu-check: failed, this host has an NVIDIA GPU ({evidence}) but TensorFlow "
              f"sees none: {what_is_missing(tf_seen)}", file=sys.stderr)
        return 1
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    why = ("no NVIDIA device (/dev/nvidia*)" if hidden is None
           else f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU")
    print(f"gpu-check: skipped, {why} and TensorFlow sees no GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
