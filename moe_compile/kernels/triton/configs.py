"""Which path and which block sizes the CUDA experts use for a shape: tuned JSON, else a heuristic.

Tuned files live beside this module in ``configs/`` (and, searched first, in
``$MOE_COMPILE_CONFIG_DIR``) and are written by the tuner (``python -m moe_compile tune``,
``moe_compile/tools/tune.py``; ``benchmarks/tune_triton.py`` wrote the shipped ones):
``E{E}_H{H}_I{I}_{dtype}_{device}.json`` maps a token count ``M`` to
``{"path": "pairs"|"decode"|"sorted"|"grouped_mm", "gemm1": {...}, "gemm2": {...}}`` (block sizes, warps,
stages), plus ``"_top_k"``. The entry whose ``M`` is nearest on a log scale is used. A file of the
same name in ``$MOE_COMPILE_CONFIG_DIR`` is merged over the shipped one: its entries replace the
shipped entries of the same ``M`` and the shipped entries at other ``M`` stay (``merged_raw``).

A shape without a file of its own on this device (another model's sizes) borrows: among this
device's files, the entry whose rows per expert (``M * top_k / E``, what decides between
memory- and compute-bound tiles) are nearest on a log scale, with a decode entry (``pairs``) only
for a decode batch and never a ``grouped_mm`` one (tuned for one shape's CUTLASS kernels). An sm_90
GPU without files of its own (an H100) reads the H200's, which were tuned on the same SMs. A
shape's own file whose nearest entry lies more than ``FAR_OCTAVES`` octaves of ``M`` away (a file
tuned for other batch sizes only) is passed over the same way. A borrowed plan's second GEMM runs
unsplit (``split_k = 1``): whether splitting K pays depends on how many tiles a shape has against
the SMs and how long its K is, not on its rows per expert (twelfth session: 3 K slices took
Mixtral M = 2048's GEMM2 from 913 to 782 µs, while 2-4 slices made Qwen3's and DeepSeek-V3's
M = 2048 GEMM2 6-97 % slower).
``python -m moe_compile tune --shape E,top_k,H,I`` tunes a shape of your own on this GPU. Without any file: the
fixed heuristic of ``default_plan``. ``python -m moe_compile plan --shape E,top_k,H,I`` prints
which plan each token count gets and where it came from (``plan_and_source``).

Paths:

- ``pairs``: one M-block per (token, expert) pair, no sorting kernels (decode with many experts);
- ``gemv``: the same batches on CUDA cores (``gemv.py``): one kernel per GEMM, the combine fused
  into the second; ``gemm1``/``gemm2`` give ``block_n``, ``block_k`` and ``num_warps`` (slower than
  ``pairs`` on the H200, so no tuned file uses it);
- ``decode``: the same batches in one kernel (``decode.py``): GEMM1, activation, GEMM2 and the
  weighted combine, each program one slice of a pair's intermediate columns, the products summed
  by fp32 atomics; ``gemm1`` gives ``block_n`` (intermediate columns per program), ``block_k``,
  ``num_warps``, ``num_stages`` and ``tma``, ``gemm2`` the second product's ``block_n`` (slower
  than or level with ``pairs`` on the H200, so no tuned file uses it);
- ``sorted``: pairs grouped by expert (``align.py``), both GEMMs in Triton, activation fused
  (``pre_gather``: the token rows are gathered into expert order by the alignment pass first);
- ``grouped_mm``: pairs grouped and gathered, ``torch._grouped_mm`` for both GEMMs (CUTLASS on
  sm90), the activation as a separate Triton pass (bf16 without biases only).
"""
from __future__ import annotations

import enum
import functools
import json
import logging
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moe_compile.kernels.grouped_mm import cuda_capability
from moe_compile.kernels.triton.gemm import GemmConfig

