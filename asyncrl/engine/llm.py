"""LLM: the engine's public API, shaped like vLLM's ``LLM``, plus RL controls.

    llm = LLM("path/to/hf_checkpoint", dtype=torch.bfloat16)
    outs = llm.generate(prompts_or_token_ids, SamplingParams(n=16, temperature=1.0, max_tokens=256))
    llm.update_weights(trainer.named_parameters(), version=v + 1)

The engine step is: schedule -> launch -> postprocess; with overlapped scheduling
(``EngineConfig.async_scheduling``, on by default on GPU) the postprocess of step t runs
after step t+1 is launched, so the host prepares step t+1 while the device computes step t.
``generate`` loops steps until its requests finish. RL controls are thread-safe against a ``generate`` running in another
thread: ``pause()`` blocks new steps (in-flight sequences keep their KV), and
``update_weights`` swaps weights between steps, so tokens sampled after it carry the new
version (vLLM's ``pause_generation(mode="keep")``). The prefix cache is namespaced by
weight version, so K/V computed under old weights is never reused by new requests.

On CUDA the engine launches on the calling thread's current stream, or with
``EngineConfig.stream_priority`` on a stream of its own: next to a trainer on the same GPU
(async RL, one GPU) both then run at once instead of interleaving kernel by kernel on the
default stream, whose FIFO queued every decode kernel behind the update's queued GEMMs (and
every token read behind them). Weights cross streams in two places only, the build and
``update_weights``, each ordered with the caller's stream (``_ordered_with_caller``).
"""
from __future__ import annotations

import contextlib
import functools
import os
import random
import threading
import time
from typing import Iterable, Optional, Sequence as Seq, Union

import torch

from asyncrl.engine.block_manager import BlockManager
from asyncrl.engine.config import EngineConfig
from asyncrl.engine.fp8_linear import check_fp8_scaling, check_quantization
from asyncrl.engine.lora import attach_adapter, is_peft_module, load_update
from asyncrl.engine.model_runner import ModelRunner
from asyncrl.engine.models import load_model
from asyncrl.engine.models.loader import build_model, fill_weights, model_source
from asyncrl.engine.parallel import TensorParallel, TensorParallelError
from asyncrl.engine.scheduler import Scheduler
from asyncrl.engine.sequence import Sequence
from asyncrl.engine.state_pool import StateSlotManager
from asyncrl.engine.step_gate import StepGate
from asyncrl.hub import is_hub_id, model_snapshot
from asyncrl.types import Completion, RequestOutput, SamplingParams

PromptType = Union[str, list[int]]


@contextlib.contextmanager
def _current_device(device: torch.device):
    """Make ``device`` the calling thread's current CUDA device, then hand back the previous one.

    CUDA graph capture and replay, Triton launches and ``current_stream()`` follow the
    thread's current device, which is cuda:0 in any new thread: an engine on cuda:1 driven
    from a worker thread (the rollout process) launched Triton kernels against cuda:0. The
    switch is forced (``set_device``): ``torch.cuda.device(...)`` defers it while the thread
    has no context on the target, and Triton then still saw cuda:0 (measured on two H200s).
    The way back uses ``torch.cuda.device``'s own exit, which creates no context on cuda:0."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    previous = torch.cuda.current_device()
    if previous == index:
        yield
        return
    torch.cuda.set_device(index)
    try:
        yield
    finally:
        torch.cuda._exchange_device(previous)


def _on_engine_device(method):
    """Run ``method`` with the engine's device and stream current (:meth:`LLM._on_device`)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._on_device():
            return method(self, *args, **kwargs)
    return wrapper


def _own_stream(device: torch.device, priority: Optional[int]) -> Optional[torch.cuda.Stream]:
    """The engine's own CUDA stream (``EngineConfig.stream_priority``; lower = more urgent: -1
    runs the decode's small kernels ahead of a trainer's queued blocks), or None: the caller's.
    PyTorch creates it non-blocking, so it never waits on the legacy default stream implicitly."""
    if priority is None or device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device, priority=priority)


