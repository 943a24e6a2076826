"""The CPU setting of issue 8, shared by both frameworks (bench/peer_trl.py).

    task       a + b, each operand: digit count uniform in 1-3, then value uniform in that range;
               prompt "{a}+{b}=", answer str(a+b); 200 held-out pairs never trained on;
               reward 1.0 for exactly the answer ending in EOS (asyncrl.data.tasks.ArithmeticTask)
    tokenizer  15 tokens (<pad> <bos> <eos> 0-9 + =), WordLevel one per character, <bos> prepended,
               PreTrainedTokenizerFast saved and loaded back with AutoTokenizer, left padding
    model      Qwen3ForCausalLM(hidden 128, 4 layers, 4 heads, 2 KV heads, head_dim 32, inter 384,
               max positions 64, tied, rope 1e4): 789,760 parameters, fp32
    warm start 300 SFT steps, batch 128, lr 1e-3 (linear decay), loss on answer + EOS only,
               saved as an HF checkpoint both frameworks load

The evaluator is one object for every framework: it copies the policy's weights into an
asyncrl engine (greedy answers equal HF generate's token for token, tests/engine) and scores
the 200 held-out prompts greedily and, mean@4 at temperature 1.0, sampled.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from asyncrl.config import TinyModelConfig
from asyncrl.data.char_tokenizer import build_char_tokenizer, save_and_reload
from asyncrl.data.tasks import ArithmeticTask
from asyncrl.eval.accuracy import heldout_accuracy
from asyncrl.rollout.engine_backend import EngineBackend
from asyncrl.training.model import build_tiny_model
from asyncrl.training.sft import run_sft

CHARSET = "0123456789+="      # the order: <pad> <bos> <eos> digits + =
PARAMETERS = 789_760
MAX_NEW_TOKENS = 6
SFT_STEPS, SFT_BATCH, SFT_LR = 300, 128, 1e-3
EVAL_SAMPLES = 4


def build_task(seed: int) -> ArithmeticTask:
    """Held-out pairs and the training stream of one seed (both frameworks read this object)."""
    return ArithmeticTask(seed=seed, num_eval=200, min_digits=1, max_digits=3, operations=("+",))


def warm_start(seed: int, root: Path, threads: int = 2) -> tuple[Path, dict]:
    """The SFT checkpoint of ``seed`` under ``root`` (built once, then reused): config.json,
    model.safetensors and the tokenizer files, as any local HF checkpoint."""
    path = root / f"sft_seed{seed}"
    info_file = path / "warm_start.json"
    if info_file.is_file():
        return path, json.loads(info_file.read_text())
    torch.set_num_threads(threads)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = save_and_reload(build_char_tokenizer(CHARSET, with_unk=False), path)
    assert len(tokenizer) == 15, len(tokenizer)
    model = build_tiny_model(TinyModelConfig(), tokenizer, seed)
    count = sum(p.numel() for p in model.parameters())
    assert count == PARAMETERS, count
    task = build_task(seed)
    torch.manual_seed(seed)
    info = run_sft(model, tokenizer, task.train_stream(seed=10_000 + seed), SFT_STEPS, SFT_BATCH, SFT_LR,
                   schedule="linear")
    model.save_pretrained(str(path), safe_serialization=True)
    info.update(parameters=count, vocab=len(tokenizer), seed=seed)
    info_file.write_text(json.dumps(info, indent=2))
    return path, info


class Evaluator:
    """Held-out accuracy of any HF ``Qwen3ForCausalLM`` on one seed's 200 pairs.

    Each call copies the weights into a fresh engine (the policy is not touched), so the same
    code scores TRL's model and asyncrl's actor."""

    def __init__(self, task: ArithmeticTask, tokenizer, seed: int):
        self.task, self.tokenizer, self.seed = task, tokenizer, seed
        self.examples = task.eval_examples()

    @torch.no_grad()
    def __call__(self, model) -> dict:
        start = time.perf_counter()
        backend = EngineBackend(model, self.tokenizer, dtype=torch.float32, device="cpu")
        common = (backend, self.tokenizer, self.task.reward, self.examples, MAX_NEW_TOKENS)
        greedy = heldout_accuracy(*common)
        sampled = heldout_accuracy(*common, temperature=1.0, samples=EVAL_SAMPLES, seed=self.seed)
        return {"greedy": greedy, "sampled": sampled, "eval_seconds": time.perf_counter() - start}
