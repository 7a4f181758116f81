"""The ``moe_npu`` torch.compile backend.

Dynamo's graph is traced to an aten-level inference graph by AOTAutograd; the MoE pass rewrites
it there (functionalised, every spelling of an op normalised), then the inner compiler runs:

- ``inductor``: the pass runs as Inductor's ``post_grad_custom_pre_pass`` (a CustomGraphPass
  whose ``uuid`` hashes the package source, the options, the exclusions and Dynamo's graph, so
  Inductor's compile caches serve rewritten graphs too: ``compile_cache.py``), so Inductor compiles
  the rewritten graph;
- ``aot_eager`` / ``eager``: the rewritten aten graph runs as is;
- ``torchair``: the rewritten graph goes to TorchAir (NPU only; see ``lowering/torchair.py``).

A graph that records autograd (training) is traced to aten by ``training.py`` first, rewritten there, and
the inner compiler differentiates the rewritten graph through the fused ops' backward (``ops/autograd.py``).

Any exception inside the pass compiles the original graph instead and warns once: a compile
that works without us works with us. A failure the original graph shares (it fails too, or the pass
changed nothing and Inductor failed) is not the pass's: no warning, and the error goes on to Dynamo
(which, for a data-dependent guard under our capture flags, traces the frame again without them).
Dynamo's ``RestartAnalysis`` (a request to trace the frame again, not a failure) is passed on, and
what the pass recorded in that attempt is forgotten.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import sys
import warnings

import torch

from moe_compile.ops.packed import pack_calls
from moe_compile.options import BackendConfig, InnerCompiler, parse_options
from moe_compile.report import record_graphs

log = logging.getLogger("moe_compile")
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args) -> None:
    log.warning(message, *args)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message % args, RuntimeWarning, stacklevel=2)


def _device_type(example_inputs) -> str:
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


def _input_names(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target for n in gm.graph.nodes if n.op == "placeholder"]


def _needs_autograd(example_inputs) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def _op_kwargs(config: BackendConfig) -> dict:
    from moe_compile.ops.fused_moe import _group_name

    ep, tp = _group_name(config.ep_group), _group_name(config.tp_group)
    return dict(tp_group_name=tp, ep_group_name=ep, dispatcher_type=None, tokens_full=True,
                reduce_results=True, lowering=config.lowering.value)


def moe_npu_backend(gm: torch.fx.GraphModule, example_inputs, options=None, mode=None):
    """``torch.compile(model, backend="moe_npu", options={...}, mode=...)``; ``mode`` is passed on
    to Inductor (e.g. ``"reduce-overhead"`` for CUDA graphs) and to TorchAir."""
    config = parse_options(options)
    if mode is not None:
        config = _with_mode(config, mode)
    inner = config.resolved_inner(_device_type(example_inputs))
    if inner is InnerCompiler.TORCHAIR:
        from moe_compile.lowering.torchair import real_torch_npu

        real_torch_npu()  # its error as it is: TorchAir cannot run here, with or without the pass
    training = _needs_autograd(example_inputs)
    if training:
        reason = _training_refusal(gm, example_inputs, inner, config)
        if reason:
            from moe_compile.report import BlockDecision, record

            record(BlockDecision(path="<graph>", reason=reason))
            return _compile_plain(gm, example_inputs, inner, config)
    from moe_compile.report import forget, tracking

    with tracking() as decisions:
        try:
            if training:
                compiled = _compile_training(gm, example_inputs, inner, config)
            else:
                compiled = _compile_with_pass(gm, example_inputs, inner, config, decisions)
        except torch._dynamo.exc.RestartAnalysis:
            # Dynamo's own control flow (e.g. under dynamic=True, AOTAutograd asks it to trace the
            # frame again with some scalars specialised): not a failure; the retrace calls us again
            forget(decisions)
            raise
        except Exception as exc:  # never break a compile that works without us
            log.debug("moe_compile: the compile with the pass failed", exc_info=True)
            if getattr(exc, "moe_compile_graph_untouched", False):
                # the pass changed nothing, so the original graph fails the same way: not ours (see below)
                forget(decisions)
                raise
            failure = exc
        else:
            _hint_cuda_graphs(decisions, config, inner, _device_type(example_inputs))
            return _without_op_graphs(compiled, config, inner, _device_type(example_inputs))
    try:
        compiled = _compile_plain(gm, example_inputs, inner, config)
    except Exception:
        # the original graph fails as well, so the pass is not to blame: its decisions go (a
        # data-dependent guard here, e.g. Inductor lowering a graph that capture.py's flags let
        # Dynamo capture, makes Dynamo trace the frame again without them, and that records its own)
        log.debug("moe_compile: the original graph fails to compile too (%s: %s)", type(failure).__name__,
                  str(failure).split("\n")[0][:200])
        forget(decisions)
        raise
    _blame_the_pass(decisions, failure)
    return compiled


def _training_refusal(gm, example_inputs, inner: InnerCompiler, config: BackendConfig) -> str | None:
    if not config.training:
        return ("autograd is recording (inputs require grad) and options['training'] is False: compiled without "
                "the pass")
    from moe_compile import training

    return training.refusal(gm, example_inputs, config, torchair=inner is InnerCompiler.TORCHAIR)


def _compile_training(gm, example_inputs, inner: InnerCompiler, config: BackendConfig):
    """A graph that records autograd: its forward traced to aten, rewritten, and handed to the inner
    compiler, which differentiates it through the fused ops' backward (``training.py``)."""
    from moe_compile import training
    from moe_compile.passes.moe_pass import MoEFusionPass

    try:
        aten_gm = training.trace_to_aten(gm, example_inputs)
    except torch._dynamo.exc.RestartAnalysis:  # e.g. floats to specialise (dynamic=True): Dynamo traces again
        raise
    except Exception as exc:  # nothing rewritten yet: a skip with its reason, not a failure of the pass
        from moe_compile.report import BlockDecision, record

        log.debug("moe_compile: tracing the training graph to aten failed", exc_info=True)
        record(BlockDecision(path="<graph>", reason="autograd is recording and the graph could not be traced to aten "
                             "for the pass (%s: %s); compiled without it" % (type(exc).__name__,
                                                                           str(exc).split("\n")[0][:200])))
        return _compile_plain(gm, example_inputs, inner, config)
    moe_pass = MoEFusionPass(config, list(example_inputs), _input_names(gm), _op_kwargs(config), training=True)
    before = aten_gm.print_readable(print_output=False)
    with torch.no_grad():  # the pass reads the parameters' values; it records nothing
        moe_pass(aten_gm.graph)
    if not moe_pass.rewritten:  # the skips are reported; the graph Dynamo gave is compiled as it was
        return _compile_plain(gm, example_inputs, inner, config)
    aten_gm.recompile()
    _graphs_done(config, before, aten_gm.print_readable(print_output=False))
    training.differentiable(aten_gm)
    from moe_compile.ops.autograd import backward_choice

    if inner is InnerCompiler.EAGER:  # the fused ops' setup_context reads the choice when the forward runs
        def forward(*args):
            with backward_choice(config.training_backward):
                return aten_gm.forward(*args)

        return forward
    with backward_choice(config.training_backward):  # AOTAutograd traces the backward inside the inner compile
        if inner is InnerCompiler.INDUCTOR:
            from torch._inductor import config as inductor_config

            from moe_compile.compile_cache import package_hash

            # a do-nothing custom pass whose uuid puts the package's source and the backward's form in Inductor's
            # and AOTAutograd's cache keys: a graph cached with another version's ops (their schemas), or with the
            # other training_backward (traced before the cache is asked), is not served
            uuid = "%s:%s" % (package_hash(), config.training_backward)
            with inductor_config.patch(post_grad_custom_pre_pass=_InductorHook(lambda graph: None, uuid)):
                return _compile_plain(aten_gm, example_inputs, inner, config)
        return _compile_plain(aten_gm, example_inputs, inner, config)


