"""Our own weight streaming for an offloaded target (``load_offloaded(..., where="stream")``).

The decoder layers' weights live in one file, written once from the checkpoint's safetensors in
the model's dtype, each layer one page-aligned region and each ``nn.Linear`` weight already in
``packed_linear``'s layout (no per-forward conversion or pack). ``k`` layer-sized buffers hold the
weights in memory (2 to 8, as many as 64 MB hold); every decoder layer's parameters are fixed views
into one of them (layer ``i`` into buffer ``i % k``). A forward pre-hook on layer ``i`` waits for its
region to have been read and hands the reads of the next layers whose buffers are free (up to
``k - 1`` ahead, wrapping to the next forward's first layers) to two reader threads (two reads in
flight: the disk stays busier than with one), so they stream in while layer ``i`` computes and
while the loop drafts and verifies between two forwards. Reads bypass the page cache
(``O_DIRECT``; where the file system refuses it, buffered reads whose pages are dropped after each
read): every forward reads the disk, as for a model larger than memory, and the resident set is
``k`` layers. A forward's first layer checks the file (reopened when replaced or rewritten): a
file gone or unreadable, or a region read short, raises :class:`OffloadReadError` naming the
layer before that layer computes (the caches keep their committed entries).

On a GPU (:class:`HostLayerStream`) the file is read once into pinned host memory and each
forward copies layer ``i + 1`` to the device on a side CUDA stream while layer ``i`` computes (two
device buffers, an event per layer): Sequoia's offloading setting, the PCIe bus in place of the
disk.

The cost of a forward is max(stream, compute) per layer plus the first layer's read: nothing that
depends on the tree but the compute (``docs/offloading.md``).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from sequoia_kernels.ops.packed_linear import linear_packed, pack_weight, packed_linear_supported

__all__ = ["OffloadReadError", "offload_folder", "StreamedLinear", "LayerStream", "HostLayerStream", "write_stream",
           "load_streamed", "stream_of"]

STREAM_FORMAT = 1
PAGE = 4096  # regions page-aligned: O_DIRECT reads whole pages into page-aligned buffers
ALIGN = 256  # each tensor within a region (as the CUDA allocator aligns: GEMMs pick the kernels they pick for it)
# LayerStream: its buffers by default take up to this many bytes (2 to MAX_STREAM_BUFFERS layers): the
# reads run that many layers ahead, over the time between two forwards too (the draft's levels,
# verification, compaction), when the disk would otherwise wait for the next forward's second layer
STREAM_BUFFER_BYTES = 64 << 20
MAX_STREAM_BUFFERS = 8
# reader threads: two reads in flight keep the disk busier than one (a second request queued while
# the first completes and its thread waits for the GIL): plain decoding 6% and 12%, 64-node steps 4%
# and 12% faster in two A/Bs against one reader (AMD EPYC Zen 4, bf16; docs/offloading.md)
STREAM_READERS = 2


class OffloadReadError(OSError):
    """An offloaded weight could not be read (its file or folder went missing, became unreadable
    or was truncated) during a forward. Raised before the layer computes, so the caches the forward
    was writing keep their committed entries: decoding can resume once the files are back."""


class StreamedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight is a view into a stream buffer, stored as ``packed_linear``
    reads it when ``packed`` (``weight`` then has the packed shape, not [N, K]). Calls of any row
    count run the packed op (so a row's result never depends on the other rows: the tree step and
    the plain step agree bitwise); unpacked, ``F.linear``."""

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor, bias: torch.Tensor | None,
                 packed: bool):
        super().__init__()
        self.in_features, self.out_features, self.packed = in_features, out_features, packed
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if not self.packed:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if x.dtype != self.weight.dtype:
            raise ValueError(f"streamed linear: input {x.dtype}, weight {self.weight.dtype}")
        y = linear_packed(x, self.weight, self.out_features, x.numel() // self.in_features)
        if self.bias is not None:
            y += self.bias
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.packed}"


