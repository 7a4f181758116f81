"""Inductor's compile caches for the graphs the pass rewrites.

Inductor keeps compiled graphs on disk (its FX graph cache and AOTAutograd cache), keyed by the
graph, its inputs' metadata, its config and each custom pass's ``uuid()``. The pass runs inside that
compile (as Inductor's post-grad custom pass), so on a cache hit it does not run at all: the compiled
code, rewrite included, comes from the cache, and a second process (or a compile after
``torch._dynamo.reset()``) skips the pass and Inductor's code generation.

What the pass makes of a graph depends on the graph, the options and which modules are excluded: those
go into ``uuid()``. It does not read the weights' values into the rewritten graph (the op reads the
weights as graph inputs, and stacked copies are re-made from them at run time), and its probes run on
random values; a candidate is also checked once with the model's own weights, and a hit replays the
decision made with the first compile's weights, as a compiled model keeps its rewrite when its weights
change later.

The per-block decisions (the report, the log, the counters) are stored beside Inductor's cache under the
pass's ``uuid()`` (which holds Dynamo's graph and its inputs' metadata too), and replayed on a hit.

No caching (the pass runs on every compile, as before) where the compile needs it to: ``verify``
(checks at compile time), ``dump_dir`` and ``explain()`` (they want the graphs), and EP/TP groups (each
rank's shards are made in its own process).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib

import torch

from moe_compile.options import BackendConfig
from moe_compile.report import BlockDecision, excluded_tensor_ids

log = logging.getLogger("moe_compile")
_FORMAT = 1


def uncached_reason(config: BackendConfig) -> str | None:
    """Why this compile must run the pass even when Inductor has the graph cached, else None."""
    from moe_compile.report import _ACTIVE

    if config.verify:
        return "options['verify'] checks each rewrite at compile time"
    if config.dump_dir:
        return "options['dump_dir'] writes each graph before and after the rewrite"
    if config.ep_group is not None or config.tp_group is not None:
        return "EP/TP shards are made per process"
    if _ACTIVE:
        return "explain() reports the graphs before and after the rewrite"
    return None


@functools.lru_cache(maxsize=1)
def package_hash() -> str:
    """Every source file of the package: a change anywhere may change what the pass emits."""
    digest = hashlib.sha256()
    root = pathlib.Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _config_text(config: BackendConfig, op_kwargs: dict) -> str:
    classes = ["%s.%s" % (c.__module__, c.__qualname__) for c in config.exclude_classes]
    return repr((config.lowering.value, sorted(config.exclude_paths), sorted(classes), config.compile_mode,
                 config.experts_only, config.cpu_decode, config.pack_args, sorted(op_kwargs.items())))


def pass_uuid(config: BackendConfig, op_kwargs: dict, gm: torch.fx.GraphModule, example_inputs) -> str:
    """The pass's ``uuid()`` for this compile, also the key of its stored decisions: the package source,
    the options, which inputs belong to modules excluded with ``moe_compile.exclude``, and Dynamo's
    graph with its inputs' metadata. Inductor's own key is the graph after AOTAutograd, which two model
    families can share while their decisions (block paths) differ: with Dynamo's graph in the uuid,
    a hit always finds the decisions made for the same graph."""
    excluded = excluded_tensor_ids()
    marked = [i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor) and id(t) in excluded]
    digest = hashlib.sha256()
    for part in [package_hash(), _config_text(config, op_kwargs), repr(marked), torch.__version__, gm.code] + [
            _input_text(t) for t in example_inputs]:
        digest.update(part.encode())
    return digest.hexdigest()


def _input_text(t) -> str:
    if isinstance(t, torch.Tensor):
        return "T%s/%s/%s/%s" % (tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type)
    return type(t).__name__


def _folder() -> pathlib.Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return pathlib.Path(cache_dir()) / "moe_compile"


def _weight_index(decision: BlockDecision, example_inputs) -> int | None:
    if decision.router_weight_id is None:
        return None
    return next((i for i, t in enumerate(example_inputs) if id(t) == decision.router_weight_id), None)


def save(key: str, decisions: list[BlockDecision], example_inputs) -> None:
    """Keep this compile's decisions for a later compile that Inductor serves from its cache."""
    rows = []
    for d in decisions:
        row = {f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name != "router_weight_id"}
        row["router_weight_index"] = _weight_index(d, example_inputs)
        rows.append(row)
    path = _folder() / ("%s.json" % key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp%d" % os.getpid())
        tmp.write_text(json.dumps({"format": _FORMAT, "decisions": rows}))
        os.replace(tmp, path)
    except OSError as exc:  # the report of a later cache hit is what is lost, not the compile
        log.info("moe_compile: cannot store the rewrite decisions beside Inductor's cache (%s)", exc)


def load(key: str, example_inputs) -> list[BlockDecision] | None:
    """The decisions stored for ``key``, with router weights resolved in this compile's inputs."""
    try:
        data = json.loads((_folder() / ("%s.json" % key)).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        return None
    out = []
    for row in data.get("decisions", []):
        index = row.pop("router_weight_index", None)
        weight = example_inputs[index] if index is not None and index < len(example_inputs) else None
        out.append(BlockDecision(**row, router_weight_id=None if weight is None else id(weight)))
    return out
