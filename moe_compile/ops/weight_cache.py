"""Expert weights that the fused op needs in another layout than the model holds them
(``ModuleList`` experts, gpt-fast's separate ``w1``/``w3``): one stacked copy per set of source
tensors, kept in step with them.

The rewritten graph calls ``moe_compile::stacked_weights(parts, key)`` once per block with the
source weights themselves (graph inputs); it returns every copy the block reads. ``key`` is the text
of the block's recipes (how each copy is made from ``parts``), so a graph loaded from Inductor's
compile cache in another process finds its entry by reading the key back. The copies are
made once, at compile time; each call then compares the sources' version counters (bumped by
every in-place write: ``p.mul_()``, ``load_state_dict``, an optimizer step) with those the copies
were made from, and re-makes them in place when they changed. So a compiled model follows its
weights as the uncompiled one does, and one compiled graph serves several modules (regional
compilation of each layer) with copies each, while graphs compiled again for the same block (new
token counts) share its copy. A copy holds its sources by weak reference: weights that are
replaced rather than written (``load_state_dict(assign=True)``, ``p.data = new``) take their copy
with them, instead of keeping the old weights and their copy alive. A call costs about 20 µs of host time, mostly the
custom-op dispatch (``benchmarks/host_overhead.py``).

Writes the version counters miss: a CUDA-graph replay runs no Python, ``p.data.copy_(new)``
writes through ``.data`` (its own counter) and inference tensors have none. After such writes call
``moe_compile.refresh_weights()``, which compares values and re-makes every stale copy in place
(same memory, so recorded CUDA graphs read the new values).
"""
from __future__ import annotations

import ast
import itertools
import weakref
from dataclasses import dataclass

import torch

from moe_compile.ops.registration import op

# recipe: ("leaf", i) | ("stack", (i, ...)) | ("cat", (recipe, ...)) | ("scale", (recipe, i)) | ("shard",
# ((w13, w2, b13, b2 recipes), shard_for_groups kwargs, field)), each with a transpose flag: (kind, payload,
# transpose).
# The copy is held with its last two dims swapped (see rewrite.py).
Recipe = tuple


@dataclass
class _Copy:
    refs: tuple  # weak references to the source tensors: a copy never keeps replaced weights alive
    ptrs: tuple  # the sources' data_ptrs when the copy was made
    versions: tuple
    values: list  # one held tensor per recipe

    def sources(self) -> list | None:
        """The source tensors, or ``None`` when one is gone or now holds other memory (``p.data = new``,
        ``load_state_dict(assign=True)``, a dtype round trip): the copy is stale for good."""
        parts = [ref() for ref in self.refs]
        if any(p is None for p in parts) or tuple(p.data_ptr() for p in parts) != self.ptrs:
            return None
        return parts


@dataclass
class _Entry:
    recipes: tuple  # one per tensor a block needs (w13, w2 and their biases, or their shards)
    signature: object  # hashable form of the recipes: graphs compiled again for the same block share copies


_ENTRIES: dict[str, _Entry] = {}
_COPIES: dict[tuple, _Copy] = {}  # (recipe signature, source data_ptrs) -> copy
_keys = itertools.count()
_LOCAL = "local:"  # keys of recipes with no text form (EP/TP shards: they hold process groups)


def _freeze(x):
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (tuple, list)):
        return tuple(_freeze(v) for v in x)
    return x


def _has_shard(recipe) -> bool:
    return isinstance(recipe, tuple) and (recipe[:1] == ("shard",) or any(_has_shard(r) for r in recipe))


def _key_of(recipes: tuple) -> str:
    """The recipes as text that reads back to themselves (plain tuples of ints, strings and bools);
    a process-local key for shard recipes."""
    if not _has_shard(recipes):
        text = repr(recipes)
        try:
            if ast.literal_eval(text) == recipes:
                return text
        except (ValueError, SyntaxError):
            pass
    return "%s%d" % (_LOCAL, next(_keys))


def _entry(key: str) -> _Entry:
    entry = _ENTRIES.get(key)
    if entry is None and not key.startswith(_LOCAL):
        try:
            recipes = ast.literal_eval(key)
        except (ValueError, SyntaxError):
            recipes = None
        if isinstance(recipes, tuple) and recipes:
            entry = _ENTRIES[key] = _Entry(recipes, _signature(recipes, key))
    if entry is None:
        raise RuntimeError(f"moe_compile::stacked_weights: no weights registered under key {key!r} "
                           f"(EP/TP shards of a graph compiled in another process?); recompile the model.")
    return entry


def _signature(recipes, key: str):
    frozen = _freeze(recipes)
    try:
        hash(frozen)
    except TypeError:  # an unhashable argument in a shard recipe: this entry's copies are its own
        return ("entry", key)
    return frozen


def _sweep() -> None:
    """Forget copies whose sources are gone or were replaced (their memory with them)."""
    for k in [k for k, c in _COPIES.items() if c.sources() is None]:
        del _COPIES[k]


