"""The typed config tree: one dataclass per concern, composed into :class:`Config`.

Loaded from a YAML recipe and overridden by dotted CLI arguments::

    asyncrl train recipes/quickstart.yaml algorithm.kl_coef=0.01 rollout.n=8

Every unknown key, wrong type or out-of-range value is refused by
:func:`load_config` before anything runs (see ``config_schema``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from asyncrl.config_schema import (ConfigError, all_keys, build_dataclass, closest_key, field_spec,
                                   parse_override, set_dotted, to_dict)

__all__ = ["Config", "ConfigError", "load_config", "resolve_recipe", "to_dict"]

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class TinyModelConfig:
    """A small model built from a config (random init): Qwen3, or Qwen3.5's hybrid architecture
    (Gated DeltaNet layers with gated full attention every 4th layer; docs/models.md)."""

    architecture: str = field_spec("qwen3", choices=("qwen3", "qwen3_5"))
    hidden_size: int = field_spec(128, ge=8)
    num_hidden_layers: int = field_spec(4, ge=1)
    num_attention_heads: int = field_spec(4, ge=1)
    num_key_value_heads: int = field_spec(2, ge=1)
    head_dim: int = field_spec(32, ge=4)
    intermediate_size: int = field_spec(384, ge=8)
    max_position_embeddings: int = field_spec(64, ge=8)
    rope_theta: float = field_spec(1e4, gt=0)

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("model.tiny.num_attention_heads must be a multiple of model.tiny.num_key_value_heads")


@dataclass
class ModelConfig:
    """The policy: a checkpoint (dir, run dir or Hub id), or the tiny model built from ``tiny``."""

    path: Optional[str] = field_spec(None, help="local HF checkpoint dir; null builds model.tiny")
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: str = field_spec("float32", choices=("float32", "bfloat16", "float16"))


@dataclass
class TaskConfig:
    """A synthetic verifiable task (asyncrl.data.tasks)."""

    name: str = field_spec("arithmetic", choices=("arithmetic", "countdown", "calculator"),
                           help="calculator: multiplication solvable by calling the calculator tool (a workflow)")
    min_digits: int = field_spec(1, ge=1, le=9, help="arithmetic: operand digit counts")
    max_digits: int = field_spec(3, ge=1, le=9)
    operations: list[str] = field_spec(default_factory=lambda: ["+"], help="arithmetic: subset of + - *")
    num_numbers: int = field_spec(3, ge=2, le=6, help="countdown: how many numbers are given")
    max_number: int = field_spec(20, ge=2, help="countdown: numbers are drawn from 1..max_number")
    max_target: int = field_spec(200, ge=1, help="countdown: targets are in 1..max_target")
    num_eval: int = field_spec(200, ge=1, help="held-out examples (never trained on)")
    tool_share: float = field_spec(0.2, ge=0, le=1, help="calculator: share of SFT demonstrations that call the "
                                                         "tool (the rest answer directly)")

    def validate(self) -> None:
        if self.min_digits > self.max_digits:
            raise ConfigError("task.min_digits must be <= task.max_digits")
        bad = [op for op in self.operations if op not in ("+", "-", "*")]
        if bad or not self.operations:
            raise ConfigError(f"task.operations: {self.operations!r} must be a non-empty subset of ['+', '-', '*']")


@dataclass
class DataConfig:
    """Prompts from a dataset file (asyncrl.data.sources) instead of the synthetic ``task``.

    ``preset`` names a set that ships with asyncrl (asyncrl/data/sets: its field mapping, its
    evaluation prompt and, when ``path`` is null, its file); ``*_field`` keys override the preset's.
    """

    path: Optional[str] = field_spec(None, help="jsonl/json/parquet/csv file, HF save_to_disk dir, or a Hugging "
                                                "Face Hub dataset id (openai/gsm8k); null with preset null: the "
                                                "synthetic task")
    subset: Optional[str] = field_spec(None, help="a Hub dataset's configuration name (openai/gsm8k: main)")
    split: str = field_spec("train", help="the training split of a dataset dict (Hub id or save_to_disk dir)")
    eval_split: str = field_spec("test", help="a dataset dict's held-out split, used when eval_path and "
                                              "eval_preset are null")
    format: Optional[str] = field_spec(None, choices=("jsonl", "json", "parquet", "csv", "hf"),
                                       help="null: from the extension")
    preset: Optional[str] = field_spec(None, choices=("gsm8k", "aime24", "amc23", "math_eval", "minerva_math"))
    prompt_field: Optional[str] = field_spec(None, help="null: the preset's, else 'prompt'")
    answer_field: Optional[str] = field_spec(None, help="null: the preset's, else 'answer'")
    extra_fields: dict[str, str] = field_spec(default_factory=dict, help="row field -> reward keyword argument")
    uid_field: Optional[str] = field_spec(None, help="row field used as uid (null: <file>:<row>)")
    prompt_template: Optional[str] = field_spec(None, help="str.format over the row (null: the preset's, "
                                                           "else the prompt field as is)")
    system_prompt: Optional[str] = field_spec(None, help="chat template only")
    use_chat_template: bool = field_spec(True, help="wrap prompts in the tokenizer's chat template")
    shuffle: bool = True
    limit: Optional[int] = field_spec(None, ge=1, help="use only the first N rows")
    eval_path: Optional[str] = field_spec(None, help="held-out file (null: eval_preset, else the preset's test split)")
    eval_preset: Optional[str] = field_spec(None, choices=("gsm8k", "aime24", "amc23", "math_eval", "minerva_math"))
    eval_limit: Optional[int] = field_spec(None, ge=1, help="evaluate only the first N held-out rows")

    @property
    def enabled(self) -> bool:
        return self.path is not None or self.preset is not None


@dataclass
class RewardConfig:
    """Reward functions combined by weight and run in a ``RewardPool`` (docs/rewards.md).

    Empty ``rewards``: the synthetic task's own checker, or ``math`` for a dataset.
    """

    rewards: list[Any] = field_spec(default_factory=list, help="names, module:function, or dicts "
                                                               "{name, fn, weight, kwargs, batched, timeout_s}")
    mode: str = field_spec("process", choices=("process", "thread", "inline"),
                           help="process: hung calls are killed (required for math)")
    num_workers: int = field_spec(2, ge=1)
    timeout_s: float = field_spec(10.0, gt=0, help="per call; a timeout scores default_score")
    default_score: float = field_spec(0.0, help="score of a failed, hung or None-returning call")

    def validate(self) -> None:
        for i, entry in enumerate(self.rewards):
            if not isinstance(entry, (str, dict)):
                raise ConfigError(f"reward.rewards[{i}]: expected a reward name or a mapping, got {entry!r}")


@dataclass
class EvalConfig:
    """``asyncrl eval``: k samples per held-out prompt -> mean@k, pass@k, maj@k.

    A sample is correct when its total reward is >= 1 (as in training's accuracy).
    """

    k: int = field_spec(1, ge=1, help="samples per prompt")
    temperature: float = field_spec(0.0, ge=0, help="0: greedy (then k must be 1)")
    top_p: float = field_spec(1.0, gt=0, le=1)
    max_tokens: Optional[int] = field_spec(None, ge=1, help="null: rollout.max_tokens")
    metrics: list[str] = field_spec(default_factory=lambda: ["mean", "pass", "maj"], help="subset of mean, pass, maj")
    batch_size: int = field_spec(64, ge=1, help="prompts per generate call")
    seed: int = field_spec(0, ge=0)

    def validate(self) -> None:
        bad = [m for m in self.metrics if m not in ("mean", "pass", "maj")]
        if bad or not self.metrics:
            raise ConfigError(f"eval.metrics: {self.metrics!r} must be a non-empty subset of ['mean', 'pass', 'maj']")
        if self.k > 1 and self.temperature == 0:
            raise ConfigError(f"eval.k={self.k} with eval.temperature=0 draws {self.k} identical greedy samples: "
                              "set eval.temperature > 0 (e.g. 0.6) or eval.k=1")


@dataclass
class SFTConfig:
    """Supervised warm start on task demonstrations (stage 1 of the pipeline)."""

    enabled: bool = True
    steps: int = field_spec(300, ge=0)
    batch_size: int = field_spec(128, ge=1)
    lr: float = field_spec(1e-3, gt=0)
    warmup_steps: int = field_spec(0, ge=0)
    lr_schedule: str = field_spec("linear", choices=("constant", "linear"))
    min_lr_ratio: float = field_spec(0.0, ge=0, le=1, help="linear schedule: final lr / peak lr")
    cache: bool = field_spec(True, help="reuse a warm start with the same model/task/sft/seed")
    cache_dir: Optional[str] = field_spec(None, help="default: $ASYNCRL_CACHE or ~/.cache/asyncrl")
    data_path: Optional[str] = field_spec(None, help="asyncrl sft: jsonl of demonstrations (default: the task's)")
    prompt_field: str = "prompt"
    response_field: str = "response"


@dataclass
class DraftConfig:
    """``asyncrl train-draft``: an EAGLE draft head trained on the policy's own samples (engine/spec/eagle_head.py),
    used as ``rollout.speculative.method=eagle rollout.speculative.model=<output>``."""

    output: str = field_spec("draft_head", help="directory the head checkpoint (config.json + safetensors) goes to")
    init: Optional[str] = field_spec(None, help="refresh: start from this head (trained on an earlier policy version)")
    prompts: int = field_spec(512, ge=1, help="task prompts sampled by the engine (rollout.n samples each, "
                                               "rollout.temperature / top_p / top_k / max_tokens)")
    steps: int = field_spec(300, ge=1)
    batch_size: int = field_spec(64, ge=1, help="sequences per step")
    lr: float = field_spec(3e-3, gt=0, help="AdamW peak lr (5% warm-up, cosine to 10%)")
    passes: int = field_spec(3, ge=1, le=16, help="training-time-test passes: how many chained drafts it learns")
    label: str = field_spec("soft", choices=("soft", "token"), help="soft: match the policy's next-token "
                            "distribution; token: the sample's own next token")
    head_init: str = field_spec("random", choices=("random", "identity"), help="a fresh head's weights (without "
                                "draft.init): random N(0, 0.02); identity: starts as drafting the policy's last "
                                "choice again, so tokens absent from the samples keep that rule (eagle_head.new_head)")
    eval_prompts: int = field_spec(64, ge=0, help="held-out prompts for the acceptance report (0: skip it)")
    num_speculative_tokens: int = field_spec(3, ge=1, le=16, help="k of the acceptance report")


@dataclass
class OpenAIServerConfig:
    """``rollout.backend=openai``: generate on an OpenAI-compatible server (asyncrl serve, vLLM,
    SGLang) with token-id prompts and logprobs (asyncrl/rollout/openai_backend.py)."""

    base_url: Optional[str] = field_spec(None, help="the server, e.g. http://127.0.0.1:8000 (no /v1)")
    model: Optional[str] = field_spec(None, help="served model name (null: the server's first model)")
    api_key: Optional[str] = field_spec(None, help="null: $OPENAI_API_KEY")
    weight_sync: str = field_spec("http", choices=("http", "disk", "none"),
                                  help="http: safetensors body to POST /v1/update_weights (asyncrl serve); disk: a "
                                       "file in shared_dir, its path posted; none: weights synced by other means")
    shared_dir: Optional[str] = field_spec(None, help="weight_sync=disk: a directory trainer and server both see")
    timeout_s: float = field_spec(600.0, gt=0)
    max_connections: int = field_spec(256, ge=1)


@dataclass
class SpeculativeRolloutConfig:
    """``rollout.speculative``: speculative decoding in the engine (asyncrl/engine/spec/, the keys
    of vLLM's ``speculative_config``). Exact: tokens follow the policy's law and the returned
    log-probs are the policy's; it only changes speed (in the small-batch tail of a rollout)."""

    method: str = field_spec("off", choices=("off", "ngram", "draft_model", "eagle"),
                             help="ngram: prompt lookup over the prompt, the sequence and its group; "
                                  "draft_model: a small model of the same tokenizer (model); "
                                  "eagle: a draft head on the policy's hidden states (model; asyncrl train-draft)")
    num_speculative_tokens: int = field_spec(4, ge=1, le=16, help="drafts per sequence per step")
    model: Optional[str] = field_spec(None, help="draft_model / eagle: its checkpoint directory (fixed: not synced)")
    prompt_lookup_max: int = field_spec(4, ge=1, help="ngram: longest suffix matched")
    prompt_lookup_min: int = field_spec(2, ge=1, help="ngram: shortest suffix matched")
    draft_sampling: str = field_spec("greedy", choices=("greedy", "probabilistic"),
                                     help="draft_model: argmax drafts, or sampled drafts with their probs")
    disable_by_batch_size: int = field_spec(32, ge=1, help="speculate only while at most this many sequences run")
    min_acceptance: float = field_spec(0.0, ge=0, lt=1, help="a sequence stops drafting below this acceptance "
                                                              "rate (the policy drifted from the draft model)")
    adaptive: bool = field_spec(True, help="speculate only while speculative steps measure faster (tokens per "
                                           "second of wall time) than plain decode at the batch size; false: "
                                           "whenever disable_by_batch_size allows")

    def engine_dict(self) -> Optional[dict]:
        """vLLM's ``speculative_config`` dict for the engine; None when off."""
        if self.method == "off":
            return None
        out = {f: getattr(self, f) for f in ("method", "num_speculative_tokens", "prompt_lookup_max",
                                             "prompt_lookup_min", "draft_sampling", "disable_by_batch_size",
                                             "min_acceptance", "adaptive")}
        return out | ({"model": self.model} if self.method in ("draft_model", "eagle") else {})


@dataclass
class RolloutConfig:
    """Generation: the rollout backend, samples per prompt (the group), sampling parameters."""

    backend: str = field_spec("auto", choices=("auto", "engine", "hf", "openai"),
                              help="auto: the asyncrl engine for Qwen3/Qwen2/Llama/Mistral, else HF generate; "
                                   "openai: an OpenAI-compatible server (rollout.openai)")
    openai: OpenAIServerConfig = field(default_factory=OpenAIServerConfig)
    n: int = field_spec(8, ge=1, help="samples per prompt (GRPO group size)")
    temperature: float = field_spec(1.0, gt=0)
    top_p: float = field_spec(1.0, gt=0, le=1)
    top_k: int = field_spec(-1, ge=-1)
    max_tokens: int = field_spec(6, ge=1, help="max new tokens per response")
    weight_sync_bucket_mb: int = field_spec(512, ge=1, help="fsdp2: weights reach the rollout backend gathered "
                                                          "in buckets of about this size (peak extra memory)")
    gpu_memory_utilization: float = field_spec(
        0.85, gt=0, le=1, help="engine on a GPU: fill the card up to this fraction of its memory (everything on it "
                               "counts, the trainer too, as in vLLM); lower it when the trainer shares the GPU")
    # -- the rollout fleet (docs/fleet.md): replicas x TP ranks, async mode --
    engines: int = field_spec(1, ge=1, help="async: engine replicas (processes; GPUs from runtime.rollout_device "
                                            "on, tensor_parallel_size each); a router sends each group to one")
    tensor_parallel_size: int = field_spec(1, ge=1, help="async + engine: ranks each replica's model is split over "
                                                         "(must divide the attention heads)")
    replica_start_timeout_s: float = field_spec(300.0, gt=0, help="fleet: a replica not ready by then is named "
                                                                  "with its log and the run stops")
    ray_strategy: str = field_spec("PACK", choices=("PACK", "SPREAD", "STRICT_SPREAD"),
                                   help="fleet + runtime.executor=ray: how the replicas' placement-group bundles "
                                        "(one per replica, its TP GPUs on one node) spread over nodes")
    return_routed_experts: bool = field_spec(True, help="engine + MoE model: return each completion's expert ids "
                                                        "(actor.routing_replay and the routing-mismatch metric)")
    speculative: SpeculativeRolloutConfig = field(default_factory=SpeculativeRolloutConfig)
    quantization: str = field_spec("none", choices=("none", "fp8"),
                                   help="engine: fp8 = the decoder linears in e4m3 (scales: rollout.fp8_scaling), "
                                        "re-quantized from the trainer's "
                                        "weights at every sync; needs algorithm.rollout_correction (TIS)")
    fp8_scaling: str = field_spec("block", choices=("block", "channel"),
                                  help="engine + rollout.quantization=fp8: block = 128x128 weight blocks and 1x128 "
                                       "activation groups (DeepSeek-V3, llm-compressor FP8_BLOCK); channel = one scale "
                                       "per output channel and per token (llm-compressor FP8_DYNAMIC, the rowwise-scaled "
                                       "GEMM vLLM runs on Hopper); block stays the default until the H200 sweep picks")
    kv_cache_dtype: str = field_spec("auto", choices=("auto", "fp8"),
                                     help="engine: fp8 = K/V cached in e4m3 (scale 1.0, vLLM's default): half the "
                                          "KV bytes read per decode step, twice the tokens in the pool")
    fused_kv_write: Optional[bool] = field_spec(None, help="engine on a GPU: q/k norm + RoPE and the K/V cache write "
                                                           "in one Triton kernel per layer instead of five (dense and "
                                                           "MoE models); null: on for a GPU engine (1.11x decode at "
                                                           "the GRPO shape on an H200), false: the torch path")
    decode_graph_sampler: Optional[bool] = field_spec(None, help="engine on a GPU: the decode CUDA graph also runs the "
                                                                 "LM head and the one-pass sampler (fewer host launches "
                                                                 "per step); null: the engine's default")
    mamba_ssm_cache_dtype: str = field_spec(
        "auto", choices=("auto", "float32", "bfloat16", "float16"),
        help="engine + Qwen3.5 (Gated DeltaNet): the recurrent state's storage dtype (vLLM's key); auto = the "
             "checkpoint's mamba_ssm_dtype (float32 in the released models), else float32; bfloat16 halves the "
             "state bytes decode reads and writes (kernels still compute in fp32; a small rollout-vs-trainer mismatch)")
    engine_stream: str = field_spec(
        "auto", choices=("auto", "high_priority", "caller"),
        help="engine on a GPU: high_priority = the engine launches on a CUDA stream of its own above the default "
             "priority, so decode runs beside a trainer's update on the same GPU instead of queued behind it; "
             "caller = the calling thread's stream; auto = high_priority for an async run whose engine is a thread "
             "of the trainer's process (one GPU for both), else caller")


@dataclass
class WorkflowConfig:
    """Multi-turn episodes (asyncrl/workflows, docs/workflows.md): ``async def rollout(client,
    example) -> Trajectory | float`` runs ``rollout.n`` times per prompt against a client bound
    to the current policy; ``rollout.max_tokens`` bounds each turn."""

    fn: Optional[str] = field_spec(None, help="module:function, or a built-in: calculator, python_math "
                                              "(null: single-turn prompt -> completion)")
    tools: list[Any] = field_spec(default_factory=list, help="built-in names (calculator, python) or "
                                                             "{fn: module:function, schema: {...}}")
    tool_parser: str = field_spec("auto", choices=("auto", "hermes", "llama3_json", "none"),
                                  help="tool-call format (auto: from the chat template)")
    max_total_tokens: int = field_spec(1024, ge=2, help="an episode's prompt + all turns at most")
    max_concurrent: int = field_spec(256, ge=1, help="episodes in flight at once per generate call")
    chat_template_kwargs: dict[str, Any] = field_spec(default_factory=dict, help="e.g. {enable_thinking: false}")

    @property
    def enabled(self) -> bool:
        return self.fn is not None


@dataclass
class KLControlConfig:
    """The coefficient β of the KL folded into the reward (``algorithm.use_kl_in_reward``).

    ``fixed`` keeps β; ``adaptive`` is Ziegler et al.'s controller (1909.08593):
    β ← β·(1 + clip(KL/target_kl − 1, ±0.2)·n/horizon), n = sequences in the batch.
    """

    type: str = field_spec("fixed", choices=("fixed", "adaptive"))
    kl_coef: float = field_spec(0.001, ge=0, help="initial β of the KL-in-reward penalty")
    target_kl: float = field_spec(0.1, gt=0, help="adaptive: the KL the controller steers to")
    horizon: int = field_spec(10000, ge=1, help="adaptive: sequences over which β moves by ≤ 20%")


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose metric is constant, generate more rounds
    until ``trainer.prompts_per_step`` groups remain, keep exactly that many."""

    enable: bool = False
    metric: str = field_spec("acc", choices=("acc", "score"),
                             help="acc: correct (reward >= 1) or not; score: the shaped reward")
    max_num_gen_batches: int = field_spec(10, ge=0, help="rollout rounds per step before an error (0: unlimited)")


@dataclass
class OverlongBufferConfig:
    """DAPO overlong reward shaping: a penalty falling linearly from 0 at
    ``rollout.max_tokens − len`` tokens to ``−penalty_factor`` at ``rollout.max_tokens``."""

    enable: bool = False
    len: int = field_spec(4, ge=1, help="buffer length in tokens (DAPO: 4096 of 20480)")
    penalty_factor: float = field_spec(1.0, ge=0)


@dataclass
class RolloutCorrectionConfig:
    """Rollout/training mismatch correction: each token's loss is multiplied by the detached
    weight w = π_old/π_rollout (old log-probs recomputed by the trainer, rollout log-probs
    from the backend), truncated (TIS) or masked (IcePop) outside the band."""

    level: str = field_spec("none", choices=("none", "token", "sequence", "geometric"),
                            help="none: no weights; sequence: product over the response; geometric: its per-token mean")
    threshold: float = field_spec(2.0, gt=0, help="upper bound of w (verl's default 2.0)")
    lower_threshold: Optional[float] = field_spec(None, ge=0, help="lower bound of w (null: none)")
    mode: str = field_spec("truncate", choices=("truncate", "mask"), help="truncate: clamp w; mask: w = 0 outside")

    def validate(self) -> None:
        if self.lower_threshold is not None and self.lower_threshold > self.threshold:
            raise ConfigError(f"algorithm.rollout_correction.lower_threshold={self.lower_threshold} must be "
                              f"<= threshold={self.threshold}")

    @property
    def enabled(self) -> bool:
        return self.level != "none"


@dataclass
class AlgorithmConfig:
    """What is optimised. Names follow verl's keys (ALGORITHMS.md)."""

    adv_estimator: str = field_spec("grpo", help="see asyncrl.algorithms.ADV_ESTIMATORS")
    norm_adv_by_std_in_grpo: bool = True
    policy_loss: str = field_spec("ppo_clip", help="see asyncrl.algorithms.POLICY_LOSSES")
    loss_agg_mode: str = field_spec("token-mean", choices=(
        "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"))
    loss_scale_factor: Optional[float] = field_spec(None, gt=0)
    clip_ratio_low: float = field_spec(0.2, ge=0)
    clip_ratio_high: float = field_spec(0.2, ge=0, help="DAPO clip-higher: 0.28")
    clip_ratio_c: float = field_spec(3.0, gt=1, help="dual-clip constant")
    tau_pos: float = field_spec(1.0, gt=0)
    tau_neg: float = field_spec(1.05, gt=0)
    kl_coef: float = field_spec(0.0, ge=0, help="KL-to-reference loss coefficient (0: no KL loss term)")
    kl_estimator: str = field_spec("k3", help="KL loss estimator: k1|k2|k3|abs (aliases kl|mse|low_var_kl), '+' = straight-through")
    use_kl_in_reward: bool = field_spec(False, help="fold -β·KL(old‖ref) into the token rewards (PPO/REINFORCE++ style)")
    kl_penalty: str = field_spec("k1", help="KL-in-reward estimator (same names as kl_estimator)")
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    entropy_coeff: float = field_spec(0.0, ge=0)
    calculate_entropy: bool = field_spec(True, help="report actor/entropy when entropy_coeff is 0 (one softmax per chunk)")
    gamma: float = field_spec(1.0, ge=0, le=1)
    lam: float = field_spec(1.0, ge=0, le=1)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    decoupled: bool = field_spec(False, help="decoupled PPO: clip on π_θ/π_prox (recomputed), weight by "
                                             "π_prox/π_behav (rollout_correction); the async runtime requires it")


@dataclass
class CriticConfig:
    """The value model of PPO (``algorithm.adv_estimator=gae``): the policy architecture with
    a scalar head (asyncrl/training/critic.py), trained on the clipped value loss."""

    enable: bool = field_spec(False, help="build and train a critic (required by adv_estimator=gae)")
    lr: float = field_spec(1e-4, gt=0)
    weight_decay: float = field_spec(0.0, ge=0)
    grad_clip: float = field_spec(1.0, gt=0)
    warmup_steps: int = field_spec(0, ge=0, help="linear lr warmup, in critic optimizer steps")
    cliprange_value: float = field_spec(0.5, gt=0, help="ε_v of the clipped value loss")
    ppo_epochs: int = field_spec(1, ge=1)
    mini_batches: int = field_spec(1, ge=1, help="critic optimizer steps per rollout batch (per epoch)")
    freeze_actor_steps: int = field_spec(0, ge=0, help="first RL steps train only the critic (verl trainer.critic_warmup)")


@dataclass
class DPOConfig:
    """``asyncrl dpo``: offline preference optimisation against a frozen reference."""

    data_path: Optional[str] = field_spec(None, help="jsonl of prompt/chosen/rejected (null: pairs built from the task)")
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    beta: float = field_spec(0.1, gt=0, help="inverse temperature of the implicit reward")
    label_smoothing: float = field_spec(0.0, ge=0, lt=0.5, help="conservative DPO: assumed fraction of flipped labels")
    steps: int = field_spec(100, ge=0)
    batch_size: int = field_spec(32, ge=1, help="preference pairs per optimizer step")
    lr: float = field_spec(1e-4, gt=0)
    warmup_steps: int = field_spec(0, ge=0)
    num_pairs: int = field_spec(512, ge=1, help="pairs built from the task when data_path is null")


@dataclass
class LoraConfig:
    """LoRA (Hu et al. 2021) through PEFT: the actor trains low-rank adapters W + (α/r)·B·A on
    ``target_modules`` while the base weights stay frozen; the reference is the base with the
    adapters disabled, and a weight sync moves only A and B (docs/lora.md)."""

    rank: int = field_spec(0, ge=0, help="adapter rank r (0: LoRA off, the whole model trains)")
    alpha: float = field_spec(16.0, gt=0, help="the adapter's output is scaled by alpha / rank")
    dropout: float = field_spec(0.0, ge=0, lt=1, help="dropout on the adapter's input while training")
    target_modules: list[str] = field_spec(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        help="module names that get adapters (PEFT's target_modules; ['all-linear'] works too)")
    merged_rollout: bool = field_spec(False, help="engine: serve W + (α/r)·B·A merged into the weights (plain "
                                                  "GEMMs; a sync then moves the adapted layers' full weights) "
                                                  "instead of adding x·A·B on the fly (a sync moves A and B only)")
    save_merged: bool = field_spec(False, help="checkpoints also hold the merged model (merged/, an HF checkpoint) "
                                               "beside the adapter in PEFT's format")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self) -> None:
        if self.enabled and not self.target_modules:
            raise ConfigError("actor.lora.target_modules is empty: name the modules that get adapters "
                              "(e.g. [q_proj, v_proj]) or set actor.lora.rank=0")


@dataclass
class ActorConfig:
    """The policy update: optimizer, PPO epochs, mini- and micro-batches."""

    lr: float = field_spec(1e-4, gt=0)
    weight_decay: float = field_spec(0.0, ge=0)
    betas: list[float] = field_spec(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = field_spec(1.0, gt=0)
    warmup_steps: int = field_spec(0, ge=0)
    ppo_epochs: int = field_spec(1, ge=1)
    mini_batches: int = field_spec(1, ge=1, help="optimizer steps per rollout batch (per epoch)")
    micro_batch_size: int = field_spec(256, ge=1, help="rows per forward/backward")
    logprob_chunk_tokens: int = field_spec(4096, ge=1, help="tokens per chunk when computing log-probs")
    master_dtype: str = field_spec("float32", choices=("float32", "bfloat16", "float16"),
                                   help="dtype of the weights AdamW updates and of its state: float32 keeps fp32 "
                                        "master weights beside a bf16/fp16 model (updates below bf16's resolution "
                                        "accumulate); model.dtype: pure low-precision training")
    routing_replay: bool = field_spec(False, help="MoE: the trainer's forward uses the experts the engine chose "
                                                  "for each token (R3); the mismatch rate is reported either way")
    # The trainer's forward (issue 20; asyncrl/training/forward_plan.py); also the reference's and critic's.
    kernels: str = field_spec("auto", choices=("auto", "liger", "eager"),
                              help="liger: Liger Kernel's RMSNorm/RoPE/SwiGLU + the Triton fused LM head (CUDA); "
                                   "eager: HF's modules + the torch fused head; auto: the fastest that runs here")
    packing: str = field_spec("auto", choices=("auto", "varlen", "tree", "padded"),
                              help="varlen: rows concatenated, attention by cumulative lengths (GPU default); "
                                   "tree: short rows as prefix trees under a 4D mask (CPU default); padded")
    compile: bool = field_spec(False, help="torch.compile the decoder blocks (dynamic shapes; recompiles in the "
                                           "metrics); Inductor then fuses what Liger's block kernels would")
    peak_tflops: Optional[float] = field_spec(None, gt=0, help="the device's peak for actor/mfu (null: known "
                                                               "GPUs' dense bf16 peak; none on CPU)")
    lora: LoraConfig = field(default_factory=LoraConfig)
    gradient_checkpointing: bool = field_spec(False, help="recompute each decoder layer's activations in backward "
                                                          "(HF activation checkpointing): less memory, ~1/3 more compute")
    offload: str = field_spec("none", choices=("none", "optimizer", "full"),
                              help="optimizer: Adam moments in host memory, streamed to the device per step; "
                                   "full (trainer.strategy=fsdp2): parameters, gradients and optimizer on the host "
                                   "(FSDP2 CPUOffloadPolicy; the reference's parameters too)")


@dataclass
class TrainerConfig:
    """The RL loop: steps, prompts per step, held-out evals, checkpoints, device."""

    steps: int = field_spec(100, ge=0, help="RL steps")
    prompts_per_step: int = field_spec(16, ge=1)
    max_wall_seconds: Optional[float] = field_spec(None, gt=0, help="stop RL early past this budget")
    eval_every: int = field_spec(0, ge=0, help="held-out eval every N steps (0: only before/after)")
    eval_samples: int = field_spec(4, ge=0, help="held-out mean@k at the rollout temperature (0: greedy only)")
    checkpoint_every: int = field_spec(0, ge=0, help="checkpoint every N steps (0: only at the end)")
    keep_checkpoints: int = field_spec(2, ge=1)
    torch_threads: int = field_spec(2, ge=1)
    device: str = field_spec("auto", choices=("auto", "cpu", "cuda"))
    strategy: str = field_spec("auto", choices=("auto", "single", "fsdp2"),
                               help="single: one process; fsdp2: FSDP2-sharded data parallelism over the launched "
                                    "ranks (docs/distributed.md); auto: fsdp2 when more than one rank runs")
    gpus: int = field_spec(1, ge=1, help="ranks `asyncrl train` launches on this machine (one per GPU; CPU "
                                         "processes over gloo with trainer.device=cpu); under torchrun or Ray the "
                                         "launcher sets the world instead")
    dist_backend: str = field_spec("auto", choices=("auto", "nccl", "gloo"),
                                   help="auto: nccl between GPUs, gloo between CPU ranks")
    dist_timeout_s: float = field_spec(600.0, gt=0, help="a collective waiting longer fails the rank (a dead or hung "
                                                         "peer); the launcher then names the rank that failed first")
    resume: str = field_spec("never", help="auto: continue from the latest complete checkpoint of logging.run_dir "
                                           "(or of the newest run with this name); never: start at step 1 (a run "
                                           "dir holding a run is refused); or the path of a checkpoint / run dir")
    max_skipped_steps: int = field_spec(5, ge=0, help="stop after this many consecutive steps without an update "
                                                      "(non-finite loss or gradient); 0: never stop")


@dataclass
class RuntimeConfig:
    """How rollout and training are scheduled (docs/async.md).

    async: a rollout loop and the train loop run concurrently around a bounded buffer; a
    group is admitted only while (max_staleness + v + 1)·prompts_per_step − (accepted + running)
    > 0, so no trained token is more than ``max_staleness`` versions old.
    """

    mode: str = field_spec("sync", choices=("sync", "async"))
    executor: str = field_spec("local", choices=("local", "ray"), help="ray: rollout, reward and trainer as Ray actors")
    max_staleness: int = field_spec(1, ge=0, help="async: max versions between a token's policy and the trainer's "
                                                  "(0: on-policy, same results as sync)")
    max_concurrent: Optional[int] = field_spec(None, ge=1, help="async: groups in flight at most "
                                                                "(null: (max_staleness + 1) * prompts_per_step)")
    sync_every: int = field_spec(1, ge=1, help="async: push weights to the rollout backend every N updates")
    rollout_chunk: Optional[int] = field_spec(None, ge=1, help="async: groups per generate call "
                                                               "(null: trainer.prompts_per_step)")
    rollout_workers: int = field_spec(1, ge=1, help="async: generate calls in flight at once (threads)")
    reward_workers: int = field_spec(2, ge=1, help="async: threads scoring groups as they complete")
    partial_rollout: bool = field_spec(True, help="async + engine: load new weights between engine steps while "
                                                  "requests run (KV kept); false: wait for running generations")
    partial_rollout_kv: str = field_spec("keep", choices=("keep", "recompute"),
                                         help="async + engine, on an in-flight weight update: running requests keep "
                                              "the K/V of the old weights, or drop it and recompute it with the new")
    rollout_process: bool = field_spec(False, help="async + local executor: the rollout engine runs in its own OS "
                                                   "process (weights through shared memory); false: a thread. "
                                                   "Ignored in sync mode and by executor=ray (a Ray actor)")
    rollout_device: Optional[str] = field_spec(None, help="async + rollout_process: the device the rollout process "
                                                          "generates on, e.g. cuda:1 (null: the trainer's)")
    weight_transport: str = field_spec("shared", choices=("shared", "collective"),
                                       help="async + rollout_process: how pushed weights reach the rollout process: "
                                            "shared (shared CPU memory / CUDA IPC, read by the child) or collective "
                                            "(a torch.distributed broadcast into the child's own copy: NCCL between "
                                            "GPUs, gloo on CPU)")
    group_timeout_s: Optional[float] = field_spec(None, gt=0, help="async: budget of a group from admission "
                                                                   "to scored (null: none)")
    straggler_policy: str = field_spec("drop", choices=("drop", "partial"),
                                       help="a group over group_timeout_s: drop it, or emit its scored completions")
    probe: bool = field_spec(True, help="async: after each weight sync, check the backend's log-probs")
    probe_every: int = field_spec(1, ge=1, help="async: probe the first push and then every N-th (1: every push; "
                                                "a probe costs a few engine steps beside the rollout on one GPU)")
    probe_tolerance: Optional[float] = field_spec(None, gt=0, help="max |lp_backend - lp_trainer| on the probe "
                                                  "tokens (null: 1e-3 in float32, 0.1 in bfloat16/float16)")
    ray_num_cpus: Optional[int] = field_spec(None, ge=1, help="ray: CPUs of the local ray.init (null: all, and at "
                                                              "least one per rollout actor + 1)")
    max_restarts: int = field_spec(3, ge=0, help="async + rollout_process: restart a rollout process (or a fleet "
                                                 "replica, process or Ray actor) that died (from the last pushed "
                                                 "weights) up to this many times")
    hang_timeout_s: float = field_spec(900.0, gt=0, help="the longest wait on the rollout process, the weight "
                                                         "channel, a collective or rollout data before the run "
                                                         "stops with an error naming what hung")


@dataclass
class HealthConfig:
    """Thresholds of the health monitors (``asyncrl/metrics/health.py``).

    Relative-drop monitors compare the median of the last ``window`` steps against the best
    such median seen after ``warmup_steps``. The monitors read these fields by attribute, so
    any object with the same fields (e.g. a copy of this class in asyncrl/config.py) works.
    """

    enabled: bool = field_spec(True, help="run the health monitors each step")
    warmup_steps: int = field_spec(5, ge=0, help="steps before trend monitors form their baseline")
    window: int = field_spec(5, ge=1, help="steps per smoothing window (medians, pooled samples)")
    repeat_every: int = field_spec(0, ge=0, help="re-print a monitor that keeps firing every N steps "
                                                 "(0: an episode is printed once when it starts and once when it ends)")
    kl_budget: float = field_spec(0.1, gt=0, help="kl/ref (nats/token) allowed before warning")
    hacking_min_reward_rise: float = field_spec(0.05, ge=0, help="train reward rise since the best eval...")
    hacking_min_accuracy_drop: float = field_spec(0.05, gt=0, help="...while eval/accuracy fell this far below its best")
    hacking_patience: int = field_spec(2, ge=1, help="...at this many consecutive evals (eval noise is ~0.035 at 200 prompts)")
    max_version_lag: int = field_spec(2, ge=0, help="async/version_lag allowed (set to runtime.max_staleness)")
    throughput_drop: float = field_spec(0.5, gt=0, lt=1, help="warn when rollout tokens/s < (1 - x) * best")
    prefix_cache_drop: float = field_spec(0.3, gt=0, lt=1, help="warn when prefix-cache hit rate < (1 - x) * best")
    drop_patience: int = field_spec(5, ge=1, help="...for this many consecutive steps (a busy neighbour is transient)")
    degenerate_max: float = field_spec(0.9, ge=0, le=1, help="groups/degenerate_fraction (window mean) allowed")
    entropy_floor: float = field_spec(0.02, ge=0, help="actor/entropy (nats/token) below this is collapse...")
    entropy_collapse_ratio: float = field_spec(0.1, ge=0, lt=1, help="...as is entropy below this x warm-up entropy")
    entropy_blowup_ratio: float = field_spec(3.0, gt=1, help="actor/entropy above this x warm-up entropy")
    length_corr_max: float = field_spec(0.5, gt=0, le=1, help="within-group corr(length, reward) allowed")
    length_min_samples: int = field_spec(32, ge=2, help="pooled samples before the correlation is trusted")
    logprob_gap_max: float = field_spec(0.1, gt=0, help="rollout/logprob_gap (mean |Δ log p|, nats/token) allowed")


@dataclass
class LoggingConfig:
    """Where outputs go: the run directory, TensorBoard, W&B, the progress bar, the report."""

    output_dir: str = "runs"
    run_dir: Optional[str] = field_spec(None, help="exact run dir (default: <output_dir>/<time>-<job>-<name>, job: train/sft/eval/dpo)")
    tensorboard: bool = True
    progress: bool = True
    memory: bool = field_spec(True, help="peak memory per stage (memory/<stage>_peak_mib)")
    report: bool = field_spec(True, help="write RUN_DIR/report.html at the end (needs matplotlib)")
    wandb: bool = field_spec(False, help="also log to Weights & Biases (pip install wandb)")
    wandb_project: str = "asyncrl"
    wandb_entity: Optional[str] = None
    wandb_mode: Optional[str] = field_spec(None, choices=(None, "online", "offline", "disabled"),
                                           help="null: $WANDB_MODE, else online")


@dataclass
class Config:
    name: str = "run"
    seed: int = field_spec(0, ge=0)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    workflow: WorkflowConfig = field(default_factory=WorkflowConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)

    def validate(self) -> None:
        batch = self.trainer.prompts_per_step * self.rollout.n
        if batch % self.actor.mini_batches:
            raise ConfigError(f"actor.mini_batches={self.actor.mini_batches} must divide the batch of "
                              f"trainer.prompts_per_step * rollout.n = {batch} responses")
        if self.critic.enable and batch % self.critic.mini_batches:
            raise ConfigError(f"critic.mini_batches={self.critic.mini_batches} must divide the batch of "
                              f"trainer.prompts_per_step * rollout.n = {batch} responses")
        buffer = self.algorithm.overlong_buffer
        if buffer.enable and buffer.len > self.rollout.max_tokens:
            raise ConfigError(f"algorithm.overlong_buffer.len={buffer.len} must be <= rollout.max_tokens="
                              f"{self.rollout.max_tokens} (the penalty starts at max_tokens - len)")


def resolve_recipe(name_or_path: str) -> Path:
    """A recipe given as a path, or as a name under the repo's ``recipes/``."""
    candidates = [Path(name_or_path), REPO_ROOT / "recipes" / name_or_path,
                  REPO_ROOT / "recipes" / f"{name_or_path}.yaml"]
    for path in candidates:
        if path.is_file():
            return path
    known = sorted(p.stem for p in (REPO_ROOT / "recipes").glob("*.yaml"))
    raise ConfigError(f"recipe '{name_or_path}' not found (known recipes: {', '.join(known)})")


def load_config(recipe: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Load a recipe (YAML) and apply dotted overrides; refuse anything invalid."""
    tree: dict[str, Any] = {}
    if recipe is not None:
        path = resolve_recipe(recipe)
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: a recipe must be a mapping of config sections")
        tree.setdefault("name", path.stem)
    valid = all_keys(Config)
    for text in overrides or []:
        keys, value = parse_override(text)
        dotted = ".".join(keys)
        if dotted not in valid:
            raise ConfigError(f"unknown config key '{dotted}'{closest_key(dotted, valid)}")
        set_dotted(tree, keys, value)
    return build_dataclass(Config, tree)


def config_to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def replace(cfg: Any, **changes: Any) -> Any:
    return dataclasses.replace(cfg, **changes)
