"""Our own weight streaming (``sequoia_decoding.streaming``, ``load_offloaded(where="stream")``): a
target whose decoder layers are read from one packed file a layer ahead of the compute, decoded
by the loop exactly as the resident model; read failures name the layer and leave the caches."""

from __future__ import annotations

import os
import re

import pytest
import torch

import tiny_models
from sequoia_decoding.generate import SamplingParams, SequoiaGenerator
from sequoia_decoding.offload import OffloadReadError, load_offloaded, offload_of
from sequoia_decoding.planner import plan_tree
from sequoia_decoding.profiles import machine_key
from sequoia_decoding.streaming import HostLayerStream, StreamedLinear, load_streamed, stream_of
from sequoia_kernels.hf import cache_kw
from sequoia_kernels.ops.packed_linear import linear_packed, pack_weight, packed_linear_supported

PROMPTS = [[5, 9, 11, 3, 7, 2, 8], [13, 4]]


def _decode(model, draft, plan, sampling, new=20):
    return SequoiaGenerator(model, draft, plan, sampling, max_length=96, packed_linears=True).generate(
        PROMPTS, max_new_tokens=new, eos_token_id=[]).tokens


def _count_forwards(model) -> list:
    calls = []
    model.model.register_forward_pre_hook(lambda mod, args: calls.append(1))
    return calls


@pytest.mark.parametrize("layers,buffers,readers", [(2, None, 2), (3, None, 2), (3, 2, 1), (5, 2, 2), (5, 3, 1),
                                                    (7, 4, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["direct", "buffered", "host"])
def test_a_streamed_target_decodes_as_the_resident_one(tmp_path, layers, buffers, readers, dtype, mode):
    """Greedy and sampled (seeded), batch 2, ragged: the loop on the streamed target emits what it
    emits on the resident one, greedy Sequoia what plain decoding emits; every forward reads each
    layer once; the layers' weights live in the stream's buffers only. ``buffers``: the disk
    stream's (default: every layer its own here; fewer than the layers, and not dividing them: the
    reads ahead stop where a buffer is still in use, across the end of a forward too); ``readers``: its
    reads in flight (the default, 2, through ``load_offloaded``). ``host``: the
    GPU path's schedule (the file held in memory, copied into two buffers a layer ahead) on the CPU."""
    from transformers import AutoModelForCausalLM

    if not packed_linear_supported(dtype) and dtype == torch.bfloat16:
        pytest.skip("no packed bf16 path on this CPU")
    tiny_models.tiny_llama(0, vocab=61, layers=layers, sharpen=3.0).save_pretrained(tmp_path / "target")
    draft = tiny_models.tiny_llama(1, vocab=61, layers=1, sharpen=3.0).to(dtype)
    resident = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=dtype).eval()
    if mode == "direct" and buffers is None:
        target = load_offloaded(str(tmp_path / "target"), dtype=dtype, device="cpu", where="stream",
                                folder=str(tmp_path / "w"))
    else:  # buffered reads, the pages dropped after each; or from host memory
        target = load_streamed(str(tmp_path / "target"), dtype=dtype, folder=tmp_path / "w", direct=mode == "direct",
                               source="host" if mode == "host" else "disk", buffers=buffers, readers=readers)
    stream = stream_of(target)
    assert mode == "host" or (stream.k, stream._pool._max_workers) == (buffers or layers, readers)
    assert isinstance(stream, HostLayerStream) == (mode == "host")
    assert mode != "buffered" or not stream.direct  # direct where asked and the file system takes O_DIRECT
    assert offload_of(target) == "stream" and machine_key(target, draft, torch.device("cpu"), dtype)["offload"] == "stream"
    plan = plan_tree([0.6, 0.2, 0.1], 8, 4)
    forwards = _count_forwards(target)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=5)):
        got = [_decode(m, d, p, sampling) for m, d, p in ((target, draft, plan), (resident, draft, plan),
                                                           (target, None, None))]
        assert got[0] == got[1], (layers, dtype, sampling)
        if sampling.temperature == 0:
            assert got[0] == got[2]
    stream.drain()  # the reads ahead of the next forward's first layers
    ahead = 1 if mode == "host" else stream.k - 1
    assert len(forwards) * layers <= stream.reads <= len(forwards) * layers + ahead
    for i, layer in enumerate(target.model.layers):
        buf = stream.buffer_of(i)
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
        assert all(lo <= p.data_ptr() < hi for p in layer.parameters()), i
        assert not any(type(m) is torch.nn.Linear for m in layer.modules())
        assert sum(isinstance(m, StreamedLinear) for m in layer.modules()) == 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_streamed_linear_is_the_packed_product_at_every_row_count(dtype, bias):
    """Against the packed op on the same weight (bitwise), an fp64 product (within the dtype's
    rounding), and its own one-row calls (bitwise: a row never depends on the others)."""
    if not packed_linear_supported(dtype):
        pytest.skip(f"no packed path for {dtype} on this CPU")
    g = torch.Generator().manual_seed(3)
    N, K = 83, 45  # awkward: padded panels and k pairs
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    lin = StreamedLinear(K, N, pack_weight(w), b, packed=True)
    for rows in (1, 2, 7, 64, 130):
        x = torch.randn(rows, K, generator=g).to(dtype)
        y = lin(x)
        want = linear_packed(x, pack_weight(w), N, rows)
        if b is not None:
            want += b
        assert torch.equal(y, want)
        ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * K ** 0.5)
        one = torch.cat([lin(x[r:r + 1]) for r in range(rows)])
        assert torch.equal(y, one)
    with pytest.raises(ValueError, match="streamed linear: input"):
        lin(torch.randn(2, K, dtype=torch.float64))


