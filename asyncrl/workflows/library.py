"""Built-in workflows (``workflow.fn``): agent loops written against the OpenAI chat API.

Each is ``async def rollout(client, example) -> float``: the client records the episode's
tokens; the returned number is its reward. They double as examples of the contract.
"""
from __future__ import annotations

import re

MAX_TURNS = 4


async def tool_loop(client, messages: list, max_turns: int = MAX_TURNS):
    """Chat until the model answers without a tool call (or ``max_turns`` replies); returns the
    last response (the final answer unless the loop ran out of turns)."""
    tools = [tool.openai_tool for tool in client.tools.values()] or None
    response = None
    for _ in range(max_turns):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
        message = response.choices[0].message
        if not message.tool_calls:
            return response
        messages = messages + [message] + await client.call_tools(message)
    return response


async def calculator_agent(client, example) -> float:
    """``task.name=calculator``: the final message must be exactly the product. Two replies at
    most (a call, then the answer): a second call never helps on this task."""
    response = await tool_loop(client, [{"role": "user", "content": example.prompt}], max_turns=2)
    choice = response.choices[0]
    if choice.message.tool_calls or choice.finish_reason != "stop":
        return 0.0
    return float((choice.message.content or "").strip() == example.answer)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
PYTHON_MATH_SYSTEM = ("Solve the problem. You may run Python with the `python` tool (print what you need). "
                      "End with the final answer as: #### <number>")


async def python_math_agent(client, example) -> float:
    """GSM8K-style problems with the sandboxed ``python`` tool (recipes/gsm8k_tool.yaml): reward 1
    when the number after ``####`` in the final message equals the reference answer."""
    messages = [{"role": "system", "content": PYTHON_MATH_SYSTEM}, {"role": "user", "content": example.prompt}]
    response = await tool_loop(client, messages)
    given = final_number(response.choices[0].message.content or "")
    reference = final_number(str(example.answer)) or str(example.answer)  # GSM8K's answer ends "#### 72"
    return float(given is not None and _same_number(given, reference))


def final_number(text: str):
    """The first number after the last ``####``, or None."""
    if "####" not in text:
        return None
    found = _NUMBER.findall(text.rsplit("####", 1)[-1])
    return found[0] if found else None


def _same_number(given: str, reference: str) -> bool:
    try:
        return abs(float(given.replace(",", "")) - float(reference.replace(",", "").strip())) < 1e-6
    except ValueError:
        return False
