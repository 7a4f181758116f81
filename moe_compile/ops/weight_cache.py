"""Expert weights that the fused op needs in another layout than the model holds them
(``ModuleList`` experts, gpt-fast's separate ``w1``/``w3``): one stacked copy per set of source
tensors, kept in step with them.

The rewritten graph calls ``moe_compile::stacked_weights(parts, key)`` with the source weights
themselves (graph inputs). The copy is made once, at compile time; each call then compares the
sources' version counters (bumped by every in-place write: ``p.mul_()``, ``load_state_dict``,
an optimizer step, an RL weight sync) with those the copy was made from, and re-makes it in place
when they changed. So a compiled model follows its weights as the uncompiled one does, and one
compiled graph serves several modules (regional compilation of each layer) with a copy each.
The check costs about 0.2 µs per source tensor per call.

Writes the version counters miss: a CUDA-graph replay runs no Python, ``p.data.copy_(new)``
writes through ``.data`` (its own counter) and inference tensors have none. After such writes call
``moe_compile.refresh_weights()``, which compares values and re-makes every stale copy in place
(same memory, so recorded CUDA graphs read the new values).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

# recipe: ("leaf", i) | ("stack", (i, ...)) | ("cat", (recipe, ...)) | ("shard", ((w13, w2, b13, b2
# recipes), shard_for_groups kwargs, field)), each with a transpose flag: (kind, payload, transpose).
# The copy is held with its last two dims swapped (see rewrite.py).
Recipe = tuple


@dataclass
class _Copy:
    parts: tuple  # the source tensors (strong references: their memory cannot be reused under us)
    versions: tuple
    value: torch.Tensor


@dataclass
class _Entry:
    recipe: Recipe
    copies: dict = field(default_factory=dict)  # tuple of source data_ptrs -> _Copy


_ENTRIES: dict[int, _Entry] = {}
_keys = itertools.count()


def _build(recipe: Recipe, parts) -> torch.Tensor:
    kind, payload, transpose = recipe
    if kind == "shard":  # one field of this rank's EP/TP share of the four expert tensors
        from moe_compile.distributed import shard_for_groups

        recipes, kwargs, name = payload
        full = [None if r is None else _build(r, parts) for r in recipes]
        return getattr(shard_for_groups(*full, **kwargs), name)
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
    return t.transpose(-1, -2).contiguous() if t.dim() >= 3 else t.unsqueeze(1).contiguous()


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor (made under inference_mode) has no version counter
        return -1


def _versions(parts) -> tuple:
    return tuple(_version(p) for p in parts)


def register(recipe: Recipe, parts) -> tuple[int, torch.Tensor, int]:
    """A new key for ``recipe``, the copy made now from ``parts`` (the compile-time weights) and
    the number of dims of what it holds (3: weights, 2: biases)."""
    key = next(_keys)
    entry = _Entry(recipe)
    _ENTRIES[key] = entry
    with torch.no_grad():
        built = _build(recipe, parts)
        value = held_layout(built)
    entry.copies[tuple(p.data_ptr() for p in parts)] = _Copy(tuple(parts), _versions(parts), value)
    return key, value, built.dim()


def _refresh(entry: _Entry, copy: _Copy, versions: tuple) -> None:
    with torch.no_grad():
        copy.value.copy_(held_layout(_build(entry.recipe, copy.parts)))
    copy.versions = versions


@torch.library.custom_op("moe_compile::stacked_weights", mutates_args=())
def stacked_weights(parts: list[torch.Tensor], key: int) -> torch.Tensor:
    entry = _ENTRIES.get(key)
    if entry is None:
        raise RuntimeError(f"moe_compile::stacked_weights: no weights registered under key {key} "
                           f"(a graph compiled in another process?); recompile the model.")
    ptrs = tuple(p.data_ptr() for p in parts)
    copy = entry.copies.get(ptrs)
    if copy is None:  # another module through the same compiled graph
        with torch.no_grad():
            value = held_layout(_build(entry.recipe, parts))
        copy = entry.copies[ptrs] = _Copy(tuple(p.detach() for p in parts), _versions(parts), value)
    else:
        versions = _versions(parts)
        if versions != copy.versions and not _capturing(parts[0]):
            _refresh(entry, copy, versions)
    # the cached tensor itself: the op is declared functional, and no consumer writes into it
    return copy.value


@stacked_weights.register_fake
def _stacked_weights_fake(parts, key):
    first = parts[0]
    probe = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in parts]
    shape = held_layout(_build(_ENTRIES[key].recipe, probe)).shape
    return first.new_empty(shape)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def clear() -> None:
    """Forget every copy (``torch._dynamo.reset()`` calls this: the compiled graphs that read them
    are gone). Until then a copy lives as long as the process, like the compiled code that reads it;
    its source tensors are held too, so their memory cannot be reused under a stale copy."""
    _ENTRIES.clear()


def refresh_weights() -> int:
    """Re-make, in place, every stacked copy whose source weights changed since it was made, by
    comparing values; returns how many were re-made. Each call of a compiled graph already checks
    its copies' version counters; call this after writes that those miss: with CUDA graphs (a
    replay runs no Python), through ``param.data`` (``p.data.copy_(new)``: ``.data`` has its own
    version counter), or on inference tensors (made under ``inference_mode``: no version counter)."""
    done = 0
    with torch.no_grad():
        for entry in _ENTRIES.values():
            for copy in entry.copies.values():
                fresh = held_layout(_build(entry.recipe, copy.parts))
                if not torch.equal(fresh, copy.value):
                    copy.value.copy_(fresh)
                    done += 1
                copy.versions = _versions(copy.parts)
    return done
