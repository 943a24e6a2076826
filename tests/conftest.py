"""Shared fixtures: a tiny tokenizer + Qwen3 model saved in HF format (no hub access)."""

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.data.char_tokenizer import build_char_tokenizer, save_and_reload
from asyncrl.training.model import build_tiny_model, load_policy
from quickstart_job import QuickstartJob

# One intra-op thread. The test models are tiny (a second thread has nothing to split), and on
# CI's 2 cores a second OpenMP thread spin-waits against the test's own child processes (ranks,
# rollout processes, replicas): tests/distributed's single-process cases took 72 s with 2 threads
# and 1.9 s with 1 on a busy 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Each test starts on one thread: ``run_training`` sets ``trainer.torch_threads`` (default 2)
    for the whole process, which would otherwise carry into the tests after it."""
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # The quickstart's tests last: its job runs beside the others (quickstart_job.py) and is
    # waited for only when every other test is done.
    items[:] = sorted(items, key=lambda item: "quickstart_run" in getattr(item, "fixturenames", ()))
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random tiny Qwen3 + char tokenizer saved like a real local checkpoint."""
    path = tmp_path_factory.mktemp("tiny_ckpt")
    cfg = load_config(None, ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2",
                             "model.tiny.head_dim=8", "model.tiny.intermediate_size=64"])
    tokenizer = save_and_reload(build_char_tokenizer(), path)
    build_tiny_model(cfg.model.tiny, tokenizer, seed=0).save_pretrained(str(path))
    return path


@pytest.fixture()
def tiny_policy(tiny_checkpoint):
    return load_policy(tiny_checkpoint)


# A chat template in Jinja, as an instruct model's tokenizer carries one.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory):
    """A random tiny Qwen3 whose character tokenizer covers printable ASCII and has a chat
    template: the shape of a real instruct checkpoint, for dataset runs and evals."""
    import string

    path = tmp_path_factory.mktemp("tiny_chat_ckpt")
    cfg = load_config(None, ["model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2",
                             "model.tiny.head_dim=8", "model.tiny.intermediate_size=64",
                             "model.tiny.max_position_embeddings=2048"])
    tokenizer = build_char_tokenizer(string.printable)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer = save_and_reload(tokenizer, path)
    build_tiny_model(cfg.model.tiny, tokenizer, seed=0).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session", autouse=True)
def _quickstart_job(request, tmp_path_factory):
    """Starts the session's quickstart job before the first test if any selected test needs it
    (it then trains beside the other tests); ends it at the session's end if still running."""
    if not any("quickstart_run" in getattr(item, "fixturenames", ()) for item in request.session.items):
        yield None
        return
    job = QuickstartJob(tmp_path_factory.mktemp("quickstart"))
    yield job
    job.stop()


@pytest.fixture(scope="session")
def quickstart_run(_quickstart_job):
    """(run_dir, summary) of the default quickstart, run once per test session as a new user runs
    it: ``python -m asyncrl train`` with no argument but where to write (an empty warm-start
    cache) and a longer wall budget than the recipe's 270 s, so that the run still reaches the
    recipe's 1,500 steps on a machine it shares with the rest of the suite (quickstart_job.py)."""
    return _quickstart_job.result()
