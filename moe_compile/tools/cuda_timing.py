"""CUDA-graph timing, as the layer benchmark and the tuner time the op (CUDA only).

Every timed graph calls the function once on each of ``ROTATE`` inputs in turn, so the experts a
call hits change from call to call and the weights come from HBM, not from L2.
"""
from __future__ import annotations

import statistics

import torch

ROTATE = 8


def capture_graph(fn, inputs):
    """``(graph, outputs)``: a CUDA graph that calls ``fn`` once on each input in turn (after one
    warm-up pass on a side stream), and the outputs of those calls (refreshed by each replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in inputs:
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(x) for x in inputs]
    return graph, outs


def graph_time_us(fn, inputs, reps: int) -> float:
    """Median per-call time of a CUDA graph that calls ``fn`` once on each input in turn."""
    graph, _ = capture_graph(fn, inputs)
    return event_time_us(graph.replay, reps) / len(inputs)


def event_time_us(run, reps: int) -> float:
    """Median microseconds of ``run()`` by CUDA events, after three warm-up calls."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


__all__ = ["ROTATE", "capture_graph", "event_time_us", "graph_time_us"]
