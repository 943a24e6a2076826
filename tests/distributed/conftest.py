"""The multi-rank runs, once per session: every case of cases.py on 2 forked gloo ranks (which
also write a sharded checkpoint) and on 4 (which resume from it), and on one process."""
import pytest
import torch

from tests.distributed import cases
from tests.distributed.ranks import run_ranks


@pytest.fixture(scope="session")
def single_process():
    return {name: cases.run_case(name, sharded=False) for name in cases.CASES}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sharded_ckpt") / "step"


@pytest.fixture(scope="session")
def world2(tmp_path_factory, checkpoint_dir):
    out = tmp_path_factory.mktemp("world2")
    run_ranks(2, out, cases.rank_main, str(out), str(checkpoint_dir), False)
    return torch.load(out / "world2.pt", weights_only=False)


@pytest.fixture(scope="session")
def world4(tmp_path_factory, checkpoint_dir, world2):
    out = tmp_path_factory.mktemp("world4")
    run_ranks(4, out, cases.rank_main, str(out), str(checkpoint_dir), True)
    return torch.load(out / "world4.pt", weights_only=False)