def test_the_stream_file_is_written_once_and_again_when_the_checkpoint_changes(tmp_path):
    tiny_models.tiny_llama(0, vocab=61, layers=2).save_pretrained(tmp_path / "target")
    kw = dict(dtype=torch.float32, device="cpu", where="stream", folder=str(tmp_path / "w"))
    first = load_offloaded(str(tmp_path / "target"), **kw)
    file = stream_of(first).file
    mtime = os.stat(file).st_mtime_ns
    ids = torch.tensor([PROMPTS[0]])
    a = first(ids).logits
    assert torch.equal(load_offloaded(str(tmp_path / "target"), **kw)(ids).logits, a)
    assert os.stat(file).st_mtime_ns == mtime  # reused
    with open(file + ".json", "w") as f:
        f.write('{"format": 1, "sour')  # an index cut short (a crash while writing it): written again
    assert torch.equal(load_offloaded(str(tmp_path / "target"), **kw)(ids).logits, a)
    assert os.stat(file).st_mtime_ns != mtime and not list((tmp_path / "w").glob("*.tmp*"))
    mtime = os.stat(file).st_mtime_ns
    tiny_models.tiny_llama(7, vocab=61, layers=2).save_pretrained(tmp_path / "target")
    from transformers import AutoModelForCausalLM

    want = AutoModelForCausalLM.from_pretrained(tmp_path / "target").eval()(ids).logits
    again = load_offloaded(str(tmp_path / "target"), **kw)
    assert os.stat(file).st_mtime_ns != mtime
    assert torch.allclose(again(ids).logits, want, atol=1e-5) and not torch.allclose(a, want, atol=1e-3)


