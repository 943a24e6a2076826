"""How a model splits over tensor-parallel ranks: head and KV-head placement (replicated when
fewer KV heads than ranks), vocabulary shards, and the error naming the valid sizes."""
import pytest

from asyncrl.engine.models.config import ModelConfig
from asyncrl.engine.parallel.layout import TensorParallel, TensorParallelError, check_tensor_parallel, valid_sizes


def qwen3_06b(architecture: str = "Qwen3ForCausalLM") -> ModelConfig:
    return ModelConfig.from_dict(dict(architectures=[architecture], vocab_size=151936, hidden_size=1024,
                                      intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                                      num_key_value_heads=8, head_dim=128))


def test_kv_heads_are_split_or_replicated():
    # 8 KV heads over 4 ranks: 2 each, rank r starts at 2r
    assert [(TensorParallel(4, r).kv_heads(8), TensorParallel(4, r).kv_head_start(8)) for r in range(4)] == \
        [(2, 0), (2, 2), (2, 4), (2, 6)]
    # 2 KV heads over 4 ranks: each replicated on 4/2 = 2 ranks; rank r holds head r // 2, the one
    # its query heads (16/4 = 4 per rank: rank r has heads 4r..4r+3, group size 16/2 = 8) read
    assert [TensorParallel(4, r).kv_head_start(2) for r in range(4)] == [0, 0, 1, 1]
    assert all(TensorParallel(4, r).kv_heads(2) == 1 for r in range(4))
    assert [(4 * r) // (16 // 2) for r in range(4)] == [0, 0, 1, 1]


def test_vocab_shards_cover_the_vocabulary_with_padding():
    # 97 rows over 4 ranks: ceil(97/4) = 25 rows each, 100 in all, the last 3 padding
    assert TensorParallel(4, 0).vocab_rows(97) == 25 and TensorParallel(1, 0).vocab_rows(97) == 97


def test_valid_sizes_of_qwen3_06b():
    # 16 heads, 8 KV heads, intermediate 3072: 1, 2, 4, 8 split everything; 16 replicates each
    # KV head on 2 ranks (3072 / 16 = 192)
    assert valid_sizes(16, 8, 3072) == [1, 2, 4, 8, 16]
    check_tensor_parallel(qwen3_06b(), 16)


@pytest.mark.parametrize("size", [3, 32])
def test_a_size_that_does_not_split_the_model_names_the_valid_ones(size):
    with pytest.raises(TensorParallelError, match=rf"tensor_parallel_size={size} does not split this model "
                                                  r"\(16 attention heads, 8 KV heads.*valid sizes: 1, 2, 4, 8, 16$"):
        check_tensor_parallel(qwen3_06b(), size)


def test_kv_heads_that_do_not_divide_the_size_are_refused():
    # 12 heads, 8 KV heads: 4 splits both, but 12 heads over 8 ranks do not split, and 6 ranks
    # would need 8 % 6 == 0 or 6 % 8 == 0
    assert valid_sizes(12, 8, 48) == [1, 2, 4]


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM"])
def test_families_with_their_own_layers_are_refused_above_one_rank(architecture):
    # MoE experts and Gated DeltaNet layers have not adopted the parallel layers: only TP=1 runs them
    config = qwen3_06b(architecture)
    check_tensor_parallel(config, 1)
    with pytest.raises(TensorParallelError, match=rf"tensor_parallel_size=2: the engine's {architecture} has "
                                                  r"layers tensor parallelism does not split yet.*valid sizes: 1$"):
        check_tensor_parallel(config, 2)
