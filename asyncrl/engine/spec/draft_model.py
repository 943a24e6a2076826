"""Draft-model proposer: a small model of the same tokenizer drafts k tokens per step.

The draft model has its own K/V pool with the target's block geometry (same block size and
block count, one cache per draft layer), so a sequence's block table addresses both: draft
K/V of position p lives in the same slot as the target's. Blocks are sized for both at
start-up (``ModelRunner(extra_block_bytes=...)``).

Draft K/V is filled lazily: ``Sequence.draft_cached`` counts the positions holding draft
K/V (reset when the sequence loses its blocks). A round first catches up (an eager prefill
of positions ``[draft_cached, L - 2)``: the prompt at the first speculative step, or tokens
decoded while speculation was off), then runs, in one CUDA graph per batch bucket on GPU:
a forward over the last two tokens (positions ``L-2, L-1``; the first is usually cached
already and is rewritten with the same values, so the graph has a fixed shape) and k - 1
one-token steps, each drafting from the previous step's logits. After verification the
draft K/V is valid for ``L + min(accepted, k - 1)`` positions.

Drafts: ``greedy`` (default) takes the draft's argmax (the verifier's one-hot rule, as vLLM
does for draft models; tokens identical to speculation off); ``probabilistic`` samples from
the draft's processed distribution q (same temperature / top-k / top-p as the request, noise
keyed by (seed, sample, position) on a salted stream) and hands q to the verifier. A round
whose rows are all greedy drafts argmax even then (``wants_q``): greedy rows never read q, and
computing it cost the round ~4 ms on an H200 at a 151,936-token vocabulary (q ``[B, k, V]``
fp32, then the verifier's eager probabilistic tail instead of the verify graph's; issue 23).
The inputs of a graph round go over in one copy (``StaticInputs``).
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

from asyncrl.engine.attention import AttentionMetadata, build_gathered_metadata
from asyncrl.engine.cuda_graphs import capture_graphs
from asyncrl.engine.sampler import gumbel_noise, processed_logprobs, row_keys
from asyncrl.engine.spec.config import SpeculativeConfig
from asyncrl.engine.spec.verifier import DRAFT_SALT, salted
from asyncrl.engine.staging import StaticInputs


# ASYNCRL_SPEC_GREEDY_Q=1: all-greedy rounds of a probabilistic drafter compute q anyway (the
# behaviour before issue 23's fix; for A/B runs: bench/spec_decode.py's "+q" rows set it per engine)
GREEDY_ROUNDS_SKIP_Q = os.environ.get("ASYNCRL_SPEC_GREEDY_Q", "0") != "1"


def wants_q(probabilistic: bool, seqs) -> bool:
    """Whether a round drafts from q (probabilistic drafts): only when configured and some row
    samples. Greedy rows take the draft's argmax either way (``draft_tokens``) and the verifier's
    one-hot rule for them ignores q, so an all-greedy round's drafts and verdicts are the same
    without q, which costs ``[B, k, V]`` fp32 and the verifier's eager probabilistic tail."""
    if not probabilistic:
        return False
    return not GREEDY_ROUNDS_SKIP_Q or any(s.params.temperature > 0 for s in seqs)


def capture_rounds(proposer, sizes: list[int], vocab: int) -> None:
    """Capture a model-based proposer's round graphs per bucket: the argmax round into
    ``proposer.graphs`` and, when its drafts are probabilistic, the round that samples from q into
    ``proposer.prob_graphs`` (its ``[max_bs, k, V]`` fp32 output in ``proposer.vars["probs"]``).
    The proposer has ``_graph_round(bs, prob)``, ``staged`` (``StaticInputs``), ``vars``, ``k``."""
    steps = [lambda bs: proposer._graph_round(bs, False)]
    if proposer.probabilistic:
        proposer.vars["probs"] = torch.zeros(max(sizes), proposer.k, vocab, dtype=torch.float32,
                                             device=proposer.device)
        steps.append(lambda bs: proposer._graph_round(bs, True))
    captured = capture_graphs(sizes, *steps, before_warmup=proposer.staged.put_padding)
    proposer.graphs.update(captured[0])
    if proposer.probabilistic:
        proposer.prob_graphs.update(captured[1])


