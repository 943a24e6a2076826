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
    with pytest.raises(ckpt.CheckpointError, match="disk full.*step_000001 is intact"):
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


def test_saving_the_same_step_twice_keeps_the_published_one(tmp_path, tiny_policy, monkeypatch):
    """The end-of-run save of a step already saved periodically is skipped: nothing published
    is deleted (it used to be rmtree'd before the new copy moved in: a kill there lost it)."""
    model, tok = tiny_policy
    first = ckpt.save_checkpoint(tmp_path, 4, model, tok)
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda *a, **k: pytest.fail("deleted a checkpoint"))
    assert ckpt.save_checkpoint(tmp_path, 4, model, tok) == first and ckpt.is_complete(first)


def test_replacing_a_step_of_another_run_keeps_a_complete_one_at_every_moment(tmp_path, tiny_policy, monkeypatch):
    """A resumed run re-saving step N of the run it resumed: the old step_N is set aside, not
    deleted, until the new one is in. A kill between the two renames (simulated) leaves the
    set-aside copy, which latest_checkpoint returns and the next save puts back."""
    model, tok = tiny_policy
    ckpt.save_checkpoint(tmp_path, 2, model, tok)
    monkeypatch.setattr(ckpt, "SESSION", "another-run")
    real_replace, calls = ckpt.os.replace, []

    def killed_after_setting_aside(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # 1: step_2 -> .old-step_2-*, 2: tmp -> step_2
            raise KeyboardInterrupt  # stands for SIGKILL: nothing after this line runs
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", killed_after_setting_aside)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, 2, model, tok)
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    survivor = ckpt.latest_checkpoint(tmp_path)
    assert survivor is not None and survivor.name.startswith(".old-step_000002") and ckpt.is_complete(survivor)
    ckpt.clean_leftovers(tmp_path / "checkpoints")  # what the next save does first
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000002"


def test_latest_falls_back_to_the_newest_complete_step_and_leftovers_are_cleaned(tmp_path, tiny_policy):
    model, tok = tiny_policy
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, model, tok, keep=3)
    root = tmp_path / "checkpoints"
    weights = root / "step_000002" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated: the manifest's size no longer matches
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_000001"
    (root / "latest").write_text("step_000009")  # names a directory that does not exist
    assert ckpt.latest_checkpoint(tmp_path) == root / "step_000001"
    (root / ".tmp-step_000003-x").mkdir()  # an interrupted save
    ckpt.save_checkpoint(tmp_path, 3, model, tok, keep=3)
    assert not list(root.glob(".tmp-*")) and ckpt.latest_checkpoint(tmp_path) == root / "step_000003"


def test_checkpoints_are_readable_by_teammates(tmp_path, tiny_policy):
    """Directories and files get the permissions the umask gives (mkdtemp/mkstemp make 0700/0600)."""
    model, tok = tiny_policy
    path = ckpt.save_checkpoint(tmp_path, 1, model, tok)
    ckpt.write_atomic_text(tmp_path / "summary.json", "{}")
    umask = ckpt._UMASK
    assert path.stat().st_mode & 0o777 == 0o777 & ~umask
    assert (tmp_path / "summary.json").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_full_disk_is_named(tmp_path, tiny_policy, monkeypatch):
    """torch.save on a full disk raises "[enforce fail at inline_container.cc:672] ...";
    the error says there is no space left, and the previous checkpoint stays."""
    model, tok = tiny_policy
    opt = torch.optim.AdamW(model.parameters())
    ckpt.save_checkpoint(tmp_path, 1, model, tok, opt)

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(ckpt.torch, "save", full)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: type("U", (), {"free": 1024})())
    with pytest.raises(ckpt.CheckpointError, match="no space left on device.*step_000001 is intact"):
        ckpt.save_checkpoint(tmp_path, 2, model, tok, opt)


def test_load_restores_model_optimizer_and_scheduler_exactly(tmp_path, tiny_policy, tiny_checkpoint):
    from asyncrl.training.model import load_policy

    model, tok = tiny_policy
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    for _ in range(2):
        model(input_ids=torch.tensor([[1, 5, 6]])).logits.sum().backward()
        opt.step()
        sched.step()
    path = ckpt.save_checkpoint(tmp_path, 2, model, tok, opt, sched)
    fresh, _ = load_policy(tiny_checkpoint)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1 / (s + 1))
    ckpt.HFPolicyState(fresh, tok, fresh_opt, fresh_sched).load(path)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert fresh_sched.last_epoch == 2 and fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    exp_avg = [s["exp_avg"] for s in opt.state.values()]
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(exp_avg, fresh_opt.state.values()))


def test_non_finite_weights_are_never_saved(tmp_path, tiny_policy):
    model, tok = tiny_policy
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(ckpt.CheckpointError, match="NaN/Inf"):
        ckpt.save_checkpoint(tmp_path, 1, model, tok)
    assert ckpt.latest_checkpoint(tmp_path) is None


WRITER = """
import sys, torch
from asyncrl.training import checkpoint as ckpt
from asyncrl.training.model import load_policy
model, tok = load_policy(sys.argv[2])
opt = torch.optim.AdamW(model.parameters())
step = int(ckpt.read_state(ckpt.latest_checkpoint(sys.argv[1]))["step"]) if ckpt.latest_checkpoint(sys.argv[1]) else 0
while True:
    step += 1
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # each step's weights differ
    ckpt.save_checkpoint(sys.argv[1], step, model, tok, opt, keep=2)
    print(step, flush=True)
"""


def test_sigkill_during_checkpoint_writes_never_loses_the_latest(tmp_path, tiny_checkpoint):
    """A process saving checkpoints back to back is SIGKILLed at random moments (bench/
    fault_injection.py does 20 kills of real training runs): after every kill `latest` names a
    complete checkpoint that loads, and the next writer cleans the interrupted save."""
    import os
    import random
    import signal
    import subprocess
    import sys

    from asyncrl.training.model import load_policy

    rng, run = random.Random(os.getpid()), tmp_path / "run"
    for _ in range(2):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(run), str(tiny_checkpoint)],
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        for _ in range(rng.randint(2, 4)):
            assert writer.stdout.readline()  # a few saves complete
        writer.send_signal(signal.SIGKILL)  # the next save is under way
        writer.wait()
        latest = ckpt.latest_checkpoint(run)
        assert latest is not None and ckpt.is_complete(latest)
        model, _ = load_policy(latest)  # what `asyncrl eval RUN` loads
        assert bool(torch.isfinite(next(model.parameters())).all())
