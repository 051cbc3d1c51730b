"""Sequoia tree speculation as a Hugging Face ``custom_generate`` recipe (this repository's form)::

    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=128,
                          custom_generate="path/to/sequoia-kernels", trust_remote_code=True,
                          draft_model=draft)                         # streamer=... streams here too

transformers loads this file (``custom_generate/generate.py`` of the repository) and calls
``generate(model=target, **every argument of target.generate)``. It needs the ``sequoia-kernels``
package installed (``pip install -e path/to/sequoia-kernels``). Extra arguments:
``draft_model`` (required), ``sequoia_budget``, ``sequoia_max_depth``, ``sequoia_acceptance``,
``sequoia_adaptive`` (see ``sequoia_decoding.SequoiaDecoding``). Everything else is ``target.generate``'s own.
"""

from sequoia_decoding import SequoiaDecoding


def generate(model, draft_model=None, sequoia_budget=None, sequoia_max_depth=None, sequoia_acceptance=None,
             sequoia_adaptive=None, streamer=None, **kwargs):
    if draft_model is None:
        raise ValueError("custom_generate=<sequoia-kernels>: pass draft_model=<a causal LM sharing the target's "
                         "tokenizer>")
    kwargs.pop("custom_generate", None)
    decoding = SequoiaDecoding(draft_model, budget=sequoia_budget, max_depth=sequoia_max_depth,
                               acceptance=sequoia_acceptance, streamer=streamer, adaptive=sequoia_adaptive)
    # generate() prepares the inputs and the config, then calls `decoding` (which streams)
    return model.generate(custom_generate=decoding, **kwargs)
