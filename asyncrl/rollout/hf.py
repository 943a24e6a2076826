"""Rollout backend over HF ``generate``: the fallback for any model transformers runs.

On GPU, models that support it generate with a static KV cache (``cache_implementation="static"``:
preallocated per batch, no per-step cache growth or re-allocation); elsewhere the dynamic cache.

Per-token behaviour log-probs come from ``output_scores``, which HF returns *after*
the logits processors (temperature, top-k, top-p), i.e. from the distribution actually
sampled. With greedy decoding they are the plain log-softmax of the logits.
"""
from __future__ import annotations

from typing import Iterable

import torch

from asyncrl.types import Completion, RequestOutput, SamplingParams


class HFGenerateBackend:
    """Wraps a ``PreTrainedModel`` and its tokenizer.

    Invariant: ``version`` is the policy version of the weights ``model`` holds; when
    the trainer shares the model object (colocated sync mode) an update only bumps it.
    """

    def __init__(self, model, tokenizer, version: int = 0, static_cache: bool | None = None):
        """``static_cache``: None = on for a CUDA model whose class supports it (transformers'
        ``_can_compile_fullgraph``; hybrid/stateful models do not)."""
        self.model, self.tokenizer, self.version = model, tokenizer, version
        self.static_cache = static_cache

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = params[name]
                if target.data_ptr() != tensor.data_ptr():  # colocated: same storage, nothing to copy
                    target.copy_(tensor)
        self.version = version

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
        input_ids, attention_mask = self._left_pad(prompt_token_ids)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        out = self.model.generate(
            input_ids=input_ids.repeat_interleave(params.n, 0),
            attention_mask=attention_mask.repeat_interleave(params.n, 0),
            **self._generation_kwargs(params))
        responses = out.sequences[:, input_ids.shape[1]:]
        logprobs = self._sampled_logprobs(out.scores, responses) if params.logprobs else None
        return self._to_outputs(prompt_token_ids, responses, logprobs, params)

    def _generation_kwargs(self, params: SamplingParams) -> dict:
        eos = [] if params.ignore_eos else [self.tokenizer.eos_token_id, *params.stop_token_ids]
        kwargs = dict(max_new_tokens=params.max_tokens, min_new_tokens=params.max_tokens if params.ignore_eos else 0,
                      pad_token_id=self.tokenizer.pad_token_id, eos_token_id=eos or None,
                      output_scores=params.logprobs, return_dict_in_generate=True,
                      use_cache=True, stop_strings=params.stop or None)
        if params.stop:
            kwargs["tokenizer"] = self.tokenizer
        if self._use_static_cache():
            kwargs["cache_implementation"] = "static"
        if params.greedy:
            return {**kwargs, "do_sample": False}
        return {**kwargs, "do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k if params.top_k > 0 else 0}

    def _use_static_cache(self) -> bool:
        if self.static_cache is not None:
            return self.static_cache
        on_gpu = next(self.model.parameters()).is_cuda
        return on_gpu and bool(getattr(self.model, "_can_compile_fullgraph", False)) \
            and not getattr(self.model, "_is_stateful", False)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        device = next(self.model.parameters()).device
        return ids.to(device), mask.to(device)

    @staticmethod
    def _sampled_logprobs(scores: tuple[torch.Tensor, ...], tokens: torch.Tensor) -> torch.Tensor:
        """[N, T] log-prob of each sampled token under the processed (sampled) distribution."""
        steps = torch.stack(scores, dim=1).float()  # [N, T, V]
        logp = torch.log_softmax(steps, dim=-1)
        return logp.gather(-1, tokens[:, :steps.shape[1], None]).squeeze(-1)

    def _to_outputs(self, prompts, responses, logprobs, params) -> list[RequestOutput]:
        eos_ids = set() if params.ignore_eos else {self.tokenizer.eos_token_id, *params.stop_token_ids}
        outputs = []
        rows = responses.tolist()
        row_logprobs = logprobs.tolist() if logprobs is not None else None
        for i, prompt in enumerate(prompts):
            completions = []
            for j in range(i * params.n, (i + 1) * params.n):
                tokens, finish = _cut_at_stop(rows[j], eos_ids, params.max_tokens)
                if finish == "length" and params.stop:  # a stop string ended it; HF padded the rest
                    tokens, finish = _strip_padding(tokens, self.tokenizer.pad_token_id)
                lps = row_logprobs[j][:len(tokens)] if row_logprobs is not None else None
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                completions.append(Completion(tokens, text, lps, finish, [self.version] * len(tokens)))
            outputs.append(RequestOutput(list(prompt), None, completions))
        return outputs


def _cut_at_stop(tokens: list[int], stop_ids: set[int], max_tokens: int) -> tuple[list[int], str]:
    """Tokens up to and including the first stop token, and the finish reason."""
    for t, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[:t + 1], "stop"
    return tokens[:max_tokens], "length"


def _strip_padding(tokens: list[int], pad_id: int) -> tuple[list[int], str]:
    end = len(tokens)
    while end > 0 and tokens[end - 1] == pad_id:
        end -= 1
    return tokens[:end], "stop" if end < len(tokens) else "length"
