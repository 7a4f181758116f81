"""Probes that make a match hold beyond the example routing, and the reasons when it does not.

A match is found and confirmed on random probes: random hidden states of unit size, each token's
logits a random permutation. Such probes leave blocks wrong that differ from the fused op only where
those probes never go, so every match also passes these, on the real weights:

* **every expert**: with few tokens (decode, T = 1) a random probe reaches ``T * top_k`` experts;
  the coverage probes route tokens to each expert in turn, so an expert that is not the same MLP as
  the others (its own residual, LoRA or activation) is found;
* **skewed routing**: every token prefers the same experts, so a block that drops or rescales
  tokens over an expert's capacity differs from the op, which drops none;
* **large inputs**: hidden states 32x (fp16: 8x) the unit probe's, so a clamp inside the experts
  fires (unless the op's activation has that clamp);
* **the block's other inputs moved**: parameters and buffers the block reads besides the ones the
  op takes (a LoRA ``B`` initialised to zero, a learned scale of ones, a zero bias on some experts,
  a temperature of 1) make no difference at compile time, so the op matches, but it would not
  follow their updates. They are perturbed, and the output must not move.
"""
from __future__ import annotations

import math

import torch
from torch import fx

from . import experts as ex
from . import router as rt
from .graph import backward_slice, val

MAX_COVERAGE_PROBES = 64
LARGE_SCALE = {torch.float16: 8.0}  # others: 32
COVERAGE_SEED, SKEW_SEED, LARGE_SEED, MOVED_SEED = 300, 400, 500, 600


