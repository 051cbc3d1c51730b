"""Loading what the tools need: causal LMs from local folders (Hugging Face or the project's
draft format) and acceptance vectors (a list on the command line or a JSON file), and the command
line's counts checked before anything loads (``check_options_at_least``). Used by the CLI, the demo,
``SequoiaDecoding`` and the benchmarks (one place, no import cycles, no torch at import)."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["acceptance_file", "check_options_at_least", "is_filtered", "load_causal_lm", "load_draft",
           "nearest_acceptance_file", "parse_acceptance", "setting_name"]

_ACCEPTANCE_PREFIX = "acceptance-T"


def is_filtered(temperature: float, top_k: int = 0, top_p: float = 1.0) -> bool:
    """Whether top-k / top-p change sampling at ``temperature`` (greedy decoding ignores them)."""
    return temperature > 0 and (bool(top_k) or top_p < 1.0)


def setting_name(temperature: float, top_k: int = 0, top_p: float = 1.0) -> str:
    """A sampling setting's name in file names: ``T0.6``, filtered ``T0.6-topk50-topp0.9`` (only
    the filters in use; none at temperature 0)."""
    name = f"T{temperature:g}"
    if is_filtered(temperature, top_k, top_p):
        name += (f"-topk{int(top_k)}" if top_k else "") + (f"-topp{top_p:g}" if top_p < 1.0 else "")
    return name


def acceptance_file(folder: str | os.PathLike, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Path:
    """Where an acceptance vector for ``temperature`` (and sampling filters) lives next to a draft:
    ``acceptance-T0.6.json``, filtered ``acceptance-T0.6-topk50-topp0.9.json`` (``setting_name``)."""
    return Path(folder) / f"acceptance-{setting_name(temperature, top_k, top_p)}.json"


def nearest_acceptance_file(folder: str | os.PathLike, temperature: float) -> Path | None:
    """The draft folder's acceptance file whose temperature is nearest to ``temperature`` (None
    when the folder has none)."""
    found = []
    for f in Path(folder).glob(f"{_ACCEPTANCE_PREFIX}*.json"):
        try:
            found.append((abs(float(f.stem[len(_ACCEPTANCE_PREFIX):]) - temperature), f))
        except ValueError:
            continue
    return min(found)[1] if found else None


def check_options_at_least(args, lo: int, *names: str) -> None:
    """A ``ValueError`` naming the first command-line option among ``names`` (``max_new_tokens``:
    ``--max-new-tokens``) that is given (not None) and not an int >= ``lo``."""
    for name in names:
        v = getattr(args, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo):
            raise ValueError(f"--{name.replace('_', '-')} must be an int >= {lo}, got {v!r}")


def parse_acceptance(text: str) -> tuple[float, ...]:
    """``--acceptance``: a comma-separated list (``0.63,0.11,0.06``), or the path of a JSON
    file holding a list or an object with key ``acceptance`` (e.g. a saved plan). An object that
    also has ``deep_acceptance`` (``measure-acceptance`` of a feature head) gives a
    ``LevelAcceptance``: its deeper levels are planned with their own vector."""
    from .tree import acceptance_from, validate_acceptance

    text = text.strip()
    if os.path.isfile(text) or text.lower().endswith(".json"):
        with open(text, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"acceptance file {text}: not valid JSON ({e.msg} at line {e.lineno})") from None
        deep = None
        if isinstance(data, dict):
            if "acceptance" not in data:
                raise ValueError(f"acceptance file {text}: no key 'acceptance'")
            data, deep = data["acceptance"], data.get("deep_acceptance")
        if not isinstance(data, list) or not isinstance(deep, (list, type(None))):
            raise ValueError(f"acceptance file {text}: 'acceptance' and 'deep_acceptance' must be lists of numbers")
        try:
            return acceptance_from(data, deep)
        except ValueError as e:
            raise ValueError(f"acceptance file {text}: {e}") from None
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"--acceptance {text!r}: empty entry (expected e.g. 0.63,0.11,0.06)")
        try:
            values.append(float(item))
        except ValueError:
            raise ValueError(f"--acceptance: {item!r} is not a number (expected e.g. 0.63,0.11,0.06 "
                             "or a JSON file)") from None
    return validate_acceptance(values)


def load_draft(path: str, *, dtype: str = "float32", device: str = "cpu"):
    """Any draft from a local folder: an EAGLE-1/2 or EAGLE-3 head (published layout, or one
    trained here: ``modeling.feature_head.FeatureHead``), the project's standalone draft format,
    or a Hugging Face causal LM."""
    from .modeling.feature_head import FeatureHead, is_feature_head_folder

    if os.path.isdir(path) and is_feature_head_folder(path):
        import torch

        torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        head = FeatureHead.load(path, dtype=torch_dtype).to(device)
        head.config._name_or_path = path  # where its acceptance files are (SequoiaDecoding)
        return head
    return load_causal_lm(path, dtype=dtype, device=device)


def load_causal_lm(path: str, *, dtype: str = "float32", device: str = "cpu", tensor_parallel: bool = False,
                   offload: str | None = None, offload_folder: str | None = None):
    """A causal LM from a local folder: a Hugging Face model (``from_pretrained``), or the
    project's own draft format (a folder holding ``draft_config.json``). ``tensor_parallel``
    (under ``torchrun``, the process group joined): sharded over the ranks by the model's TP plan
    (Hugging Face's ``DistributedConfig(tp_plan="auto")``, with attention kept whole where the world
    does not divide the heads: ``tensor_parallel.tp_plan_for``; each rank keeps its own device).
    ``offload`` (``"cpu"``, ``"disk"`` or ``"stream"``): the decoder layers offloaded, streamed in
    per forward (``offload.load_offloaded``; ``offload_folder`` for ``"disk"`` and ``"stream"``);
    not together with ``tensor_parallel`` (a ``ValueError`` on every rank, before any loading)."""
    import torch

    if not os.path.isdir(path):
        raise ValueError(f"model folder not found: {path}")
    if tensor_parallel and offload not in (None, "none"):
        raise ValueError(f"offload {offload!r} with tensor parallelism: not supported (a sharded target keeps its "
                         f"layers on its ranks' devices); run one process, or drop the offload")
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    if os.path.exists(os.path.join(path, "draft_config.json")):
        from .modeling.draft import DraftLM

        model = DraftLM.load(path)
        if not getattr(model.config, "_name_or_path", None):
            model.config._name_or_path = path  # where the draft's acceptance files are (SequoiaDecoding)
    elif offload not in (None, "none"):
        from .offload import load_offloaded

        return load_offloaded(path, dtype=torch_dtype, device=device, where=offload, folder=offload_folder)
    elif tensor_parallel:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        DistributedConfig = getattr(transformers, "DistributedConfig", None)
        if DistributedConfig is None:
            raise ImportError(f"tensor parallelism needs transformers >= 5.17 (its DistributedConfig), found "
                              f"{transformers.__version__}: pip install 'transformers>=5.17'")

        from .tensor_parallel import tp_plan_for

        config = AutoConfig.from_pretrained(path)
        plan = tp_plan_for(config, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], torch.distributed.get_world_size())
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch_dtype,
                                                     distributed_config=DistributedConfig(tp_plan=plan))
        return model.to(dtype=torch_dtype).eval()
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return model.to(device=device, dtype=torch_dtype).eval()