def _barrier(a: torch.cuda.Stream, b: torch.cuda.Stream) -> None:
    """Work queued on ``a`` or ``b`` after this call starts after everything queued on both before it."""
    a.wait_stream(b)
    b.wait_stream(a)


@contextlib.contextmanager
def _device_and_stream(device: torch.device, stream: torch.cuda.Stream):
    with _current_device(device), torch.cuda.stream(stream):
        yield


class LLM:
    def __init__(self, model, *, dtype: Optional[torch.dtype] = None, device: Optional[str] = None,
                 tokenizer=None, version: int = 0, lora: Optional[str] = None, **engine_kwargs):
        """``model``: an HF checkpoint dir (config.json + safetensors [+ tokenizer]), a Hugging
        Face Hub id (``Qwen/Qwen3-0.6B``: downloaded into the HF cache once, as vLLM does), or an
        in-memory HF ``*ForCausalLM`` module whose weights are copied (pass ``tokenizer``); a PEFT
        LoRA model serves its base with the adapter applied on the fly (engine/lora.py).
        ``lora``: a PEFT adapter directory to serve on top of ``model``.
        ``quantization="fp8"``: e4m3 linears, re-quantized at each ``update_weights`` (fp8_linear.py), scaled
        per ``fp8_scaling`` ("block": 128x128 weight blocks, the default; "channel": per output channel x per token);
        ``kv_cache_dtype="fp8"``: K/V cached in e4m3 (attention.py).
        ``engine_kwargs``: any ``EngineConfig`` field (block_size, num_kv_blocks, merge_lora, ...)."""
        if isinstance(model, str) and is_hub_id(model):
            model = str(model_snapshot(model))
        self.config = EngineConfig(**engine_kwargs)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._device = torch.device(device)
        self.stream = _own_stream(self._device, self.config.stream_priority)
        with self._ordered_with_caller(), self._on_device():  # the build copies the caller's tensors
            self._build(model, dtype, device, tokenizer, version, lora)

    def _build(self, model, dtype, device, tokenizer, version, lora) -> None:
        self.followers = None  # tensor parallelism: the other ranks (parallel/workers.py)
        self._check_speculative_tensor_parallel()
        self._check_quantization(model, lora)
        if self.config.tensor_parallel_size == 1:
            self.model = load_model(model, dtype=dtype, device=device, quantization=self.config.quantization,
                                    fp8_scaling=self.config.fp8_scaling)
        else:
            if lora is not None or is_peft_module(model):
                raise TensorParallelError("LoRA adapters are served at tensor_parallel_size=1 only "
                                          f"(got {self.config.tensor_parallel_size}); use replicas (rollout.engines)")
            self.model = self._build_tensor_parallel(model, dtype, torch.device(device))
        # before the runner captures CUDA graphs: they read the adapter slots' storages
        self.lora = attach_adapter(self.model, model, lora, self.config.merge_lora)
        self.merged_lora = self.config.merge_lora and (lora is not None or is_peft_module(model))
        mc = self.model.config
        self.max_model_len = self._max_model_len(mc)
        self.tokenizer = tokenizer if tokenizer is not None or not isinstance(model, str) else _maybe_tokenizer(model)
        self._batch_decoder = fast_batch_decoder(self.tokenizer) if self.tokenizer is not None else None
        self.eos_token_ids = list(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None and not self.eos_token_ids:
            self.eos_token_ids = [self.tokenizer.eos_token_id]
        spec, proposer = self._speculative_proposer(dtype, device)
        self.runner = ModelRunner(self.model, self.config, self.max_model_len, self.followers,
                                  extra_block_bytes=proposer.block_bytes(self.config.block_size)
                                  if hasattr(proposer, "block_bytes") else 0,
                                  record_features=getattr(proposer, "reads_target_features", False))
        if self.followers is not None:
            self.followers.wait_ready()
        if self.runner.state_pool is not None:  # hybrid: block-table rows are state slots, no prefix cache
            self.block_manager = StateSlotManager(self.runner.num_blocks, self.config.block_size,
                                                  self.runner._bt_width(), self.runner.num_state_slots)
        else:
            self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                              self.config.enable_prefix_caching,
                                              max_blocks_per_seq=self.runner._bt_width())
        self.scheduler = Scheduler(self.config, self.block_manager, self.max_model_len, self.eos_token_ids,
                                   self._hit_stop_string)
        if self.runner.routing is not None:
            self.scheduler.on_finish = self.runner.routing.gather
        self.version = version
        self.block_manager.set_namespace(version)
        self._rng = random.Random(self.config.seed)
        self._gate = StepGate()  # one step / control call at a time, control calls first
        self._unpaused = threading.Event()
        self._unpaused.set()
        self._next_request = 0
        self._requests: dict[str, Sequence] = {}  # request id -> its first sequence
        self.num_steps = 0
        # what the steps were (metrics; the server's /health): prefill steps, and the decode steps'
        # rows, so a driver can tell full decode batches from a trickle of small ones
        self.num_prefill_steps = 0
        self.num_decode_steps = 0
        self.num_decode_rows = 0
        # finishes observed outside ``step`` (a weight update / pause / abort reads the step in
        # flight): the next ``step`` returns them, so its caller sees every finish exactly once
        self._finished: list[Sequence] = []
        # finishes (and aborts) observed by any thread: a generate call rechecks its requests when it
        # moves, since another thread's step may have returned its finishes (a probe next to a rollout)
        self._finish_events = 0
        # (seconds waiting for the step in flight, seconds loading) of the last update_weights
        self.last_update_timing = (0.0, 0.0)
        # overlapped scheduling (default on GPU): step t+1 is scheduled and launched before
        # step t's tokens are read; ``_inflight`` = (batch, fetch handle, version) of the
        # launched step not yet read (at most one)
        self.async_scheduling = (self.runner.is_cuda if self.config.async_scheduling is None
                                 else self.config.async_scheduling)
        self._inflight = None
        self.spec = None
        if spec is not None:
            from asyncrl.engine.spec.decoding import SpeculativeDecoder

            self.spec = SpeculativeDecoder(spec, proposer, self.runner)

    def _check_speculative_tensor_parallel(self) -> None:
        """Speculative decoding runs at ``tensor_parallel_size == 1`` only: its verify step and
        drafters drive the model and the sampler on rank 0 alone, outside the TP step
        (``StepInputs``) that every rank replays. Refused before any rank is started."""
        from asyncrl.engine.spec.config import SpeculativeConfig

        if self.config.tensor_parallel_size > 1 and SpeculativeConfig.from_any(self.config.speculative_config):
            raise TensorParallelError(
                f"speculative_config with tensor_parallel_size={self.config.tensor_parallel_size}: speculative "
                "decoding runs at tensor_parallel_size=1 only (its verify step is not split over ranks yet); "
                "drop one of them (rollout.speculative.method=off, or rollout.tensor_parallel_size=1)")

    def _check_quantization(self, model, lora) -> None:
        """``quantization``: known, and not with a LoRA adapter (refused before anything is built)."""
        check_quantization(self.config.quantization)
        check_fp8_scaling(self.config.fp8_scaling)
        if self.config.quantization is not None and (lora is not None or is_peft_module(model)):
            raise ValueError(f"quantization={self.config.quantization!r} with a LoRA adapter: not supported (the "
                             "adapter's base GEMM and merge need full-precision weights); serve the adapter "
                             "without quantization, or merge it in the trainer and send plain weights")

    def _speculative_proposer(self, dtype, device):
        """(SpeculativeConfig, proposer) of ``speculative_config`` (spec/), or (None, None)."""
        from asyncrl.engine.spec.config import SpeculativeConfig

        spec = SpeculativeConfig.from_any(self.config.speculative_config)
        if spec is None:
            return None, None
        if hasattr(self.model, "linear_layers") and self.model.linear_layers():
            raise ValueError("speculative decoding is not supported for hybrid models (Gated DeltaNet layers): "
                             "a rejected draft would need its recurrent state rolled back")
        from asyncrl.engine.spec.decoding import make_proposer

        return spec, make_proposer(spec, next(self.model.parameters()).dtype, device, self.model.config)

    def _max_model_len(self, mc) -> int:
        return min(self.config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)

    def _build_tensor_parallel(self, model, dtype, device: torch.device):
        """Rank 0's shard; ranks 1..k-1 are spawned and build theirs (a checkpoint dir: every
        rank reads it; an in-memory module: rank 0 broadcasts its tensors)."""
        from asyncrl.engine.parallel.workers import TPFollowers

        config, tensors, source_dtype = model_source(model)
        dtype = dtype or source_dtype
        source = model if isinstance(model, str) else None
        self.followers = TPFollowers.launch(source, config, dtype, device, self.config, self._max_model_len(config))
        try:
            shard = build_model(config, dtype, device, TensorParallel(self.config.tensor_parallel_size, 0,
                                                                      self.followers.comm), self.config.quantization,
                                 self.config.fp8_scaling)
            return fill_weights(shard, tensors if source is not None else self.followers.broadcast_weights(tensors))
        except BaseException:
            self.followers.close()
            raise

    def _on_device(self, own_stream: bool = True):
        """The engine's GPU made current for the calling thread (see :func:`_current_device`), and
        the engine's own stream if it has one (``own_stream=False``: the caller's stream stays)."""
        if self._device.type != "cuda":
            return contextlib.nullcontext()
        if self.stream is None or not own_stream:
            return _current_device(self._device)
        return _device_and_stream(self._device, self.stream)

    @contextlib.contextmanager
    def _ordered_with_caller(self):
        """A barrier between the caller's stream and the engine's own, at the block's start and at
        its end (GPU-side waits, the host never blocks; a no-op without an own stream): what either
        stream queued before the block runs before the block's work, what either queues after it runs
        after. Weights cross the two streams only inside such blocks: the build copies the caller's
        tensors; ``update_weights`` overwrites what the engine's last steps read (a prefill chunk
        that samples nothing has no event ``_drain`` could wait for) with tensors the caller's
        queued work is still writing."""
        if self.stream is None:
            yield
            return
        with _current_device(self._device):
            caller = torch.cuda.current_stream()
        _barrier(caller, self.stream)
        try:
            yield
        finally:
            _barrier(caller, self.stream)

    # ---- requests --------------------------------------------------------------
    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None) -> str:
        """Queue one prompt with ``params.n`` samples; returns its request id."""
        token_ids = self._encode(prompt)
        if request_id is None:
            request_id = str(self._next_request)
            self._next_request += 1
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        parent = Sequence(token_ids, params, request_id, 0, seed)
        parent.prompt_text = prompt if isinstance(prompt, str) else None
        with self._gate.control():
            if self.config.enable_fork:
                parent.num_forks = params.n - 1
                self.scheduler.add(parent)
            else:  # no sharing by construction: n independent sequences
                self.scheduler.add(parent)
                for i in range(1, params.n):
                    child = parent.fork(i, seed)
                    parent.group.append(child)
                    child.group = parent.group
                    self.scheduler.add(child)
            self._requests[request_id] = parent
        return request_id

    @_on_engine_device
    def step(self) -> list[Sequence]:
        """Run one engine step; returns the sequences whose finish was observed since the
        previous ``step`` returned (this step's, and any read by a weight update, pause or
        abort in between), each once.

        Overlapped (``async_scheduling``): schedule and launch step t, THEN read step t-1's
        tokens (the device is busy with step t meanwhile) and postprocess them; step t's
        results are read by the next call (or ``_drain``). Otherwise launch and read at once."""
        self._unpaused.wait()
        with self._gate.step():
            if not self._unpaused.is_set():  # paused while this call waited: no step (the next call waits)
                return []
            if self.spec is not None and self.spec.should_run(self.scheduler):
                self._drain()  # drafting needs every token on the host
                self._note_finished(self.spec.step(self.scheduler, self.version))  # times itself (the gate)
                self.num_steps += 1
                return self._take_finished()
            started = self.spec.clock() if self.spec is not None and self.spec.gate is not None else None
            timed_whole = self._times_a_whole_step()
            batch = self.scheduler.schedule()
            launched = None
            if batch is not None:
                launched = (batch, self.runner.launch(batch), self.version)
                self._count_step(batch)
            self._drain()
            if launched is not None:
                self._inflight = launched
                if not self.async_scheduling:
                    self._drain()
                if started is not None and timed_whole:
                    self.spec.record_plain(batch, self.spec.clock() - started)
            return self._take_finished()

    def _times_a_whole_step(self) -> bool:
        """Whether the plain step about to run lasts one whole decode step of wall time (the
        speculation gate's measure): overlapped, it launches step t and waits for step t-1, so it
        does only when a decode step is in flight (after a speculative or prefill step it would
        read nothing, or a prefill); not overlapped, it launches and reads its own step."""
        if not self.async_scheduling:
            return True
        return self._inflight is not None and not self._inflight[0].is_prefill

    def _count_step(self, batch) -> None:
        self.num_steps += 1
        if batch.is_prefill:
            self.num_prefill_steps += 1
        else:
            self.num_decode_steps += 1
            self.num_decode_rows += len(batch.seqs)

    def _take_finished(self) -> list[Sequence]:
        """The finishes observed since the last ``step`` returned (lock held)."""
        finished, self._finished = self._finished, []
        return finished

    def _drain(self) -> None:
        """Read and postprocess the launched step not yet read, if any (lock held); its
        finished sequences wait in ``_finished`` for ``step`` to return them."""
        if self._inflight is None:
            return
        (batch, handle, version), self._inflight = self._inflight, None
        tokens, logprobs = self.runner.fetch(handle)
        self._note_finished(self.scheduler.postprocess(batch, tokens, logprobs, version))

    def _note_finished(self, seqs: list[Sequence]) -> None:
        """Finishes for ``step`` to return (lock held)."""
        if seqs:
            self._finished += seqs
            self._finish_events += 1

    def has_unfinished(self) -> bool:
        """Whether ``step`` has work: sequences to run, a step in flight, or finishes to return."""
        return not self.scheduler.is_finished() or self._inflight is not None or bool(self._finished)

    @_on_engine_device  # _collect reads device tensors (routed experts) the engine's stream wrote
    def generate(self, prompts: Union[PromptType, Seq[PromptType]],
                 sampling_params: Union[SamplingParams, Seq[SamplingParams], None] = None) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt (in order) with ``n`` completions each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            return []
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        pending, seen = set(ids), self._finish_events
        while pending and self.has_unfinished():
            self.step()
            # any thread's step may have observed this call's finishes (``step`` returns each once, to
            # its caller): recheck them all whenever something finished. Checking only the finishes this
            # thread's steps returned left a probe's generate next to a rollout's stepping until the
            # engine ran empty (a whole rollout call later: the async weight sync's cost on one GPU).
            if self._finish_events != seen:
                seen = self._finish_events
                pending = {r for r in pending if not self._request_done(r)}
        return [self._collect(r) for r in ids]

    # ---- per-request progress (a server driving ``step`` itself: asyncrl.serve) -------------
    def request_sequences(self, request_id: str) -> list[Sequence]:
        """The live samples of a queued request (read them from the thread that calls ``step``)."""
        return self._requests[request_id].group

    def fits(self, num_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens`` tokens fits ``max_model_len`` and the KV pool
        (``add_request`` refuses one that does not)."""
        bm = self.block_manager
        return num_tokens <= self.max_model_len and -(-num_tokens // bm.block_size) <= len(bm.blocks)

    def request_finished(self, request_id: str) -> bool:
        """True once every sample of the request finished (then :meth:`pop_output` it)."""
        return self._request_done(request_id)

    @_on_engine_device
    def pop_output(self, request_id: str) -> RequestOutput:
        """The finished request's output; the engine forgets the request."""
        return self._collect(request_id)

    def _request_done(self, request_id: str) -> bool:
        parent = self._requests[request_id]
        complete = len(parent.group) == parent.params.n or parent.finish_reason == "abort"
        return parent.num_forks == 0 and complete and all(s.is_finished for s in parent.group)

    def _collect(self, request_id: str) -> RequestOutput:
        parent = self._requests.pop(request_id)
        seqs = sorted(parent.group, key=lambda s: s.sample_index)
        texts = self._decode_batch([s.completion_token_ids for s in seqs if not s.text])[::-1]
        comps = [self._completion(s, s.text or texts.pop()) for s in seqs]
        while len(comps) < parent.params.n:  # aborted before its siblings were forked
            comps.append(Completion([], "", [] if parent.params.logprobs else None, "abort", []))
        return RequestOutput(prompt_token_ids=parent.token_ids[: parent.num_prompt_tokens],
                             prompt=parent.prompt_text, outputs=comps)

    def _completion(self, s: Sequence, text: str) -> Completion:
        ids = s.completion_token_ids
        routed = None if s.routed_experts is None else s.routed_experts.cpu()
        return Completion(token_ids=ids, text=text, logprobs=list(s.logprobs) if s.params.logprobs else None,
                          finish_reason=s.finish_reason or "abort", versions=list(s.versions), routed_experts=routed)

    # ---- RL controls -------------------------------------------------------------
    @property
    def adapter_dtype(self) -> Optional[torch.dtype]:
        """The dtype of the LoRA slots (the engine's weight dtype) when an adapter is served
        unmerged, else None: a push of A and B in this dtype moves no byte the engine drops."""
        return self.lora.dtype if self.lora is not None else None

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                       kv: str = "keep") -> None:
        """Load HF-named tensors in place (between steps) and set the policy version. PEFT
        adapter tensors (``...lora_A...``, ``...lora_B...``) go to the adapter's slots.

        ``kv``: what in-flight sequences do with the K/V computed under the old weights.
        "keep" continues on it (vLLM ``pause(mode="keep")``, PipelineRL); "recompute" drops it
        (``Scheduler.drop_kv``: preempted by recompute, generated tokens, log-probs and versions
        kept), so every later token attends to K/V of the new weights only (AReaL)."""
        if kv not in ("keep", "recompute"):
            raise ValueError(f"kv must be 'keep' or 'recompute', got {kv!r}")
        with self._gate.control() as waited:  # no new step starts: waits for the one in flight only
            started = time.perf_counter()
            with self._on_device():
                self._drain()  # tokens in flight came from the old weights: read them first (old version)
            # the copies run on the CALLER's stream, in order with the work that made the tensors (a
            # sharded push refills one bucket per tensor); the engine's next step waits for them
            with self._on_device(own_stream=False), self._ordered_with_caller():
                if self.followers is not None:  # every rank takes the full tensors and keeps its slice
                    named_tensors = self.followers.broadcast_weights(named_tensors)
                load_update(self.model, self.lora, named_tensors, self.merged_lora)  # LoRA: the adapter slots
            self.version = version
            self.block_manager.set_namespace(version)
            if kv == "recompute":
                self.scheduler.drop_kv()
            self.last_update_timing = (waited, time.perf_counter() - started)

    @_on_engine_device
    def pause(self) -> None:
        """Stop scheduling steps (returns once no step is running); KV stays resident."""
        self._unpaused.clear()
        with self._gate.control():
            self._drain()  # nothing in flight while paused: host state is complete

    def resume(self) -> None:
        self._unpaused.set()

    @_on_engine_device
    def abort(self, request_ids: Iterable[str]) -> None:
        """Finish these requests now with finish_reason "abort" (partial tokens kept)."""
        with self._gate.control():
            self._drain()
            self.scheduler.abort(set(request_ids))
            self._finish_events += 1  # a generate waiting on these requests rechecks them

    @_on_engine_device
    def close(self) -> None:
        """Release device memory (KV pool, CUDA graphs, weights)."""
        with self._gate.control():
            self._drain()
            self.runner.release()
            if self.spec is not None and hasattr(self.spec.proposer, "release"):
                self.spec.proposer.release()
            self.model.to("meta")
            if self.followers is not None:
                self.followers.close()

    @property
    def metrics(self) -> dict:
        bm, sc = self.block_manager, self.scheduler
        out = dict(prefill_tokens=sc.prefill_tokens, prefix_cache_hit_tokens=bm.cache_hit_tokens,
                   forked_prompt_tokens=bm.forked_tokens, preemptions=sc.num_preemptions,
                   steps=self.num_steps, prefill_steps=self.num_prefill_steps,
                   decode_steps=self.num_decode_steps, decode_rows=self.num_decode_rows,
                   free_blocks=bm.num_free_blocks, num_blocks=len(bm.blocks))
        if self.spec is not None:
            out.update(self.spec.metrics)
        return out

    # ---- text ----------------------------------------------------------------------
    def _encode(self, prompt: PromptType) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompt given but the checkpoint has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def _decode_batch(self, seqs: list[list[int]]) -> list[str]:
        """``_decode`` of each, in one call of the fast tokenizer's backend where that computes
        the same text (``fast_batch_decoder``), else one by one."""
        if self.tokenizer is None:
            return [""] * len(seqs)
        if self._batch_decoder is None or not seqs:
            return [self._decode(ids) for ids in seqs]
        return self._batch_decoder(seqs)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        """Stop strings: decode the completion; on a hit keep the text up to the stop."""
        if self.tokenizer is None:
            return False
        text = self._decode(seq.completion_token_ids)
        for stop in seq.params.stop:
            i = text.find(stop)
            if i >= 0:
                seq.text = text[:i]
                return True
        return False


