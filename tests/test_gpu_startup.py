"""The GPU suite's start-up, run by ``make test`` on a host without a GPU (issue 42, item 2).

The GPU suite (tests/gpu, ``make gpu-check``) runs only where there are GPUs, and its
conftest (tests/conftest.py with TFPAR_GPU_TESTS=1) starts TensorFlow before its first
``train_main``: a start-up failure such as issue 42's number 2 (memory growth set after the
runtime started, a RuntimeError) would stop the whole suite on its first GPU host, having
passed CI everywhere else. So here the suite is started in a child pytest as
tests/gpu/check.py starts it (TFPAR_GPU_TESTS=1, ``-s``) with tests/gpu/fake_gpu.py loaded
first: TensorFlow reports one GPU, its memory-growth calls keep TensorFlow's rules, the work
runs on the CPU. ``-k`` selects the suite's first test, a two-step mirrored ``train_main``;
the conftest, the import of every module of tests/gpu and that run are real, the GPU is not.
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = os.path.join(REPO, "tests", "gpu")
FIRST_RUN = "test_a_two_step_run_starts_after_the_suite_started_tensorflow"


def start_gpu_suite(basetemp, plugins=("fake_gpu",), plugin_path=()):
    """The GPU suite's first run in a child pytest with ``plugins`` loaded before its
    conftest (from tests/gpu and ``plugin_path``); the finished process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(TFPAR_GPU_TESTS="1", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([SUITE, *plugin_path,
                                           *filter(None, [env.get("PYTHONPATH")])]))
    loads = [arg for name in plugins for arg in ("-p", name)]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *loads,
         "--basetemp", str(basetemp), SUITE, "-k", FIRST_RUN],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_the_gpu_suite_starts_and_trains_after_its_conftest_started_tensorflow(tmp_path):
    """The suite sees the (fake) GPU, its conftest has started TensorFlow when the first run
    asks for memory growth (refused, as TensorFlow refuses it), the run says so in one
    warning, trains its two steps on "the GPU" and passes. With configure_gpus' old loop
    patched back in (failure 2), the RuntimeError ends the run and this test fails."""
    proc = start_gpu_suite(tmp_path / "child")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "1 passed" in proc.stdout
    assert "gpu-check: 1 GPU(s): /device:GPU:0" in proc.stdout  # test_gpu.py imported whole
    # The start-up order that made failure 2: growth asked for after the runtime started.
    assert ("fake-gpu: memory growth requests: /physical_device:GPU:0 True -> RuntimeError; "
            "growth now None") in proc.stdout
    assert proc.stderr.count("GPU memory growth not set: TensorFlow had started") == 1
    assert "using 1 GPU(s): /device:GPU:0 (1 replica(s))" in proc.stderr
