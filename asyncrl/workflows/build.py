"""``workflow.*`` config -> a :class:`WorkflowBackend` around the run's rollout backend."""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

from asyncrl.config_schema import ConfigError

# built-in workflows and the tools they use when workflow.tools is empty
BUILTIN_WORKFLOWS = {"calculator": ("asyncrl.workflows.library:calculator_agent", ["calculator"]),
                     "python_math": ("asyncrl.workflows.library:python_math_agent", ["python"])}


def load_workflow(ref: str) -> Callable:
    """A built-in name or ``module:function``; the function must be ``async def``."""
    ref = BUILTIN_WORKFLOWS.get(ref, (ref,))[0]
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ConfigError(f"workflow.fn={ref!r}: expected a built-in ({', '.join(BUILTIN_WORKFLOWS)}) "
                          "or 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"workflow.fn={ref!r}: {err}") from None
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"workflow.fn={ref!r} must be 'async def rollout(client, example)'")
    return fn


def wrap_backend(cfg, backend, tokenizer):
    """``backend`` itself when ``workflow.fn`` is unset, else a WorkflowBackend over it."""
    wf = cfg.workflow
    if not wf.enabled:
        return backend
    from asyncrl.data.tool_calls import build_tool_parser
    from asyncrl.workflows.backend import WorkflowBackend
    from asyncrl.workflows.tools import build_tools

    fn = load_workflow(wf.fn)
    entries = wf.tools or BUILTIN_WORKFLOWS.get(wf.fn, (None, []))[1]
    try:
        tools = build_tools(entries)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    parser = build_tool_parser(wf.tool_parser, tokenizer)
    if tools and parser is None:
        raise ConfigError("workflow.tools are set but the tokenizer's chat template has no tool-call format: "
                          "set workflow.tool_parser (hermes | llama3_json)")
    return WorkflowBackend(backend, fn, tokenizer, tools, parser, wf.max_total_tokens, wf.max_concurrent,
                           dict(wf.chat_template_kwargs) or None)
