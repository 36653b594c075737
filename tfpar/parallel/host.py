"""What the host has, read without TensorFlow (standard library only).

The console filter (:mod:`tfpar.tools.console`) must decide before TensorFlow is imported
whether GPU library and driver lines are news (this host should have GPUs) or noise (it
has none), and :func:`tfpar.parallel.devices.configure_gpus` turns "should have GPUs but
TensorFlow found none" into an error; both ask :func:`gpus_expected`.
"""

from __future__ import annotations

import glob
import os
from typing import Mapping


def gpus_expected(env: Mapping[str, str] | None = None, dev: str = "/dev") -> str | None:
    """Why this process should see NVIDIA GPUs, or None when it should not.

    ``CUDA_VISIBLE_DEVICES`` decides when set: a device list says GPUs are wanted ("" or
    "-1" hides them all); unset, an NVIDIA device node (``/dev/nvidia0``...) says the
    host has them.

    Returns:
      The evidence, e.g. ``"CUDA_VISIBLE_DEVICES=0,1"`` or ``"/dev/nvidia0"``, or None.
    """
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        visible = visible.strip()
        return f"CUDA_VISIBLE_DEVICES={visible}" if visible and visible != "-1" else None
    nodes = sorted(glob.glob(os.path.join(dev, "nvidia[0-9]*")))
    return nodes[0] if nodes else None
