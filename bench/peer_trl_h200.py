"""The H200 setting of issue 8: TRL's GRPOTrainer vs asyncrl (sync, async), throughput only.

    python bench/peer_trl.py --setting h200 --warmup-steps 3 --timed-steps 5 --json OUT.json

    model      Qwen3ForCausalLM(vocab 151,936, hidden 1024, intermediate 3072, 28 layers, 16 heads,
               8 KV heads, head_dim 128, tied), random weights (seed 0), saved in bf16
    tokenizer  local WordLevel over "t0".."t151935" (whitespace split), pad and eos declared as
               AddedToken(single_word=True), so "t151935" is one token in transformers 5
    prompts    256 random tokens each; 16 prompts x 8 samples = 128 completions per step, each
               exactly 256 new tokens (TRL: min_new_tokens=256; asyncrl: ignore_eos)
    GRPO       lr 1e-6, beta 0, token-mean (TRL loss_type="dapo"), a cheap reward
               (completion token ids' sum mod 97, / 96): throughput is what counts

Each framework runs in its own process (GPU memory and the engine's KV cache are not shared
between runs) from the same bf16 checkpoint: ``warmup`` untimed steps, then ``timed`` steps;
medians over the timed steps. TRL loads the weights in bf16 (model_init_kwargs dtype
bfloat16), bf16 autocast on (its default), gradient checkpointing off (faster, memory is
plentiful); asyncrl loads them in bf16 (model.dtype=bfloat16) through model.path.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

VOCAB, PROMPT_TOKENS, NEW_TOKENS, PROMPTS, SAMPLES = 151_936, 256, 256, 16, 8
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128)
if os.environ.get("PEER_TRL_TINY") == "1":  # a CPU dry run of this file's code paths (no GPU)
    VOCAB, PROMPT_TOKENS, NEW_TOKENS = 1000, 16, 8
    SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)


# asyncrl's trainer runs the 128 rows in one micro-batch, as TRL does (its peak: 128 GiB); in
# micro-batches of 64 (the same loss: token-mean over the whole batch) the update took 0.524 s
# against 0.472 s in one (bench/RESULTS.md, 2026-12-02 12:30 UTC), with 36.6 vs 57.9 GiB peak.
MICRO_BATCH, ENGINE_MEMORY = 128, 0.3


def _device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_checkpoint(path: Path) -> Path:
    """The random-weight 0.6B-shaped Qwen3 (bf16 safetensors) and its word-level tokenizer."""
    import torch
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").is_file():
        return path
    vocab = {f"t{i}": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    pad, eos = AddedToken(f"t{VOCAB - 2}", single_word=True), AddedToken(f"t{VOCAB - 1}", single_word=True)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", pad_token=pad, eos_token=eos,
                                        padding_side="left")
    tokenizer.save_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert len(tokenizer) == VOCAB and tokenizer(f"t5 t{VOCAB - 1}")["input_ids"] == [5, VOCAB - 1]
    config = Qwen3Config(vocab_size=VOCAB, **SHAPE, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def prompt_ids(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of 256 random ordinary token ids (never pad, eos or unk)."""
    import random
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB - 2) for _ in range(PROMPT_TOKENS)] for _ in range(count)]


def cheap_score(token_ids) -> float:
    return (sum(token_ids) % 97) / 96.0


# -- one framework per process --------------------------------------------------------------