def sampling_host(seqs, rows: int, k: int, probabilistic: bool) -> dict:
    """Host arrays for drafting ``rows`` rows (padding past ``len(seqs)``): temp, top_p ``[rows]``
    fp32, top_k ``[rows]`` int64 and noise keys ``[rows, k]`` of draft j at position ``L + j``
    (greedy defaults when drafts are argmax)."""
    B = len(seqs)
    temp = np.zeros(rows, dtype=np.float32)
    top_p = np.ones(rows, dtype=np.float32)
    top_k = np.full(rows, -1, dtype=np.int64)
    keys = np.zeros((rows, k), dtype=np.int64)
    if probabilistic and B:
        L = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
        temp[:B] = [s.params.temperature for s in seqs]
        top_p[:B] = [s.params.top_p for s in seqs]
        top_k[:B] = [s.params.top_k for s in seqs]
        keys[:B] = row_keys(np.array([s.seed for s in seqs], dtype=np.int64)[:, None],
                            np.array([s.sample_index for s in seqs], dtype=np.int64)[:, None],
                            L[:, None] + np.arange(k)[None, :])
    return dict(temp=temp, top_p=top_p, top_k=top_k, keys=keys)


def draft_tokens(logits: torch.Tensor, dev: dict, j: int, probabilistic: bool):
    """Draft j of every row from the drafter's ``logits [rows, V]``: (tokens ``[rows]``, q
    ``[rows, V]`` or None). Argmax drafts, or samples from the processed q (the request's
    temperature / top-k / top-p, noise keyed as the sampler's on a salted stream)."""
    if not probabilistic:
        return logits.argmax(-1), None
    logp = processed_logprobs(logits, dev["temp"], dev["top_k"], dev["top_p"], True)
    noise = gumbel_noise(salted(dev["keys"][:, j], DRAFT_SALT), logits.shape[-1])
    # greedy requests are verified by argmax match: their drafts are the draft's argmax
    tok = torch.where(dev["temp"] <= 0, logits.argmax(-1), torch.argmax(logp + noise, -1))
    return tok, logp.exp()