log = logging.getLogger("moe_compile")
CONFIG_DIR = Path(__file__).parent / "configs"
USER_DIR_ENV = "MOE_COMPILE_CONFIG_DIR"  # a directory of your own tuned files, searched before CONFIG_DIR


def config_dirs() -> list[Path]:
    """Where tuned files are looked for: ``$MOE_COMPILE_CONFIG_DIR`` (if set), then the shipped ones.
    Read at first use of each file (the lookups are cached)."""
    user = os.environ.get(USER_DIR_ENV, "").strip()
    return ([Path(user)] if user else []) + [CONFIG_DIR]


class ExpertsPath(enum.Enum):
    PAIRS = "pairs"
    GEMV = "gemv"
    DECODE = "decode"
    SORTED = "sorted"
    GROUPED_MM = "grouped_mm"


DECODE_PATHS = (ExpertsPath.PAIRS, ExpertsPath.GEMV, ExpertsPath.DECODE)  # plans for few pairs over many experts


@dataclass(frozen=True)
class Plan:
    path: ExpertsPath
    gemm1: GemmConfig
    gemm2: GemmConfig
    # sorted path: the alignment pass also gathers the token rows into expert order, so GEMM1 reads
    # contiguous rows (by TMA where gemm1.tma) instead of gathering them inside its K-loop
    pre_gather: bool = False

    def to_dict(self) -> dict:
        from dataclasses import asdict

        d = {"path": self.path.value, "gemm1": asdict(self.gemm1), "gemm2": asdict(self.gemm2)}
        if self.pre_gather:
            d["pre_gather"] = 1
        return d

    @staticmethod
    def from_dict(d: dict) -> "Plan":
        return Plan(ExpertsPath(d["path"]), GemmConfig.from_dict(d["gemm1"]), GemmConfig.from_dict(d["gemm2"]),
                    bool(d.get("pre_gather", 0)))


