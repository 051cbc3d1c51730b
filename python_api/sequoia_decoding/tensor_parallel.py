"""A tensor-parallel target: a model loaded with Hugging Face's TP plan under ``torchrun``
(``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``), its weights
DTensors sharded over a device mesh.

What the loop needs from it: each rank's cache holds the rank's own KV heads (read from its
``k_proj`` shard); the LM head gathers the full vocabulary, so every rank verifies the same
logits, bit for bit; the draft runs unsharded on every rank. The ranks then decide the same
tokens by construction when their random numbers are the same: the seed is shared (rank 0's,
broadcast once when none is given), plans and cost models are rank 0's (read from its profile
cache, broadcast), the re-planner reads the slowest rank's step time, and at the end of a call
the ranks compare what they emitted (one small all-gather) so that a divergence is an error on
every rank, never silently different outputs. ``docs/tensor_parallel.md`` has the design.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Callable

import torch

from sequoia_kernels.hf import text_config

__all__ = ["TensorParallel", "tensor_parallel_of", "torchrun_group", "is_rank0", "local_kv_heads", "shared_seed",
           "rank0s", "same_request", "slowest_rank", "check_same_tokens", "all_reached", "peer_failure",
           "join_torchrun", "tp_plan_for"]


@dataclass(frozen=True)
class TensorParallel:
    """The target's TP group: this process's rank in it and its size."""

    group: object
    rank: int
    size: int


def tensor_parallel_of(model) -> TensorParallel | None:
    """The TP group of a model loaded with a TP plan (None: one process). A mesh of one rank is a
    TP group too (the same code path, a few bytes of collectives per call: what a one-GPU NCCL
    run checks)."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    if mesh.ndim > 1:  # transformers 5.19 on: a mesh over ("pp", "fsdp", "tp"), the others of size 1 under a TP plan
        names = tuple(mesh.mesh_dim_names or ())
        others = {n: s for n, s in zip(names, mesh.shape) if n != "tp" and s > 1}
        if "tp" not in names or others:
            raise ValueError(f"a target sharded over {dict(zip(names, mesh.shape))}: only tensor parallelism "
                             "(a mesh whose other dimensions are 1) is supported")
        mesh = mesh["tp"]
    group = mesh.get_group()
    return TensorParallel(group, torch.distributed.get_rank(group), torch.distributed.get_world_size(group))


def torchrun_group() -> TensorParallel | None:
    """All the ranks ``torchrun`` started (the group a TP target is sharded over), before any
    model is loaded: for decisions the ranks must share (a cached dtype, a cached profile); None
    in one process."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    size = torch.distributed.get_world_size()
    return TensorParallel(torch.distributed.group.WORLD, torch.distributed.get_rank(), size) if size > 1 else None


def is_rank0(tp: TensorParallel | None) -> bool:
    """Whether this process writes files and prints (one process, or rank 0 of a TP group)."""
    return tp is None or tp.rank == 0


def local_kv_heads(model) -> int:
    """KV heads of one rank's attention layers (all of them in one process), read from the first
    layer's ``k_proj`` shard (a TP plan may shard attention or keep it whole); a shard that does
    not hold whole heads is refused: sharding a head's dimensions across ranks would make every
    rank's attention wrong."""
    config = text_config(model.config)
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    tp = tensor_parallel_of(model)
    if tp is None:
        return kv
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    k_proj = next((m.k_proj for m in model.modules() if hasattr(m, "k_proj")), None)
    w = getattr(k_proj, "weight", None)
    rows = w.to_local().shape[0] if hasattr(w, "to_local") else (w.shape[0] if w is not None else kv * head_dim)
    if rows % head_dim:
        raise ValueError(f"a tensor-parallel target's ranks must hold whole KV heads: {kv} KV heads of {head_dim} "
                         f"over {tp.size} ranks leave {rows} k_proj rows on a rank (a world size the KV heads "
                         "are divisible by, or a TP plan that keeps attention whole)")
    return rows // head_dim


def shared_seed(seed: int | None, tp: TensorParallel | None, device: torch.device) -> int | None:
    """The seed every rank samples with: ``seed`` itself, or (None) one drawn on rank 0 and
    broadcast, so that unseeded calls still draw the same numbers on every rank."""
    if tp is None or seed is not None:
        return seed
    s = torch.randint(0, 2**62, (1,), dtype=torch.int64) if tp.rank == 0 else torch.zeros(1, dtype=torch.int64)
    s = s.to(_comm_device(tp, device))
    torch.distributed.broadcast(s, group=tp.group, group_src=0)
    return int(s.item())


def rank0s(obj, tp: TensorParallel | None):
    """Rank 0's ``obj`` on every rank (a plan, a cost model: anything read from a rank's own
    cache or clock that the ranks must agree on); ``obj`` itself in one process."""
    if tp is None:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, group=tp.group, group_src=0)
    return box[0]


