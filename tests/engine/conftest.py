"""Tiny random-weight HF checkpoints (Qwen3, Qwen2, Llama) saved to a tmp dir, fp32."""
from __future__ import annotations

import os

import pytest
import torch

VOCAB = 97


def _make(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=3, bos_token_id=1, pad_token_id=0)
    if arch == "qwen3":
        return Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)
    if arch == "qwen2":
        return Qwen2Config(tie_word_embeddings=False, **common)
    return LlamaConfig(head_dim=16, tie_word_embeddings=False, **common)


def build_tiny(arch: str, path) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed({"qwen3": 0, "qwen2": 1, "llama": 2}[arch])
    model = AutoModelForCausalLM.from_config(_make(arch), dtype=torch.float32)
    with torch.no_grad():  # larger-than-default init so logits are far from uniform
        for p in model.parameters():
            if p.dim() > 1:  # embeddings large so next-token distributions are peaked
                p.normal_(0, 0.5 if p.shape[0] == VOCAB else 0.15)
            elif arch == "qwen2" and p.dim() == 1 and p.numel() != 64:
                p.normal_(0, 0.1)  # non-zero q/k/v biases
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    return {a: build_tiny(a, tmp_path_factory.mktemp(a)) for a in ("qwen3", "qwen2", "llama")}


@pytest.fixture(scope="session")
def hf_models(tiny_dirs):
    from transformers import AutoModelForCausalLM

    return {a: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for a, d in tiny_dirs.items()}


def make_llm(path, **kw):
    from asyncrl.engine import LLM

    kw.setdefault("block_size", 4)
    kw.setdefault("max_num_seqs", 16)
    return LLM(path, dtype=torch.float32, device="cpu", **kw)


def hf_greedy(hf, prompt, max_new_tokens, eos=3):
    """HF generate, batch 1 (no padding), greedy; stops at EOS like the engine."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_same_completions(off, on, atol):
    """Each completion of ``on`` is its twin in ``off``: log-probs within ``atol``, same versions
    and finish reason (speculation on vs off: the target's law, the target's log-probs)."""
    for a, b in zip(off, on):
        for ca, cb in zip(a.outputs, b.outputs):
            torch.testing.assert_close(torch.tensor(cb.logprobs), torch.tensor(ca.logprobs), atol=atol, rtol=0)
            assert cb.versions == ca.versions and cb.finish_reason == ca.finish_reason


def prompts_for(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


def hf_greedy_loop(hf, prompt, n):
    """Greedy by full recompute with HF forward, no EOS handling (for ignore_eos runs)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids], device=hf.device)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def skip_unless_triton_runs() -> bool:
    """Module-level guard of the Triton kernel tests: they run natively on a GPU, or on CPU through
    the Triton interpreter (``TRITON_INTERPRET=1``, set before the process starts); otherwise the
    module is skipped. Returns whether CUDA is available."""
    cuda = torch.cuda.is_available()
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA: run with TRITON_INTERPRET=1 to use the Triton interpreter", allow_module_level=True)
    pytest.importorskip("triton")
    return cuda


def scattered_tables(lens: list[int], page: int, nb: int, g: torch.Generator | None = None):
    """Block tables of sequences of ``lens`` tokens over a random permutation of blocks ``0..nb-1``
    (``g``, or torch's global generator): (the tables as lists, the ``[B, width]`` int32 tensor padded
    with block ``nb``, a spare)."""
    perm = torch.randperm(nb, generator=g).tolist()
    tables, o = [], 0
    for n in lens:
        tables.append(perm[o:o + -(-n // page)])
        o += len(tables[-1])
    width = max(map(len, tables))
    return tables, torch.tensor([t + [nb] * (width - len(t)) for t in tables], dtype=torch.int32)
