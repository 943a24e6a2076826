"""The after-step weight check: a NaN/Inf in a checked tensor raises naming the parameter; a
caller's own tensor list (the optimizer's) limits what is checked."""
import pytest
import torch

from asyncrl.errors import NonFiniteError
from asyncrl.training.param_check import check_parameters_finite


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))


def test_finite_weights_pass():
    model = _model()
    check_parameters_finite(model, "step 1")
    check_parameters_finite(model, "step 1", list(model.parameters()))
    check_parameters_finite(model, "step 1", [])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_named(bad):
    model = _model()
    with torch.no_grad():
        model[1].weight[2] = bad
    with pytest.raises(NonFiniteError, match=r"parameter 1\.weight holds 1 NaN/Inf values after step 7"):
        check_parameters_finite(model, "step 7")
    with pytest.raises(NonFiniteError, match=r"parameter 1\.weight"):
        check_parameters_finite(model, "step 7", [model[1].weight])


def test_only_the_given_tensors_are_checked():
    """A frozen tensor (not the optimizer's) is not re-checked every step: nothing changes it."""
    model = _model()
    with torch.no_grad():
        model[0].bias[0] = float("nan")
    check_parameters_finite(model, "step 2", [model[0].weight, *model[1].parameters()])
    with pytest.raises(NonFiniteError, match=r"parameter 0\.bias"):
        check_parameters_finite(model, "step 2")


def test_mixed_dtypes_and_norms_that_overflow():
    """bf16 and fp32 parameters are checked together; finite weights whose norm overflows fp32 (the
    squares of 1e20) are not reported (the exact per-parameter scan decides), a NaN among them is."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).to(torch.bfloat16))
    check_parameters_finite(model, "step 3")
    with torch.no_grad():
        model[0].weight.fill_(1e20)
    assert torch.isinf(torch._foreach_norm([model[0].weight])[0])
    check_parameters_finite(model, "step 3")
    with torch.no_grad():
        model[1].bias[0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"parameter 1\.bias holds 1 NaN/Inf"):
        check_parameters_finite(model, "step 3")
