"""Module-level reward functions for the pool tests (process workers import them)."""
import os
import time


def constant(prompt, response, value=1.0, **fields):
    """Returns ``value`` (a bound kwarg) for every response."""
    return value


def length(prompt, response, **fields):
    """len(response) / 10: a deterministic, response-dependent score."""
    return len(response) / 10


def echo_field(prompt, response, answer=None, **fields):
    """1.0 when the response equals the ``answer`` field."""
    return float(response == answer)


def raises(prompt, response, **fields):
    raise RuntimeError(f"bad reward for {response!r}")


def hangs(prompt, response, **fields):
    """Hangs when the response says so, else scores 1."""
    if response == "hang":
        time.sleep(3600)
    return 1.0


def returns_none(prompt, response, **fields):
    return None


def returns_nan(prompt, response, **fields):
    return float("nan")


def returns_text(prompt, response, **fields):
    return "one"


def exits(prompt, response, **fields):
    raise SystemExit(3)


def kills_worker(prompt, response, **fields):
    """Ends its process without Python cleanup, like a segfault would."""
    os._exit(7)


def batched_lengths(prompts, responses, fields):
    """Batched contract: one score per item."""
    return [len(r) / 10 for r in responses]


batched_lengths.batched = True


def batched_wrong_size(prompts, responses, fields):
    return [1.0]


batched_wrong_size.batched = True


async def async_length(prompt, response, **fields):
    """An ``async def`` reward (e.g. one that awaits an HTTP client)."""
    import asyncio

    await asyncio.sleep(0)
    return len(response) / 10