def _layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def _checkpoint_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"offload 'stream' writes its file from safetensors weights; none in {path} "
                         f"(use offload 'disk' for other checkpoints)")
    return files


def _source_key(files: list[Path], dtype: torch.dtype, pack: bool) -> str:
    parts = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return hashlib.sha1("|".join([*parts, str(dtype), str(pack), str(STREAM_FORMAT)]).encode()).hexdigest()[:16]


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def write_stream(path: str | os.PathLike, dtype: torch.dtype, out: str | os.PathLike, num_layers: int,
                 pack: bool) -> dict:
    """Write the decoder layers of the safetensors checkpoint in ``path`` to ``out`` (atomic) and
    return its index (also written, as ``out`` + ``.json``): per layer its region and per tensor
    its name, shape, dtype, offset within the region and whether it is packed. ``pack``: 2-D
    ``*.weight`` tensors of ``nn.Linear`` modules in ``packed_linear``'s layout (the caller knows
    which names those are: every 2-D weight of a Llama decoder layer)."""
    from safetensors import safe_open

    files, out = _checkpoint_files(Path(path)), Path(out)
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {k: h for h in handles for k in h.keys()}
    index = {"format": STREAM_FORMAT, "source": _source_key(files, dtype, pack), "dtype": str(dtype), "layers": []}
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for i in range(num_layers):
                index["layers"].append(_write_layer(f, where, i, dtype, pack, path))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        tmp = Path(str(out) + f".json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(index))
        os.replace(tmp, str(out) + ".json")
    finally:
        Path(tmp).unlink(missing_ok=True)
    return index


def _write_layer(f, where: dict, i: int, dtype: torch.dtype, pack: bool, path) -> dict:
    """Layer ``i``'s tensors appended to ``f`` (the region page-aligned, each tensor ALIGN-aligned);
    its index entry."""
    names = sorted(k for k in where if k.startswith(_layer_prefix(i)))
    if not names:
        raise ValueError(f"offload 'stream': no weights for layer {i} in {path}")
    start, tensors, offset = f.tell(), [], 0
    for name in names:
        t = where[name].get_tensor(name).to(dtype)
        packed = pack and t.dim() == 2 and name.endswith(".weight")
        data = (pack_weight(t) if packed else t).contiguous()
        f.write(b"\0" * (_round(offset, ALIGN) - offset))
        offset = _round(offset, ALIGN)
        f.write(data.view(torch.uint8).reshape(-1).numpy().tobytes())
        tensors.append({"name": name[len(_layer_prefix(i)):], "shape": list(t.shape),
                        "stored": list(data.shape), "offset": offset, "packed": packed})
        offset += data.numel() * data.element_size()
    length = _round(offset, PAGE)
    f.write(b"\0" * (length - offset))
    return {"offset": start, "length": length, "tensors": tensors}


def _aligned_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A page-aligned anonymous buffer (O_DIRECT reads into it) and a uint8 tensor over it."""
    mm = mmap.mmap(-1, max(nbytes, PAGE))
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


class LayerStream:
    """Reads the layers' regions of a stream file into ``buffers`` layer-sized buffers (layer ``i``
    into buffer ``i % buffers``; default: as many as ``STREAM_BUFFER_BYTES`` hold, 2 to
    ``MAX_STREAM_BUFFERS``), up to ``buffers - 1`` layers ahead of the layer computing (see the
    module's docstring), ``readers`` reads in flight at a time (started in layer order, each layer's
    own buffer: they never touch the same bytes). ``reads`` / ``bytes_read`` count what it read."""

    def __init__(self, file: str | os.PathLike, index: dict, names: list[str], direct: bool = True,
                 buffers: int | None = None, readers: int = STREAM_READERS):
        self.file, self.index, self.names = str(file), index, names
        self.direct = direct and hasattr(os, "O_DIRECT")
        size = max(layer["length"] for layer in index["layers"])
        k = buffers if buffers is not None else min(MAX_STREAM_BUFFERS, STREAM_BUFFER_BYTES // max(size, 1))
        self.k = max(2, min(int(k), len(index["layers"])))
        self._buffers = [_aligned_buffer(size) for _ in range(self.k)]
        self._fd: int | None = None
        self._opened: tuple | None = None  # (inode, size, mtime) of the file the fd reads
        if int(readers) < 1:
            raise ValueError(f"a stream needs at least one reader thread, got readers={readers}")
        self._pool = ThreadPoolExecutor(max_workers=int(readers), thread_name_prefix="sequoia-stream")
        self._pending: dict[int, Future] = {}  # layer -> its read in flight (or done, not yet waited for)
        self._lock = threading.Lock()
        self.reads = self.bytes_read = 0

    def buffer_of(self, i: int) -> torch.Tensor:  # [bytes] uint8, the buffer layer i's views point into
        return self._buffers[i % self.k][1]

    def _failed(self, i: int, e: BaseException) -> OffloadReadError:
        layer = self.index["layers"][i]
        return OffloadReadError(f"offloaded layer {self.names[i]}: cannot read its weights from {self.file} "
                                f"(bytes {layer['offset']}..{layer['offset'] + layer['length']}; "
                                f"{type(e).__name__}: {e}); the caches keep their committed entries")

    def _reopen(self) -> None:
        """The fd on the file as it is now (O_DIRECT unless its file system refuses it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = self._opened = None
        try:
            fd = os.open(self.file, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except OSError as e:
            if not (self.direct and e.errno == 22):  # EINVAL: no O_DIRECT on this file system
                raise
            self.direct = False
            fd = os.open(self.file, os.O_RDONLY)
        st = os.fstat(fd)
        self._fd, self._opened = fd, (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self, i: int) -> None:
        """Layer ``i``'s region into its buffer (in the reader thread, or inline)."""
        layer = self.index["layers"][i]
        try:
            with self._lock:  # the fd is (re)opened by one thread at a time
                if self._fd is None:
                    self._reopen()
                fd = self._fd
            view = memoryview(self._buffers[i % self.k][0])[:layer["length"]]
            got = os.preadv(fd, [view], layer["offset"])
            if not self.direct:  # the pages dropped: the next forward reads the disk again
                os.posix_fadvise(fd, layer["offset"], layer["length"], os.POSIX_FADV_DONTNEED)
            if got != layer["length"]:
                raise OSError(f"read {got} of {layer['length']} bytes (the file is shorter than its index)")
        except OSError as e:
            raise self._failed(i, e) from e
        with self._lock:
            self.reads += 1
            self.bytes_read += layer["length"]

    def _same_file(self) -> bool:
        """At a forward's start: whether the open fd still reads the file at its path as it is
        (not replaced, truncated or rewritten); raises naming the first layer when it is gone."""
        try:
            st = os.stat(self.file)
        except OSError as e:
            raise self._failed(0, e) from e
        return self._opened == (st.st_ino, st.st_size, st.st_mtime_ns)

    def before_layer(self, i: int) -> None:
        """Layer ``i``'s weights in place (its read waited for, or done now), the reads of the layers
        after it started, as far as their buffers are free (``_read_ahead``). The first layer also
        checks the file: replaced or changed since it was opened, it is opened again and the layer
        read from it."""
        stale = i == 0 and not self._same_file()
        pending = None if stale else self._pending.pop(i, None)
        if pending is not None:
            pending.result()
        else:  # the first forward, a forward after a failed one, or a changed file: the reads in flight end first
            self.drain()
            if stale:
                self._pending.clear()  # what they read came from the old file
                try:
                    self._reopen()
                except OSError as e:
                    raise self._failed(0, e) from e
            self._read(i)
        self._read_ahead(i)

    def _read_ahead(self, i: int) -> None:
        """Starts the reads of the layers after ``i`` (wrapping to the next forward's first ones)
        whose buffers no layer from ``i`` up to them uses: at most ``k - 1`` ahead. A read in flight
        for a layer outside that window (a forward that ended early) is waited for and dropped."""
        L, window, used = len(self.index["layers"]), [], {i % self.k}
        for step in range(1, self.k):
            j = (i + step) % L
            if j % self.k in used:
                break
            used.add(j % self.k)
            window.append(j)
        for j in [j for j in self._pending if j not in window]:
            self._pending.pop(j).exception()
        for j in window:
            if j not in self._pending:
                self._pending[j] = self._pool.submit(self._read, j)

    def drain(self) -> None:
        """Wait for the reads in flight, if any (they stay pending: a failed one raises at the layer that needs it)."""
        for fut in list(self._pending.values()):
            fut.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = self._opened = None


class HostLayerStream:
    """The stream file's layers held in host memory (pinned on a GPU), each forward copied into two
    device buffers one layer ahead of the compute: at layer ``i``'s pre-hook layer ``i + 1``'s copy
    is enqueued on a side CUDA stream, after the compute stream's work so far (layer ``i - 1``, the
    last reader of that buffer), and layer ``i`` waits for its own copy's event: the copy of layer
    ``i + 1`` overlaps layer ``i``'s compute. The last layer prefetches the next forward's first
    where their buffers differ, until a forward is captured in a CUDA graph: a captured forward
    copies all its layers and joins every copy, and its replays (which run no hooks) may come
    between two eager forwards, so from then on each forward copies its first layer itself
    (capture after a ``torch.cuda.synchronize()``, as the loop does, so that no copy from before
    the capture is still in flight). On a CPU the same schedule runs with inline copies (that
    path's logic, testable without a GPU; slower than a resident model). ``reads`` /
    ``bytes_read`` count the copies."""

    def __init__(self, file: str | os.PathLike, index: dict, names: list[str], device: torch.device):
        self.file, self.index, self.names, self.device = str(file), index, names, torch.device(device)
        cuda = self.device.type == "cuda"
        layers = index["layers"]
        self._host = torch.empty(max(x["offset"] + x["length"] for x in layers), dtype=torch.uint8,
                                 pin_memory=cuda)  # [bytes]: the whole file
        self._read_file()
        size = max(x["length"] for x in layers)
        self._buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self._copier = torch.cuda.Stream(self.device) if cuda else None
        self._done = [torch.cuda.Event() for _ in layers] if cuda else None  # layer i's copy enqueued before it
        self._pending: int | None = None  # the layer whose copy was enqueued ahead
        self._captured = False  # a forward was captured: its replays may run between eager forwards
        self.reads = self.bytes_read = 0

    def _read_file(self) -> None:
        """The file into host memory (once, at load); a short file names the first layer it cuts."""
        view, got = memoryview(self._host.numpy()), 0
        with open(self.file, "rb", buffering=0) as f:
            while got < len(view):
                n = f.readinto(view[got:got + (1 << 30)])
                if not n:
                    break
                got += n
        cut = [i for i, x in enumerate(self.index["layers"]) if x["offset"] + x["length"] > got]
        if cut:
            raise OffloadReadError(f"offloaded layer {self.names[cut[0]]}: {self.file} holds {got} bytes, its "
                                   f"index {len(view)}: the file is shorter than its index")

    def buffer_of(self, i: int) -> torch.Tensor:  # [bytes] uint8, the buffer layer i's views point into
        return self._buffers[i % 2]

    def _copy(self, i: int) -> None:
        """Layer ``i``'s bytes into its buffer: enqueued on the side stream (CUDA), or done now."""
        layer = self.index["layers"][i]
        src = self._host[layer["offset"]:layer["offset"] + layer["length"]]
        dst = self._buffers[i % 2][:layer["length"]]
        self.reads, self.bytes_read = self.reads + 1, self.bytes_read + layer["length"]
        if self._copier is None:
            dst.copy_(src)
            return
        self._copier.wait_stream(torch.cuda.current_stream(self.device))  # the buffer's last reader enqueued
        with torch.cuda.stream(self._copier):
            dst.copy_(src, non_blocking=True)
            self._done[i].record(self._copier)

    def before_layer(self, i: int) -> None:
        """Layer ``i``'s weights in place (its copy waited for, or made now), layer ``i + 1``'s copy
        enqueued (see the class docstring)."""
        capturing = self._copier is not None and torch.cuda.is_current_stream_capturing()
        self._captured |= capturing
        pending, self._pending = self._pending, None
        if pending != i or (capturing and i == 0):  # a capture copies its first layer itself
            self._copy(i)
        if self._copier is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done[i])
        nxt = (i + 1) % len(self.index["layers"])
        if nxt % 2 != i % 2 and not (nxt == 0 and self._captured):  # a capture leaves no copy unjoined
            self._copy(nxt)
            self._pending = nxt

    def drain(self) -> None:
        """Wait for the copies in flight, if any."""
        if self._copier is not None:
            self._copier.synchronize()

    def close(self) -> None:
        self.drain()


def _views(buffer: torch.Tensor, layer: dict, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, dict]]:
    """Each tensor of ``layer`` (its index entry) as a view of ``buffer``: name -> (view, entry)."""
    out = {}
    for t in layer["tensors"]:
        nbytes = math.prod(t["stored"]) * dtype.itemsize
        out[t["name"]] = buffer[t["offset"]:t["offset"] + nbytes].view(dtype).view(t["stored"]), t
    return out