def _hint_cuda_graphs(decisions: list, config: BackendConfig, inner: InnerCompiler, device_type: str) -> None:
    """Say once, at INFO, that CUDA graphs pay off when MoE blocks were rewritten for CUDA without them: an eager
    call of the fused op costs ~200-370 µs of host time on the H200's host at decode sizes against tens of µs of
    kernels, so a compiled decode step without graphs is host-bound (``benchmarks/probe_launch.py``,
    ``profile_block_host.py``; DeepSeek-V4's hash block at one token: 342.8 µs per forward with graphs, 1593.8
    without, in one run of ``bench_hash_layer.py`` before the launch cache)."""
    if inner is not InnerCompiler.INDUCTOR or device_type != "cuda" or "cuda_graphs" in _warned:
        return
    if _inductor_cuda_graphs(config):
        return
    rewritten = sum(1 for d in decisions if d.rewritten)
    if rewritten:
        _warned.add("cuda_graphs")
        log.info("moe_compile: %d MoE block(s) rewritten for CUDA without CUDA graphs; at a few tokens a step is "
                 "bound by the host's launch work: the fused op replays a CUDA graph of its own kernels from its "
                 "second call of a shape on, the rest of the step does not; torch.compile(..., "
                 "mode=\"reduce-overhead\") captures the whole step (said once)", rewritten)


