"""Tool-call parsing in the Qwen3 (hermes) and Llama 3 (JSON) formats."""
from __future__ import annotations

import json

from asyncrl.data.tool_calls import HermesParser, Llama3JsonParser, build_tool_parser


def test_hermes_calls_and_content():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "mul", "arguments": {"b": 2}}</tool_call>'
    parsed = HermesParser().parse(text)
    assert parsed.content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("add", {"a": 1}), ("mul", {"b": 2})]
    unterminated = HermesParser().parse('<tool_call>{"name": "f", "arguments": {}}')  # stopped at EOS
    assert unterminated.tool_calls[0].name == "f" and unterminated.content is None
    broken = '<tool_call>{"name": "f", "arguments": </tool_call>'
    assert HermesParser().parse(broken).content == broken and not HermesParser().parse(broken).tool_calls
    assert HermesParser().may_start_call("abc <tool_") == 4 and HermesParser().may_start_call("abc") == 3


def test_llama3_json_calls():
    parsed = Llama3JsonParser().parse('<|python_tag|>{"name": "f", "parameters": {"x": "a;b"}}; {"name": "g", '
                                      '"parameters": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("f", {"x": "a;b"}), ("g", {})]
    assert Llama3JsonParser().parse("The answer is 4.").tool_calls == []
    assert Llama3JsonParser().parse('{"answer": 4}').tool_calls == []  # JSON, but not a call


def test_parser_detection():
    class Tok:
        chat_template = "{% if tools %}<tool_call>{% endif %}"
    assert build_tool_parser("auto", Tok()).name == "hermes"
    Tok.chat_template = "<|start_header_id|>ipython<|end_header_id|>"
    assert build_tool_parser("auto", Tok()).name == "llama3_json"
    Tok.chat_template = "{{ messages }}"
    assert build_tool_parser("auto", Tok()) is None
