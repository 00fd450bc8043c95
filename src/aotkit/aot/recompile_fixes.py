"""The fixes a RecompileLimitError names, by the reason of the recompile it would make."""

from __future__ import annotations


def recompile_fix(why: str, dynamic: bool, made_per_call: int = 0) -> str:
    """The fix a RecompileLimitError names for a recompile of reason ``why``; ``made_per_call``:
    how many entries of modules or hooks freed after one call count towards the limit."""
    return f"{_cause_fix(why, dynamic, made_per_call)}; or raise the limit with " \
        "aotkit.config.patch(recompile_limit=...). See aotkit.explain() for the reasons."


def _cause_fix(why: str, dynamic: bool, made_per_call: int) -> str:
    if "hooks" in why:
        return ("register module hooks once, before the first call (a hook added and removed at "
                "every step, or a profiler's global hooks entered per step, compiles anew each "
                "time)")
    if why.startswith("storage offset of "):
        return ("the graph places a view at a storage offset (as_strided, or a custom op writing "
                "a view of an input), so each place of the input in its memory compiles again: "
                "pass the input at one place (a .clone(), or a tensor of its own rather than a "
                "window of a larger one), or compile with torch.compile(backend='aotkit'), which "
                "runs calls at other places eagerly")
    if made_per_call:
        return ("a module the function calls or takes is made anew at every call (a loss "
                "module, a submodule replaced at every step): make it once, outside the loop; "
                "load new weights into one model (load_state_dict)")
    if "changed in place from" in why:
        return ("a tensor the function reads besides its arguments changes its size, dtype or "
                "strides in place between calls (Note [Constants changed in place]): pass it as "
                "an argument (with dynamic=True where its size varies), or, for a module's "
                "buffer, compile the module with aot_module, which takes its buffers as inputs")
    if "which the graph reads as a constant, was replaced" in why:
        return ("a tensor of a module the function calls is replaced between calls (a cache, a "
                "hidden state, a mask set at every step, a checkpoint loaded with "
                "load_state_dict(..., assign=True), each graph holding the tensors it read): "
                "pass it as an argument, load checkpoints without assign=True (which copies "
                "into the tensors the graph reads), or compile the module with aot_module, "
                "which reads its tensors at every call")
    if why.startswith(("the global ", "the closed-over ", "self.", "keyword ", "argument ")) \
            or " of self changed" in why or " of self." in why:
        return ("a value the function reads besides its arguments changes at every call "
                "(Note [Values a function captures]): pass it as a tensor argument where the "
                "graph computes with it (torch.tensor(lr)); move code that only logs it out of "
                "the compiled function; for a bound method whose object holds a counter, "
                "compile the plain function and pass what it reads (aot_function(Cls.method) "
                "called with the tensors it needs)")
    if why.startswith("aotkit.config."):
        return ("keep aotkit.config fixed while the function runs (each value of an option "
                "compiles anew: compile one function per value instead)")
    return (f"{varying_shapes_fix(dynamic)}; pass Python numbers that change from call to call "
            "as tensors (torch.tensor(n)), since other arguments are constants of the graph (the "
            "attributes of an object argument too: pass only what the function reads, not an "
            "object holding a step counter), or, for numbers used as sizes (x[:n]), use "
            "torch.compile(fn, backend='aotkit', dynamic=True), which keeps them symbolic; keep "
            "dtypes/devices/requires_grad stable")


def varying_shapes_fix(dynamic: bool) -> str:
    if not dynamic:
        return "pass dynamic=True if shapes vary"
    return ("sizes still recompiling under dynamic=True were made constants while tracing (a "
            "size turned into a Python number: int(), float() or math.* of x.shape, a size "
            "compared with a number, an RNN's loop over time; the recompile reason names the "
            "line where the trace can tell): compute such numbers with torch ops on tensors, or "
            "use torch.compile(fn, backend='aotkit', dynamic=True), which traces Python "
            "arithmetic on sizes symbolically")
