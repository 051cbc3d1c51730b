"""Sequoia's offloading setting: a target whose decoder layers stream in per forward.

A target too large for the device keeps its decoder layers in host memory (``"cpu"``) or in
files on disk (``"disk"``) and Hugging Face / accelerate's hooks bring each layer's weights in
for its forward, so one forward costs about the same for 1 tree token or hundreds: the stream
dominates, and the large trees Sequoia plans for such a flat curve pay. ``"stream"``: our own
streaming instead of accelerate's hooks (:mod:`sequoia_decoding.streaming`: from disk on a CPU,
from pinned host memory on a GPU).
``load_offloaded`` loads a target that way (embedding, final norm and LM head stay on the
device); the loop runs it unchanged; the profile measures its latency curve to ``OFFLOAD_SIZES`` and the planner searches
up to ``OFFLOAD_MAX_DEPTH`` levels. ``docs/offloading.md`` has the design and the measurements.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from .streaming import OffloadReadError, offload_folder

__all__ = ["OFFLOAD_KINDS", "OFFLOAD_SIZES", "OFFLOAD_MAX_DEPTH", "OffloadReadError", "offload_device_map",
           "load_offloaded", "offload_of"]

OFFLOAD_KINDS = ("cpu", "disk", "stream")
OFFLOAD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # the profile's tree sizes for an offloaded target
OFFLOAD_MAX_DEPTH = 20  # the planner's level limit there (the DP is exact at these sizes: ~0.3 s at 1024 x 20)


def offload_device_map(config, where: str, device: str) -> dict[str, str]:
    """accelerate's device map for a Llama-family target: every decoder layer on ``where``
    (``"cpu"`` or ``"disk"``), the rest on ``device``."""
    _check_kind(where)
    layers = int(config.num_hidden_layers)
    dm = {"model.embed_tokens": device, "model.norm": device, "model.rotary_emb": device, "lm_head": device}
    dm.update({f"model.layers.{i}": where for i in range(layers)})
    return dm


def load_offloaded(path: str, *, dtype: torch.dtype, device: str, where: str, folder: str | None = None):
    """The target in ``path`` with its decoder layers offloaded to ``where``. ``"disk"``:
    accelerate's hooks read each layer's weights at every forward, straight from the checkpoint's
    memory-mapped safetensors files (converted to ``dtype`` when stored in another), or from
    ``folder`` for what the checkpoint cannot serve (default: under the project's cache, one
    folder per model and dtype).
    ``"cpu"``: on a GPU, the layers in host memory, copied to the device per forward; on a CPU
    (where host memory is the device) the same hooks run, each forward reading the weights from
    the offloaded state dict: the setting's overheads without its transfer.
    ``"stream"``: our own streaming (:mod:`sequoia_decoding.streaming`): the layers stored in one
    file under ``folder``; on a CPU packed and read from disk one layer ahead of the compute at
    every forward, on a GPU held in pinned host memory and copied to the device one layer ahead on
    a side CUDA stream."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _check_kind(where)
    if where == "stream":
        from .streaming import load_streamed

        return load_streamed(path, dtype=dtype, folder=folder or _default_folder(path, dtype), device=device)
    config = AutoConfig.from_pretrained(path)
    if where == "cpu" and torch.device(device).type == "cpu":
        from accelerate import cpu_offload

        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype).eval()
        for layer in model.model.layers:
            cpu_offload(layer, execution_device=torch.device("cpu"))
        model._sequoia_offload = "cpu"
        return model
    if where == "disk":
        folder = folder or str(_default_folder(path, dtype))
        offload_folder(folder)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype,
                                                 device_map=offload_device_map(config, where, device),
                                                 offload_folder=folder).eval()
    model._sequoia_offload = where
    _name_failed_reads(model)
    return model


def offload_of(model) -> str | None:
    """``"cpu"``, ``"disk"`` or ``"stream"`` for a target loaded by :func:`load_offloaded` (or
    ``"disk"`` with a device map that offloads layers), else None."""
    tag = getattr(model, "_sequoia_offload", None)
    if tag is not None:
        return tag
    placed = set((getattr(model, "hf_device_map", None) or {}).values())
    return "disk" if "disk" in placed else None


class _NamedReads(Mapping):
    """accelerate's weight loader, whose failed reads raise :class:`OffloadReadError` naming the
    layer, the weight and the file it was read from."""

    def __init__(self, loader: Mapping):
        self.loader = loader

    def __getitem__(self, key: str):
        try:
            return self.loader[key]
        except Exception as e:
            layer = ".".join(key.split(".")[:3]) if key.startswith("model.layers.") else key.rsplit(".", 1)[0]
            info = getattr(self.loader, "index", {}).get(key, {})
            where = info.get("safetensors_file") or os.path.join(str(getattr(self.loader, "save_folder", "?")),
                                                                 f"{key}.dat")
            raise OffloadReadError(f"offloaded layer {layer}: cannot read its weight {key} from {where} "
                                   f"({type(e).__name__}: {e}); the caches keep their committed entries") from e

    def __iter__(self):
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)


def _name_failed_reads(model) -> None:
    """Wrap the loader behind every offloading hook of ``model`` in :class:`_NamedReads` (once)."""
    from accelerate.hooks import SequentialHook
    from accelerate.utils import PrefixedDataset

    named: dict[int, _NamedReads] = {}  # one wrapper per loader (the hooks share accelerate's one)
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for h in (hook.hooks if isinstance(hook, SequentialHook) else [hook]):
            wm = getattr(h, "weights_map", None)
            if isinstance(wm, PrefixedDataset) and not isinstance(wm.dataset, _NamedReads):
                wm.dataset = named.setdefault(id(wm.dataset), _NamedReads(wm.dataset))


def _check_kind(where: str) -> None:
    if where not in OFFLOAD_KINDS:
        raise ValueError(f"offload must be one of {OFFLOAD_KINDS}, got {where!r}")


def _default_folder(path: str, dtype: torch.dtype) -> Path:
    from .modeling.smollm2 import CACHE_ROOT

    key = hashlib.sha1(f"{os.path.abspath(path)}|{dtype}".encode()).hexdigest()[:12]
    return Path(CACHE_ROOT) / "offload" / f"{Path(path).name}-{str(dtype).replace('torch.', '')}-{key}"
