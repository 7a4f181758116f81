"""Tuned-plan directories with a few fields changed, for ``ab_layer.py --a-set / --b-set``.

A spec names one tuned point and the fields to change in its plan::

    deepseek_v3:8192:gemm1.expert_order=1,gemm1.group_m=1024,gemm2.expert_order=1
    mixtral:2048:gemm2.split_k=1,pre_gather=0
    qwen3:2048:path=grouped_mm

``gemm1.*`` / ``gemm2.*`` are ``GemmConfig`` fields (integers), ``pre_gather`` is 0 or 1 and
``path`` one of the experts paths. The point's plan is read from the side's own directory if
it has that shape's file, else from the shipped one; the changed file goes into a new directory
(with the side's other files), which that side then reads before the shipped plans. So an A/B
run of one changed field needs no hand-edited copy of a tuned file.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import fields
from pathlib import Path

import torch

from moe_compile.kernels.triton.configs import CONFIG_DIR, ExpertsPath, Plan, config_file_name
from moe_compile.kernels.triton.gemm import GemmConfig

GEMM_FIELDS = {f.name for f in fields(GemmConfig)}
PATHS = {p.value for p in ExpertsPath}


def parse_override(spec: str, shapes: dict) -> tuple[str, int, dict[str, object]]:
    """``"shape:M:field=value,..."`` -> (shape, M, {field: value}); ``ValueError`` naming what is wrong."""
    parts = spec.split(":")
    if len(parts) != 3 or not parts[2]:
        raise ValueError(f"plan override {spec!r}: expected SHAPE:M:FIELD=VALUE[,FIELD=VALUE...]")
    name, m, assigns = parts
    if name not in shapes:
        raise ValueError(f"plan override {spec!r}: shape {name!r} is not one of {sorted(shapes)}")
    if not m.isdigit() or int(m) < 1:
        raise ValueError(f"plan override {spec!r}: M={m!r} must be a positive integer")
    changes: dict[str, object] = {}
    for assign in assigns.split(","):
        key, sep, value = assign.partition("=")
        if not sep:
            raise ValueError(f"plan override {spec!r}: {assign!r} is not FIELD=VALUE")
        gemm, dot, field = key.partition(".")
        if dot and gemm in ("gemm1", "gemm2") and field in GEMM_FIELDS:
            if not value.isdigit():
                raise ValueError(f"plan override {spec!r}: {key}={value!r} must be a non-negative integer")
            changes[key] = int(value)
        elif key == "pre_gather":
            if value not in ("0", "1"):
                raise ValueError(f"plan override {spec!r}: pre_gather={value!r} must be 0 or 1")
            changes[key] = int(value)
        elif key == "path":
            if value not in PATHS:
                raise ValueError(f"plan override {spec!r}: path={value!r} must be one of {sorted(PATHS)}")
            changes[key] = value
        else:
            raise ValueError(f"plan override {spec!r}: unknown field {key!r}; expected gemm1.<f>, gemm2.<f> "
                             f"(f in {sorted(GEMM_FIELDS)}), pre_gather or path")
    return name, int(m), changes


def tuned_table(shape, directory: Path, device: str, dtype: torch.dtype = torch.bfloat16) -> tuple[Path, dict]:
    """``(path in directory, table)`` of ``shape``'s tuned file: the table from ``directory`` when it
    has the file, else the shipped one (``ValueError`` when neither exists)."""
    name = config_file_name(shape.num_experts, shape.hidden, shape.inter, dtype, device)
    path = Path(directory) / name
    src = path if path.exists() else CONFIG_DIR / name
    if not src.exists():
        raise ValueError(f"no tuned file {name} for device {device!r} in {directory} or {CONFIG_DIR}")
    return path, json.loads(src.read_text())


def write_overrides(specs: list[str], shapes: dict, base_dir: str | None, out_dir: Path, device: str,
                    dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Fill ``out_dir`` with ``base_dir``'s tuned files and the overridden ones; returns one line per
    change (the plan before and after)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if base_dir:
        for f in Path(base_dir).glob("*.json"):
            shutil.copy(f, out_dir / f.name)
    said = []
    for spec in specs:
        name, m, changes = parse_override(spec, shapes)
        try:
            path, table = tuned_table(shapes[name], out_dir, device, dtype)
        except ValueError as exc:
            raise ValueError(f"plan override {spec!r}: {exc}") from None
        if str(m) not in table:
            raise ValueError(f"plan override {spec!r}: {path.name} has no plan for M={m} (it has "
                             f"{sorted(int(k) for k in table if k.isdigit())})")
        entry = table[str(m)]
        before = Plan.from_dict(entry)
        for key, value in changes.items():
            gemm, _, field = key.partition(".")
            if field:
                entry[gemm][field] = value
            else:
                entry[key] = value
        after = Plan.from_dict(entry)  # the changed entry must still be a plan
        entry["_from"] = f"benchmarks/plan_override.py: {spec}"
        path.write_text(json.dumps(table, indent=1))
        said.append(f"{name} M={m}: {spec.split(':', 2)[2]} ({'no change' if before == after else 'changed'})")
    return said