def test_stream_read_failures_name_the_layer_and_keep_the_caches(tmp_path):
    """The stream file cut short mid-run: the forward raises :class:`OffloadReadError` naming the
    first layer it cannot read, before that layer computes; gone: naming the first layer; a target
    cache keeps its committed entries through both; with the file back, decoding is as before."""
    from sequoia_kernels.hf import SequoiaCache

    tiny_models.tiny_llama(0, vocab=61, layers=3, sharpen=3.0).save_pretrained(tmp_path / "target")
    draft = tiny_models.tiny_llama(1, vocab=61, layers=1, sharpen=3.0)
    target = load_offloaded(str(tmp_path / "target"), dtype=torch.float32, device="cpu", where="stream",
                            folder=str(tmp_path / "w"))
    stream = stream_of(target)
    file, saved = stream.file, open(stream.file, "rb").read()
    plan = plan_tree([0.6, 0.2, 0.1], 8, 4)
    before = _decode(target, draft, plan, SamplingParams(), new=12)
    cut = stream.index["layers"][2]["offset"] + 4096
    calls = []

    def truncate(module, args):
        calls.append(1)
        if len(calls) == 3:
            os.truncate(file, cut)

    handle = target.model.layers[1].register_forward_pre_hook(truncate)
    with pytest.raises(OffloadReadError, match=r"offloaded layer model\.layers\.2: cannot read its weights from "
                                               + re.escape(file) + r" .*shorter than its index"):
        _decode(target, draft, plan, SamplingParams(), new=12)
    handle.remove()
    cache = SequoiaCache(target.config, batch_size=1, max_cache_len=32)
    with open(file, "wb") as f:
        f.write(saved)
    target(torch.tensor([PROMPTS[0]]), **cache_kw(target, cache), use_cache=True)
    cache.commit(len(PROMPTS[0]))
    kept, lens = cache.tensor.clone(), cache.prefix_len.clone()
    for broken in ("truncated", "gone"):
        if broken == "truncated":
            os.truncate(file, cut)
            match = r"model\.layers\.2: .*shorter than its index"
        else:
            os.rename(file, file + ".away")
            match = r"model\.layers\.0: cannot read its weights from " + re.escape(file) + r" .*FileNotFoundError"
        with pytest.raises(OffloadReadError, match=match):
            target(torch.tensor([[4, 5]]), **cache_kw(target, cache), use_cache=True)
        assert torch.equal(cache.prefix_len, lens)
        assert torch.equal(cache.tensor[:, :, :, :len(PROMPTS[0])], kept[:, :, :, :len(PROMPTS[0])])
    with open(file, "wb") as f:
        f.write(saved)
    assert _decode(target, draft, plan, SamplingParams(), new=12) == before


def test_stream_bad_input(tmp_path):
    model = tiny_models.tiny_llama(0, vocab=61, layers=2)
    model.save_pretrained(tmp_path / "target")
    with pytest.raises(ValueError, match="a GPU from 'host'"):
        load_streamed(str(tmp_path / "target"), dtype=torch.float32, folder=tmp_path / "w", device="cuda",
                      source="disk")
    with pytest.raises(ValueError, match="at least one reader thread, got readers=0"):
        load_streamed(str(tmp_path / "target"), dtype=torch.float32, folder=tmp_path / "w", readers=0)
    with pytest.raises(ValueError, match="from 'tape'"):
        load_streamed(str(tmp_path / "target"), dtype=torch.float32, folder=tmp_path / "w", source="tape")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device here"):
            load_offloaded(str(tmp_path / "target"), dtype=torch.float32, device="cuda", where="stream",
                           folder=str(tmp_path / "w"))
    bin_dir = tmp_path / "bin"
    model.config.save_pretrained(bin_dir)
    torch.save(model.state_dict(), bin_dir / "pytorch_model.bin")
    with pytest.raises(ValueError, match="writes its file from safetensors weights; none in"):
        load_offloaded(str(bin_dir), dtype=torch.float32, device="cpu", where="stream", folder=str(tmp_path / "w"))



@pytest.mark.parametrize("where", ["stream", "disk"])
def test_an_offload_folder_that_cannot_be_made_is_named(tmp_path, where):
    """A file where the offload folder would be, or among its parents: a ValueError naming the
    folder (not an errno), before anything is written."""
    tiny_models.tiny_llama(0, vocab=61, layers=2).save_pretrained(tmp_path / "target")
    (tmp_path / "a-file").write_text("")
    kw = dict(dtype=torch.float32, device="cpu", where=where)
    with pytest.raises(ValueError, match=r"offload folder .*a-file: a file of that name is in the way"):
        load_offloaded(str(tmp_path / "target"), folder=str(tmp_path / "a-file"), **kw)
    with pytest.raises(ValueError, match=r"offload folder .*a-file/w cannot be made: Not a directory"):
        load_offloaded(str(tmp_path / "target"), folder=str(tmp_path / "a-file" / "w"), **kw)

