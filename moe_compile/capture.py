"""Dynamo's capture of data-dependent shapes, scoped to this backend's compiles.

transformers-4.x style loops over experts (``torch.where``/``nonzero``) and ``.tolist()`` splits
graph-break unless Dynamo captures data-dependent output shapes and scalars. The backend turns
``capture_dynamic_output_shape_ops`` and ``capture_scalar_outputs`` on only while Dynamo compiles a
frame for ``moe_npu`` (a compile start/end callback that checks the backend) and restores them
right after, so no global state leaks to other compiles.

Some code that Dynamo compiles fine without them fails under them: ``for e in ids.unique().tolist()``
(iterating a tensor of data-dependent length) and ``torch.split(x, counts.tolist())`` raise
``GuardOnDataDependentSymNode`` while Dynamo traces. A compile that works without us must work
with us, so when tracing a frame under our flags fails that way, the flags are turned off and
Dynamo traces the frame again (its own ``RestartAnalysis``), exactly as it would without us; the
report says why (``<frame ...>``: skipped), and the blocks in that frame stay as they were. The same
goes for a frame Dynamo traces under them but Inductor cannot lower (``x[mask.nonzero()]`` feeding a
``matmul``: Inductor's bmm lowering guards on the data-dependent size), once the original graph has
failed too, or straight away where the pass changed nothing (``backend.py``): the graph breaks at
the data-dependent op, as without us, and blocks that do not need the capture are rewritten in the
graphs on either side.
"""
from __future__ import annotations

import linecache
import logging
import re
import sys

import torch

log = logging.getLogger("moe_compile")

_capture_patch: list = []


def _is_ours(fn, depth: int = 0) -> bool:
    from moe_compile.backend import moe_npu_backend

    if fn is None or depth > 5:
        return False
    if fn is moe_npu_backend:
        return True
    for attr in ("_torchdynamo_orig_backend", "compiler_fn", "func"):
        inner = getattr(fn, attr, None)
        if inner is not None and inner is not fn and _is_ours(inner, depth + 1):
            return True
    return False


def _compiling_with_us() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_compile" and "compiler_fn" in frame.f_locals:
            return _is_ours(frame.f_locals["compiler_fn"])
        frame = frame.f_back
    return False


def _on_compile_start(*_args, **_kwargs) -> None:
    if _compiling_with_us():
        patch = torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True)
        patch.__enter__()
        _capture_patch.append(patch)
    else:
        _capture_patch.append(None)


def _on_compile_end(*_args, **_kwargs) -> None:
    if _capture_patch:
        patch = _capture_patch.pop()
        if patch is not None:
            patch.__exit__(None, None, None)


def _data_dependent(error: BaseException) -> BaseException | None:
    """The ``GuardOnDataDependentSymNode`` behind ``error`` (Dynamo wraps it in ``UserError``)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, GuardOnDataDependentSymNode):
            return error
        error = error.__cause__ or error.__context__
        seen += 1
    return None


_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ')
_BRANCH = re.compile(r"^(if|elif|while|assert)\b")


def user_line(message: str) -> str:
    """`` at file:line: `source` `` for the last user frame of a data-dependent guard's message, with a hint
    when that line branches on the value (``if tokens.numel() == 0: continue``); "" when it names none."""
    stack = message.split("User Stack", 1)
    frames = _USER_FRAME.findall(stack[1]) if len(stack) == 2 else []
    if not frames:
        return ""
    path, line = frames[-1][0], int(frames[-1][1])
    source = linecache.getline(path, line).strip()
    out = " at %s:%d" % (path, line) + (": `%s`" % source[:120] if source else "")
    if _BRANCH.match(source):
        out += (" (a Python branch on a data-dependent value: an expert loop needs no branch for an expert "
                "without tokens, and without it the loop can be captured)")
    return out


def _retrace_without_flags(code, error: BaseException) -> None:
    """Turn this compile's flags off and ask Dynamo to trace the frame again."""
    from moe_compile.report import BlockDecision, record

    patch = _capture_patch.pop()
    patch.__exit__(None, None, None)
    _capture_patch.append(None)
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    where = "<frame %s at %s:%s>" % (code.co_name, code.co_filename, code.co_firstlineno)
    record(BlockDecision(path=where, reason=(
        "this frame could not be traced or compiled while capturing data-dependent shapes (%s: %s)%s; it was "
        "traced again without that capture, as without moe_npu, so MoE blocks in it that need it (expert loops "
        "over torch.where/.tolist()) are split by graph breaks and left as they were" % (
            type(error).__name__, first[:160], user_line(str(error))))))
    raise torch._dynamo.exc.RestartAnalysis(restart_reason="moe_compile: retrace without data-dependent capture")


def _install_retrace() -> None:
    from torch._dynamo import convert_frame

    original = getattr(convert_frame, "transform_code_object", None)
    if original is None or getattr(original, "_moe_compile", False):
        return

    def transform_code_object(code, transform, *args, **kwargs):
        try:
            return original(code, transform, *args, **kwargs)
        except Exception as error:
            cause = _data_dependent(error)
            if cause is None or not _capture_patch or _capture_patch[-1] is None:
                raise
            _retrace_without_flags(code, cause)

    transform_code_object._moe_compile = True
    transform_code_object.__wrapped__ = original
    convert_frame.transform_code_object = transform_code_object


def _register_callbacks() -> None:
    from torch._dynamo import callback_handler

    if _on_compile_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_compile_start)
        callback_handler.register_end_callback(_on_compile_end)


def _keep_callbacks_across_reset() -> None:
    """``torch._dynamo.reset()`` clears every compile callback; put ours back right after, and drop
    the stacked weight copies of the graphs it forgets."""
    from torch._dynamo import callback_handler

    clear = callback_handler.clear
    if getattr(clear, "_moe_compile", False):
        return

    def clear_and_reregister() -> None:
        from moe_compile.ops import weight_cache

        clear()
        _register_callbacks()
        weight_cache.clear()  # the graphs that read the stacked copies are gone with Dynamo's caches

    clear_and_reregister._moe_compile = True
    callback_handler.clear = clear_and_reregister


def install() -> None:
    _register_callbacks()
    _keep_callbacks_across_reset()
    _install_retrace()
