"""Tensor-parallel model shards on gloo (4 spawned ranks, one spawn for every case): for Qwen3
(tied head, q/k norm), Qwen2 (q/k/v bias) and Llama, TP=2 and TP=4 give the same logits as TP=1
to 1e-5 (fp32) through a packed prefill and decode steps over the paged KV cache, and the
engine's sampler draws the same greedy, seeded and top-k/top-p tokens from them. The tiny
models have 4 query heads, 2 KV heads (so TP=4 replicates each KV head on 2 ranks) and a
vocabulary of 97 (not a multiple of 2 or 4: the last shard is padded)."""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from asyncrl.engine.attention import build_gathered_metadata
from asyncrl.engine.models import load_model
from asyncrl.engine.parallel.comm import TPComm
from asyncrl.engine.parallel.layout import TensorParallel
from asyncrl.engine.sampler import row_keys, sample

WORLD = 4
BLOCK, BLOCKS = 4, 24


def _alloc_cache(model):
    for layer in model.model.layers:
        attn = layer.self_attn
        shape = (BLOCKS + 1, BLOCK, attn.num_kv_heads, attn.head_dim)
        attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)


def _step_logits(model, seqs, starts, tables):
    """Logits of every sequence's last new token ``[B, V]`` (rank 0; None elsewhere)."""
    ns = [len(s) - a for s, a in zip(seqs, starts)]
    meta = build_gathered_metadata(tables, starts, ns, BLOCK, BLOCKS, torch.device("cpu"))
    ids = torch.tensor([t for s, a in zip(seqs, starts) for t in s[a:]])
    pos = torch.tensor([p for s, a in zip(seqs, starts) for p in range(a, len(s))])
    ends = torch.tensor(np.cumsum(ns) - 1)
    return model.compute_logits(model(ids, pos, meta)[ends])


def _draws(logits, positions):
    """(greedy, seeded, seeded top-k 5 + top-p 0.8) tokens of each row."""
    B = logits.shape[0]
    keys = torch.from_numpy(row_keys(np.full(B, 11), np.arange(B), np.asarray(positions)))
    out = []
    for t, k, p in ((0.0, -1, 1.0), (1.0, -1, 1.0), (0.9, 5, 0.8)):
        out.append(sample(logits, torch.full((B,), t), torch.full((B,), k), torch.full((B,), p), keys,
                          use_filter=k > 0 or p < 1)[0])
    return torch.stack(out)


def _run(rank, dirs, store_path):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    prompts = [[5, 17, 33, 8, 91, 40, 2], [60, 7, 7, 12], [44, 19, 70, 71, 5, 6, 30, 31, 9, 15, 88]]
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    for arch, path in dirs.items():
        for size in (2, 4):
            group_rank = rank % size
            comm = TPComm(dist.PrefixStore(f"{arch}/{size}/{rank // size}", store), group_rank, size, "cpu")
            shard = load_model(path, torch.float32, "cpu", TensorParallel(size, group_rank, comm))
            ref = load_model(path, torch.float32, "cpu") if group_rank == 0 else None
            for m in filter(None, (shard, ref)):
                _alloc_cache(m)
            seqs, starts = [list(p) for p in prompts], [0, 0, 0]
            with torch.no_grad():
                for step in range(4):  # the packed prefill, then 3 decode steps through the KV cache
                    got = _step_logits(shard, seqs, starts, tables)
                    if ref is None:
                        assert got is None  # only rank 0 gathers the full vocabulary
                        nxt = torch.zeros(len(seqs), dtype=torch.int64)
                    else:
                        want = _step_logits(ref, seqs, starts, tables)
                        err = (got - want).abs().max().item()
                        assert got.shape == (3, 97) and err <= 1e-5, (arch, size, step, err)
                        positions = [len(s) for s in seqs]
                        assert torch.equal(_draws(got, positions), _draws(want, positions)), (arch, size, step)
                        nxt = want.argmax(-1)
                    comm.broadcast(nxt)  # every rank appends the same token
                    starts = [len(s) for s in seqs]
                    for s, t in zip(seqs, nxt.tolist()):
                        s.append(t)
            comm.close()


@pytest.mark.slow
def test_tp2_and_tp4_logits_and_tokens_equal_tp1(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    mp.start_processes(_run, args=(tiny_dirs, str(tmp_path / "store")), nprocs=WORLD, join=True,
                       start_method="forkserver")  # one torch import for the 4 ranks
