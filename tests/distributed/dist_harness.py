"""Run one function on W spawned ranks (gloo on CPU, or NCCL with one GPU per rank) and collect
what each rank reports.

One spawn serves many cases: the worker runs them all and returns ``{case_id: error or None}``;
the test then asserts on every rank's report. Rendezvous goes through a fresh ``file://`` path,
so parallel pytest-xdist workers never collide on a port. The default group's collectives time
out after ``GROUP_TIMEOUT`` seconds, and the parent kills ranks that outlive ``deadline_s`` (480 s by
default: on the H200 under ``pytest -n 12`` the two gloo ranks, compiling under the Triton interpreter,
once took longer than the 240 s it was before).
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback

import torch.multiprocessing as mp

GROUP_TIMEOUT = datetime.timedelta(seconds=60)


def device():
    """This rank's device: its GPU under NCCL, else the CPU (the cases build their tensors here)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _entry(target, rank: int, world_size: int, init_method: str, out_dir: str, args: tuple,
           backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # W ranks share the CI machine's few cores
    report: dict = {}
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=GROUP_TIMEOUT)
        report = target(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - the parent shows the traceback
        report = {"<worker>": traceback.format_exc()}
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(report, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(target, world_size: int, *args, deadline_s: float = 480.0, backend: str = "gloo") -> list[dict]:
    """``target(rank, world_size, *args) -> dict`` on ``world_size`` ranks; the reports by rank.
    ``backend="nccl"`` puts rank r on GPU r (NVLink multicast off, as on the H200 machines)."""
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    out_dir = tempfile.mkdtemp(prefix="moe_dist_")
    init_method = "file://" + os.path.join(out_dir, "rendezvous")
    procs = [ctx.Process(target=_entry, args=(target, r, world_size, init_method, out_dir, args, backend))
             for r in range(world_size)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    reports = []
    for rank, p in enumerate(procs):
        killed = p.is_alive()
        if killed:
            p.kill()  # only the ranks this call started
            p.join()
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                reports.append(pickle.load(f))
        else:
            why = f"killed, still running after {deadline_s:.0f} s" if killed else f"exit code {p.exitcode}"
            reports.append({"<worker>": f"rank {rank} left no report ({why})"})
    return reports


def failures(reports: list[dict]) -> list[str]:
    """Every ``rank r / case: error`` line of the reports (empty when all passed)."""
    return [f"rank {rank} / {case}: {err}" for rank, rep in enumerate(reports)
            for case, err in rep.items() if err is not None]


def run_cases(cases, run_one) -> dict:
    """``{case.id: None | traceback}`` for ``run_one(case)`` over ``cases`` (one failure does not stop the rest)."""
    out = {}
    for case in cases:
        try:
            run_one(case)
            out[case.id] = None
        except BaseException:  # noqa: BLE001
            out[case.id] = traceback.format_exc(limit=6)
    return out
