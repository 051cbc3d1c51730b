"""The ``sequoia-kernels`` command line.

Subcommands are registered in :data:`SUBCOMMANDS`: each is a function that takes the
argparse sub-parsers object, adds its parser and sets ``func`` (the handler, which gets
the parsed namespace and returns an exit code). To add one::

    def _add_generate(sub):
        p = sub.add_parser("generate", help="...")
        p.add_argument(...)
        p.set_defaults(func=_cmd_generate)

    SUBCOMMANDS.append(_add_generate)   # or list it below

Handlers should import heavy modules (torch, sequoia_kernels, transformers, matplotlib)
inside themselves so that ``sequoia-kernels plan`` starts fast and works without the
compiled extension. A ``ValueError`` or ``OSError`` escaping a handler is reported as
``sequoia-kernels: error: <message>`` on stderr with exit code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Callable, Sequence

from .loading import check_options_at_least, load_causal_lm, load_draft, parse_acceptance  # noqa: F401  (part of the CLI's API)

PROG = "sequoia-kernels"

# Errors caused by user input; json.JSONDecodeError is a ValueError.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


def _one_line(exc: BaseException) -> str:
    msg = " ".join(str(exc).split())
    return msg or type(exc).__name__


# ---------------------------------------------------------------------------- plan


def _fmt_list(xs, limit: int = 16) -> str:
    xs = list(xs)
    s = ",".join(str(x) for x in xs[:limit])
    return s + (f",… ({len(xs)} in all)" if len(xs) > limit else "")


def _print_plan_summary(plan, out) -> None:
    print(f"Sequoia tree plan (budget {plan.budget} nodes, max depth {plan.max_depth} levels)", file=out)
    print(f"acceptance: {', '.join(f'{x:g}' for x in plan.acceptance)}", file=out)
    print(f"expected tokens per step: {plan.expected_tokens:.4f} "
          f"({plan.num_nodes} nodes, {plan.num_levels} levels)", file=out)
    print(file=out)
    print(plan.draw(max_lines=64), file=out)
    print(file=out)
    levels = plan.levels()
    if levels:
        print("draft expansion per level (expanding nodes -> child counts):", file=out)
        for nodes, counts in levels:
            d = plan.depth[nodes[0]]
            c = sum(counts)
            print(f"  depth {d}: {len(nodes)} node{'s' if len(nodes) != 1 else ''} -> {c} "
                  f"child{'ren' if c != 1 else ''}; nodes {_fmt_list(nodes)}; counts {_fmt_list(counts)}", file=out)
    else:
        print("draft expansion: none (the tree is just the root)", file=out)


def _print_hardware_summary(hp, out) -> None:
    ms = 1e3
    print(file=out)
    print(f"hardware-aware choice (draft step {hp.draft_step_s * ms:.3f} ms, T(1) = {hp.baseline_s * ms:.3f} ms):",
          file=out)
    print(f"  budget n = {hp.budget}, depth d = {hp.max_depth}: E = {hp.plan.expected_tokens:.4f} tokens/step, "
          f"{hp.seconds_per_token * ms:.3f} ms/token, predicted speedup {hp.speedup:.2f}x", file=out)
    print("  best depth per budget:", file=out)
    print(f"  {'n':>6} {'d':>3} {'E':>8} {'step ms':>9} {'ms/token':>9} {'speedup':>8}", file=out)
    for c in hp.best_per_budget().values():
        mark = " *" if (c.budget, c.max_depth) == (hp.budget, hp.max_depth) else ""
        print(f"  {c.budget:>6} {c.max_depth:>3} {c.expected_tokens:>8.4f} {c.step_s * ms:>9.3f} "
              f"{c.seconds_per_token * ms:>9.3f} {c.speedup:>7.2f}x{mark}", file=out)


def _cmd_plan(args: argparse.Namespace) -> int:
    from .planner import DEFAULT_ACCEPTANCE, choose_plan, load_latency, plan_tree
    from .plotting import plot_tree

    acceptance = parse_acceptance(args.acceptance) if args.acceptance is not None else DEFAULT_ACCEPTANCE
    check_options_at_least(args, 1, "budget", "max_depth")
    hardware = None
    if args.latency is not None:
        draft_step_s, table = load_latency(args.latency)  # validate before any work
    plan = plan_tree(acceptance, args.budget, args.max_depth)
    if args.latency is not None:
        hardware = choose_plan(acceptance, draft_step_s, table, max_depth=args.max_depth)
    if args.plot is not None:
        try:
            plot_tree(plan, args.plot)
        except ImportError as e:
            raise ValueError(f"--plot needs matplotlib ({e})") from None
    out = sys.stdout
    if args.json:
        result = plan.to_dict()
        if hardware is not None:
            result["hardware"] = hardware.to_dict()
        if args.plot is not None:
            result["plot"] = os.fspath(args.plot)
        print(json.dumps(result), file=out)
    else:
        _print_plan_summary(plan, out)
        if hardware is not None:
            _print_hardware_summary(hardware, out)
        if args.plot is not None:
            print(f"\ntree drawn to {args.plot}", file=out)
    return 0


def _add_plan(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="plan the optimal Sequoia speculation tree",
        description="Find the tree maximising expected tokens per step for an acceptance vector, "
        "a node budget and a depth limit (Sequoia's dynamic program, exact). With --latency, "
        "also choose the budget and depth that minimise predicted time per token.",
    )
    p.add_argument("--acceptance", metavar="P1,P2,...|FILE.json",
                   help="acceptance vector p_1..p_K: p_k = probability that the k-th sampled draft child is "
                   "accepted (sum <= 1); a comma list or a JSON file with key 'acceptance' "
                   "(default: a built-in paper-like vector)")
    p.add_argument("--budget", type=int, default=64, metavar="N",
                   help="tree nodes including the root = tokens the target verifies per step (default 64)")
    p.add_argument("--max-depth", type=int, default=8, metavar="D",
                   help="most levels including the root (default 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    p.add_argument("--latency", metavar="FILE.json",
                   help='hardware latencies {"draft_step_s": t_d, "target_latency_s": {"1": T(1), "2": T(2), ...}}: '
                   "choose (n, d) minimising (d*t_d + T(n)) / E(n, d) over the file's budgets and depths "
                   "1..--max-depth, and report the predicted speedup T(1)/that")
    p.add_argument("--plot", metavar="FILE.png", help="draw the tree to an image file (needs matplotlib)")
    p.set_defaults(func=_cmd_plan)


# ---------------------------------------------------------------------------- generate


def _tree_from_args(args):
    from .planner import DEFAULT_ACCEPTANCE, TreePlan, chain_tree, kxd_tree, plan_tree

    if args.tree is not None:
        return TreePlan.load(args.tree)
    if args.chain is not None:
        return chain_tree(args.chain)
    if args.kxd is not None:
        m = re.fullmatch(r"(\d+)x(\d+)", args.kxd)
        if not m:
            raise ValueError(f"--kxd must look like 4x3, got {args.kxd!r}")
        return kxd_tree(int(m.group(1)), int(m.group(2)))
    if args.budget is None:
        return None  # planned after loading, as SequoiaDecoding plans (the demo's calibrated planner)
    acceptance = parse_acceptance(args.acceptance) if args.acceptance is not None else DEFAULT_ACCEPTANCE
    return plan_tree(acceptance, args.budget, args.max_depth or 8)


def _load_pair(args):
    for path in filter(None, (args.target, getattr(args, "draft", None))):
        if not os.path.isdir(path):
            raise ValueError(f"model folder not found: {path}")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .tensor_parallel import join_torchrun

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(args.target)
    # under torchrun: every rank joins; the target sharded by its TP plan, the draft whole on every rank
    _, world, args.device = join_torchrun(args.device)
    if args.dtype == "auto":
        args.dtype = _auto_dtype(args.target, args.device)
    target = load_causal_lm(args.target, dtype=args.dtype, device=args.device, tensor_parallel=world > 1,
                            offload=args.offload, offload_folder=args.offload_folder)
    from .modeling.feature_head import FeatureHead

    draft = load_draft(args.draft, dtype=args.dtype, device=args.device) if args.draft else None
    if isinstance(draft, FeatureHead):
        draft.bind(target)  # a feature head reads this target: checked here, before any work
    return tok, target, draft


def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class _TextStream:
    """A row's text written as its tokens arrive (``generate``'s callback): the tokens so far
    decoded whole, what was not written yet written; a character whose bytes are still arriving
    (a trailing U+FFFD: one token of a multi-byte character) is held back until they have."""

    def __init__(self, tok, out):
        self.tok, self.out, self.seen, self.printed = tok, out, [], ""

    def __call__(self, _row: int, new: list[int], final: bool = False) -> None:
        self.seen.extend(new)
        text = self.tok.decode(self.seen, skip_special_tokens=True)
        if not final:
            text = text.rstrip("\ufffd")
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text

    def finish(self) -> None:  # what was held back (bytes that never made a character)
        self(0, [], final=True)


def _cmd_generate(args: argparse.Namespace) -> int:
    import time

    from .generate import SamplingParams, SequoiaGenerator
    from .tensor_parallel import rank0s, tensor_parallel_of

    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    check_options_at_least(args, 1, "max_new_tokens", "max_depth")
    plan = _tree_from_args(args) if args.draft else None  # bad input fails before loading
    tok, target, draft = _load_pair(args)
    rank = _rank()  # torchrun: every rank decodes, rank 0 prints
    ids = _prompt_ids(tok, args)
    if draft is not None and plan is None:  # no tree given: the plan SequoiaDecoding would use
        from .hf_generate import SequoiaDecoding
        from .profiles import typical_context

        from .offload import OFFLOAD_MAX_DEPTH

        depth = args.max_depth or (OFFLOAD_MAX_DEPTH if args.offload != "none" else None)  # as the demo plans it
        planner = SequoiaDecoding(draft, max_depth=depth, acceptance=args.acceptance)
        plan = rank0s(planner.plan_for(target, args.temperature, args.top_k, args.top_p,
                                       context=typical_context([ids], args.max_new_tokens)), tensor_parallel_of(target))
    if args.adaptive and draft is None:
        raise ValueError("--adaptive re-plans the draft's trees: it needs --draft")
    gen = SequoiaGenerator(target, draft, plan, sampling, max_length=None, adaptive=args.adaptive)  # caches as needed
    out = sys.stdout if rank == 0 else open(os.devnull, "w")
    stream = _TextStream(tok, out)
    out.write(args.prompt + ("\n" if args.chat else ""))
    t0 = time.perf_counter()
    res = gen.generate([ids], max_new_tokens=args.max_new_tokens, callback=stream)
    wall = time.perf_counter() - t0
    stream.finish()
    out.write("\n")
    shape = f"{gen.plan.num_nodes}-node tree, {gen.plan.num_levels} levels" if gen.draft is not None else "autoregressive"
    if res.replan is not None:
        rp = res.replan
        shape += f" first; re-planned {rp.replans}x, {rp.plan_changes} changes, {rp.replan_ms:.2f} ms each"
    if rank == 0:
        print(f"[{len(res.tokens[0])} tokens in {len(res.steps)} steps ({shape}): {res.tokens_per_step:.2f} "
              f"tokens/step, {len(res.tokens[0]) / res.decode_s:.1f} tokens/s decode, {wall:.2f} s total]",
              file=sys.stderr)
    return 0


def _prompt_ids(tok, args: argparse.Namespace) -> list[int]:
    """``--prompt``'s token ids: through the chat template as one user message with ``--chat``,
    else the text as it is (special tokens such as BOS added with ``--bos``)."""
    from .prompts import prompt_ids

    if args.chat:
        return prompt_ids(tok, {"kind": "chat", "text": args.prompt})
    ids = tok(args.prompt, add_special_tokens=args.bos)["input_ids"]
    if not ids:
        raise ValueError(f"--prompt {args.prompt!r} has no tokens")
    return ids


def _device(text: str) -> str:
    """``--device``: a CPU or CUDA device this machine has (a usage error naming it, not torch's
    traceback after the models have loaded)."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (e.g. cpu, cuda, cuda:1)") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text}: the loop runs on cpu or cuda devices")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def _auto_dtype(target: str, device: str) -> str:
    """``--dtype auto``: the demo's dtype for ``target`` on this machine (``profiling.pick_dtype``,
    from its cache: nothing is timed here), said on stderr (rank 0); else float32."""
    import torch

    from .profiling import pick_dtype

    got = pick_dtype(target, torch.device(device), measure=False)
    if got is None:
        return "float32"  # the demo has not measured this target here
    if _rank() == 0:
        print(f"[dtype {got[1]}; --dtype sets it]", file=sys.stderr)
    return got[0]


