import inspect
import os

import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. Must be set before triton is
# imported anywhere.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

# Triton kernels run on CPU tensors only in Triton's interpreter. `make test` runs the suite a
# second time with TRITON_INTERPRET=0 (what a GPU machine sees, minus the GPU): every test must
# then choose its CPU backends from what the machine offers.
TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
NO_TRITON_ON_CPU = "Triton runs on CPU tensors only in its interpreter (TRITON_INTERPRET=1)"


def cpu_backends(*names: str) -> list[str]:
    """The backends among ``names`` that can run on CPU tensors on this machine."""
    return [b for b in names if b != "triton" or TRITON_ON_CPU]


def skip_unless_triton_on_cpu() -> None:
    if not TRITON_ON_CPU:
        pytest.skip(NO_TRITON_ON_CPU)


def touches_triton(item) -> bool:
    """Whether a test exercises Triton: its id or its own source names it (a backend parameter,
    a Triton kernel, ``skip_unless_triton_on_cpu``, ``cpu_backends("triton", ...)``)."""
    if "triton" in item.nodeid.lower():
        return True
    fn = getattr(item, "function", None)
    try:
        return fn is not None and "triton" in inspect.getsource(fn).lower()
    except (OSError, TypeError):
        return True  # unknown: keep it


def pytest_collection_modifyitems(config, items):
    """``SEQUOIA_TRITON_ONLY=1`` (``scripts/test.sh``'s interpreter pass): only the tests that
    exercise Triton (:func:`touches_triton`) and do not compile it ahead of time (marker ``aot``)
    are run; the others ran in the first pass, whose result does not depend on the interpreter. Otherwise a parametrized case with backend
    "triton" on CPU tensors (device "cpu" or no device parameter) is skipped, with the reason,
    when Triton cannot run on CPU tensors here."""
    if os.environ.get("SEQUOIA_TRITON_ONLY") == "1":
        # ahead-of-time GPU compilation (marker "aot") runs without the interpreter in both passes: once
        wanted = [touches_triton(it) and it.get_closest_marker("aot") is None for it in items]
        config.hook.pytest_deselected(items=[it for it, w in zip(items, wanted) if not w])
        items[:] = [it for it, w in zip(items, wanted) if w]
    if TRITON_ON_CPU:
        return
    mark = pytest.mark.skip(reason=NO_TRITON_ON_CPU)
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if params.get("backend") == "triton" and params.get("device", "cpu") == "cpu":
            item.add_marker(mark)


@pytest.fixture
def one_thread():
    """Small-tensor statistics are op-overhead bound: one intra-op thread is fastest and
    immune to oversubscribed CI cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def all_cores():
    """Statistics over 10^5-10^6 rows at a time are bandwidth and sort bound: every usable core
    (1.6-1.9x faster on 2 cores than one thread); the rows are independent, so the draws are
    bitwise the same at any thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    yield
    torch.set_num_threads(n)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A same-width integer view, so that comparisons are bitwise and NaN == NaN."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise_equal(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, msg
    eq = bits(a) == bits(b)
    if not bool(eq.all()):
        idx = (~eq).nonzero()[:5].tolist()
        raise AssertionError(f"{msg}: {int((~eq).sum())} elements differ, first at {idx}")


def assert_ulp_close(got: torch.Tensor, ref: torch.Tensor, max_ulp: int, msg: str = "") -> None:
    """Non-negative fp32 tensors (probabilities) equal up to ``max_ulp`` units in the last place:
    the same zeros (the same support) and NaNs, and every other pair at most ``max_ulp`` apart
    (for non-negative floats the bit patterns order like the values)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype == torch.float32, msg
    assert torch.equal(got.isnan(), ref.isnan()), f"{msg}: NaNs differ"
    g, r = got.nan_to_num(0.0), ref.nan_to_num(0.0)
    assert bool((g >= 0).all() and (r >= 0).all()), f"{msg}: negative values"
    diff_support = (g > 0) != (r > 0)
    if bool(diff_support.any()):
        raise AssertionError(f"{msg}: support differs at {diff_support.nonzero()[:5].tolist()}")
    d = (bits(g).to(torch.int64) - bits(r).to(torch.int64)).abs()
    if int(d.max()) > max_ulp:
        i = int(d.argmax())
        raise AssertionError(f"{msg}: {int((d > max_ulp).sum())} values more than {max_ulp} ulp apart, "
                             f"worst {int(d.max())} ulp at flat index {i}: {g.flatten()[i].item()!r} vs "
                             f"{r.flatten()[i].item()!r}")


def pair_counts(rows: list[list[int]], vocab: int) -> torch.Tensor:
    """``[V, V]`` counts of each row's first two tokens (fp64)."""
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    for toks in rows:
        counts[toks[0], toks[1]] += 1
    return counts


@torch.no_grad()
def filtered_two_token_distribution(target, prompt: list[int], sampling) -> torch.Tensor:
    """P(first two new tokens) of the target's own filtered sampling (``sampling``: temperature,
    top-k, top-p), by enumeration over its vocabulary: [V, V] (fp64)."""
    from sequoia_kernels.reference.sampling import sampling_probs_reference

    def probs(logits):
        return sampling_probs_reference(logits, sampling.temperature, sampling.top_k, sampling.top_p).double()

    target.set_attn_implementation("sdpa")
    p1 = probs(target(torch.tensor([prompt])).logits[0, -1])
    p2 = probs(target(torch.tensor([prompt + [x] for x in range(target.config.vocab_size)])).logits[:, -1])
    return p1[:, None] * p2


def assert_pairs_follow(counts: torch.Tensor, exact: torch.Tensor, n: int, alpha: float = 1e-3) -> None:
    """``counts [V, V]`` of n sampled (first, second) token pairs against their exact
    distribution ``exact [V, V]``: nothing outside its support, and chi-square tests (p > alpha)
    of the first token alone and of the pairs (cells with expected count > 5, the rest pooled)."""
    from scipy.stats import chisquare

    assert float(counts[exact == 0].sum()) == 0.0, "a sampled pair has probability 0"
    c1, e1 = counts.sum(1), exact.sum(1) * n
    keep = e1 > 5
    stat = chisquare(c1[keep].numpy(), e1[keep].numpy() * c1[keep].sum().item() / e1[keep].sum().item())
    assert stat.pvalue > alpha, stat
    flat_c, flat_e = counts.flatten(), exact.flatten() * n
    keep = flat_e > 5
    obs = torch.cat([flat_c[keep], (n - flat_c[keep].sum()).reshape(1)]).numpy()
    exp = torch.cat([flat_e[keep], (n - flat_e[keep].sum()).reshape(1)]).numpy()
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    stat = chisquare(obs, exp * obs.sum() / exp.sum())
    assert stat.pvalue > alpha, stat


# ---------------------------------------------------------------- a tiny local model pair

PAIR_WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(46)]


@pytest.fixture(scope="session")
def pair_dirs(tmp_path_factory):
    """A tiny target (2 layers) and draft (1 layer) saved as Hugging Face folders with a
    word-level tokenizer over ``PAIR_WORDS``: ``({"target": dir, "draft": dir}, tokenizer)``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tiny_models import tiny_llama
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("pair")
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(PAIR_WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")
    dirs = {}
    for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
        model = tiny_llama(seed, vocab=len(PAIR_WORDS), layers=layers, max_pos=512, attn=None, eos_token_id=1)
        d = root / name
        model.save_pretrained(d)
        tok.save_pretrained(d)
        dirs[name] = str(d)
    return dirs, tok