def _inductor_cuda_graphs(config: BackendConfig) -> bool:
    """Whether Inductor runs the compiled graph through CUDA graphs: ``reduce-overhead`` and ``max-autotune``
    turn them on (``_inductor_patches``), as does Inductor's own config."""
    from torch._inductor import config as inductor_config

    return bool(inductor_config.triton.cudagraphs or _inductor_patches(config).get("triton.cudagraphs"))


def _without_op_graphs(compiled, config: BackendConfig, inner: InnerCompiler, device_type: str):
    """A graph Inductor runs through CUDA graphs runs with the fused op's own graphs suspended
    (``lowering/op_graphs.py``): its replays skip the op's Python anyway, and its warm-up runs must not
    capture graphs of ours."""
    if inner is not InnerCompiler.INDUCTOR or device_type != "cuda" or not _inductor_cuda_graphs(config):
        return compiled
    from moe_compile.lowering.op_graphs import suspended

    @functools.wraps(compiled)
    def run(*args, **kwargs):
        with suspended():
            return compiled(*args, **kwargs)

    return run


def _blame_the_pass(decisions: list, exc: Exception) -> None:
    """The compile with the pass failed and the original graph compiled: warn, count, and turn the
    rewrites back into skips."""
    from moe_compile.report import take_back

    _warn_once("pass", "moe_compile: the MoE pass failed (%s: %s); compiled the original graph",
               type(exc).__name__, exc)
    torch._dynamo.utils.counters["moe_compile"]["pass_failed"] += 1
    take_back(decisions, "the compile failed after the rewrite (%s: %s); the original graph was "
              "compiled instead" % (type(exc).__name__, str(exc).split("\n")[0][:200]))


def _with_mode(config: BackendConfig, mode: str) -> BackendConfig:
    import dataclasses

    from moe_compile.options import COMPILE_MODES

    if mode not in COMPILE_MODES:
        raise ValueError("mode must be one of %s, but got %r" % (list(COMPILE_MODES), mode))
    return dataclasses.replace(config, compile_mode=mode)


def _inductor_patches(config: BackendConfig) -> dict:
    if config.compile_mode in (None, "default"):
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(config.compile_mode))


def _make_pass(gm, example_inputs, config):
    from moe_compile.passes.moe_pass import MoEFusionPass

    return MoEFusionPass(config, list(example_inputs), _input_names(gm), _op_kwargs(config))