def _pair_args(p, draft_required: bool) -> None:
    p.add_argument("--target", required=True, metavar="PATH", help="target model folder")
    p.add_argument("--draft", required=draft_required, metavar="PATH",
                   help="draft folder: a standalone draft model, or an EAGLE-1/2/3 feature head")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                   help="auto (default): the dtype the demo picked for this target here (bfloat16 on a GPU; on a "
                   "CPU its measured choice, float32 where the demo has not measured this target)")
    p.add_argument("--device", default="cpu", type=_device)
    _offload_args(p)


def _offload_args(p) -> None:
    p.add_argument("--offload", choices=["none", "cpu", "disk", "stream"], default="none",
                   help="Sequoia's offloading setting: the target's decoder layers in host memory or on disk, "
                   "streamed in per forward by accelerate's hooks (cpu, disk) or by our own streaming from one "
                   "file, a layer ahead of the compute (stream: on a CPU read from disk, on a GPU copied from "
                   "pinned host memory) (profiled to 1024 tree nodes, planned to 20 levels)")
    p.add_argument("--offload-folder", metavar="DIR", help="where --offload disk / stream writes the layers "
                   "(default: under the project's cache)")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with Sequoia speculative decoding",
                       description="Speculative decoding of a target model with a draft model over a Sequoia "
                       "tree (exact: the output follows the target's own distribution). Streams the text, then "
                       "prints tokens/step and tokens/s.")
    _pair_args(p, False)  # no --draft: the autoregressive baseline
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=None)
    tree = p.add_mutually_exclusive_group()
    tree.add_argument("--tree", metavar="PLAN.json", help="a saved plan (sequoia-kernels plan --json > PLAN.json)")
    tree.add_argument("--budget", type=int, help="plan a Sequoia tree of this many nodes (default: the tree the "
                      "demo's calibrated planner picks for this machine, or plain decoding where it has not run)")
    tree.add_argument("--chain", type=int, metavar="K", help="baseline: chain speculation of K tokens")
    tree.add_argument("--kxd", metavar="KxD", help="baseline: SpecInfer-style K x D tree")
    p.add_argument("--acceptance", metavar="P1,P2,...|FILE.json", help="acceptance vector for --budget planning")
    p.add_argument("--max-depth", type=int, default=None,
                   help="most tree levels (default 8 with --budget; 16 for the planned tree, as the demo)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--bos", action="store_true", help="let the tokenizer add special tokens (BOS) to the prompt")
    form.add_argument("--chat", action="store_true", help="send the prompt through the tokenizer's chat template as "
                      "one user message, with the generation prompt (an instruct model's form)")
    p.add_argument("--adaptive", action="store_true", help="re-plan the tree online from the live acceptance and "
                   "step times (the tree above is the first step's; sampling: it or plain decoding; needs the demo's "
                   "cached profile)")
    p.set_defaults(func=_cmd_generate)