def _attention_layers(model) -> list:
    return [layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn")]


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, dtype: torch.dtype, device: torch.device, target_config):
        from asyncrl.engine.models import load_model

        self.k = config.num_speculative_tokens
        self.probabilistic = config.draft_sampling == "probabilistic"
        self.max_batch = config.disable_by_batch_size
        self.model = load_model(config.model, dtype=dtype, device=device)
        c = self.model.config
        if c.vocab_size != target_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({c.vocab_size}) differs from the target's "
                             f"({target_config.vocab_size}): a draft model must share the tokenizer")
        if hasattr(self.model, "linear_layers") and self.model.linear_layers():
            raise ValueError("a hybrid (Gated DeltaNet) draft model is not supported: its state cannot roll back")
        self.dtype, self.device = dtype, torch.device(device)
        self.runner = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}       # argmax drafts (all rows greedy, or greedy config)
        self.prob_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # drafts sampled from q (probabilistic config)
        self.staged: Optional[StaticInputs] = None
        self.catch_up_tokens = 0  # positions the last propose prefilled before its round (see _catch_up)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one KV block of the draft (all its layers, K and V)."""
        c = self.model.config
        return 2 * len(_attention_layers(self.model)) * block_size * c.num_key_value_heads * c.head_dim * \
            self.dtype.itemsize

    def attach(self, runner) -> None:
        """Allocate the draft K/V with the target's block geometry; capture the round graphs."""
        self.runner = runner
        c = self.model.config
        shape = (runner.num_blocks + 1, runner.block_size, c.num_key_value_heads, c.head_dim)
        for attn in _attention_layers(self.model):
            attn.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            attn.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.table_width = runner._bt_width() + -(-(self.k + 1) // runner.block_size)
        if runner.is_cuda and not runner.config.enforce_eager:
            self._capture([b for b in runner._graph_sizes() if b <= self.max_batch] or [1])

    def release(self) -> None:
        self.graphs.clear()
        self.prob_graphs.clear()
        for attn in _attention_layers(self.model):
            attn.k_cache = attn.v_cache = torch.empty(0)

    # ---- one round ----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, batch, budgets: list[int]):
        """(drafts ``[B, K]`` int64 on the device, counts ``[B]`` host = budgets, probs ``[B, K, V]``
        fp32 or None)."""
        seqs = batch.seqs
        self._catch_up(seqs)
        B = len(seqs)
        prob = wants_q(self.probabilistic, seqs)
        bs = min((b for b in self.graphs if b >= B), default=None)
        rows = B if bs is None else bs
        host = self._round_host(seqs, rows, prob)
        if bs is not None:
            drafts, probs = self._replay(host, bs, prob)
        else:
            drafts, probs = self._round(*self._round_inputs(host, seqs, rows), prob)
        counts = np.asarray(budgets, dtype=np.int64)
        return drafts[:B], counts, (probs[:B] if probs is not None else None)

    def verified(self, batch, out) -> None:
        """Draft K/V now holds the accepted drafts' positions (at most k - 1 of them were fed)."""
        for i, (seq, toks) in enumerate(zip(batch.seqs, out.tokens)):
            L = batch.starts[i] + 1  # tokens before the step
            seq.draft_cached = L + min(len(toks) - 1, self.k - 1)

    def _catch_up(self, seqs) -> None:
        """Eager prefill of every row's draft K/V up to position ``L - 3`` (inclusive)."""
        rows = [(s, s.draft_cached, len(s.token_ids) - 2 - s.draft_cached) for s in seqs
                if s.draft_cached < len(s.token_ids) - 2]
        # 0 in the steady state (``verified`` leaves the draft K/V one round behind, which the round
        # itself rewrites); > 0 for new sequences and after steps decoded without speculation
        self.catch_up_tokens = sum(n for _, _, n in rows)
        if not rows:
            return
        r = self.runner
        ids = torch.tensor([t for s, a, n in rows for t in s.token_ids[a:a + n]], device=self.device)
        pos = torch.tensor([p for s, a, n in rows for p in range(a, a + n)], device=self.device)
        meta = build_gathered_metadata([s.block_table for s, _, _ in rows], [a for _, a, _ in rows],
                                       [n for _, _, n in rows], r.block_size, r.scratch_block, self.device)
        self.model(ids, pos, meta)
        for s, a, n in rows:
            s.draft_cached = a + n

    def _round_host(self, seqs, rows: int, prob: bool) -> dict:
        """Host arrays of a round for ``rows`` rows (padding rows: position 0.., scratch slots);
        the sampling arrays hold greedy defaults unless ``prob``."""
        r, k, bsz = self.runner, self.k, self.runner.block_size
        B = len(seqs)
        L = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
        bt = np.full((rows, self.table_width), r.scratch_block, dtype=np.int32)
        for i, s in enumerate(seqs):
            bt[i, :len(s.block_table)] = s.block_table
        base = np.zeros(rows, dtype=np.int64)
        base[:B] = L - 2
        pos = base[:, None] + np.arange(k + 1)[None, :]  # round positions: L-2, L-1, then k - 1 drafts
        blk = bt[np.arange(rows)[:, None], np.minimum(pos // bsz, bt.shape[1] - 1)].astype(np.int64)
        slots = blk * bsz + pos % bsz
        ids = np.zeros((rows, 2), dtype=np.int64)
        if B:  # (an empty list would not broadcast to [0, 2]: the graph capture's padding-only round)
            ids[:B] = [s.token_ids[-2:] for s in seqs]
        return dict(ids=ids, pos=pos, slots=slots, bt=bt, **sampling_host(seqs, rows, k, prob))

    def _round_inputs(self, host: dict, seqs, rows: int):
        """Eager round: device inputs and per-forward metadata (paged on GPU, gathered on CPU)."""
        r, k = self.runner, self.k
        dev = {name: torch.from_numpy(a).to(self.device) for name, a in host.items()}
        pos = host["pos"]
        if r.is_cuda:
            ctx = torch.from_numpy(pos[:, 1] + 1).to(self.device, torch.int32)
            metas = [AttentionMetadata(slot_mapping=dev["slots"][:, :2].reshape(-1), block_tables=dev["bt"],
                                       context_lens=ctx, paged_decode=True, query_len=2)]
            metas += [AttentionMetadata(slot_mapping=dev["slots"][:, 1 + j].contiguous(), block_tables=dev["bt"],
                                        context_lens=ctx + j, paged_decode=True) for j in range(1, k)]
        else:
            tables = [s.block_table for s in seqs]
            metas = [build_gathered_metadata(tables, list(pos[:, 0]), [2] * rows, r.block_size, r.scratch_block,
                                             self.device)]
            metas += [build_gathered_metadata(tables, list(pos[:, 1 + j]), [1] * rows, r.block_size,
                                              r.scratch_block, self.device) for j in range(1, k)]
        return dev, metas

    def _round(self, dev: dict, metas: list[AttentionMetadata], prob: bool):
        """The k draft forwards (graph-capturable): drafts ``[rows, k]``, probs ``[rows, k, V]`` (``prob``)
        or None."""
        rows, k = dev["ids"].shape[0], self.k
        hidden = self.model(dev["ids"].reshape(-1), dev["pos"][:, :2].reshape(-1), metas[0])[1::2]
        drafts, probs = [], []
        for j in range(k):
            if j:
                hidden = self.model(drafts[-1], dev["pos"][:, 1 + j], metas[j])
            tok, q = draft_tokens(self.model.lm_head(hidden), dev, j, prob)
            drafts.append(tok)
            probs.append(q)
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if prob else None)

    # ---- CUDA graphs ------------------------------------------------------------------
    def _replay(self, host: dict, bs: int, prob: bool):
        self.staged.put(bs, host)  # every input: one asynchronous copy (was one blocking copy per array)
        (self.prob_graphs if prob else self.graphs)[bs].replay()
        return self.vars["drafts"][:bs], (self.vars["probs"][:bs] if prob else None)

    def _padding_host(self, bs: int) -> dict:
        """Bucket ``bs``'s inputs with every row padding (valid positions, the scratch block): the
        staged layout and the warm-up's inputs."""
        r = self.runner
        host = self._round_host([], bs, False)
        host["slots"][:] = r.scratch_block * r.block_size
        return host

    @torch.inference_mode()
    def _capture(self, sizes: list[int]) -> None:
        """Per bucket: the argmax round and, with probabilistic drafts, the round that samples from q."""
        k, max_bs = self.k, max(sizes)
        self.staged = StaticInputs.padded({bs: self._padding_host(bs) for bs in sizes}, self.device)
        self.views = {bs: self.staged.views(bs) for bs in sizes}
        self.vars = dict(drafts=torch.zeros(max_bs, k, dtype=torch.int64, device=self.device))
        capture_rounds(self, sizes, self.model.config.vocab_size)

    def _graph_round(self, bs: int, prob: bool) -> None:
        """The round of ``bs`` rows on the staged inputs (what a bucket's graph holds)."""
        view = self.views[bs]
        self._round_meta_graph(view, (view["pos"][:, 1] + 1).to(torch.int32), bs, prob)

    def _round_meta_graph(self, view: dict, ctx: torch.Tensor, bs: int, prob: bool) -> None:
        k = self.k
        metas = [AttentionMetadata(slot_mapping=view["slots"][:, :2].reshape(-1), block_tables=view["bt"],
                                   context_lens=ctx, paged_decode=True, query_len=2)]
        # contiguous as in the eager round: a column of [rows, k + 1] has stride k + 1, and the
        # cache-write kernel reads slot i at slot_mapping + i
        metas += [AttentionMetadata(slot_mapping=view["slots"][:, 1 + j].contiguous(), block_tables=view["bt"],
                                    context_lens=ctx + j, paged_decode=True) for j in range(1, k)]
        drafts, probs = self._round(view, metas, prob)
        self.vars["drafts"][:bs].copy_(drafts)
        if probs is not None:
            self.vars["probs"][:bs].copy_(probs)
