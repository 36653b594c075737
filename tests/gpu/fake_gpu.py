"""A pytest plugin that makes TensorFlow report one GPU on a host without one.

``make test`` runs the GPU suite's start-up with it (tests/test_gpu_startup.py):
``python -m pytest -p fake_gpu tests/gpu -k <its first run>``, this folder on PYTHONPATH
so that ``-p`` imports it before pytest imports tests/conftest.py. Loaded that early, the
patches below are in place before anything asks TensorFlow about devices:

- ``tf.config.list_physical_devices`` / ``list_logical_devices`` report one GPU,
  ``GPU:0``, beside the real CPU devices (what tfpar's configure_gpus and num_gpus, the
  conftest's ``host_has_gpus`` and the suite's ``GPUS`` ask);
- ``tf.config.experimental.set_memory_growth`` / ``get_memory_growth`` keep the rules
  of TensorFlow's own (``context.Context.set_memory_growth``): an unknown device is a
  ValueError, the value it already has is accepted, and any change once the runtime has
  started is ``RuntimeError: Physical devices cannot be modified after being
  initialized``, the start-up failure of issue 42 (number 2). Every request is recorded
  and printed at the end of the session (``fake-gpu: memory growth ...``);
- the work stays on the CPU: TensorFlow's soft placement runs ops placed on the missing
  ``/device:GPU:0`` on ``/cpu:0``, and ``tfpar.model.layers.runs_on_gpu`` answers False,
  so the layers take the fast recurrence (``CudnnRNNV3`` has GPU kernels only; the
  suite's own tokens/s test patches it the same way).

What it cannot show is anything a GPU computes: only the order of the start-up (conftest,
imports, the first ``train_main``) and the decisions a GPU count drives are real here.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.eager import context

from tfpar.model import layers

GPU = tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")
LOGICAL_GPU = tf.config.LogicalDevice("/device:GPU:0", "GPU")
# (device name, value asked for, "set" | "unchanged" | the exception's type name)
GROWTH_REQUESTS: list[tuple[str, bool, str]] = []
_growth: dict[str, bool] = {}
_real_physical = tf.config.list_physical_devices
_real_logical = tf.config.list_logical_devices


def runtime_started() -> bool:
    """Whether TensorFlow's runtime has started (after which physical devices are fixed).

    TensorFlow's own test, private: the eager context's handle exists once the runtime
    is up. Read here and nowhere else; if the name moves this raises AttributeError and
    the start-up test fails loudly instead of faking a runtime that never starts.
    """
    return context.context()._context_handle is not None


def list_physical_devices(device_type=None):
    real = _real_physical(device_type)
    return [GPU] if device_type == "GPU" else real + ([GPU] if device_type is None else [])


def list_logical_devices(device_type=None):
    real = _real_logical(device_type)
    return ([LOGICAL_GPU] if device_type == "GPU"
            else real + ([LOGICAL_GPU] if device_type is None else []))


def set_memory_growth(device, enable):
    if device != GPU:
        GROWTH_REQUESTS.append((getattr(device, "name", repr(device)), enable, "ValueError"))
        raise ValueError(f"Unrecognized device: {device!r}")
    if _growth.get(device.name) == enable:
        GROWTH_REQUESTS.append((device.name, enable, "unchanged"))
        return
    if runtime_started():
        GROWTH_REQUESTS.append((device.name, enable, "RuntimeError"))
        raise RuntimeError("Physical devices cannot be modified after being initialized")
    _growth[device.name] = enable
    GROWTH_REQUESTS.append((device.name, enable, "set"))


def get_memory_growth(device):
    if device != GPU:
        raise ValueError(f"Unrecognized device: {device!r}")
    return _growth.get(device.name)


tf.config.list_physical_devices = list_physical_devices
tf.config.list_logical_devices = list_logical_devices
tf.config.experimental.set_memory_growth = set_memory_growth
tf.config.experimental.get_memory_growth = get_memory_growth
layers.runs_on_gpu = lambda probe: False


def pytest_report_header(config):
    return "fake-gpu: TensorFlow reports /physical_device:GPU:0 (no such device; work on CPU)"


def pytest_unconfigure(config):
    requests = "; ".join(f"{name} {enable} -> {outcome}"
                         for name, enable, outcome in GROWTH_REQUESTS) or "none"
    print(f"\nfake-gpu: memory growth requests: {requests}; growth now "
          f"{get_memory_growth(GPU)}", flush=True)
