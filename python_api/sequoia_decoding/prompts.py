"""Prompt files for the CLI tools (``measure-acceptance``, ``demo``) and the benchmarks.

Two formats, told apart by their content:

* plain: one prompt per non-empty line, given to the model as raw text to continue;
* blocks: a line ``### chat`` or ``### raw`` opens a prompt that runs to the next such line
  (several lines allowed). A ``chat`` prompt is sent through the tokenizer's chat template as one
  user message (with the generation prompt); a ``raw`` prompt is text to continue. Lines before
  the first block (comments) are ignored.

Prompts are tokenized without special tokens (the chat template writes its own).
"""

from __future__ import annotations

import os
import re

_BLOCK = re.compile(r"### (chat|raw)\s*")


def read_prompts(path: str | os.PathLike) -> list[dict]:
    """``[{"kind": "chat" | "raw", "text": str}]`` from a prompt file (see the module docstring)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if not any(_BLOCK.fullmatch(ln) for ln in lines):
        prompts = [{"kind": "raw", "text": ln.strip()} for ln in lines if ln.strip()]
    else:
        prompts, kind, body = [], None, []
        for ln in lines + ["### raw"]:  # the sentinel flushes the last block
            m = _BLOCK.fullmatch(ln)
            if m:
                text = "\n".join(body).strip("\n")
                if kind is not None and text.strip():
                    prompts.append({"kind": kind, "text": text})
                kind, body = m.group(1), []
            elif kind is not None:
                body.append(ln)
    if not prompts:
        raise ValueError(f"no prompts in {os.fspath(path)}")
    return prompts


def prompt_ids(tok, prompt: dict) -> list[int]:
    """Token ids of one prompt: chat prompts through the chat template, raw ones as they are."""
    text = prompt["text"]
    if prompt["kind"] == "chat":
        if not getattr(tok, "chat_template", None):
            raise ValueError("a '### chat' prompt needs a tokenizer with a chat template")
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"prompt {prompt['text']!r} has no tokens")
    return list(ids)


def load_prompt_ids(path: str | os.PathLike, tok, limit: int | None = None, skip: int = 0) -> list[list[int]]:
    """Token ids of prompts ``skip .. skip + limit`` of a prompt file."""
    prompts = read_prompts(path)[skip:]
    if limit is not None:
        prompts = prompts[:limit]
    if not prompts:
        raise ValueError(f"no prompts left in {os.fspath(path)} after skipping {skip}")
    return [prompt_ids(tok, p) for p in prompts]
