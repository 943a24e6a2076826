"""StateSlotManager: block-table rows are recurrent-state slots, bounded, counted in admission."""
import math

import torch

from asyncrl.engine.sequence import Sequence
from asyncrl.engine.state_pool import StatePool, StateSlotManager
from asyncrl.types import SamplingParams


def _seq(n=5):
    return Sequence(list(range(4, 4 + n)), SamplingParams(), "r", 0, 0)


def test_slots_bound_admission_and_forks():
    bm = StateSlotManager(num_blocks=32, block_size=4, max_blocks_per_seq=8, num_slots=2)
    assert not bm.enable_prefix_caching
    a, b, c = _seq(), _seq(), _seq()
    bm.allocate(a)
    assert bm.fork_cost(a) == 1  # a partial last block to copy, and a slot is free
    bm.allocate(b)
    assert {a.table_row, b.table_row} == {0, 1}
    assert not bm.can_allocate(c) and bm.fork_cost(a) == math.inf  # blocks are free, slots are not
    bm.deallocate(a)
    assert bm.can_allocate(c)
    bm.allocate(c)
    assert c.table_row == 0  # the freed slot
    bm.check_invariants([b, c])


class _Layer:
    conv_dim, kernel, num_v_heads, head_k_dim, head_v_dim = 6, 4, 2, 3, 5


def test_pool_copies_states_between_slots():
    layers = [_Layer(), _Layer()]
    pool = StatePool(layers, num_slots=3, dtype=torch.float32, device=torch.device("cpu"))
    assert layers[0].ssm_state.shape == (4, 2, 3, 5) and layers[1].conv_state.shape == (4, 6, 3)
    for conv, ssm in zip(pool.conv, pool.ssm):
        conv[1].normal_()
        ssm[1].normal_()
    pool.copy(torch.tensor([1, 1]), torch.tensor([0, 2]))
    for conv, ssm in zip(pool.conv, pool.ssm):
        assert torch.equal(conv[0], conv[1]) and torch.equal(ssm[2], ssm[1]) and ssm[3].abs().sum() == 0
    assert StatePool.bytes_per_slot(layers, torch.float32) == 2 * (6 * 3 * 4 + 2 * 3 * 5 * 4)


def test_ssm_state_dtype_follows_the_checkpoint_then_fp32_and_names_bad_values():
    """vLLM's ``mamba_ssm_cache_dtype``: auto = the checkpoint's ``mamba_ssm_dtype`` (released
    Qwen3.5: float32), fp32 without it; an explicit value wins; a typo is named."""
    from types import SimpleNamespace

    import pytest

    from asyncrl.engine.state_pool import ssm_state_dtype

    released, bare = SimpleNamespace(extra={"mamba_ssm_dtype": "float32"}), SimpleNamespace(extra={})
    assert ssm_state_dtype(None, released) == ssm_state_dtype("auto", bare) == torch.float32
    assert ssm_state_dtype("auto", SimpleNamespace(extra={"mamba_ssm_dtype": "bfloat16"})) == torch.bfloat16
    assert ssm_state_dtype("bfloat16", released) == torch.bfloat16
    assert ssm_state_dtype("float16", bare) == torch.float16
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype='bf16'.*'bfloat16'"):
        ssm_state_dtype("bf16", bare)
    with pytest.raises(ValueError, match="checkpoint's mamba_ssm_dtype='fp32'"):
        ssm_state_dtype("auto", SimpleNamespace(extra={"mamba_ssm_dtype": "fp32"}))
    # a released multimodal config.json may name it beside text_config or inside it
    from asyncrl.engine.models.config import ModelConfig
    from families import family_config

    text = family_config("qwen3_5").to_dict()
    beside = {"text_config": text, "mamba_ssm_dtype": "bfloat16"}
    for raw in (beside, {"text_config": {**text, "mamba_ssm_dtype": "bfloat16"}}):
        config = ModelConfig.from_dict(raw, architecture="Qwen3_5ForConditionalGeneration")
        assert ssm_state_dtype("auto", config) == torch.bfloat16


def test_bf16_pool_halves_the_delta_rule_state():
    layers = [_Layer()]
    pool = StatePool(layers, num_slots=2, dtype=torch.float32, device=torch.device("cpu"), ssm_dtype=torch.bfloat16)
    assert layers[0].ssm_state.dtype == torch.bfloat16 and layers[0].conv_state.dtype == torch.float32
    pool.ssm[0][0].normal_()
    pool.copy(torch.tensor([0]), torch.tensor([1]))  # fork copies the bf16 bytes as they are
    assert torch.equal(pool.ssm[0][1], pool.ssm[0][0])
    assert StatePool.bytes_per_slot(layers, torch.float32, torch.bfloat16) == 6 * 3 * 4 + 2 * 3 * 5 * 2