def _compile_with_pass(gm, example_inputs, inner: InnerCompiler, config: BackendConfig, decisions: list):
    moe_pass = _make_pass(gm, example_inputs, config)
    if inner is InnerCompiler.INDUCTOR:
        return _compile_inductor(gm, example_inputs, config, moe_pass, decisions)
    if inner is InnerCompiler.TORCHAIR:
        from moe_compile.lowering.torchair import compile_with_torchair

        return compile_with_torchair(gm, example_inputs, config, moe_pass)
    return _aot(gm, example_inputs, moe_pass)


def _aot(gm, example_inputs, moe_pass):
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def inference(fx_g, fake_inputs):
        before = fx_g.print_readable(print_output=False)
        moe_pass(fx_g.graph)
        fx_g.recompile()
        _graphs_done(moe_pass.config, before, fx_g.print_readable(print_output=False))
        if moe_pass.config.pack_args and pack_calls(fx_g.graph):  # after the reports: they keep the plain call
            fx_g.recompile()
        return boxed_nop(fx_g, fake_inputs)

    return aot_autograd(fw_compiler=boxed_nop, inference_compiler=inference)(gm, example_inputs)


_dump_counter = itertools.count()


def _graphs_done(config: BackendConfig, before: str, after: str) -> None:
    """Hand the before/after graphs to the open reports, and to ``options["dump_dir"]``."""
    record_graphs(before, after)
    if config.dump_dir:
        import os

        index = next(_dump_counter)
        try:
            os.makedirs(config.dump_dir, exist_ok=True)
            for tag, text in (("before", before), ("after", after)):
                with open(os.path.join(config.dump_dir, "moe_npu_graph%d_%s.txt" % (index, tag)), "w") as fh:
                    fh.write(text)
        except OSError as exc:  # a debug output: the rewrite stands
            _warn_once("dump_dir", "moe_compile: cannot write graphs to dump_dir=%r (%s: %s); the rewrite "
                       "is kept", config.dump_dir, type(exc).__name__, exc)


def _no_partitions_for_data_dependent_graphs(graph) -> None:
    """With CUDA graphs, a graph that still holds data-dependent shapes after the rewrite (a block
    left as it was, captured with our data-dependent capture flags, e.g. jetmoe's attention experts)
    is compiled without Inductor's graph partitions: Inductor then runs it without CUDA graphs
    ("incompatible op"), as it always did. With partitions, torch 2.11's CUDA-graph trees failed an
    assertion on such a graph's partition inputs (jetmoe, bf16, mode="reduce-overhead", H200)."""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if not (inductor_config.triton.cudagraphs and inductor_config.graph_partition):
        return
    for node in graph.nodes:
        value = node.meta.get("val")
        if value is not None and free_unbacked_symbols(value):
            inductor_config.graph_partition = False
            log.info("moe_compile: %s keeps data-dependent shapes after the rewrite; compiled without graph "
                     "partitions, so Inductor runs this graph without CUDA graphs", node.format_node()[:120])
            return


