"""Host-side costs of one GRPO step at issue 8's batch, on CPU (issue 20: the sync step's bar).

    python bench/step_host_costs.py [--repeats 5]

The work between the engine's last step and the trainer's first kernel, at 16 prompts x 8
samples x (256 + 256) tokens with bench/peer_trl_h200.py's word-level tokenizer (151,936
words "t0".."t151935"), random token ids; each row times the code the runtime runs now against
the code it ran before (kept here as the reference), in the same process, median of
``--repeats``:

  detokenize   the 128 completion texts: tokenizer.decode one by one (before) vs the engine's
               batched backend decode (engine/llm.py ``fast_batch_decoder``), equal texts checked
  reward       the H200 bench's text reward over 128 responses: a generator of ord(c) (before)
               vs sum(map(ord, ...)) (same values, checked)
  batch        build_train_batch: rows padded as Python lists then converted (before) vs flat
               arrays scattered through masks (training/batch.py), equal tensors checked
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB, PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS = 151_936, 16, 8, 256, 256


def word_tokenizer(path: Path):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    pad, eos = AddedToken(f"t{VOCAB - 2}", single_word=True), AddedToken(f"t{VOCAB - 1}", single_word=True)
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="t0", pad_token=pad, eos_token=eos,
                            padding_side="left").save_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def median_ms(fn, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1e3


def rows_as_lists(prompts, responses, logprobs, versions, pad_id):
    """The padding before issue 20's change (training/batch.py at main 59f012b, verbatim): Python
    lists per row, one tensor per output."""
    prompt_len = max(len(p) for p in prompts)
    resp_len = max(1, max(len(r) for r in responses))
    ids, attn, resp = [], [], []
    for prompt, response in zip(prompts, responses):
        left, right = prompt_len - len(prompt), resp_len - len(response)
        ids.append([pad_id] * left + list(prompt) + list(response) + [pad_id] * right)
        attn.append([0] * left + [1] * (len(prompt) + len(response)) + [0] * right)
        resp.append([1.0] * len(response) + [0.0] * right)

    def pad_rows(rows, length, fill, dtype):
        return torch.tensor([list(row or [])[:length] + [fill] * (length - len(row or [])) for row in rows], dtype=dtype)

    return (torch.tensor(ids, dtype=torch.long), torch.tensor(attn, dtype=torch.long),
            torch.tensor(resp, dtype=torch.float32), pad_rows(logprobs, resp_len, 0.0, torch.float32),
            pad_rows(versions, resp_len, -1, torch.long))


def main():
    from asyncrl.engine.llm import fast_batch_decoder
    from asyncrl.training.batch import build_train_batch
    from asyncrl.types import Completion, RequestOutput

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        tok = word_tokenizer(Path(tmp))
    comps = [[rng.randrange(1, VOCAB - 2) for _ in range(NEW_TOKENS)] for _ in range(PROMPTS * SAMPLES)]
    prompts = [[rng.randrange(1, VOCAB - 2) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    batched = fast_batch_decoder(tok)
    texts = [tok.decode(c, skip_special_tokens=True) for c in comps]
    assert batched is not None and batched(comps) == texts
    rows = {"detokenize": (lambda: [tok.decode(c, skip_special_tokens=True) for c in comps],
                           lambda: batched(comps))}
    assert [sum(map(ord, t)) for t in texts] == [sum(ord(c) for c in t) for t in texts]
    rows["reward"] = (lambda: [(sum(ord(c) for c in t) % 97) / 96.0 for t in texts],
                      lambda: [(sum(map(ord, t)) % 97) / 96.0 for t in texts])
    outs = [RequestOutput(prompts[g], None, [Completion(comps[g * SAMPLES + i], texts[g * SAMPLES + i],
                                                        [-1.0] * NEW_TOKENS, "length", [0] * NEW_TOKENS)
                                             for i in range(SAMPLES)]) for g in range(PROMPTS)]
    flat_prompts = [prompts[i // SAMPLES] for i in range(PROMPTS * SAMPLES)]
    logprobs, versions = [c.logprobs for o in outs for c in o.completions], [c.versions for o in outs for c in o.completions]
    reference = lambda: rows_as_lists(flat_prompts, comps, logprobs, versions, 0)
    new, old = build_train_batch(outs, [0.5] * len(comps), 0), reference()
    assert all(torch.equal(a, b) for a, b in zip(old, (new.input_ids, new.attention_mask, new.response_mask,
                                                     new.rollout_logprobs, new.token_versions)))
    rows["batch"] = (reference, lambda: build_train_batch(outs, [0.5] * len(comps), 0))
    print(f"{PROMPTS} x {SAMPLES} completions, {PROMPT_TOKENS} + {NEW_TOKENS} tokens, vocab {VOCAB:,}, "
          f"torch threads {torch.get_num_threads()}, python {sys.version.split()[0]}")
    total_before = total_after = 0.0
    for name, (before, after) in rows.items():
        b, a = median_ms(before, args.repeats), median_ms(after, args.repeats)
        total_before, total_after = total_before + b, total_after + a
        print(f"{name:11s} before {b:6.1f} ms   now {a:6.1f} ms")
    print(f"{'total':11s} before {total_before:6.1f} ms   now {total_after:6.1f} ms")


if __name__ == "__main__":
    main()
