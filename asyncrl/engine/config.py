"""EngineConfig: the knobs of one engine instance (defaults suit a GPU; tests shrink them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class EngineConfig:
    block_size: int = 64              # tokens per KV block (prefix-cache granularity)
    num_kv_blocks: Optional[int] = None  # None: sized from memory (GPU) or max_num_seqs x max_model_len (CPU)
    max_num_seqs: int = 512           # running sequences at most (the decode batch)
    max_num_batched_tokens: int = 16384  # prefill token budget of one step (chunked beyond it)
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.85
    kv_memory_gb_cpu: float = 1.0     # CPU cap on the KV pool when num_kv_blocks is None
    enable_prefix_caching: bool = True
    enable_fork: bool = True          # n samples share the prompt's KV (prefill once)
    enforce_eager: bool = False       # no CUDA graphs
    async_scheduling: Optional[bool] = None  # overlap host step t+1 with device step t (None: on for CUDA)
    # CUDA: launch on a stream of the engine's own with this priority (lower = more urgent; -1 ahead of the
    # default stream), so a trainer sharing the GPU neither queues decode kernels behind its GEMMs nor
    # waits on them; None: the calling thread's current stream (llm.py's module doc)
    stream_priority: Optional[int] = None
    cascade_attention: bool = True    # GPU decode: rows sharing prefix blocks read them once per group
    # CUDA: q/k norm + RoPE and the K/V cache write in one Triton kernel per layer (triton_qkv.py) instead of
    # five (compiled norm/RoPE, v copy, two index_copy_); dense and MoE decoders. None: on for CUDA (the
    # GRPO-shaped decode 1.11x on the H200, bench/fused_kv_write.py); False: the torch path
    fused_kv_write: Optional[bool] = None
    # CUDA graphs: the decode graph of a step without top-k / top-p also runs the LM head and the one-pass
    # sampler and packs the tokens for the read-back (model_runner.py ``_graph_decode``): ~15 fewer host
    # launches per decode step (issue 20); None/False: off (H200, GRPO shape: equal wall, the decode is
    # device-bound; bench/engine_host_decode.py --device cuda, bench/RESULTS.md)
    decode_graph_sampler: Optional[bool] = None
    compile_sampler: bool = True      # torch.compile the sampler on CUDA
    triton_sampler: bool = True       # CUDA: one-pass Triton kernel for batches without top-k/top-p
    seed: int = 0                     # seeds requests that give none
    tensor_parallel_size: int = 1     # ranks the model is split over (processes; GPUs from the engine's device on)
    return_routed_experts: bool = False  # MoE: return each completion's expert ids (routing replay)
    merge_lora: bool = False          # a LoRA adapter: merged into the weights at load, not applied on the fly
    # speculative decoding (spec/): vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 4}
    speculative_config: Any = None
    # "fp8": the decoder layers' linears in blockwise e4m3, re-quantized at every weight sync (fp8_linear.py)
    quantization: Optional[str] = None
    # FP8 scales: "block" (128x128 weight blocks, 1x128 activation groups) or "channel" (per output channel
    # x per token, the rowwise-scaled GEMM); "block" stays the default until the H200 sweep picks one
    fp8_scaling: str = "block"
    kv_cache_dtype: Optional[str] = None  # "fp8": K/V stored in e4m3 (scale 1.0, as vLLM's default); None: model dtype
    # hybrid (Qwen3.5): the Gated DeltaNet state's storage dtype, vLLM's key and values ("float32", "bfloat16",
    # "float16"); None/"auto": the checkpoint's mamba_ssm_dtype, else float32 (state_pool.ssm_state_dtype)
    mamba_ssm_cache_dtype: Optional[str] = None
