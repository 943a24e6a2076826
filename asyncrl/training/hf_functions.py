"""Replacing a function of a transformers modeling module, whatever form it takes there.

The trainer puts dispatchers in front of a few module-level functions of HF's modeling code
(``apply_rotary_pos_emb`` for Liger's RoPE, Qwen3.5's gated delta rule and short conv for the CPU
forms): the model's forward looks them up in its module at call time, so replacing the module
attribute reaches every call. Two forms exist:

- a plain function (transformers < 5.25, or 5.25 without the ``kernels`` package), possibly
  behind transformers' kernel-routing wrapper (``functools.wraps``: ``__wrapped__``);
- a hub-kernel ``Func`` module (transformers >= 5.25 with ``kernels`` installed): an ``nn.Module``
  whose class ``forward`` calls the function (held in its closure as ``func``). Each layer keeps a
  private copy made by ``type(global)()``, and pickling a layer rebuilds that copy the same way,
  so the module attribute must stay a ``Func``: the replacement goes into the instance's
  ``forward`` instead (``nn.Module.__call__`` reads it), and the class ``forward`` stays reachable
  as the original.
"""
from __future__ import annotations

import functools
import inspect
import types
from typing import Callable

import torch

MARK = "_asyncrl_replacement"


def _is_func_module(fn) -> bool:
    return isinstance(fn, torch.nn.Module)


def function_behind(fn: Callable) -> Callable:
    """The function a hub-kernel ``Func`` module calls (its class ``forward``'s ``func``), else ``fn``."""
    if _is_func_module(fn):
        try:
            inner = inspect.getclosurevars(type(fn).forward).nonlocals.get("func")
        except TypeError:
            inner = None
        if callable(inner):
            return inner
    return fn


def torch_function_of(fn: Callable) -> Callable:
    """transformers' own torch function behind ``fn``: through a hub-kernel module and the routing
    wrapper's ``__wrapped__`` chain; ``fn`` itself if it wraps nothing."""
    return inspect.unwrap(function_behind(fn))


def replaced(fn) -> bool:
    """Whether ``fn`` (a module attribute) already carries a replacement from :func:`replace`."""
    current = fn.__dict__.get("forward") if _is_func_module(fn) else fn
    return bool(getattr(current, MARK, False))


def replace(module: types.ModuleType, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Put ``make(original)`` in front of ``module.<name>`` (once; False if already done).
    ``original`` calls what ran before: the plain function, or the ``Func`` module's class
    ``forward`` bound to it (calling the module itself would re-enter the replacement)."""
    fn = getattr(module, name)
    if replaced(fn):
        return False
    func_module = _is_func_module(fn)
    replacement = make(types.MethodType(type(fn).forward, fn) if func_module else fn)
    functools.update_wrapper(replacement, function_behind(fn))  # name, docs, __wrapped__: the function's
    setattr(replacement, MARK, True)
    if func_module:
        fn.forward = replacement  # an instance attribute: the module object (and its pickling) stays
    else:
        setattr(module, name, replacement)
    return True
