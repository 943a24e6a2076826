"""The whole-array numpy layout (varlen.py) equals the layout built token by token in Python."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.training.batch import pad_prompt_response
from asyncrl.training.varlen import varlen_rows


class _ReferenceWriter:
    """The layout built one token at a time in Python lists (the implementation before the
    whole-array numpy one, kept as its reference)."""

    def __init__(self):
        self.tok: list[int] = []
        self.pos: list[int] = []
        self.keys: list[int] = []
        self.len_q: list[int] = []
        self.len_k: list[int] = []
        self.state_index: list[int] = []
        self.token_index: list[int] = []
        self.targets: list[int] = []
        self.first_slot: list[int] = []  # per token: its slot in its own sequence
        self.extra: list[tuple[int, int, list[int]]] = []  # per group with inputs: (prompt start, length, row bases)

    def sequence(self, queries: range, keys: list) -> None:
        self.keys.extend(keys)
        self.len_q.append(len(queries))
        self.len_k.append(len(keys))

    def group(self, prompt: list[int], responses: list[tuple[int, list[int]]], length: int) -> None:
        """Prompt ``prompt`` once, then each (row, response) of its group."""
        start, n = len(self.tok), len(prompt)
        self.tok.extend(prompt)
        self.pos.extend(range(n))
        prompt_slots = range(start, start + n)
        self.first_slot.extend(range(len(self.keys), len(self.keys) + n))
        self.sequence(prompt_slots, list(prompt_slots))
        row_bases = []  # first key slot of each row with inputs: its copy of the prompt
        for row, response in responses:
            inputs = response[:-1]
            first = len(self.tok)
            self.tok.extend(inputs)
            self.pos.extend(range(n, n + len(inputs)))
            if inputs:
                own = range(first, first + len(inputs))
                row_bases.append(len(self.keys))
                self.first_slot.extend(range(len(self.keys) + n, len(self.keys) + n + len(inputs)))
                self.sequence(own, [*prompt_slots, *own])
            if response:  # response token 0: the prompt's last state; token t: input t - 1's
                self.state_index.append(start + n - 1)
            self.state_index.extend(range(first, first + len(inputs)))
            self.token_index.extend(range(row * length, row * length + len(response)))
            self.targets.extend(response)
        if row_bases:  # prompt token i's other slots: base + i for each row base
            self.extra.append((start, n, row_bases))

    def pad_to(self, multiple: int) -> None:
        """Tail tokens (id 0) as one more sequence of their own, so T is a multiple of ``multiple``."""
        extra = -len(self.tok) % multiple
        if extra:
            first = len(self.tok)
            self.tok.extend([0] * extra)
            self.pos.extend(range(extra))
            self.first_slot.extend(range(len(self.keys), len(self.keys) + extra))
            self.sequence(range(extra), list(range(first, first + extra)))

    def arrays(self) -> dict[str, list]:
        extra_tokens, extra_slots = self._extra_slots()
        return {"input_ids": self.tok, "position_ids": self.pos, "key_index": self.keys,
                "cu_q": np.concatenate([[0], np.cumsum(self.len_q)]).tolist(),
                "cu_k": np.concatenate([[0], np.cumsum(self.len_k)]).tolist(),
                "max_q": max(self.len_q), "max_k": max(self.len_k), "state_index": self.state_index,
                "token_index": self.token_index, "targets": self.targets, "first_slot": self.first_slot,
                "extra_tokens": extra_tokens.tolist(), "extra_slots": extra_slots.tolist()}

    def _extra_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens [P], their other slots [P, W] padded with -1) from the groups' row bases."""
        width = max((len(bases) for _, _, bases in self.extra), default=0)
        tokens, slots = [np.zeros(0, np.int64)], [np.zeros((0, width), np.int64)]
        for start, n, bases in self.extra:
            offsets = np.arange(n, dtype=np.int64)
            block = np.full((n, width), -1, dtype=np.int64)
            block[:, :len(bases)] = offsets[:, None] + np.asarray(bases, dtype=np.int64)[None, :]
            tokens.append(start + offsets)
            slots.append(block)
        return np.concatenate(tokens), np.concatenate(slots)


def _ours(groups, pad_multiple):
    prompts = [p for p, rs in groups for _ in rs]
    responses = [r for _, rs in groups for r in rs]
    ids, attention, _, P = pad_prompt_response(prompts, responses, 0)
    rows = varlen_rows(ids, attention, P, pad_multiple)
    s = rows.slots
    return {"input_ids": rows.input_ids.tolist(), "position_ids": rows.position_ids.tolist(),
            "key_index": rows.key_index.tolist(), "cu_q": rows.cu_q.tolist(), "cu_k": rows.cu_k.tolist(),
            "max_q": rows.max_q, "max_k": rows.max_k, "state_index": rows.state_index.tolist(),
            "token_index": rows.token_index.tolist(), "targets": rows.targets.tolist(),
            "first_slot": s.first_slot.tolist(), "extra_tokens": s.extra_tokens.tolist(),
            "extra_slots": s.extra_slots.tolist()}, ids.shape[1] - P


def _reference(groups, pad_multiple, length):
    writer, row = _ReferenceWriter(), 0
    for prompt, responses in groups:
        writer.group(prompt, [(row + i, r) for i, r in enumerate(responses)], length)
        row += len(responses)
    writer.pad_to(pad_multiple)
    return writer.arrays()


GROUPS = st.lists(st.tuples(st.lists(st.integers(1, 50), min_size=1, max_size=6),
                            st.lists(st.lists(st.integers(1, 50), max_size=7), min_size=1, max_size=5)),
                  min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(GROUPS, st.sampled_from([1, 8]))
def test_numpy_layout_equals_the_token_by_token_reference(groups, pad_multiple):
    """Groups of 1-5 rows, prompts of 1-6 tokens, responses of 0-7 tokens (empty rows, rows of one
    token: no inputs), the same prompt repeated in two groups (they merge: rows of identical prompts
    group by first appearance, so the reference gets the merged groups)."""
    merged: dict[tuple, list] = {}
    for prompt, responses in groups:
        merged.setdefault(tuple(prompt), []).extend(responses)
    groups = [(list(p), rs) for p, rs in merged.items()]
    ours, length = _ours(groups, pad_multiple)
    assert ours == _reference(groups, pad_multiple, length)


def test_the_peer_shape_equals_the_reference():
    """16 prompts x 8 rows x (up to 256 + 256) tokens with ragged lengths, as the GRPO update's."""
    g = np.random.default_rng(0)
    groups = [(g.integers(1, 1000, g.integers(100, 257)).tolist(),
               [g.integers(1, 1000, g.integers(0, 257)).tolist() for _ in range(8)]) for _ in range(16)]
    ours, length = _ours(groups, 1)
    assert ours == _reference(groups, 1, length)
