"""hf_functions.replace puts a dispatcher in front of a modeling module's function in both forms
transformers uses: a plain (possibly routing-wrapped) function, and transformers 5.25's hub-kernel
``Func`` module (the ``kernels`` package), where layers keep private copies rebuilt by type."""
import functools
import pickle
import sys
import textwrap
import types

import pytest
import torch

from asyncrl.training import hf_functions

TOY = textwrap.dedent('''
    import torch

    def toy(x):
        return x + 1

    _torch_toy = toy
    toy = WRAP(toy)  # named as the module attribute, as transformers' functions are (kernels pickles by name)

    class Layer(torch.nn.Module):
        def forward(self, x):
            return toy(x) * 2
''')


def _toy_module(name: str, wrap) -> types.ModuleType:
    """A modeling-like module (its function made by ``wrap``, a layer calling it by its global
    name), registered under ``name`` so that pickle finds its classes."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    module.WRAP = wrap
    exec(compile(TOY, name, "exec"), module.__dict__)
    return module


def _plus_ten(original):
    return lambda x: original(x) + 10


def _routing_wrapper(fn):
    """What transformers' kernel routing does to a torch function (``functools.wraps``)."""
    @functools.wraps(fn)
    def routed(x):
        return fn(x)
    return routed


def test_a_plain_routed_function_is_replaced_once():
    module = _toy_module("asyncrl_toy_plain", _routing_wrapper)
    layer = module.Layer()
    assert hf_functions.torch_function_of(module.toy) is module._torch_toy
    assert hf_functions.replace(module, "toy", _plus_ten)
    assert layer(torch.tensor(1.0)).item() == 24.0  # (1 + 1 + 10) * 2
    assert not hf_functions.replace(module, "toy", _plus_ten)  # once: no second layer
    assert layer(torch.tensor(1.0)).item() == 24.0
    assert hf_functions.torch_function_of(module.toy) is module._torch_toy  # still reachable


def test_a_hub_kernel_module_keeps_its_object_and_pickles():
    """transformers >= 5.25 with ``kernels``: the module attribute is a ``Func`` module and each
    layer holds a private copy made by ``type(global)()``; replacing the attribute by a plain
    function made pickling a layer fail (TypeError: function() missing required argument 'code')."""
    kernels = pytest.importorskip("kernels")
    module = _toy_module("asyncrl_toy_kernels", kernels.use_kernel_forward_from_hub("AsyncrlToy"))
    module.Layer = kernels.use_kernelized_func(module.toy)(module.Layer)
    layer = module.Layer()
    func_module = module.toy
    assert isinstance(func_module, torch.nn.Module)
    assert hf_functions.torch_function_of(func_module) is module._torch_toy
    assert hf_functions.replace(module, "toy", _plus_ten)
    assert module.toy is func_module and hf_functions.replaced(module.toy)
    assert layer(torch.tensor(1.0)).item() == 24.0
    assert module.Layer()(torch.tensor(1.0)).item() == 24.0  # a layer built after the replacement
    restored = pickle.loads(pickle.dumps(layer))
    assert restored(torch.tensor(1.0)).item() == 24.0
    assert not hf_functions.replace(module, "toy", _plus_ten)
    assert hf_functions.torch_function_of(module.toy) is module._torch_toy