def same_request(tp: TensorParallel | None, device: torch.device, check: Callable[[], tuple], extra: tuple = ()
                 ) -> tuple:
    """``check()`` (a call's request checks, returning ``(prompts, eos_ids)``); with a TP target
    every rank then learns whether every rank's request was valid and the same (one all-gather of
    a digest), so that a bad request on one rank is an error on every rank at once (the failing
    rank's own, a ``ValueError`` naming it on the others), before any state changes, instead of
    the others waiting in the first forward's collective until the process group times out."""
    if tp is None:
        return check()
    err, key = None, -1
    try:
        prompts, eos = out = check()
        key = _digest([len(p) for p in prompts] + [x for p in prompts for x in p] + list(eos) + list(extra))
    except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
        err = e
    keys = [torch.empty(1, dtype=torch.int64, device=_comm_device(tp, device)) for _ in range(tp.size)]
    torch.distributed.all_gather(keys, torch.tensor([key], dtype=torch.int64, device=keys[0].device), group=tp.group)
    if err is not None:
        raise err
    bad = [r for r, k in enumerate(keys) if int(k) == -1]
    if bad:
        raise ValueError(f"tensor-parallel rank(s) {bad} refused their request: every rank stops before decoding")
    if any(int(k) != int(keys[0]) for k in keys):
        raise ValueError("tensor-parallel ranks were given different requests (prompts, lengths or EOS ids): "
                         "every rank must decode the same request")
    return out


def slowest_rank(seconds: float, tp: TensorParallel | None, device: torch.device) -> float:
    """A step's time as the re-planner reads it: the slowest rank's (one tiny all-reduce), so that
    every rank re-plans from the same number and grows the same trees."""
    if tp is None:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=_comm_device(tp, device))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=tp.group)
    return float(t.item())


def check_same_tokens(tokens: list[list[int]], tp: TensorParallel | None, device: torch.device) -> None:
    """Every rank emitted the same tokens (one all-gather of a [rows, 2] digest); RuntimeError on
    every rank otherwise."""
    if tp is None:
        return
    dig = torch.tensor([[len(t), _digest(t)] for t in tokens], dtype=torch.int64,
                       device=_comm_device(tp, device)).reshape(-1)  # [rows * 2]
    got = [torch.empty_like(dig) for _ in range(tp.size)]
    torch.distributed.all_gather(got, dig, group=tp.group)
    if any(not torch.equal(g, got[0]) for g in got):
        raise RuntimeError("tensor-parallel ranks emitted different tokens (their logits or random numbers "
                           "differed): the call's output is not valid on any rank")


def all_reached(tp: TensorParallel | None, device: torch.device) -> None:
    """Every rank got here (one 8-byte all-reduce; a no-op in one process): a step's tokens are
    handed to a streaming callback only once every rank has computed them, so that no rank
    streams tokens that another rank did not reach."""
    if tp is not None:
        torch.distributed.all_reduce(torch.ones(1, device=_comm_device(tp, device)), group=tp.group)


def peer_failure(e: BaseException, tp: TensorParallel | None) -> RuntimeError | None:
    """The error a rank raises when one of its collectives failed mid-call (``e`` from gloo or
    NCCL: another rank raised and exited, or did not reach the collective within the process
    group's timeout); None when ``e`` is this rank's own error (re-raised as it is)."""
    text = str(e)
    if tp is None or not (isinstance(e, torch.distributed.DistError) or "gloo" in text or "NCCL" in text):
        return None
    first = text.strip().splitlines()[0][:200] if text.strip() else type(e).__name__
    return RuntimeError(f"tensor-parallel rank {tp.rank} of {tp.size}: a collective failed mid-call ({first}): "
                        "another rank raised or exited, or did not reach the same collective within "
                        "the process group's timeout; this call's tokens are discarded on this rank, and the ranks' "
                        "caches and process group are no longer in step (start the ranks again)")


def _digest(t: list[int]) -> int:
    h = 1469598103934665603
    for x in t:
        h = ((h ^ (x & 0xFFFFFFFF)) * 1099511628211) & 0x7FFFFFFFFFFFFFFF
    return h


def _comm_device(tp: TensorParallel, device: torch.device) -> torch.device:
    return device if torch.distributed.get_backend(tp.group) == "nccl" else torch.device("cpu")


def join_torchrun(device: str, timeout_s: float = 300.0) -> tuple[int, int, str]:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1): join the process group (gloo on a CPU, NCCL on
    CUDA, collectives bounded by ``timeout_s``) and return (rank, world size, this rank's device:
    ``cuda:LOCAL_RANK`` for CUDA). One process: (0, 1, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, device
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(torch.device(device))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return torch.distributed.get_rank(), world, device


def tp_plan_for(config, model_class, world: int) -> str | dict:
    """The TP plan to load a target with: Hugging Face's own (``"auto"``) where the world divides
    the query and KV heads, else that plan with attention kept whole on every rank (the MLPs and
    the LM head still sharded), so that no rank holds part of a head."""
    config = text_config(config)
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % world == 0 and kv % world == 0:
        return "auto"
    import transformers
    from packaging.version import Version
    from transformers.integrations import ALL_PARALLEL_STYLES

    prefix = getattr(model_class, "base_model_prefix", "model")
    base = {f"{prefix}.{k}": v for k, v in (getattr(config, "base_model_tp_plan", None) or {}).items()}
    plan = {k: v for k, v in base.items() if "self_attn" not in k}
    plan.update(getattr(model_class, "_tp_plan", None) or {})
    if Version(transformers.__version__) >= Version("5.19"):  # a plan's rules then override the model's, whose
        # attention rules would shard it: attention's say "replicated" (5.22 on "replicate"; the older style
        # replicates the weights too, its hook runs only in backward passes)
        whole = "replicate" if "replicate" in ALL_PARALLEL_STYLES else "replicated_with_grad_allreduce"
        plan.update({k: whole for k in base if "self_attn" in k})
    return plan
