"""``asyncrl`` on the command line: the help a user reads before the first run, and every
failure reported in one line naming the file and the cause (the traceback goes to a log file,
not the terminal; the data stays untouched)."""
import dataclasses

import pytest

from asyncrl.cli import main
from asyncrl.config import Config


def test_train_help_lists_the_config_groups_and_points_at_print_config(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "asyncrl print-config" in text and "trainer.steps=200" in text
    for group in (f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.type) or f.name == "model"):
        assert f"\n  {group} " in text, group


def last_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.fixture()
def broken_model(tiny_checkpoint, tmp_path):
    """A copy of the tiny checkpoint whose model.safetensors is cut in half."""
    import shutil

    path = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return path


def test_a_binary_jsonl_is_named(tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_bytes(bytes(range(256)) * 4)
    assert main(["train", "gsm8k_grpo_cpu", f"data.path={data}", f"model.path={tmp_path}"]) == 2
    assert last_line(capsys) == f"asyncrl: error: {data}: not UTF-8 text (byte 0x80 at offset 128): a binary file " \
                                "with a .jsonl name?"


def test_a_corrupt_parquet_is_named(tmp_path, capsys):
    data = tmp_path / "data.parquet"
    data.write_bytes(b"PAR1" + b"\0" * 64)
    assert main(["train", "gsm8k_grpo_cpu", f"data.path={data}", f"model.path={tmp_path}"]) == 2
    assert last_line(capsys).startswith(f"asyncrl: error: {data}: not a readable parquet file (")


def test_a_model_path_without_a_tokenizer_is_named(tiny_checkpoint, tmp_path, capsys):
    """transformers said "install sentencepiece or tiktoken" for this."""
    import shutil

    path = tmp_path / "model"
    shutil.copytree(tiny_checkpoint, path, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    assert main(["eval", "quickstart", f"model.path={path}", f"logging.output_dir={tmp_path / 'runs'}"]) == 2
    assert last_line(capsys) == f"asyncrl: error: model path {path} has no tokenizer files (tokenizer.json, " \
                                "tokenizer_config.json, tokenizer.model, vocab.json)"


def test_a_truncated_safetensors_is_named(broken_model, tmp_path, capsys):
    assert main(["eval", "quickstart", f"model.path={broken_model}", f"logging.output_dir={tmp_path / 'runs'}"]) == 2
    line = last_line(capsys)
    assert line.startswith(f"asyncrl: error: {broken_model / 'model.safetensors'} is not a readable safetensors "
                           "file (truncated or corrupt")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_an_unexpected_error_is_one_line_with_the_log(monkeypatch, tmp_path, capsys):
    import asyncrl.runtime.pipeline as pipeline

    def boom(cfg):
        raise ZeroDivisionError("division by zero somewhere deep")
    monkeypatch.setattr(pipeline, "run_training", boom)
    assert main(["train", "quickstart"]) == 1
    line = last_line(capsys)
    assert line.startswith("asyncrl: error: unexpected ZeroDivisionError: division by zero somewhere deep "
                           "(full traceback: ")
    log = line.split("(full traceback: ")[1].rstrip(")")
    assert "ZeroDivisionError" in open(log).read()


def test_console_script_prints_the_packages_info_records_once(capsys):
    """The engine's KV-pool line and the trainer's forward plan are INFO records: the console
    script shows them on stderr, once however often it is set up."""
    import logging

    from asyncrl.cli import show_info_records

    log = logging.getLogger("asyncrl")
    saved = (list(log.handlers), log.level)
    try:
        log.handlers.clear()
        show_info_records()
        show_info_records()
        assert len(log.handlers) == 1
        logging.getLogger("asyncrl.engine.model_runner").info("KV pool: 7 blocks")
        assert capsys.readouterr().err.strip() == "[asyncrl.engine.model_runner] KV pool: 7 blocks"
    finally:
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])