BATCH_DECODE_MIN_TOKENS = 16384  # fast_batch_decoder: below it the backend decodes one by one


def fast_batch_decoder(tokenizer):
    """A function decoding many id lists at once, equal to ``tokenizer.decode(ids,
    skip_special_tokens=True)`` for each, or None where that cannot be promised.

    transformers' fast ``decode`` converts the ids to Python objects one by one and then calls the
    ``tokenizers`` backend; calling the backend directly skips that. Small requests go one by one
    through the backend's ``decode``: its ``decode_batch`` starts Rust worker threads, which cost
    more than they save below ~16k tokens (quickstart tokenizer, 2 cores: 8 x 16 tokens 8 us one
    by one vs 70 us batched, HF's decode 30 us; 128 x 256: 1.8 vs 2.5 ms, HF 4.3 ms); larger
    batches (many cores) go to ``decode_batch``. Used only where ``decode`` is transformers' own
    (not overridden by the tokenizer's class) and does no ``clean_up_tokenization_spaces`` pass,
    so the text is the backend's exactly."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    cls = type(tokenizer)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast) or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or cls.decode is not PreTrainedTokenizerFast.decode or cls._decode is not PreTrainedTokenizerFast._decode):
        return None
    backend = tokenizer.backend_tokenizer

    def decode(seqs: list[list[int]]) -> list[str]:
        if sum(len(ids) for ids in seqs) >= BATCH_DECODE_MIN_TOKENS:
            return backend.decode_batch(seqs, skip_special_tokens=True)
        return [backend.decode(ids, skip_special_tokens=True) for ids in seqs]
    return decode



def _maybe_tokenizer(path: str):
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
