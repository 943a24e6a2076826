"""``asyncrl sft``: the loss of every step in metrics.jsonl and TensorBoard, a run directory
named by its job, and a report that renders from it."""
import json

from asyncrl.cli import main
from asyncrl.metrics.report import write_report

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.head_dim=8",
        "model.tiny.intermediate_size=64", "sft.steps=6", "sft.batch_size=8", "task.num_eval=8",
        "logging.progress=false"]


def test_sft_logs_its_loss_and_names_its_run_dir(tmp_path, capsys):
    assert main(["sft", "quickstart", *TINY, f"logging.output_dir={tmp_path}"]) == 0
    [run_dir] = tmp_path.iterdir()
    assert run_dir.name.endswith("-sft-quickstart")  # <time>-sft-<recipe>, not mistaken for a train run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7)) and all(r["sft/loss"] > 0 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sft/final_loss"] == rows[-1]["sft/loss"]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert f"SFT loss {rows[-1]['sft/loss']:.4f} after 6 steps" in capsys.readouterr().out
    page = write_report(run_dir).read_text()
    assert "<h2>SFT loss</h2>" in page


def test_sft_of_a_tool_task_keeps_its_tool_tokens_and_chat_template(tmp_path):
    """``asyncrl sft calculator_tool`` saves the task's own tokenizer (tool tags as single tokens,
    its chat template), not the plain character one a model could never call the tool with."""
    from transformers import AutoTokenizer

    from asyncrl.data.tasks.calculator import CHAT_TEMPLATE

    assert main(["sft", "calculator_tool", *TINY, "task.tool_share=1.0", f"logging.output_dir={tmp_path}"]) == 0
    [run_dir] = tmp_path.iterdir()
    tok = AutoTokenizer.from_pretrained(str(run_dir / "model"))
    assert len(tok("<tool_call></tool_response>", add_special_tokens=False)["input_ids"]) == 2
    assert tok.chat_template == CHAT_TEMPLATE
