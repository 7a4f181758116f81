"""The NPU lowering's distributed modes on 2 gloo ranks under the emulation (poison=True).

TP (all_reduce / all_gather + reduce_scatter), static EP (active_expert_range; reduce or not) and
dynamic EP (token permute + all_to_all_single), each against the single-process reference. One
spawn runs every case; each rank reports ``{case: None | traceback}``.
"""
import datetime
import os
import pickle
import tempfile
import traceback

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
E, K, H, I = 8, 2, 16, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def _model(num_tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(num_tokens, H, generator=g), logits=torch.randn(num_tokens, E, generator=g),
                w13=torch.randn(E, H, 2 * I, generator=g) / 4, w2=torch.randn(E, I, H, generator=g) / 3,
                b13=torch.randn(E, 2 * I, generator=g) * 0.1, b2=torch.randn(E, H, generator=g) * 0.1)


def _run_case(name, rank, group, npu):
    import torch.distributed as dist

    from moe_compile import fused_moe
    from moe_compile.distributed.sharding import shard_experts_for_ep, shard_for_tp, shard_tokens

    full_tokens = name.endswith("full")
    m = _model(12)
    top_k = 1 if name.startswith("ep_auto") else K
    reference = fused_moe(m["x"], m["logits"], E, top_k, m["w13"], m["w2"], m["b13"], m["b2"],
                          renormalize=True, lowering="cpu")
    x, logits, want = m["x"], m["logits"], reference
    if not full_tokens:
        x, logits, want = (shard_tokens(t, rank=rank, world_size=WORLD) for t in (x, logits, reference))
    weights = (m["w13"], m["w2"], m["b13"], m["b2"])
    kwargs = dict(renormalize=True, lowering="npu", tokens_full=full_tokens)
    if name.startswith("tp"):
        w = shard_for_tp(*weights, rank=rank, world_size=WORLD)
        kwargs["tp_group"] = group
    else:
        w = shard_experts_for_ep(*weights, rank=rank, world_size=WORLD)
        kwargs["ep_group"] = group
        kwargs["dispatcher_type"] = {"static": "static", "dynamic": "dynamic", "auto": None}[name.split("_")[1]]
    kwargs["reduce_results"] = "partial" not in name
    permutes = npu.calls["npu_moe_token_permute"]
    out = fused_moe(x, logits, E, top_k, w.w13, w.w2, w.w13_bias, w.w2_bias, **kwargs)
    assert not torch.isnan(out).any()
    if "partial" in name:  # reduce_results=False: each rank holds its experts' share; the caller sums
        dist.all_reduce(out, group=group)
    torch.testing.assert_close(out, want, **TOL)
    dynamic = "dynamic" in name or name.startswith("ep_auto")  # auto with top_k=1 < ep=2: dynamic
    assert (npu.calls["npu_moe_token_permute"] > permutes) == dynamic


CASES = ["tp_full", "tp_sharded", "ep_static_full", "ep_static_sharded", "ep_static_partial_full",
         "ep_dynamic_full", "ep_dynamic_sharded", "ep_auto_full"]


def _worker(rank, init_method, out_dir):
    import torch.distributed as dist

    from moe_compile.testing import emulated_npu

    torch.set_num_threads(1)
    report = {}
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=60))
        with emulated_npu(poison=True) as npu:
            for name in CASES:
                try:
                    _run_case(name, rank, dist.group.WORLD, npu)
                    report[name] = None
                except Exception:  # noqa: BLE001 - the parent shows it
                    report[name] = traceback.format_exc()
    except BaseException:  # noqa: BLE001
        report["<worker>"] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(report, f)
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.distributed
def test_tp_static_ep_and_dynamic_ep_match_the_reference():
    out_dir = tempfile.mkdtemp(prefix="moe_npu_dist_")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, "file://" + os.path.join(out_dir, "rdv"), out_dir))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        if p.is_alive():
            p.kill()  # only the ranks this test started
            p.join()
    errors = []
    for rank in range(WORLD):
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        if not os.path.exists(path):
            errors.append(f"rank {rank}: no report")
            continue
        with open(path, "rb") as f:
            report = pickle.load(f)
        assert set(report) >= set(CASES) or "<worker>" in report
        errors += [f"rank {rank} / {case}:\n{err}" for case, err in report.items() if err]
    assert not errors, "\n".join(errors)