def device_key(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return _cuda_device_key(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_device_key(index: int) -> str:  # cached: plans are looked up on every call
    name = torch.cuda.get_device_name(index)
    if "H200" in name:
        return "NVIDIA_H200"
    return name.replace(" ", "_")


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def config_file_name(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str) -> str:
    return f"E{num_experts}_H{hidden}_I{inter}_{dtype_key(dtype)}_{device}.json"


def merged_raw(file_name: str) -> tuple[dict, dict[str, Path]] | None:
    """The tuned file ``file_name`` as the lookups see it: every config directory's file of that name
    merged, an entry of an earlier directory (``$MOE_COMPILE_CONFIG_DIR``) replacing the same token
    count of a later one (the shipped file), so tuning a few batch sizes of your own keeps the
    shipped plans at the others. Returns the merged JSON and, per key, the file it came from;
    ``None`` when no directory has the file."""
    merged, origin = {}, {}
    for path in reversed([d / file_name for d in config_dirs()]):
        if path.exists():
            raw = json.loads(path.read_text())
            merged.update(raw)
            origin.update(dict.fromkeys(raw, path))
    return (merged, origin) if merged else None


@functools.lru_cache(maxsize=64)
def _load_with_origin(file_name: str) -> dict[int, tuple[Plan, Path]] | None:
    found = merged_raw(file_name)
    if found is None:
        return None
    raw, origin = found
    return {int(m): (Plan.from_dict(v), origin[m]) for m, v in raw.items() if not m.startswith("_")}


def _load(file_name: str) -> dict[int, Plan] | None:
    """``{M: plan}`` of the merged tuned file ``file_name`` (see ``merged_raw``), ``None`` without one."""
    table = _load_with_origin(file_name)
    return None if table is None else {m: plan for m, (plan, _) in table.items()}


def pairs_eligible(num_pairs: int, num_local: int) -> bool:
    """Few pairs over many experts: a sort costs more launches than the rare shared expert saves."""
    return num_pairs * 4 <= num_local or num_pairs <= 2


def decode_plan(block_i: int, block_k: int, block_n: int, warps: int = 4, stages: int = 3, tma: int = 0) -> Plan:
    """A ``decode``-path plan: ``block_i`` intermediate columns per program and ``block_k`` its
    K step (``gemm1.block_n`` / ``block_k``), ``block_n`` output columns per step of the second
    product (``gemm2.block_n``); warps, stages and TMA loads are the one kernel's (``gemm1``'s)."""
    g1 = GemmConfig(block_m=16, block_n=block_i, block_k=block_k, group_m=1, num_warps=warps, num_stages=stages,
                    tma=tma)
    return Plan(ExpertsPath.DECODE, g1, GemmConfig(block_m=16, block_n=block_n, block_k=block_i, group_m=1))


def default_plan(num_tokens: int, top_k: int, num_local: int, hidden: int, inter: int) -> Plan:
    pairs = num_tokens * top_k
    if pairs_eligible(pairs, num_local):
        small = GemmConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
        return Plan(ExpertsPath.PAIRS, small, small)
    per_expert = pairs / max(num_local, 1)
    if per_expert <= 16:
        cfg = GemmConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
        return Plan(ExpertsPath.SORTED, cfg, cfg)
    if per_expert <= 64:
        cfg = GemmConfig(block_m=64, block_n=64, block_k=64, group_m=4, num_warps=4, num_stages=4)
        return Plan(ExpertsPath.SORTED, cfg, cfg)
    g1 = GemmConfig(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=8, num_stages=3)
    g2 = GemmConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    return Plan(ExpertsPath.SORTED, g1, g2)


def parse_shape(spec: str) -> tuple[int, int, int, int]:
    """``"E,top_k,H,I"`` (experts, top-k, hidden size, expert intermediate size) -> the four ints;
    ``ValueError`` naming ``shape`` otherwise."""
    try:
        experts, top_k, hidden, inter = (int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"shape {spec!r}: expected four integers E,top_k,H,I") from None
    if min(experts, top_k, hidden, inter) < 1 or top_k > experts:
        raise ValueError(f"shape {spec!r}: sizes must be positive and top_k <= E")
    return experts, top_k, hidden, inter


SM90_TUNED = "NVIDIA_H200"  # the sm_90 device whose files other sm_90 devices read


def tuned_device_keys(key: str, capability: tuple[int, int] | None) -> list[str]:
    """The device keys whose files serve device ``key``: its own, then, on sm_90, the H200's."""
    keys = [key]
    if capability == (9, 0) and key != SM90_TUNED:
        keys.append(SM90_TUNED)
    return keys


def _device_keys(device: torch.device) -> list[str]:
    key = device_key(device)
    if device.type != "cuda":
        return [key]
    index = device.index if device.index is not None else torch.cuda.current_device()
    return tuned_device_keys(key, tuple(cuda_capability(index)))


@functools.lru_cache(maxsize=64)
def _device_files(dtype_name: str, device: str) -> tuple[tuple[str, int, float, tuple], ...]:
    """``(file, E, H, ((M, top_k, plan), ...))`` of every tuned file for ``device`` and dtype that
    records its ``_top_k`` (without it rows per expert are unknown)."""
    pattern = re.compile(rf"E(\d+)_H(\d+)_I(\d+)_{dtype_name}_{re.escape(device)}\.json")
    out, seen = [], set()
    for path in [p for d in config_dirs() for p in sorted(d.glob(f"*_{dtype_name}_{device}.json"))]:
        match = pattern.fullmatch(path.name)
        if not match or path.name in seen:  # one shape's files are merged (``merged_raw``) and read once
            continue
        seen.add(path.name)
        raw = merged_raw(path.name)[0]
        top_k = raw.get("_top_k")
        if not isinstance(top_k, int) or top_k < 1:
            continue
        entries = tuple((int(m), top_k, Plan.from_dict(v)) for m, v in raw.items() if not m.startswith("_"))
        out.append((path.name, int(match.group(1)), float(match.group(2)), entries))
    return tuple(out)


def borrowed_plan(*, num_tokens: int, top_k: int, num_local: int, hidden: int, dtype: torch.dtype, device: str,
                  exclude: str | None = None) -> tuple[Plan, str] | None:
    """The plan another shape's file on ``device`` tuned for the nearest rows per expert (see the
    module doc), and where it came from; ``None`` without a usable file. ``exclude``: a file name
    not to borrow from (the shape's own, in a leave-one-out measurement)."""
    pairs = num_tokens * top_k
    target = math.log2(max(pairs / max(num_local, 1), 1e-6))
    decode = pairs_eligible(pairs, num_local)
    best = None
    for name, experts, file_hidden, entries in _device_files(dtype_key(dtype), device):
        if name == exclude:
            continue
        for m, k, plan in entries:
            if plan.path is ExpertsPath.GROUPED_MM or (plan.path in DECODE_PATHS) != decode:
                continue
            dist = (abs(math.log2(m * k / experts) - target), abs(math.log2(file_hidden / max(hidden, 1))), name, m)
            if best is None or dist < best[0]:
                best = (dist, plan, f"{name} M={m}")
    if best is None:
        return None
    plan, source = best[1], best[2]
    if plan.gemm2.split_k > 1:  # tuned for another shape's tile count and K (see the module doc)
        plan = replace(plan, gemm2=replace(plan.gemm2, split_k=1))
        source += " with its second GEMM unsplit (split-K is tuned per shape)"
    return plan, source


_SAID: set[str] = set()


def _say_once(message: str, key: str | None = None) -> None:
    """Log ``message`` the first time ``key`` (default: the message) comes up."""
    key = message if key is None else key
    if key not in _SAID:
        _SAID.add(key)
        log.info(message)


FAR_OCTAVES = 3  # a tuned entry this many octaves of M away is another regime (a partial tuning run)


@functools.lru_cache(maxsize=4096)
def _untuned_plan(num_tokens: int, top_k: int, num_local: int, hidden: int, inter: int, dtype: torch.dtype,
                  keys: tuple[str, ...], why: str, said: str) -> tuple[Plan, str]:
    """Borrowed, else the default heuristic, and where it came from; says so once per ``said`` (a
    shape and a reason)."""
    for key in keys:
        found = borrowed_plan(num_tokens=num_tokens, top_k=top_k, num_local=num_local, hidden=hidden, dtype=dtype,
                              device=key)
        if found:
            _say_once(f"moe_compile: {why}; borrowing the plans tuned for the nearest rows per expert on {key} "
                      f"(e.g. {found[1]}); `python -m moe_compile tune --shape "
                      f"{num_local},{top_k},{hidden},{inter}` tunes this shape on this GPU (it writes to "
                      f"${USER_DIR_ENV} when that is set)", said)
            return found[0], f"borrowed: {found[1]} ({why})"
    _say_once(f"moe_compile: {why} and none to borrow; using the default heuristic", said)
    return default_plan(num_tokens, top_k, num_local, hidden, inter), f"default heuristic ({why}, none to borrow)"


def plan_and_source(*, num_tokens: int, top_k: int, num_local: int, hidden: int, inter: int, dtype: torch.dtype,
                    keys: tuple[str, ...]) -> tuple[Plan, str]:
    """``choose_plan`` for the tuned files of device keys ``keys`` (see ``tuned_device_keys``), and
    where the plan came from: ``tuned: FILE M=...``, ``borrowed: FILE M=... (why)`` or ``default
    heuristic (why)``. Cached per shape and token count (``reload`` forgets): this runs on every
    call of the op, and the lookup itself took ~12 µs of host time per call."""
    return _plan_and_source(num_tokens, top_k, num_local, hidden, inter, dtype, tuple(keys))


@functools.lru_cache(maxsize=4096)
def _plan_and_source(num_tokens: int, top_k: int, num_local: int, hidden: int, inter: int, dtype: torch.dtype,
                     keys: tuple[str, ...]) -> tuple[Plan, str]:
    table, name = None, config_file_name(num_local, hidden, inter, dtype, keys[0])
    for key in keys:
        table = _load_with_origin(config_file_name(num_local, hidden, inter, dtype, key))
        if table:
            name = config_file_name(num_local, hidden, inter, dtype, key)
            break
    if not table:
        return _untuned_plan(num_tokens, top_k, num_local, hidden, inter, dtype, keys, f"no tuned plans {name}",
                             f"none {name}")
    target = math.log2(max(num_tokens, 1))
    best = min(table, key=lambda m: (abs(math.log2(max(m, 1)) - target), m))
    plan, origin = table[best]
    if abs(math.log2(max(best, 1)) - target) > FAR_OCTAVES:
        # the file was tuned for other batch sizes only: a plan tuned for these rows per expert
        return _untuned_plan(num_tokens, top_k, num_local, hidden, inter, dtype, keys,
                             f"{name} has no entry within {2 ** FAR_OCTAVES}x of {num_tokens} tokens (nor of other "
                             "batch sizes this far from its entries; said once)", f"far {name}")
    if plan.path in DECODE_PATHS and not pairs_eligible(num_tokens * top_k, num_local):
        # a tuned decode entry does not carry over to a batch whose pairs share experts
        why = f"{name} M={best} is a decode plan and {num_tokens} tokens' pairs share experts"
        _say_once(f"moe_compile: {why}; using the default heuristic (said once per file)", f"decode {name}")
        return default_plan(num_tokens, top_k, num_local, hidden, inter), f"default heuristic ({why})"
    where = "" if origin.parent == CONFIG_DIR else f" in {origin.parent}"
    return plan, f"tuned: {name} M={best}{where}"


def choose_plan(*, num_tokens: int, top_k: int, num_local: int, hidden: int, inter: int,
                dtype: torch.dtype, device: torch.device) -> Plan:
    return plan_and_source(num_tokens=num_tokens, top_k=top_k, num_local=num_local, hidden=hidden, inter=inter,
                           dtype=dtype, keys=tuple(_device_keys(device)))[0]


def reload() -> None:
    """Forget the tuned files read so far, so the next lookups read ``config_dirs()`` again (after
    changing ``$MOE_COMPILE_CONFIG_DIR`` or the files in it within one process). Kernels already
    captured in a CUDA graph keep the plans they were captured with."""
    for cache in (_load_with_origin, _device_files, _untuned_plan, _plan_and_source):
        cache.cache_clear()


def describe_plan(plan: Plan) -> str:
    """One line: the path and each GEMM's tile, warps, stages and options."""
    def gemm(g: GemmConfig) -> str:
        opts = [name for name, on in (("tma", g.tma), (f"persistent={g.persistent}", g.persistent),
                                      (f"tail={g.tail_m}", g.tail_m), ("by-expert", g.expert_order),
                                      (f"merge={g.merge_m}", g.merge_m),
                                      ("(2nd launch)", g.merge_m and g.merge_launch),
                                      (f"split_k={g.split_k}", g.split_k > 1)) if on]
        return f"{g.block_m}x{g.block_n}x{g.block_k} w{g.num_warps} s{g.num_stages} g{g.group_m}" + (
            " " + " ".join(opts) if opts else "")
    extra = " pre-gathered" if plan.pre_gather else ""
    return f"{plan.path.value}{extra} | gemm1 {gemm(plan.gemm1)} | gemm2 {gemm(plan.gemm2)}"


__all__ = ["CONFIG_DIR", "USER_DIR_ENV", "ExpertsPath", "Plan", "borrowed_plan", "choose_plan", "config_dirs",
           "config_file_name", "default_plan", "describe_plan", "device_key", "merged_raw", "parse_shape",
           "plan_and_source", "reload", "tuned_device_keys"]