def probe_grid(num_experts: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``num_experts`` evenly spaced logits over about ±2, exactly representable in ``dtype``, and
    off-centre by an eighth of a step where ``dtype`` holds that: a grid symmetric about 0 makes
    ``sigmoid(a) + sigmoid(-a) = 1`` exactly, so two groups' top-2 sums tie (with a zero selection
    bias), and the block's ``torch.topk`` and the op then keep different groups. (bf16 holds the
    offset up to 64 experts; routers with more compute their scores in fp32.)"""
    step = 2.0 ** round(math.log2(4.0 / num_experts))
    centred = torch.arange(num_experts, dtype=torch.float32) - num_experts / 2
    shifted = (centred + 0.125) * step
    return shifted if torch.equal(shifted.to(dtype).float(), shifted) else centred * step


def coverage_logits(shape, top_k: int, first: int, dtype, device, gen: torch.Generator) -> torch.Tensor:
    """Logits whose token ``j`` ranks experts ``first + j*top_k ... + top_k - 1`` (mod E) highest,
    in a shuffled order, every other expert below them shuffled; distinct, exactly representable
    values (``probe_logits``' grid). Neighbouring experts share a group, so a grouped router keeps
    them when ``top_k`` experts span no more groups than it keeps."""
    num_tokens, num_experts = shape
    grid = probe_grid(num_experts, dtype)
    high, low = grid[num_experts - top_k:], grid[:num_experts - top_k]
    wanted = (first + torch.arange(num_tokens)[:, None] * top_k + torch.arange(top_k)) % num_experts
    chosen = torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, wanted, True)
    rows = torch.empty(num_tokens, num_experts)
    # each row's top_k highest values on its wanted experts and the rest below, both shuffled per row
    rows[chosen] = high[torch.rand(num_tokens, top_k, generator=gen).argsort(dim=1)].reshape(-1)
    rows[~chosen] = low[torch.rand(num_tokens, num_experts - top_k, generator=gen).argsort(dim=1)].reshape(-1)
    return rows.to(device=device, dtype=dtype)


def num_coverage_probes(num_tokens: int, num_experts: int, top_k: int) -> int:
    return min(MAX_COVERAGE_PROBES, max(1, -(-num_experts // max(1, num_tokens * top_k))))


def _consumed_leaves(ctx, anchor, choice: ex.ExpertsChoice) -> set[fx.Node]:
    """The graph inputs the fused op reads: the experts' weights and biases, the router's weight and
    the selection bias (with the inputs it is computed from)."""
    out: set[fx.Node] = set()

    def add(source):
        if source is None:
            return
        for part in source.nodes:
            if isinstance(part, ex.WeightSource):
                add(part)
            else:
                out.add(part)

    for source in (choice.w13, choice.w2, choice.b13, choice.b2):
        add(source)
    for node in (anchor.router_weight, anchor.bias):
        if node is not None:
            out.update(n for n in backward_slice([node], set()) if n.op in ("placeholder", "get_attr"))
    return out


def other_inputs(ctx, anchor, choice: ex.ExpertsChoice, nodes: set[fx.Node], probed: set[fx.Node]) -> list[fx.Node]:
    """Floating-point graph inputs in the block's slice that the fused op does not read (``probed``: the
    block input and logits, which the probes set). Python
    numbers Dynamo made float64 0-d inputs are left out: a routing scale among them is read per call
    by the rewritten graph (``scales.scale_source``)."""
    consumed = _consumed_leaves(ctx, anchor, choice)
    out = []
    for node in nodes:
        if node.op not in ("placeholder", "get_attr") or node in consumed or node in probed:
            continue
        value = ctx.values.get(node)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() == 0:
            continue
        scalar = value.dim() == 0 and value.dtype == torch.float64 and not rt.is_weight_root(node, ctx.names)
        if not scalar:
            out.append(node)
    order = {n: i for i, n in enumerate(ctx.graph.nodes)}
    return sorted(out, key=order.__getitem__)


def _moved(value: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    scale = float(value.float().abs().mean()) * 0.5 + 0.05
    noise = torch.randn(value.shape, generator=gen) * scale
    return value + noise.to(device=value.device, dtype=value.dtype)


def _input_name(ctx, node: fx.Node) -> str:
    name = ctx.names.get(node) or (node.target if node.op == "get_attr" else node.name)
    return str(name).replace("L__self___", "").replace("L['self'].", "")


def _bad_experts(fused: torch.Tensor, got: torch.Tensor, ids: torch.Tensor, tol: float) -> list[int]:
    """Experts that only the rows which disagree use."""
    got = got.reshape(fused.shape).float()
    err = (fused.float() - got).abs().amax(dim=-1)
    bad = err > tol * (got.abs().max() + 1e-6)
    ids = ids.reshape(fused.shape[0], -1)
    good = set(ids[~bad].reshape(-1).tolist())
    return sorted(set(ids[bad].reshape(-1).tolist()) - good)


def stress(ctx, anchor, routing, output: fx.Node, choice: ex.ExpertsChoice, bias_value, weights) -> str | None:
    """``None`` when the match holds on every stress probe, else why it does not (the block stays)."""
    from .match import TOLERANCE, _eval, close, compare_dtype, fused_reference, make_probe

    w13, w2, b13, b2 = weights
    base = make_probe(ctx, anchor, COVERAGE_SEED)
    if isinstance(base, str):
        return base
    num_tokens, num_experts = base.logits.shape
    top_k = routing.top_k

    def check(probe, overrides=None):
        """(fused, got, ok) on a probe; ``got`` None when the block cannot run on it."""
        probe_overrides = {**probe.overrides, **(overrides or {})}
        got = _eval(ctx, type(probe)(probe_overrides, probe.x2d, probe.logits), [output])
        if got is None:
            return None, None, False
        fused = fused_reference(probe.x2d, probe.logits, routing, bias_value, w13, w2, b13, b2, choice.config)
        dtype = compare_dtype(got[0].dtype, w13.dtype)
        return fused, got[0], close(fused, got[0], dtype)

    def coverage(shift: int) -> tuple[str | None, set[int]]:
        """Route to every expert in turn, starting at expert ``shift``: (why the block could not run,
        the experts of the rows that disagreed)."""
        bad: set[int] = set()
        for i in range(num_coverage_probes(num_tokens, num_experts, top_k)):
            gen = torch.Generator().manual_seed(ctx.seed * 1000 + COVERAGE_SEED + i)
            logits = coverage_logits(base.logits.shape, top_k, shift + i * num_tokens * top_k, base.logits.dtype,
                                     base.logits.device, gen)
            fused, got, ok = check(make_probe(ctx, anchor, COVERAGE_SEED + i, logits=logits))
            if got is None:
                return "the block could not be evaluated on probes that route tokens to every expert in turn", bad
            if not ok:
                ids = rt.reference_routing(logits, routing, bias_value if routing.has_correction_bias else None)[1]
                bad |= set(_bad_experts(fused, got, ids, TOLERANCE.get(compare_dtype(got.dtype, w13.dtype), 3e-2)))
                bad.add(-1)  # a disagreement, even when no expert can be singled out
        return None, bad

    failed, bad = coverage(0)
    if failed:
        return failed
    if bad:
        # the rows that disagreed each hold top_k experts; a second pass, shifted by one expert, pairs
        # them differently, and the experts in both passes' disagreeing rows are the odd ones
        _, again = coverage(1)
        both = (bad & again) - {-1} or bad - {-1}
        which = "experts %s" % sorted(both) if both else "some experts"
        return ("the experts are not all the same MLP: with tokens routed to every expert in turn, the block's "
                "output differs from the fused op's for %s (an expert with its own residual, adapter or "
                "activation?)" % which)

    probe = make_probe(ctx, anchor, SKEW_SEED)
    skewed = probe.logits[:1].expand_as(probe.logits).contiguous()
    fused, got, ok = check(make_probe(ctx, anchor, SKEW_SEED, logits=skewed))
    if not ok:
        return ("with every token routed to the same experts the block's output differs from the fused op's: the "
                "block drops or rescales tokens over an expert's capacity (the fused op drops none)")

    probe = make_probe(ctx, anchor, LARGE_SEED, x_scale=LARGE_SCALE.get(probe.x2d.dtype, 32.0))
    fused, got, ok = check(probe)
    if not ok and got is not None and torch.isfinite(got.float()).all():
        return ("on large hidden states the block's output differs from the fused op's (%s experts): something in "
                "the experts depends on the input's size (a clamp?) that the op's activation does not have"
                % choice.describe())

    probed = set(probe.overrides)
    others = other_inputs(ctx, anchor, choice, backward_slice([output], probed), probed)
    if others:
        gen = torch.Generator().manual_seed(ctx.seed * 1000 + MOVED_SEED)
        probe = make_probe(ctx, anchor, MOVED_SEED)
        fused, got, ok = check(probe, {n: _moved(ctx.values[n], gen) for n in others})
        if not ok:
            names = ", ".join("%s %s" % (_input_name(ctx, n), list(val(n).shape)) for n in others[:4])
            more = " and %d more" % (len(others) - 4) if len(others) > 4 else ""
            return ("the block also reads %s%s, which the fused op does not take: at their values now they change "
                    "nothing (a LoRA, a scale or a bias initialised to a no-op?), but the op would not follow their "
                    "updates, so the block is left as it was" % (names, more))
    return None