# ---------------------------------------------------------------------------- measurements


def _cmd_measure_acceptance(args: argparse.Namespace) -> int:
    from .tools import measure_acceptance, write_json

    from sequoia_kernels.ops.sampling import check_sampling_params

    check_sampling_params(args.temperature, args.top_k, args.top_p, "--temperature / --top-k / --top-p")
    check_options_at_least(args, 1, "width", "max_new_tokens", "num_prompts", "runs")
    if not os.path.isfile(args.prompts):
        raise ValueError(f"prompts file not found: {args.prompts}")
    from .prompts import load_prompt_ids, read_prompts

    read_prompts(args.prompts)  # a malformed file fails before the models load
    tok, target, draft = _load_pair(args)
    prompts = load_prompt_ids(args.prompts, tok, args.num_prompts)
    result = measure_acceptance(target, draft, prompts, temperature=args.temperature, width=args.width,
                                max_new_tokens=args.max_new_tokens, runs=args.runs, seed=args.seed,
                                top_k=args.top_k, top_p=args.top_p, head_level=args.head_level,
                                eos_token_id=[] if args.ignore_eos else None)
    print(write_json(result, args.out))
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from .plotting import plot_latency
    from .tools import profile_latency, write_json

    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        raise ValueError(f"--sizes must be a comma list of integers, got {args.sizes!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--sizes must be tree sizes >= 1, got {args.sizes!r}")
    check_options_at_least(args, 0, "prefix")
    check_options_at_least(args, 1, "repeats")
    tok, target, draft = _load_pair(args)
    result = profile_latency(target, draft, sizes=sizes, prefix=args.prefix, repeats=args.repeats)
    if _rank() == 0:  # torchrun: every rank times the same forwards (their collectives), rank 0's times
        if args.plot:
            plot_latency(result, args.plot)
        print(write_json(result, args.out))
    return 0


