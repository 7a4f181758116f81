"""CUDA graphs of the op itself, for calls that run without an outer CUDA graph.

Under ``torch.compile``'s default mode (and in plain eager inference) every call of the op pays its
host work: our Python around the kernels, then 4-6 kernel launches. At decode sizes that host work,
not the GPU, sets the pace: on the H200 an eager Qwen3-30B-A3B call at 1-32 tokens costs ~0.5 ms of
host time against ~0.03-0.26 ms of GPU time (``benchmarks/probe_launch.py``). ``mode="reduce-overhead"``
removes it for the whole model; this module removes most of it for the op alone, where the user's
graph runs without CUDA graphs.

A call is keyed by everything its kernels depend on: the config; the device and the current stream;
the shapes and dtypes of the per-call tensors (hidden states, router logits, precomputed top-k); the
address, shape, strides and dtype of the resident ones (weights, biases, the score-correction bias),
which the graph reads in place, so weights updated in place are seen and weights replaced by other
tensors make another key. The ``warm_calls``-th call of a key captures the op's kernels into a CUDA
graph over static copies of the per-call tensors (after one warm-up run on a side stream, with no host
synchronisation and without emptying the allocator's cache, which ``torch.cuda.graph`` does); each later
call copies its per-call tensors in, replays the graph and returns a copy of the graph's output
(never the graph's own buffer, which the next replay overwrites).

Only single-device CUDA calls of at most ``max_tokens`` tokens (1024) whose experts may read at most
``max_expert_bytes`` (1.5 GB: beyond, the GPU time dwarfs the host's and a graph's copies cost more than it
saves; measured on the H200, ``benchmarks/bench_op_graphs.py``) are graphed, never while a stream is
capturing (an outer CUDA graph records the op's kernels itself) nor inside ``suspended()`` (the backend
runs graphs it compiled for CUDA graphs, ``reduce-overhead`` or ``max-autotune``, in one: see there). At most
``max_graphs`` graphs are kept (least recently used first out), sharing one memory pool per device
and stream. A capture that fails is logged once, and that key runs without a graph from then on.
``MOE_COMPILE_OP_GRAPHS=0`` turns graphs off (read at import; ``configure(enabled=False)`` at run time);
``STATS`` counts captures, replays, evictions, failures and, per reason, the calls run without a graph.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable

import torch

log = logging.getLogger("moe_compile")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"{name}={value!r}; expected an int >= 1 (unset: {default}).")
    return number


@dataclass
class Settings:
    enabled: bool = os.environ.get("MOE_COMPILE_OP_GRAPHS", "1") != "0"
    max_tokens: int = _env_int("MOE_COMPILE_OP_GRAPHS_MAX_TOKENS", 1024)
    # expert weight bytes a call may read (experts it can hit x bytes per expert) above which its kernels
    # outlast its host work and a graph's extra copies cost more than it saves (H200: 2.8 GB, Mixtral at
    # 32-1024 tokens, 0.94-0.98x with a graph; 1.2 GB, Qwen3-30B-A3B at 1-1024 tokens, 1.09-3.54x; runs 2-4 of
    # the twenty-eighth session, benchmarks/results/op_graphs_*_s28.log)
    max_expert_bytes: int = _env_int("MOE_COMPILE_OP_GRAPHS_MAX_BYTES", 1_500_000_000)
    max_graphs: int = 32
    warm_calls: int = 2  # the call of a key that captures it (earlier ones run without a graph)


SETTINGS = Settings()
# captured, replayed, evicted, failed, and "skipped: <reason>" per call run without a graph (skip_reason's words)
STATS: collections.Counter = collections.Counter()
MAX_SEEN = 4096  # keys counted towards warm_calls; the oldest are forgotten first


@dataclass
class _Entry:
    graph: object  # torch.cuda.CUDAGraph
    static_in: tuple  # static copies of the per-call tensors (None where the call has none)
    static_out: torch.Tensor
    tokens: int = 0  # the call's tokens and the expert bytes it may read: what configure's limits are checked on
    expert_bytes: int = 0


_LOCAL = threading.local()  # depth: suspended() blocks entered on this thread
_GRAPHS: collections.OrderedDict = collections.OrderedDict()
_SEEN: collections.OrderedDict = collections.OrderedDict()
_FAILED: set = set()
_POOLS: dict = {}


def configure(*, enabled: bool | None = None, max_tokens: int | None = None, max_graphs: int | None = None,
              warm_calls: int | None = None, max_expert_bytes: int | None = None) -> Settings:
    """Change the settings (``None`` keeps one); returns them. Dropping ``max_graphs`` evicts at once."""
    for name, value in (("max_tokens", max_tokens), ("max_graphs", max_graphs), ("warm_calls", warm_calls),
                        ("max_expert_bytes", max_expert_bytes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"op_graphs.configure: {name}={value!r}; expected an int >= 1.")
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"op_graphs.configure: enabled={enabled!r}; expected a bool.")
    changes = dict(enabled=enabled, max_tokens=max_tokens, max_graphs=max_graphs, warm_calls=warm_calls,
                   max_expert_bytes=max_expert_bytes)
    for name, value in changes.items():
        if value is not None:
            setattr(SETTINGS, name, value)
    for key in [k for k, e in _GRAPHS.items()
                if e.tokens > SETTINGS.max_tokens or e.expert_bytes > SETTINGS.max_expert_bytes]:
        del _GRAPHS[key]  # replay_hit trusts a kept graph's key to be within the limits
    _evict()
    return dataclasses.replace(SETTINGS)


def clear() -> None:
    """Forget every graph, count and failure (the memory returns once nothing else holds it)."""
    _GRAPHS.clear()
    _SEEN.clear()
    _FAILED.clear()
    _POOLS.clear()
    STATS.clear()


@contextlib.contextmanager
def suspended():
    """No graphs of ours on this thread inside the block: the backend runs graphs compiled with CUDA graphs
    (``reduce-overhead``, ``max-autotune``) in one, as their warm-up runs are eager, not capturing, and
    route this thread's allocations to their own memory pool, where a capture of ours does not belong."""
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


