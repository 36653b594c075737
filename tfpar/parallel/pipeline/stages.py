"""The ``--stages`` language: which device each part of the model goes on, and its stages.

The model's parts are ``embedding``, ``rnn_0`` … ``rnn_{L-1}`` and ``softmax``
(``tfpar.model.lm``); ``--stages`` puts each on a device (``rnn`` means every RNN layer),
e.g. ``embedding=/cpu:0,rnn=/cpu:1,softmax=/cpu:1``, and every run of consecutive parts on
one device is a *stage*. A part's weights live on its stage's device, and so do its
forward ops and their gradient ops (the plug-in, :mod:`tfpar.parallel.pipeline.plugin`).
Without ``--stages`` a default rule splits the parts over the devices (:class:`Placement`);
:func:`even_stages` writes an even ``--stages`` for a model's depth.
"""

from __future__ import annotations

import dataclasses
import re

from tfpar.parallel import devices as devices_lib
from tfpar.config import DistConfig
from tfpar.errors import ConfigError
from tfpar.model.lm import EMBEDDING, SOFTMAX, rnn_name

RNN = "rnn"  # In --stages: every RNN layer.
RNN_PART = re.compile(r"^rnn_(\d+)$")
_CPU_DEVICE = re.compile(r"^/?(?:device:)?cpu:(\d+)$", re.IGNORECASE)
_PART_HELP = f"{EMBEDDING}, {RNN} (every RNN layer), rnn_0 ... rnn_{{L-1}}, {SOFTMAX}"


def model_parts(layers: int) -> list[str]:
    """The parts of an ``layers``-layer model, in the order the data flows through them."""
    return [EMBEDDING] + [rnn_name(i) for i in range(layers)] + [SOFTMAX]


def _is_part(name: str) -> bool:
    return name in (EMBEDDING, SOFTMAX, RNN) or bool(RNN_PART.match(name))


def parse_stages(text: str) -> dict[str, str]:
    """``"embedding=/cpu:0,rnn=/cpu:1,softmax=/cpu:1"`` → {part: device as written}.

    Raises:
      ConfigError: an item is not PART=DEVICE, names an unknown part, or assigns a part
        twice (``rnn`` counts as every ``rnn_i``).
    """
    spec: dict[str, str] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        part, sep, device = (s.strip() for s in item.partition("="))
        if not sep or not part or not device:
            raise ConfigError(f"cannot parse --stages item {item!r}; expected PART=DEVICE, "
                              f"e.g. {EMBEDDING}=/cpu:0")
        part = part.lower()
        if not _is_part(part):
            raise ConfigError(f"unknown part {part!r} in --stages; the model's parts are "
                              f"{_PART_HELP}")
        twice = part in spec or (part == RNN and any(RNN_PART.match(p) for p in spec)) or \
            (RNN_PART.match(part) and RNN in spec)
        if twice:
            raise ConfigError(f"--stages assigns {part!r} twice ({RNN!r} means every RNN "
                              f"layer); give each part one device")
        spec[part] = device
    if not spec:
        raise ConfigError(f"--stages {text!r} assigns no part; e.g. {EMBEDDING}=/cpu:0,"
                          f"{RNN}=/cpu:1,{SOFTMAX}=/cpu:1")
    return spec


@dataclasses.dataclass(frozen=True)
class Stage:
    """Consecutive parts of the model on one device."""

    index: int
    device: str
    parts: tuple[str, ...]

    @property
    def scope(self) -> str:
        return f"stage_{self.index}"