def _add_measure_acceptance(sub) -> None:
    p = sub.add_parser("measure-acceptance", help="measure Sequoia's acceptance vector of a draft",
                       description="p_k = probability that the k-th child sampled from the draft (without "
                       "replacement) is accepted, measured on the target's continuations of held-out prompts; "
                       "writes JSON that `plan --acceptance FILE` reads.")
    _pair_args(p, True)
    p.add_argument("--prompts", required=True, metavar="FILE", help="one prompt per line, or '### chat' / '### raw' blocks")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-k", type=int, default=0, help="the top-k filter decoding will use (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="the top-p filter decoding will use (1 = off)")
    p.add_argument("--width", type=int, default=8, help="children sampled per position (K)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="target continuation length per prompt")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--runs", type=int, default=4, help="Monte Carlo runs per position (sampling)")
    p.add_argument("--ignore-eos", action="store_true", help="measure the continuations past the end of sequence "
                   "(default: each stops at the target's EOS, as decoding does, and only the positions decoding "
                   "verifies count)")
    p.add_argument("--head-level", type=int, choices=[1, 2], default=1,
                   help="a feature head: read with the target's features (1, the tree's first level; the deeper "
                        "levels' reading is measured in the same pass: deep_acceptance) or with its own prediction "
                        "of the last one (2, deeper levels alone)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="FILE.json")
    p.set_defaults(func=_cmd_measure_acceptance)


def _add_profile(sub) -> None:
    p = sub.add_parser("profile", help="measure the target's latency curve T(n) and one draft step",
                       description="Times the target's forward over n tree tokens (through the tree-attention "
                       "path, after --prefix tokens of context) and one draft step; finds the knee; writes JSON "
                       "that `plan --latency FILE` reads.")
    _pair_args(p, False)
    p.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", metavar="FILE.json")
    p.add_argument("--plot", metavar="FILE.png")
    p.set_defaults(func=_cmd_profile)


# ---------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.main(args)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the whole workflow on SmolLM2-135M + our draft: profile, plan, generate",
                       description="Obtain the model pair (SmolLM2-135M-Instruct + the project's distilled draft), "
                       "profile this machine once (cached), plan a Sequoia tree per temperature, generate a few "
                       "prompts autoregressively and with the tree, and print AR vs Sequoia tokens/s and tokens "
                       "per step measured vs predicted. Uses the GPU when there is one.")
    p.add_argument("--target", metavar="PATH", help="target folder (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--draft", metavar="PATH", help="draft folder, or a comma list of them: the demo runs the one the "
                   "planner predicts faster (default: models/draft/smollm2-draft and, where it exists, the feature "
                   "head models/draft/smollm2-eagle)")
    p.add_argument("--prompts", metavar="FILE", help="prompts to generate (default: models/draft/demo_prompts.txt)")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="times over the prompts, the methods' order rotating from "
                   "one prompt's turn to the next (more rounds: finer paired ratios, e.g. adaptive / static)")
    p.add_argument("--temperatures", default="0,0.6", help="comma list")
    p.add_argument("--top-k", type=int, default=0, help="top-k filter of the sampled rows (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p filter of the sampled rows (1 = off)")
    p.add_argument("--top-p-row", type=float, default=0.9, metavar="P",
                   help="add a row at the last sampled temperature with top-p P (0 or 1: none; default 0.9)")
    p.add_argument("--max-depth", type=int, default=16, help="most tree levels the planner may use")
    p.add_argument("--out", default="sequoia-demo", metavar="DIR", help="plots and demo.json go here")
    p.add_argument("--device", default=None, type=_device, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="default: bfloat16 on GPUs; on CPUs the faster of float32 and bfloat16 by measured "
                        "T(1) + T(16) (timed once per machine, cached)")
    p.add_argument("--reprofile", action="store_true", help="measure the latency curve again")
    _offload_args(p)
    p.add_argument("--cuda-graphs", action="store_true", help="capture each decoding step in a CUDA graph (GPU)")
    p.add_argument("--adaptive", action="store_true", help="also run the tree re-planned online (same turns as AR "
                   "and the static plan): adaptive_speedup, plan_changes, replan_ms per row, a plot per setting")
    p.add_argument("--hindsight", action="store_true", help="also run the static plan solved from the prompts' own "
                   "measured acceptance (same turns; measuring it costs about one generation per setting): "
                   "hindsight_speedup per row, what a per-domain offline measurement would give")
    p.add_argument("--measure-acceptance", action="store_true",
                   help="measure the acceptance vectors instead of using those shipped with the draft")
    p.add_argument("--acceptance-prompts", metavar="FILE",
                   help="prompts for --measure-acceptance (default: the draft's held-out prompts)")
    p.add_argument("--acceptance-num-prompts", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_demo)


# ---------------------------------------------------------------------------- main

#: Functions that register a subcommand (see the module docstring).
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_demo, _add_plan, _add_generate, _add_measure_acceptance, _add_profile,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Sequoia speculative decoding kernels: tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


#: Options whose value may start with "-" followed by a digit (e.g. ``--acceptance -0.1,0.5``),
#: which argparse would otherwise take for an option; glued as ``--opt=value`` before parsing
#: so the value reaches the validator and gets its own error message.
NUMERIC_LIST_OPTIONS = {"--acceptance"}


def _glue_dash_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out.extend(argv[i:])
            break
        if a in NUMERIC_LIST_OPTIONS and i + 1 < len(argv) and re.match(r"-[\d.]", argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2 for usage or input errors)."""
    parser = build_parser()
    argv = _glue_dash_values(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # usage errors (2) and --help (0)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
