"""Sequoia tree speculation as a Hugging Face ``custom_generate`` recipe (this repository's form)::

    out = target.generate(input_ids, attention_mask=mask, max_new_tokens=128,
                          custom_generate="path/to/sequoia-kernels", trust_remote_code=True,
                          draft_model=draft)                         # streamer=... streams here too

transformers loads this file (``custom_generate/generate.py`` of the repository) and calls
``generate(model=target, **every argument of target.generate)``. It needs the ``sequoia-kernels``
package installed (``pip install -e path/to/sequoia-kernels``). Extra arguments:
``draft_model`` (required), ``sequoia_budget``, ``sequoia_max_depth``, ``sequoia_acceptance``,
``sequoia_adaptive`` (see ``sequoia_decoding.SequoiaDecoding``). Everything else is ``target.generate``'s own,
``stop_strings`` with ``tokenizer=`` included (here a ``StopStringCriteria``: transformers does not hand
``tokenizer`` on to the callable this recipe runs, and would refuse the stop strings without it).
"""

from transformers import StoppingCriteriaList, StopStringCriteria

from sequoia_decoding import SequoiaDecoding


def _stop_strings(model, kwargs: dict) -> None:
    """Stop strings (passed, in ``generation_config`` or in the model's own) with a ``tokenizer``
    become a ``StopStringCriteria`` in ``kwargs["stopping_criteria"]``, as ``generate()`` builds it;
    without a tokenizer transformers raises its own error naming it."""
    tokenizer = kwargs.get("tokenizer")
    if "stop_strings" in kwargs:
        strings = kwargs["stop_strings"]
    else:
        strings = getattr(kwargs.get("generation_config"), "stop_strings", None)
        if not strings and kwargs.get("use_model_defaults") is not False:
            strings = getattr(model.generation_config, "stop_strings", None)
    if not strings or tokenizer is None:
        return
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer, strings))
    kwargs["stopping_criteria"], kwargs["stop_strings"] = criteria, None


def generate(model, draft_model=None, sequoia_budget=None, sequoia_max_depth=None, sequoia_acceptance=None,
             sequoia_adaptive=None, streamer=None, **kwargs):
    if draft_model is None:
        raise ValueError("custom_generate=<sequoia-kernels>: pass draft_model=<a causal LM sharing the target's "
                         "tokenizer>")
    kwargs.pop("custom_generate", None)
    _stop_strings(model, kwargs)
    decoding = SequoiaDecoding(draft_model, budget=sequoia_budget, max_depth=sequoia_max_depth,
                               acceptance=sequoia_acceptance, streamer=streamer, adaptive=sequoia_adaptive)
    # generate() prepares the inputs and the config, then calls `decoding` (which streams)
    return model.generate(custom_generate=decoding, **kwargs)