def _compile_inductor(gm, example_inputs, config: BackendConfig, moe_pass, decisions: list):
    """Inductor with the pass as its post-grad custom pass. Inductor's compile caches serve a graph
    compiled before with the same pass, options and exclusions; the pass then does not run, and the
    decisions stored with the first compile are replayed (``compile_cache.py``)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from moe_compile import compile_cache

    def pre_pass(graph):
        touched, hook.touched = hook.touched, True  # until the pass has run and changed nothing
        before, partitions = graph.python_code("self").src, inductor_config.graph_partition
        moe_pass(graph)
        after = graph.python_code("self").src
        _graphs_done(config, before, after)
        inlined = config.cpu_decode and _inline_cpu_decode(graph)
        packed = config.pack_args and pack_calls(graph) > 0
        _no_partitions_for_data_dependent_graphs(graph)
        hook.touched = (touched or after != before or inlined or packed
                        or inductor_config.graph_partition != partitions)

    uncached = compile_cache.uncached_reason(config)
    uuid = None if uncached else compile_cache.pass_uuid(config, moe_pass.op_kwargs, gm, example_inputs)
    hook = _InductorHook(pre_pass, uuid)
    patches = dict(post_grad_custom_pre_pass=hook, graph_partition=inductor_config.graph_partition)
    if uncached:
        patches["fx_graph_cache"] = False
    try:
        with inductor_config.patch(**patches):
            compiled = compile_fx(gm, example_inputs, config_patches=_inductor_patches(config))
    except Exception as exc:
        if not hook.touched:  # Inductor failed on the graph as it came: compiling it again would too
            with contextlib.suppress(AttributeError):
                exc.moe_compile_graph_untouched = True
        raise
    if uuid is not None:
        if hook.ran:
            compile_cache.save(uuid, list(decisions), example_inputs)
        else:
            _replay(compile_cache.load(uuid, example_inputs))
    return compiled


def _inline_cpu_decode(graph) -> bool:
    """The CPU's few-token fused-op nodes as gather-GEMVs that Inductor compiles with the graph
    (``lowering/cpu_decode.py``); whether any was."""
    from moe_compile.lowering.cpu_decode import inline_cpu_decode

    return graph.owning_module is not None and inline_cpu_decode(graph.owning_module) > 0


def _replay(stored) -> None:
    from moe_compile.report import record

    counters = torch._dynamo.utils.counters["moe_compile"]
    counters["from_cache"] += 1
    if stored is None:
        log.info("moe_compile: a graph came from Inductor's compile cache without its stored rewrite decisions")
        return
    log.info("moe_compile: a graph came from Inductor's compile cache; its %d decision(s) as first made:", len(stored))
    for decision in stored:
        record(decision)


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _CustomGraphPass
except ImportError:  # pragma: no cover - older torch
    _CustomGraphPass = object


class _InductorHook(_CustomGraphPass):
    """Inductor's custom-pass slot: ``__call__(graph)`` runs the pass; ``uuid()`` keys Inductor's
    caches (None: not cacheable)."""

    def __init__(self, fn, uuid: str | None):
        self._fn, self._uuid, self.ran = fn, uuid, False
        self.touched = False  # whether the pass changed a graph (or failed inside)

    def __call__(self, graph):
        self.ran = True
        self._fn(graph)

    def uuid(self):
        return self._uuid


def _compile_plain(gm, example_inputs, inner: InnerCompiler, config: BackendConfig):
    if inner is InnerCompiler.INDUCTOR:
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=_inductor_patches(config))
    if inner is InnerCompiler.TORCHAIR:
        from moe_compile.lowering.torchair import compile_with_torchair

        return compile_with_torchair(gm, example_inputs, config, None)
    if inner is InnerCompiler.EAGER:
        return gm.forward
    from torch._dynamo.backends.debugging import aot_eager

    return aot_eager(gm, example_inputs)


def _has_entry_point() -> bool:
    from importlib.metadata import entry_points

    try:
        return any(e.name == "moe_npu" and e.value.startswith("moe_compile.")
                   for e in entry_points(group="torch_dynamo_backends"))
    except Exception:  # broken metadata: fall back to registering by hand
        return False


def _install() -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    # With the package installed, torch registers the entry point itself on first lookup (and
    # would refuse a second registration); from a source tree without metadata we register.
    if "moe_npu" not in _COMPILER_FNS and not _has_entry_point():
        register_backend(compiler_fn=moe_npu_backend, name="moe_npu")
    with contextlib.suppress(Exception):
        from moe_compile import capture

        capture.install()
    from torch._logging import _internal

    with contextlib.suppress(Exception):
        _internal.register_log("moe_compile", "moe_compile")
        if not _inside_torch_init_logs():
            _internal._init_logs()  # set our log up like torch's own, and apply TORCH_LOGS to it


def _inside_torch_init_logs() -> bool:
    """Whether torch's own ``_init_logs`` is importing us (it imports the unknown names in
    ``$TORCH_LOGS`` as modules). A nested ``_init_logs`` there added a second handler to every
    torch log, so each line printed twice; the outer call registers our log's handler itself."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_init_logs" and "_logging" in code.co_filename:
            return True
        frame = frame.f_back
    return False


_install()
