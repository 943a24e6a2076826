"""Sequence: one sample (prompt + its growing completion) as the scheduler sees it."""
from __future__ import annotations

from enum import Enum, auto
from itertools import count
from typing import Optional

from asyncrl.types import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Token ids, KV bookkeeping and sampling state of one sample.

    Invariants:
      * ``num_cached_tokens <= len(self)``: the first ``num_cached_tokens`` tokens
        have K/V in the blocks of ``block_table`` (in order, ``block_size`` per block);
      * ``len(logprobs) == len(versions) == num_completion_tokens``;
      * ``num_tokens = len(token_ids) + num_pending``: ``num_pending`` tokens (0 or 1 when
        the scheduler runs) were sampled by a launched step whose results the host has not
        read yet (overlapped scheduling); the pending token is row ``pending_row`` of the
        last launched step's sampled-token tensor, so the next step reads it on the device;
      * ``num_cached_tokens`` counts K/V computed *or being computed* by launched steps
        (one CUDA stream: a later step sees it), so it may include the pending token.
    ``sample_index`` (0..n-1) and ``seed`` key the sampling noise, so the tokens drawn
    depend only on (seed, sample_index, position, logits), never on the batch.
    ``num_forks`` > 0 on a parent whose prompt will be shared with that many siblings
    once its prefill completes (``Scheduler`` forks them; ``BlockManager.fork``).
    """

    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, request_id: str,
                 sample_index: int, seed: int, num_prompt_tokens: Optional[int] = None):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.sample_index = sample_index
        self.seed = seed
        self.params = params
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_scheduled_tokens = 0  # tokens this step computes (set by the scheduler)
        self.num_pending = 0
        self.pending_row = -1
        self.num_hashed_blocks = 0  # prefix-cache registration is incremental (BlockManager)
        self.last_hash: Optional[int] = None
        self.block_table: list[int] = []
        self.table_row = -1  # its row of BlockManager.tables while it holds blocks
        self.status = SequenceStatus.WAITING
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: Optional[str] = None
        self.text: str = ""
        self.num_forks = 0
        self.prompt_text: Optional[str] = None
        self.group: list[Sequence] = [self]  # all samples of this request, shared list
        self.routed_experts = None  # MoE routing [len - 1, L_moe, K] (device), set at finish (routing.py)
        self.spec_drafted = 0  # speculative decoding: draft tokens proposed / accepted (spec/decoding.py)
        self.spec_accepted = 0
        self.draft_cached = 0  # positions whose draft-model K/V is written (reset with the blocks)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens including the pending one (its position is known, its id not yet)."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def num_blocks_needed(self, block_size: int, num_tokens: Optional[int] = None) -> int:
        n = len(self) if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size: (i + 1) * block_size]

    def append_token(self, token_id: int, logprob: float, version: int) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.versions.append(version)

    def fork(self, sample_index: int, seed: int) -> "Sequence":
        """A sibling sharing this sequence's prompt (its completion starts empty)."""
        child = Sequence(self.token_ids[: self.num_prompt_tokens], self.params, self.request_id,
                         sample_index, seed)
        return child
