"""Tools: the calculator's arithmetic, registration by module:function, the sandboxed python tool."""
from __future__ import annotations

import asyncio

import pytest

from asyncrl.workflows.tools import CALCULATOR, PYTHON, Tool, build_tools, evaluate_arithmetic


def test_calculator_values_and_refusals():
    assert evaluate_arithmetic("123*456") == 56088
    assert evaluate_arithmetic("(2+3)**2 - 7//2 % 2") == 24  # 25 - (3 % 2) = 24
    assert evaluate_arithmetic("-1.5*4") == -6.0
    for bad in ("__import__('os')", "a+1", "2**1000", "[1]"):
        with pytest.raises(ValueError):
            evaluate_arithmetic(bad)
    assert asyncio.run(CALCULATOR('{"expression": "6*7"}')) == "42"
    assert asyncio.run(CALCULATOR('{"expression": "1/0"}')).startswith("error: ZeroDivisionError")
    assert asyncio.run(CALCULATOR("not json")).startswith("error:")


def shout(text: str) -> str:
    return text.upper()


def test_registration_by_reference():
    tools = build_tools(["calculator", {"fn": "tests.workflows.test_tools:shout",
                                        "schema": {"description": "upper-case", "parameters": {
                                            "type": "object", "properties": {"text": {"type": "string"}}}}}])
    assert set(tools) == {"calculator", "shout"}
    assert tools["shout"].openai_tool["function"]["name"] == "shout"
    assert asyncio.run(tools["shout"]({"text": "hi"})) == "HI"
    with pytest.raises(ValueError, match="unknown tool"):
        build_tools(["search"])
    with pytest.raises(ValueError, match="module:function"):
        Tool.from_ref("no_colon", {})


def test_python_tool_runs_in_the_sandbox():
    assert asyncio.run(PYTHON({"code": "print(sum(range(10)))"})).strip() == "45"
    assert "Error" in asyncio.run(PYTHON({"code": "raise ValueError('boom')"}))