def _attach(layer_module: torch.nn.Module, views: dict) -> None:
    """The decoder layer's parameters set to their buffer views; its ``nn.Linear`` modules replaced
    by :class:`StreamedLinear` over them."""
    linears = {n: m for n, m in layer_module.named_modules() if type(m) is torch.nn.Linear}
    for name, lin in linears.items():
        w, spec = views.pop(f"{name}.weight")
        b = views.pop(f"{name}.bias", (None, None))[0]
        new = StreamedLinear(lin.in_features, lin.out_features, w, b, spec["packed"])
        parent = layer_module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer_module
        setattr(parent, name.rsplit(".", 1)[-1], new)
    for name, (view, spec) in views.items():
        if spec["packed"]:
            raise ValueError(f"offload 'stream': {name} was stored packed but is no nn.Linear weight")
        mod_name, _, attr = name.rpartition(".")
        mod = layer_module.get_submodule(mod_name) if mod_name else layer_module
        if attr not in mod._parameters:
            raise ValueError(f"offload 'stream': the checkpoint's {name} is no parameter of the model's layer")
        mod._parameters[attr] = torch.nn.Parameter(view, requires_grad=False)


def offload_folder(folder) -> Path:
    """``folder`` (where offloaded layers are written), made where missing; a ValueError naming it
    where it cannot be: a file is in the way, or it is not readable and writable."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"offload folder {folder}: a file of that name is in the way") from None
    except OSError as e:  # a file as one of its parents, no permission, a read-only file system
        raise ValueError(f"offload folder {folder} cannot be made: {e.strerror or e}") from None
    if not os.access(folder, os.W_OK | os.R_OK | os.X_OK):
        raise ValueError(f"offload folder is not readable and writable: {folder}")
    return Path(folder)


def load_streamed(path: str, *, dtype: torch.dtype, folder: str | os.PathLike, direct: bool = True,
                  device: str | torch.device = "cpu", source: str | None = None, buffers: int | None = None,
                  readers: int = STREAM_READERS):
    """The causal LM in ``path`` (safetensors) on ``device`` with its decoder layers streamed from
    a file under ``folder`` (written on the first load, rewritten when the checkpoint or dtype
    changes); everything else resident. ``source``: ``"disk"`` (the CPU's default) reads the file
    at every forward (:class:`LayerStream`; ``direct``: bypass the page cache, else the pages are
    dropped after each read); ``"host"`` (the GPU's default, the only one there) holds it in
    pinned host memory and copies each layer to the device per forward (:class:`HostLayerStream`).
    ``buffers``: the disk stream's layer buffers (default: ``LayerStream``'s); ``readers``: its
    reads in flight at a time (``STREAM_READERS``)."""
    from transformers import AutoConfig

    device = torch.device(device)
    source = source or ("disk" if device.type == "cpu" else "host")
    if source not in ("disk", "host") or (source == "disk" and device.type != "cpu"):
        raise ValueError(f"offload 'stream' from {source!r} to {device.type!r}: the CPU streams from 'disk' or "
                         f"'host', a GPU from 'host' (its layers in pinned host memory)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"offload 'stream' to {device}: no CUDA device here")
    config = AutoConfig.from_pretrained(path)
    pack = device.type == "cpu" and packed_linear_supported(dtype)  # a GPU reads the plain [N, K] weights
    files = _checkpoint_files(Path(path))
    offload_folder(folder)
    kind = "" if device.type == "cpu" else f"-{device.type}"
    file = Path(folder) / f"layers-{str(dtype).replace('torch.', '')}{kind}.stream"
    index_file = Path(str(file) + ".json")
    try:
        index = json.loads(index_file.read_text()) if file.is_file() else None
    except (OSError, ValueError):  # none yet, or unreadable: written again
        index = None
    if index is None or index.get("source") != _source_key(files, dtype, pack):
        index = write_stream(path, dtype, file, int(config.num_hidden_layers), pack)
    model = _resident_rest(path, config, files, dtype, device)
    layers, names = model.model.layers, [f"model.layers.{i}" for i in range(len(model.model.layers))]
    stream = (LayerStream(file, index, names, direct=direct, buffers=buffers, readers=readers) if source == "disk"
              else HostLayerStream(file, index, names, device))
    for i, layer in enumerate(layers):
        _attach(layer, _views(stream.buffer_of(i), index["layers"][i], dtype))
        layer.register_forward_pre_hook(lambda mod, args, i=i: stream.before_layer(i))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]  # the layers' too
    if left:
        raise ValueError(f"offload 'stream': no weights in {path} for {left}")
    model._sequoia_offload, model._sequoia_stream = "stream", stream
    weakref.finalize(model, stream.close)  # the reader thread and the descriptor go with the model
    return model


def _resident_rest(path: str, config, files: list[Path], dtype: torch.dtype, device: torch.device):
    """The model built on the meta device (no accelerate needed), all but its decoder layers
    loaded on ``device`` (embedding, final norm, LM head); modules whose buffers are computed at
    construction (RoPE's inverse frequencies) built again there."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                if not k.startswith("model.layers."):
                    mod_name, _, attr = k.rpartition(".")
                    mod = model.get_submodule(mod_name)
                    mod._parameters[attr] = torch.nn.Parameter(h.get_tensor(k).to(device, dtype), requires_grad=False)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    for name, mod in list(model.named_modules()):
        if any(b is not None and b.is_meta for b in mod._buffers.values()):
            try:
                with torch.device(device):
                    fresh = type(mod)(config=mod.config if hasattr(mod, "config") else config)
            except TypeError as e:
                raise ValueError(f"offload 'stream': cannot build {name} ({type(mod).__name__}) again on {device}: "
                                 f"its buffers are computed at construction") from e
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, fresh)
    return model


def stream_of(model) -> LayerStream | HostLayerStream | None:
    """The stream (:class:`LayerStream` or :class:`HostLayerStream`) of a target :func:`load_streamed`
    made, else None."""
    return getattr(model, "_sequoia_stream", None)
