"""Switches of a model that hold for one thread: the thread that made them (a decoding loop's).

The loop switches the models it decodes with for the length of a call (``"sequoia_tree"``
attention, packed linears, fused and lean layers: ``sequoia_decoding.patching``). A server may
meanwhile run plain ``generate()`` on the same model from another thread (a request with options
the tree verifier does not take, say). That thread must see the model as it was: switched modules
run their own forward for it (:func:`for_this_thread`), and its attention and masks are the
model's own implementation (:func:`use_tree_attention`: the config answers ``_attn_implementation``
by the calling thread). A plain batch with left padding otherwise had its padding ignored (the
``"sequoia_tree"`` implementation builds no mask) or met a switched linear half-restored.
"""

from __future__ import annotations

import contextlib
import copyreg
import functools
import threading
from collections.abc import Iterator

__all__ = ["for_this_thread", "use_tree_attention"]

ATTN_IMPLEMENTATION = "sequoia_tree"  # the name sequoia_kernels.hf registers its attention under

# id(config) -> the thread whose forwards use "sequoia_tree" (use_tree_attention; a config in one block at a time)
_TREE_THREAD: dict[int, int] = {}
_PER_THREAD_CLASS: dict[type, type] = {}  # a config class -> its subclass answering per thread


def for_this_thread(fast, plain):
    """A forward that runs ``fast`` for the calling thread and ``plain`` for every other thread
    (``inspect.signature`` and the name read ``plain``'s)."""
    owner = threading.get_ident()

    @functools.wraps(plain)
    def forward(*args, **kwargs):
        return fast(*args, **kwargs) if threading.get_ident() == owner else plain(*args, **kwargs)

    return forward


def _attn_implementation(config) -> str | None:
    """``config._attn_implementation`` of a config in a :func:`use_tree_attention` block."""
    if _TREE_THREAD.get(id(config)) == threading.get_ident():
        return ATTN_IMPLEMENTATION
    return config._attn_implementation_internal


def _reduce_ex(self, protocol):
    """Pickled and copied as an instance of the model's own config class (its state as it has it)."""
    sub = type(self)
    rv = super(sub, self).__reduce_ex__(protocol)
    if isinstance(rv, tuple) and rv[0] in (copyreg.__newobj__, copyreg._reconstructor):  # object's reduction
        rv = (copyreg._reconstructor, (sub.__mro__[1], object, None), *rv[2:])
    return rv


def _per_thread_class(cls: type) -> type:
    sub = _PER_THREAD_CLASS.get(cls)
    if sub is None:
        setter = cls._attn_implementation.fset  # transformers' (the same for every thread)
        sub = type(cls.__name__, (cls,), {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                          "_attn_implementation": property(_attn_implementation, setter),
                                          "__reduce_ex__": _reduce_ex})
        _PER_THREAD_CLASS[cls] = sub
    return sub


def _configs(model) -> list:
    """The configs ``model``'s attention reads: its own, its sub-models' and their sub-configs."""
    from transformers import PreTrainedModel

    found = [model.config] + [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    found += [getattr(c, k, None) for c in list(found) for k in getattr(c, "sub_configs", {}) or {}]
    unique = []
    for c in found:
        if c is not None and all(c is not u for u in unique):
            unique.append(c)
    return unique


@contextlib.contextmanager
def use_tree_attention(model) -> Iterator[None]:
    """Within the block, the calling thread's forwards of ``model`` use the ``"sequoia_tree"``
    attention; other threads' use the model's own implementation, masks included (each config's
    class is swapped for a subclass whose ``_attn_implementation`` reads the calling thread; the
    class is put back on exit). A config already in a block (an enclosing one) is left to it. A
    model whose config is not a transformers config (no ``_attn_implementation`` property) is
    switched for every thread (``set_attn_implementation``) and back on exit."""
    configs = [c for c in _configs(model) if id(c) not in _TREE_THREAD]
    if not all(isinstance(getattr(type(c), "_attn_implementation", None), property) for c in configs):
        with _for_every_thread(model):
            yield
        return
    owner, switched = threading.get_ident(), []
    try:
        for cfg in configs:
            _TREE_THREAD[id(cfg)] = owner
            switched.append((cfg, type(cfg)))
            object.__setattr__(cfg, "__class__", _per_thread_class(type(cfg)))  # past a strict dataclass' __setattr__
        yield
    finally:
        for cfg, cls in switched:
            object.__setattr__(cfg, "__class__", cls)
            del _TREE_THREAD[id(cfg)]


@contextlib.contextmanager
def _for_every_thread(model) -> Iterator[None]:
    before = model.config._attn_implementation
    if before != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        yield
    finally:
        if before is not None and before != ATTN_IMPLEMENTATION:
            model.set_attn_implementation(before)