def test_a_file_system_without_o_direct_falls_back_to_dropped_pages(tmp_path, monkeypatch):
    """``O_DIRECT`` refused (EINVAL at open, as on some file systems): buffered reads, the same
    results."""
    import errno

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here")
    tiny_models.tiny_llama(0, vocab=61, layers=2).save_pretrained(tmp_path / "target")
    ids = torch.tensor([PROMPTS[0]])
    kw = dict(dtype=torch.float32, device="cpu", where="stream", folder=str(tmp_path / "w"))
    want = load_offloaded(str(tmp_path / "target"), **kw)(ids).logits
    real_open = os.open

    def no_direct(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", no_direct)
    target = load_offloaded(str(tmp_path / "target"), **kw)
    assert torch.equal(target(ids).logits, want) and not stream_of(target).direct


def test_a_host_stream_whose_file_is_short_names_the_layer_at_load(tmp_path):
    """``source="host"`` reads the file once, at load: cut short, the load raises naming the first
    layer it misses."""
    tiny_models.tiny_llama(0, vocab=61, layers=3).save_pretrained(tmp_path / "target")
    kw = dict(dtype=torch.float32, folder=tmp_path / "w", source="host")
    stream = stream_of(load_streamed(str(tmp_path / "target"), **kw))
    os.truncate(stream.file, stream.index["layers"][1]["offset"] + 100)  # the index still matches: kept
    with pytest.raises(OffloadReadError, match=r"offloaded layer model\.layers\.1: .*shorter than its index"):
        load_streamed(str(tmp_path / "target"), **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_target_streamed_from_pinned_host_memory_decodes_as_the_resident_one_on_a_gpu(tmp_path, cuda_graphs):
    """The GPU path: the layers in pinned host memory, copied to the device a layer ahead on a side
    stream; greedy and sampled decoding (eager and in a CUDA graph) as the resident model on the
    GPU, each forward copies each layer once, the parameters are views into the two device buffers."""
    from transformers import AutoModelForCausalLM

    tiny_models.tiny_llama(0, vocab=61, layers=4, sharpen=3.0).save_pretrained(tmp_path / "target")
    draft = tiny_models.tiny_llama(1, vocab=61, layers=1, sharpen=3.0).cuda()
    resident = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32).cuda().eval()
    target = load_offloaded(str(tmp_path / "target"), dtype=torch.float32, device="cuda", where="stream",
                            folder=str(tmp_path / "w"))
    stream = stream_of(target)
    assert isinstance(stream, HostLayerStream) and stream._host.is_pinned()
    plan = plan_tree([0.6, 0.2, 0.1], 8, 4)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=5)):
        got = [SequoiaGenerator(m, d, p, sampling, max_length=96, cuda_graphs=cuda_graphs).generate(
            PROMPTS, max_new_tokens=20, eos_token_id=[]).tokens
            for m, d, p in ((target, draft, plan), (resident, draft, plan), (target, None, None))]
        assert got[0] == got[1], sampling
        if sampling.temperature == 0:
            assert got[0] == got[2]
    for i, layer in enumerate(target.model.layers):
        buf = stream.buffer_of(i)
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
        assert all(p.is_cuda and lo <= p.data_ptr() < hi for p in layer.parameters()), i
    reads = stream.reads
    target(torch.tensor([PROMPTS[0]], device="cuda"))
    assert stream.reads - reads in (4, 5)  # each layer once (the first already prefetched, or not)


def test_the_offload_check_gpu_check_runs(tmp_path):
    """``bench/offload_gpu_check.py`` (what ``bench/gpu_check.sh`` runs on a GPU with 7B-shaped
    layers) here on the CPU, tiny: the host-memory stream's tokens equal the resident model's."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "offload_gpu_check.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--layers", "3", "--hidden", "128",
                           "--inter", "256", "--heads", "4", "--sizes", "1,8", "--repeats", "1", "--dir", str(tmp_path)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "offload_gpu_check: ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("streamed == resident: True") == 4