def graphs() -> int:
    return len(_GRAPHS)


def _meta(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.dtype)


def _where(t: torch.Tensor | None):
    return None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype)


def call_key(inputs, cfg, device: int, stream: int) -> tuple:
    """What a graph of this call depends on (see the module doc)."""
    w = inputs.weights
    return (cfg, device, stream, _meta(inputs.hidden_states), _meta(inputs.router_logits),
            _meta(inputs.topk_weights), _meta(inputs.topk_ids), _where(w.w13), _where(w.w2),
            _where(w.w13_bias), _where(w.w2_bias), _where(inputs.e_score_correction_bias))


def expert_bytes(inputs, cfg, tokens: int) -> int:
    """The expert weight bytes a call of ``tokens`` tokens may read: the experts it can hit, each in full."""
    w13, w2 = inputs.weights.w13, inputs.weights.w2
    per_expert = w13.shape[1] * w13.shape[2] + w2.shape[1] * w2.shape[2]
    return min(w13.shape[0], tokens * cfg.routing.top_k) * per_expert * w13.element_size()


def skip_reason(inputs, cfg) -> str:
    """Why this call runs without a graph of its own ('' when it may have one)."""
    x = inputs.hidden_states
    if not SETTINGS.enabled:
        return "off"
    if x.device.type != "cuda":
        return "not cuda"
    if cfg.parallel.tp_group_name or cfg.parallel.ep_group_name:
        return "distributed"
    tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if tokens == 0 or tokens > SETTINGS.max_tokens:
        return "tokens"
    if expert_bytes(inputs, cfg, tokens) > SETTINGS.max_expert_bytes:
        return "expert bytes"
    if getattr(_LOCAL, "depth", 0):
        return "suspended"
    if torch.cuda.is_current_stream_capturing():
        return "capturing"
    return ""


_PER_CALL = ("hidden_states", "router_logits", "topk_weights", "topk_ids")
_SKIPPED = {r: f"skipped: {r}" for r in ("off", "not cuda", "distributed", "tokens", "expert bytes", "suspended",
                                          "capturing")}


