"""LLM-as-judge reward through any OpenAI-compatible ``/chat/completions`` endpoint.

    judge prompt = template with {prompt}, {response}, {answer} and any row field
    reply        = POST {base_url}/chat/completions  (vLLM, SGLang, OpenAI, llama.cpp ...)
    score        = first match of ``score_pattern`` in the reply, / ``max_score``

Plain ``urllib`` on purpose: one POST needs no client library, and a judge must work
in the same minimal environment as the trainer. The API key is read from the
environment variable named by ``api_key_env`` at call time, never stored in config.

Placeholders are replaced by name only (``{prompt}``, ``{response}``, ...), so a
template may contain JSON braces without escaping them. A reply without a score is
an error (recorded by the pool with the sample), not a silent zero.
"""
from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from typing import Any, Optional

DEFAULT_TEMPLATE = """You are grading an answer to a question.

Question:
{prompt}

Reference answer (may be empty):
{answer}

Answer to grade:
{response}

Judge whether the answer is correct and well reasoned. End your reply with a line
"Score: N" where N is an integer from 0 (wrong) to 10 (perfect)."""

DEFAULT_SCORE_PATTERN = r"[Ss]core\s*[:=]\s*(-?\d+(?:\.\d+)?)"
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class JudgeError(RuntimeError):
    """The endpoint failed or its reply had no score."""


def render(template: str, values: dict[str, Any]) -> str:
    """Replace ``{name}`` for known names; leave every other brace alone."""
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), template)


def parse_score(reply: str, pattern: str = DEFAULT_SCORE_PATTERN) -> Optional[float]:
    """The last match of ``pattern`` (its first group) in the reply, or None."""
    matches = re.findall(pattern, reply or "")
    if not matches:
        return None
    last = matches[-1]
    return float(last[0] if isinstance(last, tuple) else last)


def chat_completion(base_url: str, model: str, content: str, api_key: Optional[str] = None,
                    temperature: float = 0.0, max_tokens: int = 512, timeout_s: float = 60.0,
                    retries: int = 2, backoff_s: float = 0.5) -> str:
    """The assistant text of one chat completion. Retries connection errors, 429
    and 5xx with exponential backoff; other HTTP errors fail at once."""
    url = base_url.rstrip("/") + "/chat/completions"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "temperature": temperature, "max_tokens": max_tokens}).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    last_error = ""
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            request = urllib.request.Request(url, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(request, timeout=timeout_s) as reply:
                payload = json.loads(reply.read().decode("utf-8"))
            return payload["choices"][0]["message"]["content"] or ""
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode("utf-8", errors="replace")
            last_error = f"HTTP {err.code} from {url}: {detail}"
            if err.code != 429 and err.code < 500:
                break
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            last_error = f"cannot reach {url}: {getattr(err, 'reason', err)}"
        except (KeyError, IndexError, TypeError, json.JSONDecodeError) as err:
            raise JudgeError(f"unexpected reply shape from {url}: {type(err).__name__}: {err}") from None
    raise JudgeError(last_error)


def judge_reward(prompt: str, response: str, base_url: str = "", model: str = "",
                 template: str = DEFAULT_TEMPLATE, score_pattern: str = DEFAULT_SCORE_PATTERN,
                 max_score: float = 10.0, api_key_env: str = "OPENAI_API_KEY",
                 temperature: float = 0.0, max_tokens: int = 512, timeout_s: float = 60.0,
                 retries: int = 2, **fields: Any) -> float:
    """The judge's score for ``response``, scaled to [0, 1] by ``max_score`` and clipped."""
    if not base_url or not model:
        raise ValueError("judge_reward needs base_url and model (RewardSpec kwargs)")
    content = render(template, {"answer": "", **fields, "prompt": prompt, "response": response})
    reply = chat_completion(base_url, model, content, os.environ.get(api_key_env),
                            temperature, max_tokens, timeout_s, retries)
    score = parse_score(reply, score_pattern)
    if score is None:
        raise JudgeError(f"judge reply has no score matching {score_pattern!r}: {reply[-300:]!r}")
    return min(max(score / max_score, 0.0), 1.0)
