"""A name -> function table, keyed by the strings users write in config.

Every axis of the algorithm space (advantage estimator, policy loss, KL estimator)
is one ``Registry`` over one input record, so every entry has the same signature and
call sites never grow ``if name == ...`` ladders.
"""
from __future__ import annotations

import difflib
from typing import Callable, Generic, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Maps config strings to functions.

    >>> LOSSES = Registry("policy loss")
    >>> @LOSSES.register("pg", "gpg")       # a name and optional aliases
    ... def pg(inp, cfg): ...
    >>> LOSSES.get("pg") is pg
    True
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, name: str, *aliases: str) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name`` and each alias; duplicates are errors."""

        def decorator(fn: F) -> F:
            for key in (name, *aliases):
                if key in self._table:
                    raise ValueError(f"{self.kind} {key!r} is already registered")
                self._table[key] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as ``name``; an unknown name raises ``ValueError``
        that names the key and the closest valid names (typos are the usual cause)."""
        try:
            return self._table[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), self._table, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(
                f"unknown {self.kind} {name!r}{hint} (valid: {', '.join(self.names())})"
            ) from None

    def names(self) -> list[str]:
        """All registered names (aliases included), sorted."""
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