def _copy_for(entry: _Entry, parts) -> _Copy:
    """The copy of ``parts`` under ``entry``'s recipes: the one already made (by this graph, or a graph
    compiled before it for the same block), else a new one."""
    ptrs = tuple(p.data_ptr() for p in parts)
    copy = _COPIES.get((entry.signature, ptrs))
    if copy is not None and not all(ref() is p for ref, p in zip(copy.refs, parts)) and copy.sources() is None:
        copy = None  # made from tensors that are gone; another tensor now has their memory
    if copy is None:
        _sweep()
        copy = _Copy(tuple(weakref.ref(p) for p in parts), ptrs, _versions(parts), _make(entry.recipes, parts))
        _COPIES[(entry.signature, ptrs)] = copy
    return copy


def _build(recipe: Recipe, parts) -> torch.Tensor:
    kind, payload, transpose = recipe
    if kind == "shard":  # one field of this rank's EP/TP share of the four expert tensors
        from moe_compile.distributed import shard_for_groups

        recipes, kwargs, name = payload
        full = [None if r is None else _build(r, parts) for r in recipes]
        return getattr(shard_for_groups(*full, **kwargs), name)
    if kind == "scale":  # expert e's slice times parts[i][e] (a per-expert output scale), rounded once
        inner, i = payload
        t = _build(inner, parts)
        return (t.float() * parts[i].reshape((-1,) + (1,) * (t.dim() - 1)).float()).to(t.dtype)
    if kind == "cat":
        t = torch.cat([_build(r, parts) for r in payload], dim=-1)
    elif kind == "stack":
        t = torch.stack([parts[i] for i in payload])
    else:
        t = parts[payload]
    return t.transpose(-2, -1) if transpose else t


def held_layout(t: torch.Tensor) -> torch.Tensor:
    """How a copy is held: weights ``[E, K, N]`` as ``[E, N, K]``, biases ``[E, N]`` as ``[E, 1, N]``."""
    t = t.detach()
    t = t.transpose(-1, -2) if t.dim() >= 3 else t.unsqueeze(1)
    return t.clone(memory_format=torch.contiguous_format)  # never the source itself (the op may not alias it)


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor (made under inference_mode) has no version counter
        return -1


def _versions(parts) -> tuple:
    return tuple(_version(p) for p in parts)


def _make(recipes: tuple, parts) -> list:
    with torch.no_grad():
        return [held_layout(_build(r, parts)) for r in recipes]


def register(recipes: tuple, parts) -> tuple[str, list, list]:
    """A new key for a block's ``recipes``, the copies of ``parts`` (the compile-time weights; shared
    with an earlier graph of the same block), and the number of dims each is made from (3: weights,
    2: biases)."""
    recipes = tuple(recipes)
    key = _key_of(recipes)
    if key not in _ENTRIES:  # recompiles of a block share its entry (and so its copy)
        _ENTRIES[key] = _Entry(recipes, _signature(recipes, key))
    entry = _ENTRIES[key]
    copy = _copy_for(entry, parts)
    _keep_fresh(entry, copy, parts)
    probe = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in parts]
    return key, copy.values, [_build(r, probe).dim() for r in entry.recipes]


def _keep_fresh(entry: _Entry, copy: _Copy, parts) -> None:
    versions = _versions(parts)
    if versions != copy.versions and not _capturing(parts[0]):
        for value, fresh in zip(copy.values, _make(entry.recipes, parts)):
            value.copy_(fresh)
        copy.versions = versions


@op("moe_compile::stacked_weights")
def stacked_weights(parts: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """Every copy one block reads, in one call (one dispatch per block, not per tensor)."""
    entry = _entry(key)
    copy = _copy_for(entry, parts)  # another module through the same graph gets its own
    _keep_fresh(entry, copy, parts)
    # the cached tensors themselves: the op is declared functional, and no consumer writes into them
    return list(copy.values)


@stacked_weights.register_fake
def _stacked_weights_fake(parts, key):
    probe = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in parts]
    return [parts[0].new_empty(held_layout(_build(r, probe)).shape) for r in _entry(key).recipes]


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def clear() -> None:
    """Forget every copy (``torch._dynamo.reset()`` calls this: the compiled graphs that read them
    are gone). Until then a copy lives as long as its source tensors do, and no longer: copies of
    weights that were replaced (``load_state_dict(assign=True)``, ``p.data = new``) are dropped
    when the next copy is made."""
    _ENTRIES.clear()
    _COPIES.clear()


def refresh_weights() -> int:
    """Re-make, in place, every stacked copy whose source weights changed since it was made, by
    comparing values; returns how many tensors were re-made. Each call of a compiled graph already
    checks its copies' version counters; call this after writes that those miss: with CUDA graphs (a
    replay runs no Python), through ``param.data`` (``p.data.copy_(new)``: ``.data`` has its own
    version counter), or on inference tensors (made under ``inference_mode``: no version counter)."""
    _sweep()
    recipes = {e.signature: e.recipes for e in _ENTRIES.values()}
    done = 0
    for (signature, _), copy in _COPIES.items():
        parts = copy.sources()
        for value, fresh in zip(copy.values, _make(recipes[signature], parts)):
            if not torch.equal(fresh, value):
                value.copy_(fresh)
                done += 1
        copy.versions = _versions(parts)
    return done
