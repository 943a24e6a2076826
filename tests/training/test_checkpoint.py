"""Checkpoints: transformers loads them as is; a crash mid-write keeps the previous one."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.training import checkpoint as ckpt


def test_checkpoint_loads_in_transformers_and_keeps_optimizer(tmp_path, tiny_policy):
    model, tok = tiny_policy
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 5, 6]])).logits.sum().backward()
    opt.step()
    path = ckpt.save_checkpoint(tmp_path, 7, model, tok, opt, state={"policy_version": 7})
    loaded = AutoModelForCausalLM.from_pretrained(str(path))
    assert AutoTokenizer.from_pretrained(str(path))("1+1=")["input_ids"] == tok("1+1=")["input_ids"]
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    assert "optimizer" in torch.load(path / "optimizer.pt")
    assert json.loads((path / "trainer_state.json").read_text())["step"] == 7
    assert ckpt.latest_checkpoint(tmp_path) == path


def test_crash_mid_write_leaves_previous_checkpoint(tmp_path, tiny_policy, monkeypatch):
    model, tok = tiny_policy
    first = ckpt.save_checkpoint(tmp_path, 1, model, tok)
    before = sorted(p.name for p in first.iterdir())

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tok, "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, 2, model, tok)
    assert ckpt.latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in first.iterdir()) == before
    assert not (tmp_path / "checkpoints" / "step_000002").exists()
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # no debris


def test_only_the_newest_checkpoints_are_kept(tmp_path, tiny_policy):
    model, tok = tiny_policy
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, model, tok, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000002", "step_000003"]