def replay_hit(inputs, cfg) -> torch.Tensor | None:
    """The output of this call's graph if one is kept, else None: a repeat call's fast path. A kept graph's key
    passed every static rule of ``skip_reason`` (device, parallelism, tokens, expert bytes; ``configure`` drops
    graphs that newer limits rule out), so only the switches that can change between calls are checked."""
    if not _GRAPHS or not SETTINGS.enabled or getattr(_LOCAL, "depth", 0):
        return None
    device = _cuda_index(inputs.hidden_states)
    if device is None:
        return None
    key = call_key(inputs, cfg, device, _stream(device))
    entry = _GRAPHS.get(key)
    if entry is None or _capturing():
        return None
    _GRAPHS.move_to_end(key)
    return _replay(entry, inputs)


def run(inputs, cfg, body: Callable) -> torch.Tensor | None:
    """``body(inputs, cfg)`` through a CUDA graph of this call's key, or None: the caller runs it plainly."""
    reason = skip_reason(inputs, cfg)
    if reason:
        STATS[_SKIPPED[reason]] += 1
        return None
    device = inputs.hidden_states.device.index
    key = call_key(inputs, cfg, device, _stream(device))
    entry = _GRAPHS.get(key)
    if entry is None:
        if key in _FAILED:
            return None
        seen = _SEEN.pop(key, 0) + 1
        if seen < SETTINGS.warm_calls:
            _SEEN[key] = seen
            while len(_SEEN) > MAX_SEEN:
                _SEEN.popitem(last=False)
            return None
        entry = _capture(inputs, cfg, body, key)
        if entry is None:
            return None
    else:
        _GRAPHS.move_to_end(key)
    return _replay(entry, inputs)


def _cuda_index(x: torch.Tensor) -> int | None:
    return x.device.index if x.device.type == "cuda" else None


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def _static_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _pool(device: int, stream: int):
    pool = _POOLS.get((device, stream))
    if pool is None:
        pool = _POOLS[(device, stream)] = torch.cuda.graph_pool_handle()
    return pool


def _capture(inputs, cfg, body: Callable, key: tuple) -> _Entry | None:
    device, stream = key[1], key[2]
    try:
        with torch.inference_mode(False), torch.no_grad():
            static_in = tuple(_static_copy(getattr(inputs, name)) for name in _PER_CALL)
            static = dataclasses.replace(inputs, **dict(zip(_PER_CALL, static_in)))
            # not torch.cuda.graph(): it synchronises the device and empties the allocator's cache
            current, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
            side.wait_stream(current)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                body(static, cfg)  # warm-up: compiles, fills the launch cache, lazy CUDA state
                graph.capture_begin(_pool(device, stream), capture_error_mode="thread_local")
                try:
                    static_out = body(static, cfg)
                finally:
                    graph.capture_end()
            current.wait_stream(side)
    except Exception as exc:  # noqa: BLE001 - any failure: this key runs without a graph, as before
        _FAILED.add(key)
        STATS["failed"] += 1
        if STATS["failed"] == 1:
            log.warning("moe_compile: could not capture the op in a CUDA graph (%s: %s); such calls run "
                        "without one", type(exc).__name__, exc)
        return None
    x = inputs.hidden_states
    tokens = x.numel() // x.shape[-1]
    entry = _GRAPHS[key] = _Entry(graph, static_in, static_out, tokens, expert_bytes(inputs, cfg, tokens))
    STATS["captured"] += 1
    _evict()
    return entry


def _evict() -> None:
    while len(_GRAPHS) > SETTINGS.max_graphs:
        _GRAPHS.popitem(last=False)
        STATS["evicted"] += 1


def _replay(entry: _Entry, inputs) -> torch.Tensor:
    with torch.no_grad():
        for static, name in zip(entry.static_in, _PER_CALL):
            if static is not None:
                static.copy_(getattr(inputs, name))
        entry.graph.replay()
        STATS["replayed"] += 1
        return entry.static_out.clone()


__all__ = ["SETTINGS", "STATS", "Settings", "call_key", "clear", "configure", "expert_bytes", "graphs", "replay_hit",
           "run", "skip_reason", "suspended"]
