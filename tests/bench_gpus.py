"""Training tokens/s of ``mirrored`` on one device and on several: the GPU suite's short
measurement (tests/gpu/test_gpu.py; ``make gpu-check`` puts its line in the report).

Weak scaling: every device trains the same rows (``rows_per_device``), so the global
batch grows with the devices, as in the published multi-GPU figures; the speed-up is the
ratio of tokens/s. The contenders and the timing are the benchmark's
(:func:`~tfpar.tools.bench.contenders.build_tfpar`, :func:`~tfpar.tools.bench.measure.interleave`:
interleaved rounds, medians), each with ``steps_per_execution`` steps per call (training's
default on GPUs). A measurement for the report, not a check: nothing here has a target.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from tfpar.tools.bench.contenders import build_tfpar
from tfpar.tools.bench.measure import failing_as, interleave
from tfpar.tools.bench.workload import Setup


def device_scaling(setup: Setup, device_sets: Mapping[str, Sequence[str]], *,
                   rows_per_device: int, steps_per_execution: int) -> dict[str, dict[str, Any]]:
    """Tokens/s of mirrored over each of ``device_sets`` (name -> device names).

    ``setup.spec``'s rounds and steps time every contender (steps: whole calls of
    ``steps_per_execution``); its batch size is replaced by ``rows_per_device`` times the
    devices.

    Returns:
      name -> {"devices": the names, "replicas", "batch_size" (global), "tokens_per_sec",
      "step_seconds", "tokens_per_cpu_sec"} (medians over rounds).

    Raises:
      ContenderFailed: a contender failed to build, trace or step.
    """
    from tfpar.config import DistConfig

    spe = steps_per_execution
    spec = dataclasses.replace(setup.spec, steps=max(spe, setup.spec.steps // spe * spe))
    contenders, shapes = [], {}
    for name, devices in device_sets.items():
        rows = rows_per_device * len(devices)
        mine = dataclasses.replace(setup, spec=dataclasses.replace(spec, batch_size=rows))
        with failing_as(name):
            contender, plugin = build_tfpar(
                mine, name, DistConfig(strategy="mirrored", devices=tuple(devices)),
                steps_per_execution=spe)
            contender.warm_up(max(spe, spec.warmup))  # traces the call of `spe` steps
        contenders.append(contender)
        shapes[name] = {"devices": list(plugin.devices), "replicas": plugin.num_replicas,
                        "batch_size": rows}
    rates = interleave(contenders, spec)
    return {name: {**shapes[name], **rates[name]} for name in device_sets}


def format_line(results: Mapping[str, Mapping[str, Any]], *, unit: str = "GPU") -> str:
    """``tokens/s (mirrored, 64 rows per GPU, weak scaling): 1 GPU 41,200; 4 GPUs
    150,300 (3.65x)``: the first entry of ``results`` is the base of the speed-up."""
    first, *rest = results.values()
    per = first["batch_size"] // first["replicas"]

    def rate(r):
        return f"{r['replicas']} {unit}{'s' if r['replicas'] > 1 else ''} {r['tokens_per_sec']:,.0f}"

    parts = [rate(first)] + [f"{rate(r)} ({r['tokens_per_sec'] / first['tokens_per_sec']:.2f}x)"
                             for r in rest]
    return f"tokens/s (mirrored, {per} rows per {unit}, weak scaling): {'; '.join(parts)}"
