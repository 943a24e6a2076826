"""The OpenAI-compatible server over the asyncrl engine (``asyncrl serve``)."""
from asyncrl.serve.async_engine import AsyncEngine, SampleDelta
from asyncrl.serve.limits import ServeLimits

__all__ = ["AsyncEngine", "SampleDelta", "ServeLimits"]
