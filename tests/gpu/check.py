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
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys

from tfpar.parallel.host import gpus_expected

SUITE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(SUITE))
PROBE = ("import json, tensorflow as tf; print(json.dumps(dict("
         "gpus=len(tf.config.list_physical_devices('GPU')), "
         "cuda=tf.test.is_built_with_cuda(), version=tf.__version__)))")


def probe_tensorflow() -> dict:
    """``{"gpus": physical GPUs, "cuda": built with CUDA, "version": ...}`` from a child."""
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


def run_suite(argv: list[str]) -> int:
    """The GPU suite (tests/gpu) in a fresh process; its exit status."""
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-s", "-p",
                            "no:cacheprovider", SUITE, *argv], cwd=REPO,
                           env={**os.environ, "TFPAR_GPU_TESTS": "1"})


def main(argv: list[str] | None = None) -> int:
    """``argv``: extra pytest arguments for the suite. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    tf_seen = probe_tensorflow()
    if tf_seen["gpus"]:
        return run_suite(argv)
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