def run_trl_h200(checkpoint: str, steps: int, out_dir: str):
    import torch
    from transformers import AutoTokenizer
    from peer_trl_clock import Limits
    from peer_trl_trl import run_grpo_trainer, trl_config
    from datasets import Dataset

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    prompts = [" ".join(f"t{i}" for i in ids) for ids in prompt_ids(PROMPTS * steps)]
    assert tokenizer(prompts[0])["input_ids"] == prompt_ids(1)[0]
    dataset = Dataset.from_dict({"prompt": prompts})

    def cheap_reward(completion_ids, **_):
        return [cheap_score(ids) for ids in completion_ids]

    config = trl_config(out_dir, 0, 0, steps, max_completion_length=NEW_TOKENS, learning_rate=1e-6,
                        generation_kwargs={"min_new_tokens": NEW_TOKENS}, use_cpu=_device() == "cpu", bf16=True,
                        model_init_kwargs={"dtype": "bfloat16"}, logging_steps=1)
    record = run_grpo_trainer(checkpoint, tokenizer, config, dataset, cheap_reward, Limits(steps=steps), None,
                              0, start)
    if torch.cuda.is_available():
        record.extra["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return record


class _Source:
    """Prompt stream and reward for asyncrl's controller (the H200 prompts are token ids)."""

    def __init__(self):
        from asyncrl.types import Example
        self._ids = prompt_ids(PROMPTS * 1000)
        self._examples = [Example(prompt=str(i), answer="", fields={"ids": ids}, uid=str(i))
                          for i, ids in enumerate(self._ids)]

    def train_stream(self):
        return iter(self._examples)

    @staticmethod
    def encode(example):
        return list(example.fields["ids"])

    def reward(self, prompt, response, **fields):
        return (sum(map(ord, response)) % 97) / 96.0  # the same numbers as a generator of ord(c), twice as fast


def run_asyncrl_h200(checkpoint: str, steps: int, mode: str, out_dir: str):
    import torch
    from asyncrl.rollout.engine_backend import EngineBackend
    from asyncrl.rollout.registry import engine_options, engine_stream_priority
    from asyncrl.runtime.async_controller import build_async_controller
    from asyncrl.runtime.sync_controller import build_sync_controller
    from asyncrl.training.model import load_policy
    from peer_trl_asyncrl import asyncrl_config
    from peer_trl_clock import Limits, RunRecord
    from peer_trl_asyncrl import run_controller

    start = time.perf_counter()
    extra = ["model.dtype=bfloat16", f"trainer.device={_device()}", f"rollout.max_tokens={NEW_TOKENS}", "actor.lr=1e-6",
             f"actor.micro_batch_size={MICRO_BATCH}", "runtime.rollout_process=false", "logging.memory=false",
             *os.environ.get("PEER_TRL_ASYNCRL_OVERRIDES", "").split()]  # e.g. "actor.kernels=eager" (bench/trainer_speed_gpu.py)
    cfg = asyncrl_config(checkpoint, 0, mode, 1, out_dir, extra)
    torch.manual_seed(0)
    model, tokenizer = load_policy(cfg.model.path, cfg.model.dtype, _device())
    source = _Source()
    # The engine shares the GPU with the trainer: its KV pool takes ENGINE_MEMORY of the card
    # (the engine's default, 0.85, is for an engine alone; vLLM colocated in TRL uses 0.3).
    kwargs = {"gpu_memory_utilization": ENGINE_MEMORY} if torch.cuda.is_available() else {}
    # as build_async_controller builds it: async = a thread of this process, its own stream (rollout.engine_stream)
    kwargs["stream_priority"] = engine_stream_priority(cfg.rollout.engine_stream, async_thread=mode == "async")
    # the rollout section's other engine fields, as the registry passes them (e.g. rollout.fused_kv_write)
    kwargs = {**{k: v for k, v in engine_options(cfg.rollout).items() if v is not None}, **kwargs}
    backend = EngineBackend(model, tokenizer, dtype=torch.bfloat16, device=_device(), **kwargs)
    if mode == "async":
        controller = build_async_controller(cfg, model, tokenizer, source.reward, source.train_stream(),
                                            encode=source.encode, backend=backend)
    else:
        controller = build_sync_controller(cfg, model, backend, tokenizer, source.reward, source.train_stream(),
                                           encode=source.encode)
    controller.params.ignore_eos = True  # exactly 256 new tokens, as TRL's min_new_tokens
    record = RunRecord(f"asyncrl-{mode}", 0)
    record.startup_seconds = time.perf_counter() - start
    run_controller(controller, model, record, Limits(steps=steps), None, mode)
    if torch.cuda.is_available():
        record.extra["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return record


def _child(framework: str, checkpoint: str, steps: int, out_json: str, work: str) -> None:
    if framework == "trl":
        record = run_trl_h200(checkpoint, steps, work)
    else:
        record = run_asyncrl_h200(checkpoint, steps, framework, work)
    Path(out_json).write_text(json.dumps(record.to_json(), default=str))


# -- the parent ------------------------------------------------------------------------------

def timed_summary(run: dict, warmup: int) -> dict:
    """Medians over the steps after ``warmup``."""
    import statistics
    steps = run["step_seconds"][warmup:]
    stages = run["stages"][warmup:]
    tokens = run["tokens"][warmup:]
    completions = run["completions"][warmup:]
    med = statistics.median(steps)
    keys = sorted({k for s in stages for k in s})
    return {"framework": run["summary"]["framework"], "timed_steps": len(steps), "s_per_step_median": med,
            "completions_per_s": statistics.median(completions) / med,
            "gen_tokens_per_s": statistics.median(tokens) / med,
            "stage_median_s": {k: statistics.median(s.get(k, 0.0) for s in stages) for k in keys},
            "step_seconds": steps, "startup_seconds": run["summary"]["startup_seconds"],
            **{k: v for k, v in run["summary"].items() if k in ("gpu_peak_gib", "trl_version", "backend")}}


def run_h200(args) -> dict:
    work = Path(args.work_dir or "/tmp/peer_trl_h200")
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    checkpoint = build_checkpoint(work / "qwen3_06b_random_bf16")
    out = {"setting": "h200", "args": vars(args), "checkpoint_seconds": time.perf_counter() - t0, "runs": []}
    steps = args.warmup_steps + args.timed_steps
    for framework in args.frameworks:
        out_json = work / f"{framework}.json"
        t1 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, framework, str(checkpoint), str(steps), str(out_json),
                               str(work / framework)], env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if proc.returncode != 0 or not out_json.is_file():
            out["runs"].append({"framework": framework, "error": f"exit {proc.returncode}"})
            continue
        summary = timed_summary(json.loads(out_json.read_text()), args.warmup_steps)
        summary["process_seconds"] = time.perf_counter() - t1
        out["runs"].append(summary)
        print(f"[h200] {framework}: {summary['s_per_step_median']:.3f} s/step, "
              f"{summary['completions_per_s']:.1f} completions/s, {summary['gen_tokens_per_s']:.0f} tok/s, stages "
              f"{ {k: round(v, 3) for k, v in summary['stage_median_s'].items()} }", flush=True)
        if args.json:  # partial results survive a later failure
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    trl = next((r for r in out["runs"] if r.get("framework") == "trl" and "error" not in r), None)
    for r in out["runs"]:
        if trl and "error" not in r:
            r["speedup_vs_trl"] = r["completions_per_s"] / trl["completions_per_s"]
    return out


if __name__ == "__main__":
    _child(*sys.argv[1:3], int(sys.argv[3]), *sys.argv[4:6])
