"""aotkit's record of what Dynamo decides before any backend sees a graph: recompiles and its
recompile-limit fallback, as explain() decisions."""

from __future__ import annotations

import functools
import logging
from typing import Any

from aotkit import compat, counters

log = logging.getLogger("aotkit.aot")


# Note [Dynamo's recompiles in explain()]
# Dynamo decides when a frame is compiled again (a guard failed: a new shape, dtype, grad mode
# or Python value) and, after torch._dynamo.config.recompile_limit compiles of one frame, runs
# it eagerly from then on. Both happen before any backend sees a graph, so aotkit records them:
# a backend call for a frame's second or later compile is a "recompile" decision with Dynamo's
# guard failure, and Dynamo's warning on hitting its limit is a "fallback" decision.
#: The compile whose recompile was recorded last (a restarted compile keeps its context; the
#: frame's name repeats after torch._dynamo.reset(), so it cannot tell restarts apart).
_recorded: list[Any] = [None]


def note_dynamo_recompile(name: str) -> None:
    """Record why Dynamo compiles this frame again, if it does (Note [Dynamo's recompiles in
    explain()]); install the recorder of Dynamo's recompile-limit fallbacks on first use."""
    from torch._guards import CompileContext

    _record_dynamo_fallbacks()
    context = CompileContext.try_get()
    if context is None or context.compile_id is None or not context.compile_id.frame_compile_id:
        return
    if _recorded[0] is context:  # Dynamo restarted this compile (specialize): one decision
        return
    _recorded[0] = context
    reason = compat.dynamo_recompile_reason() or "Dynamo did not say which guard failed"
    counters.record("recompile", name, (
        f"Dynamo compiles this frame again; a guard of the compiled version it tried first "
        f"failed: {reason} (TORCH_LOGS=recompiles lists the failures of every version)"),
        logger=log)


@functools.cache
def _record_dynamo_fallbacks() -> None:
    compat.on_dynamo_recompile_limit(_record_dynamo_fallback)


def _record_dynamo_fallback(limit_type: str, limit: Any, function: str, reason: str | None,
                            raises: bool) -> None:
    """Dynamo's recompile limit as a "fallback" decision."""
    sizes = "size mismatch" in str(reason) or "stride mismatch" in str(reason)
    fix = ("let the changing sizes be dynamic (torch._dynamo.mark_dynamic, or "
           "torch.compile(..., dynamic=True))" if sizes else
           "keep the guarded value stable, or pass a Python value that changes from "
           "call to call as a tensor")
    reason = compat.tidy_guard_failure(reason) if reason else reason
    counters.record("fallback", f"torch.compile({function})", (
        f"Dynamo compiled it torch._dynamo.config.{limit_type} = {limit} times and "
        f"{'raises (fullgraph=True)' if raises else 'runs it eagerly from now on'} (last "
        f"recompile: {reason}).\nFix: {fix}, or "
        f"raise torch._dynamo.config.{limit_type}."), logger=log)
