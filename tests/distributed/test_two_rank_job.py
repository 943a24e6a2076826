"""The training job on 2 gloo ranks (forked, each calling ``run_training`` as a launched rank
does): rank 0 alone writes metrics, the summary and the report of every rank's memory, each rank
logs to its own file, the reference is sharded too (KL term), and the sharded checkpoint is
complete, resumable and its HF export loads."""
import json

import torch
from transformers import AutoModelForCausalLM

from asyncrl.config import load_config
from asyncrl.runtime.pipeline import run_training
from tests.distributed.ranks import run_ranks
from tests.runtime.test_pipeline import FAST

TWO_RANKS = [*FAST, "trainer.device=cpu", "trainer.strategy=fsdp2", "trainer.prompts_per_step=3",
             "trainer.torch_threads=1", "logging.report=false", "trainer.eval_samples=0", "task.num_eval=8",
             "algorithm.kl_coef=0.05", "trainer.steps=3", "trainer.checkpoint_every=2"]


def _job(rank: int, world: int, root: str) -> None:
    cfg = load_config("quickstart", [*TWO_RANKS, f"logging.run_dir={root}/run", f"sft.cache_dir={root}/cache"])
    summary = run_training(cfg)
    torch.save(summary, f"{root}/summary_rank{rank}.pt")


def test_two_rank_job_writes_once_and_logs_per_rank(tmp_path):
    run_ranks(2, tmp_path, _job, str(tmp_path))
    assert torch.load(tmp_path / "summary_rank1.pt") == {}  # a follower has no summary of its own
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert len(summary["memory_per_rank"]) == 2 and all(r["peak_mib"] for r in summary["memory_per_rank"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # one writer: no duplicated rows
    assert all(r["memory/rank0_peak_mib"] > 0 and r["memory/rank1_peak_mib"] > 0 for r in rows)
    assert all(r["actor/kl_loss"] >= 0 and r["rollout/logprob_gap"] < 1e-4 for r in rows)  # engine = trainer
    for rank in (0, 1):
        assert (run / "logs" / f"rank_{rank}.log").read_text().startswith(f"rank {rank} (pid ")
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert latest.name == "step_000003"
    for name in ("model.safetensors", "trainer_state.json", "dcp/.metadata", "rng/rank_0.pt", "rng/rank_1.pt"):
        assert (latest / name).exists(), name
    assert AutoModelForCausalLM.from_pretrained(latest).config.model_type == "qwen3"
    assert json.loads((latest / "trainer_state.json").read_text())["policy_version"] == 3


def _resume_job(rank: int, world: int, root: str, steps: int, resume: str, run: str = "run") -> None:
    cfg = load_config("quickstart", [*TWO_RANKS, f"logging.run_dir={root}/{run}", f"sft.cache_dir={root}/cache",
                                     f"trainer.steps={steps}", f"trainer.resume={resume}"])
    torch.save(run_training(cfg), f"{root}/summary_rank{rank}.pt")


def test_two_rank_job_resumes_through_trainer_resume(tmp_path):
    """Issue 18's ``trainer.resume=auto`` on a sharded run: the checkpoint of step 2 (DCP shards
    + resume.pt by issue 18's protocol) is loaded on both ranks and the run continues at step 3."""
    run_ranks(2, tmp_path, _resume_job, str(tmp_path), 2, "never")
    run_ranks(2, tmp_path, _resume_job, str(tmp_path), 3, "auto")
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3 and summary["world_size"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert latest.name == "step_000003" and (latest / "dcp/.metadata").exists() and (latest / "resume.pt").exists()
    assert json.loads((latest / "trainer_state.json").read_text())["policy_version"] == 3
    run_ranks(2, tmp_path, _resume_job, str(tmp_path), 3, "never", "straight")  # uninterrupted, same cache
    straight = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    learning = [k for k in straight[2] if k.split("/")[0] in ("actor", "reward", "response_length")
                and k not in ("actor/tflops", "actor/mfu")]
    assert learning and {k: rows[2].get(k) for k in learning} == {k: straight[2][k] for k in learning}


LORA = ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.save_merged=true"]


def _lora_job(rank: int, world: int, root: str, resume: str) -> None:
    cfg = load_config("quickstart_lora", [*TWO_RANKS, *LORA, f"logging.run_dir={root}/run",
                                          f"sft.cache_dir={root}/cache", f"trainer.resume={resume}"])
    run_training(cfg)


def test_a_two_rank_lora_job_syncs_adapters_only_and_resumes(tmp_path):
    """``quickstart_lora`` on 2 ranks (actor.lora with trainer.strategy=fsdp2): the engine on rank 0
    serves the adapters it is pushed (trainer = engine log-probs), each push moves the adapters'
    bytes only, checkpoints are PEFT adapters (+ merged/) with the adapters' shards, and a
    resume from step 2 (``trainer.resume=PATH``) repeats step 3 exactly."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from asyncrl.data.tasks import build_task
    from asyncrl.runtime.pipeline import prepare_policy

    run_ranks(2, tmp_path, _lora_job, str(tmp_path), "never")
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["rollout/logprob_gap"] < 1e-4 for r in rows)
    step2 = run / "checkpoints" / "step_000002"
    adapter = load_file(step2 / "adapter_model.safetensors")
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    cfg = load_config("quickstart_lora", [*TWO_RANKS, *LORA, f"sft.cache_dir={tmp_path}/cache"])
    base = prepare_policy(cfg, build_task(cfg.task, cfg.seed), torch.device("cpu"), announce=False)[0].eval()
    full_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    # the adapters' bytes exactly (16 KiB here: rank 4 is 21% of this hidden-32 model), never the base's
    assert all(r["weight_sync/bytes"] == adapter_bytes < 0.25 * full_bytes for r in rows)
    assert (step2 / "dcp/.metadata").exists() and not (step2 / "model.safetensors").exists()
    ids = torch.tensor([[1, 5, 7, 3, 4, 9, 11, 2]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(step2 / "merged").eval()(ids).logits
        adapted = PeftModel.from_pretrained(base, str(step2)).eval()(ids).logits
    torch.testing.assert_close(adapted, merged, rtol=0, atol=1e-5)
    run_ranks(2, tmp_path, _lora_job, str(tmp_path), str(step2))
    resumed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    learning = [k for k in rows[2] if k.split("/")[0] in ("actor", "reward") and k not in ("actor/tflops", "actor/mfu")]
    assert learning and {k: resumed[2][k] for k in learning} == {k: rows[2][k] for k in learning}
