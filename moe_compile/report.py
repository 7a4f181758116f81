"""What the pass did: per-block decisions, counters, and the before/after graphs.

Each backend compile appends to the active reports (``explain`` opens one); the counters in
``torch._dynamo.utils.counters["moe_compile"]`` are always updated.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import os
import weakref
from dataclasses import dataclass, field

import torch

log = logging.getLogger("moe_compile")

_ACTIVE: list["Report"] = []
_TRACKING: list[list] = []
_EXCLUDED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


@dataclass(frozen=True)
class BlockDecision:
    path: str
    router: str = "-"
    experts: str = "-"
    num_experts: int | None = None
    top_k: int | None = None
    activation: str = "-"
    rewritten: bool = False
    reason: str = ""
    # id() of the router's weight tensor, so explain() can name the block by its path in the model
    # when Dynamo compiled a nested frame (paths are relative to the frame's module)
    router_weight_id: int | None = field(default=None, compare=False, repr=False)
    not_moe: bool = False  # a top-k that is no MoE router (an attention indexer's): listed apart

    @property
    def decision(self) -> str:
        return "rewritten" if self.rewritten else "skipped: " + self.reason


@dataclass
class Report:
    blocks: list[BlockDecision] = field(default_factory=list)
    graphs_before: list[str] = field(default_factory=list)
    graphs_after: list[str] = field(default_factory=list)
    graph_count: int = 0
    output: object = None  # what the compiled model returned in explain()

    @property
    def rewritten(self) -> list[str]:
        return [b.path for b in self.blocks if b.rewritten]

    @property
    def skipped(self) -> list[tuple[str, str]]:
        """The MoE blocks left as they were, with the reasons (``other_topk`` holds the rest)."""
        return [(b.path, b.reason) for b in self.blocks if not b.rewritten and not b.not_moe]

    @property
    def other_topk(self) -> list[tuple[str, str]]:
        """Top-k ops that are no MoE router (attention indexers, values-only top-k), with why."""
        return [(b.path, b.reason) for b in self.blocks if b.not_moe]

    def add(self, decision: BlockDecision, *, supersede: bool = False) -> None:
        # one line per block: a later rewrite (e.g. a recompile) supersedes a skip
        for i, old in enumerate(self.blocks):
            if old.path == decision.path:
                if supersede or decision.rewritten or not old.rewritten:
                    self.blocks[i] = decision
                return
        self.blocks.append(decision)

    def write_graphs(self, folder: str) -> list[str]:
        os.makedirs(folder, exist_ok=True)
        paths = []
        for i, (before, after) in enumerate(zip(self.graphs_before, self.graphs_after)):
            for tag, text in (("before", before), ("after", after)):
                path = os.path.join(folder, "graph%d_%s.txt" % (i, tag))
                with open(path, "w") as fh:
                    fh.write(text)
                paths.append(path)
        return paths

    def __repr__(self) -> str:
        # short: the dataclass repr would hold every graph's text (tens of thousands of characters)
        return "<%s: %d rewritten, %d skipped, %d graph(s); print() for the table>" % (
            type(self).__name__, len(self.rewritten), len(self.skipped), self.graph_count)

    def __str__(self) -> str:
        header = ("path", "router", "experts", "E", "top-k", "activation", "decision")
        rows = [header] + [
            (b.path or "<root>", b.router, b.experts, "-" if b.num_experts is None else str(b.num_experts),
             "-" if b.top_k is None else str(b.top_k), b.activation, b.decision)
            for b in self.blocks if not b.not_moe
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        lines = []
        for j, row in enumerate(rows):
            cells = [c.ljust(w) for c, w in zip(row[:-1], widths)] + [row[-1]]
            lines.append("  ".join(cells).rstrip())
            if j == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 8)
        summary = "%d MoE block(s) rewritten, %d skipped" % (len(self.rewritten), len(self.skipped))
        others = ["%d other top-k op(s), not MoE routers, left as they were:" % len(self.other_topk)] + [
            "  %s: %s" % (path or "<root>", reason) for path, reason in self.other_topk] if self.other_topk else []
        return "\n".join(lines + [summary] + others)


@contextlib.contextmanager
def collecting():
    report = Report()
    _ACTIVE.append(report)
    try:
        yield report
    finally:
        _ACTIVE.remove(report)


@contextlib.contextmanager
def tracking():
    """The decisions recorded inside the block (to take back if the compile fails after the pass)."""
    seen: list[BlockDecision] = []
    _TRACKING.append(seen)
    try:
        yield seen
    finally:
        _TRACKING.remove(seen)


def take_back(decisions: list[BlockDecision], reason: str) -> None:
    """The compile that used these rewrites failed and the original graph was compiled instead:
    each rewritten block becomes a skip with ``reason`` (counters and open reports alike)."""
    counters = torch._dynamo.utils.counters["moe_compile"]
    for decision in decisions:
        if not decision.rewritten:
            continue
        counters["rewritten"] -= 1
        counters["skipped"] += 1
        undone = dataclasses.replace(decision, rewritten=False, reason=reason)
        log.warning("moe_compile: %s is not rewritten after all: %s", decision.path or "<root>", reason)
        for report in _ACTIVE:
            report.add(undone, supersede=True)


def forget(decisions: list[BlockDecision]) -> None:
    """Dynamo will trace this graph again (``RestartAnalysis``): take these decisions out of the
    counters and the open reports, quietly; the retrace records its own."""
    counters = torch._dynamo.utils.counters["moe_compile"]
    for decision in decisions:
        counters[_counter(decision)] -= 1
        for report in _ACTIVE:
            report.blocks = [b for b in report.blocks if b is not decision]


def record(decision: BlockDecision) -> None:
    for seen in _TRACKING:
        seen.append(decision)
    counters = torch._dynamo.utils.counters["moe_compile"]
    counters[_counter(decision)] += 1
    if decision.rewritten:
        log.info("moe_compile: rewrote %s (%s, %s, E=%s, top-k=%s, %s)", decision.path, decision.router,
                 decision.experts, decision.num_experts, decision.top_k, decision.activation)
    elif decision.not_moe:
        log.info("moe_compile: a top-k at %s is no MoE router: %s", decision.path or "<root>", decision.reason)
    else:
        log.info("moe_compile: left %s as it was: %s", decision.path or "<root>", decision.reason)
    for report in _ACTIVE:
        report.add(decision)


def _counter(decision: BlockDecision) -> str:
    return "rewritten" if decision.rewritten else "other_topk" if decision.not_moe else "skipped"


def record_graphs(before: str, after: str) -> None:
    for report in _ACTIVE:
        report.graphs_before.append(before)
        report.graphs_after.append(after)
        report.graph_count += 1


def exclude(module: torch.nn.Module) -> torch.nn.Module:
    """Leave this module instance (and the MoE blocks inside it) out of the rewrite."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError("exclude() takes a torch.nn.Module, but got %s" % type(module).__name__)
    _EXCLUDED.add(module)
    return module


def excluded_tensor_ids() -> set[int]:
    ids = set()
    for module in list(_EXCLUDED):
        for t in list(module.parameters()) + list(module.buffers()):
            ids.add(id(t))
    return ids


def path_excluded(path: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(path, g) or fnmatch.fnmatchcase(path + ".", g) for g in globs)