class Placement:
    """Which device each part of the model goes on.

    Either explicit (``--stages``) or the default rule, which needs no layer count (the
    variables are placed while Keras builds the model, before its depth is known here):

    * accelerators present: the embedding on the host CPU (a large, memory-bound lookup:
      the heterogeneous placement of the guide), ``rnn_i`` on accelerator min(i, n-1) and
      the softmax on the last one: with one GPU everything but the embedding is on it.
      A tied embedding (``tied``) is the softmax's matrix too: it goes on the softmax's
      accelerator, so the last stage never reads the [V, E] table across PCIe;
    * CPU only, n (logical) devices: the embedding and ``rnn_i`` on device min(i, n-1),
      the softmax on the last, so 2 devices hold {embedding, rnn_0} | {rnn_1.., softmax}.

    A deep model on few devices is not balanced by this rule; ``--stages`` is.
    """

    def __init__(self, spec: dict[str, str] | None = None, *, compute: list[str] = (),
                 host: str = "", tied: bool = False):
        self.spec = spec
        self.compute = list(compute)
        self.host = host
        self.tied = tied

    def device_of(self, part: str) -> str | None:
        """The device of ``part`` (None: ``--stages`` leaves it unassigned)."""
        m = RNN_PART.match(part)
        if self.spec is not None:
            return self.spec.get(part) or (self.spec.get(RNN) if m else None)
        last = len(self.compute) - 1
        if part == EMBEDDING:
            if self.tied and self.host:
                return self.compute[last]
            return self.host or self.compute[0]
        if part == SOFTMAX:
            return self.compute[last]
        return self.compute[min(int(m.group(1)), last)] if m else None

    def stages(self, layers: int) -> list[Stage]:
        """The stages of a ``layers``-layer model.

        Raises:
          ConfigError: ``--stages`` names an RNN layer the model does not have, or leaves
            a part without a device.
        """
        parts = model_parts(layers)
        if self.spec is not None:
            extra = [p for p in self.spec if p != RNN and p not in parts]
            if extra:
                raise ConfigError(
                    f"unknown part {extra[0]!r} in --stages: this model has {layers} RNN "
                    f"layer(s), rnn_0 ... rnn_{layers - 1}")
            missing = [p for p in parts if self.device_of(p) is None]
            if missing:
                raise ConfigError(
                    f"--stages leaves {', '.join(missing)} unassigned; give every part a "
                    f"device ({_PART_HELP})")
        out: list[Stage] = []
        for part in parts:
            device = self.device_of(part)
            if out and out[-1].device == device:
                out[-1] = dataclasses.replace(out[-1], parts=out[-1].parts + (part,))
            else:
                out.append(Stage(len(out), device, (part,)))
        return out

    def describe(self) -> str:
        if self.spec is not None:
            return ", ".join(f"{p}={d}" for p, d in self.spec.items())
        host = f"{EMBEDDING} on {self.device_of(EMBEDDING)}, " if self.host else ""
        return f"{host}default split over {', '.join(self.compute)}"


def placement_from_config(dist: DistConfig, *, tied: bool = False) -> Placement:
    """``--stages``, or the default rule over ``--devices``, the GPUs or logical CPUs;
    ``tied``: the model's embedding is its softmax's matrix too (the default rule keeps
    it with the softmax).

    Raises:
      ConfigError: a bad ``--stages`` (see :func:`parse_stages`), or both ``--stages``
        and ``--devices``.
      DeviceError: a device that does not exist on this host.
    """
    if dist.stages.strip():
        if dist.devices:
            raise ConfigError(f"--devices {','.join(dist.devices)} and --stages both place "
                              f"the pipeline; give only --stages")
        spec = parse_stages(dist.stages)
        # One check per device, however it is spelled ("/cpu:1", "CPU:1").
        named = {devices_lib.canonical(d).lower(): d for d in spec.values()}
        resolved = dict(zip(named, devices_lib.resolve_devices(tuple(named.values()))))
        return Placement({part: resolved[devices_lib.canonical(d).lower()]
                          for part, d in spec.items()}, tied=tied)
    if dist.devices:
        compute = devices_lib.resolve_devices(dist.devices)
    elif devices_lib.num_gpus():
        compute = devices_lib.default_devices(devices_lib.num_gpus())
    else:
        compute = devices_lib.default_devices(dist.cpu_devices or 2)
    host = "/device:CPU:0" if all("GPU" in d.upper() for d in compute) else ""
    return Placement(compute=compute, host=host, tied=tied)


def even_stages(layers: int, devices: list[str]) -> str:
    """A ``--stages`` value that cuts the parts of a ``layers``-layer model into
    ``len(devices)`` runs of consecutive parts, as even as they go (earlier runs get the
    extra part): ``even_stages(2, ["/cpu:0", "/cpu:1"])`` →
    ``"embedding=/cpu:0,rnn_0=/cpu:0,rnn_1=/cpu:1,softmax=/cpu:1"``.

    Raises:
      ConfigError: more devices than the model has parts.
    """
    parts = model_parts(layers)
    if not 0 < len(devices) <= len(parts):
        raise ConfigError(f"cannot cut the {len(parts)} parts of a {layers}-layer model "
                          f"into {len(devices)} stages; use 1 to {len(parts)} devices")
    base, extra = divmod(len(parts), len(devices))
    items, start = [], 0
    for k, device in enumerate(devices):
        size = base + (k < extra)
        items += [f"{p}={device}" for p in parts[start:start + size]]
        start += size
    return ",".join(items)


def stage_device_names(stages_text: str) -> tuple[str, ...]:
    """The CPU devices ``--stages`` mentions, as ``/cpu:N`` (anything else is skipped and
    reported later by :func:`placement_from_config`), to size the logical CPU split before
    TensorFlow starts."""
    names = []
    for item in stages_text.split(","):
        m = _CPU_DEVICE.match(item.partition("=")[2].strip())
        if m:
            names.append(f"/cpu:{m.group(1)}")
    return tuple(names)


def part_of_path(path: str | None) -> str | None:
    """'rnn_lm/rnn_1/lstm_cell/kernel' → 'rnn_1'; None for non-model variables."""
    for piece in (path or "").split("/"):
        if piece in (EMBEDDING, SOFTMAX) or RNN_PART.match(piece):
            return piece
    return None
