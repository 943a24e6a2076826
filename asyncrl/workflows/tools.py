"""Tools an agent calls: a JSON schema (what the model sees) and a function (what runs).

Built in: ``calculator`` (arithmetic on numbers: + - * / // % ** and parentheses, parsed with
``ast`` and evaluated by hand, so no code runs) and ``python`` (a program run in the code
sandbox of ``asyncrl.rewards.sandbox``: time, memory and process limits, no network). Your
own: ``Tool.from_ref("my_pkg.tools:search", schema)`` or ``workflow.tools`` entries
``{"fn": "my_pkg.tools:search", "schema": {...}}``; the function takes the call's arguments
as keywords and returns a string (sync or async).
"""
from __future__ import annotations

import ast
import asyncio
import importlib
import inspect
import json
import operator
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Tool:
    """``schema`` is the OpenAI function schema ``{"name", "description", "parameters"}``."""

    name: str
    schema: dict
    fn: Callable[..., Any]

    @property
    def openai_tool(self) -> dict:
        return {"type": "function", "function": self.schema}

    @classmethod
    def from_ref(cls, ref: str, schema: dict) -> "Tool":
        """``module:function`` with its JSON schema (``name`` defaults to the function's)."""
        module, _, attr = ref.partition(":")
        if not module or not attr:
            raise ValueError(f"tool {ref!r}: expected 'module:function'")
        fn = getattr(importlib.import_module(module), attr, None)
        if not callable(fn):
            raise ValueError(f"tool {ref!r}: {module} has no function {attr!r}")
        schema = {"name": attr, **schema}
        if not isinstance(schema.get("parameters", {}), dict):
            raise ValueError(f"tool {ref!r}: schema 'parameters' must be a JSON schema object")
        return cls(schema["name"], schema, fn)

    async def __call__(self, arguments: str | dict) -> str:
        """Run the tool on a call's arguments (JSON text or a dict); errors come back as text,
        which is what the model reads (a bad call is the policy's mistake, not a crash)."""
        try:
            kwargs = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
            if not isinstance(kwargs, dict):
                raise ValueError("arguments must be a JSON object")
            result = self.fn(**kwargs)
            if inspect.isawaitable(result):
                result = await result
            return str(result)
        except Exception as err:  # noqa: BLE001 - reported to the model
            return f"error: {type(err).__name__}: {err}"


# ---- calculator --------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPONENT = 64  # 10**10**10 would hang the worker


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression; anything else raises ValueError."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        return ev(ast.parse(expression.strip(), mode="eval"))
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None


def calculator(expression: str) -> str:
    value = evaluate_arithmetic(expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


CALCULATOR = Tool("calculator", {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}, calculator)


# ---- python (the code sandbox) ------------------------------------------------------------

async def run_python_code(code: str, timeout_s: float = 10.0, memory_mb: int = 512) -> str:
    """Run ``code`` in the sandbox (asyncrl.rewards.sandbox.run_python) in a worker thread;
    the model reads stdout, or the error."""
    from asyncrl.rewards.sandbox import SandboxLimits, run_python

    limits = SandboxLimits(wall_time_s=timeout_s, cpu_time_s=max(1, int(timeout_s)), memory_mb=memory_mb)
    result = await asyncio.to_thread(run_python, code, "", limits)
    if result.status == "ok":
        return result.stdout[-2000:] or "(no output: print the result)"
    return f"{result.status}: {(result.stderr or result.stdout)[-1000:]}"


PYTHON = Tool("python", {
    "name": "python", "description": "Run a Python program and return what it prints (no network, 10 s).",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
}, run_python_code)

BUILTIN_TOOLS = {"calculator": CALCULATOR, "python": PYTHON}


def build_tools(entries: list) -> dict[str, Tool]:
    """``workflow.tools``: built-in names, or ``{"fn": "module:function", "schema": {...}}``."""
    tools = {}
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            if entry not in BUILTIN_TOOLS:
                raise ValueError(f"workflow.tools[{i}]: unknown tool {entry!r} (built in: "
                                 f"{', '.join(BUILTIN_TOOLS)}; or {{fn: module:function, schema: ...}})")
            tool = BUILTIN_TOOLS[entry]
        elif isinstance(entry, dict) and "fn" in entry:
            tool = Tool.from_ref(entry["fn"], entry.get("schema") or {})
        else:
            raise ValueError(f"workflow.tools[{i}]: expected a tool name or {{fn, schema}}, got {entry!r}")
        tools[tool.name] = tool
    return tools
