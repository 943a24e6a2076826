"""PolicyClient: an OpenAI-style client bound to the current policy, recording one episode.

A workflow is ``async def rollout(client, example) -> Trajectory | float``; ``client`` answers
``await client.chat.completions.create(messages=..., tools=...)`` and
``await client.completions.create(prompt=...)`` with the ``openai`` package's own response
types (tool calls parsed in the model's format), so an agent loop written for the OpenAI API
runs unchanged. Underneath, the client keeps the episode as token ids (:class:`Trajectory`):

* the first call renders the conversation with the model's chat template;
* every later call must extend the conversation it has seen (the previous messages plus the
  assistant reply it returned); only the new messages are rendered
  (``chat_render.continuation_ids``) and appended as inserted tokens (no loss), and the
  sampled reply's ids are appended exactly as sampled (loss on them). Nothing is re-tokenized.

All turns of one client share its ``session_id`` (the routing key that keeps an episode on
one engine replica and its prefix cache). Sampling follows the run's ``rollout.*`` settings:
the trainer recomputes log-probs at ``rollout.temperature``, so another temperature is refused.
"""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Optional

from asyncrl.data.chat_render import continuation_ids, normalize_messages, render_ids
from asyncrl.serve import responses as R
from asyncrl.types import SamplingParams
from asyncrl.workflows.generators import TurnGenerator, turn_params
from asyncrl.workflows.trajectory import Trajectory


class ContextLengthExceeded(Exception):
    """The episode has no room left for another turn (``workflow.max_total_tokens`` or the
    model's context); the runner ends it with reward 0 (info ``truncated``)."""


class ConversationMismatch(ValueError):
    """A call's messages do not extend the conversation the client has recorded."""


class PolicyClient:
    def __init__(self, generator: TurnGenerator, tokenizer, params: SamplingParams, session_id: str,
                 tool_parser=None, max_total_tokens: int = 4096, template_kwargs: Optional[dict] = None,
                 seed: Optional[int] = None, eos_token_ids: Optional[list[int]] = None):
        self.generator, self.tokenizer, self.params = generator, tokenizer, params
        self.session_id, self.tool_parser = session_id, tool_parser
        self.max_total_tokens, self.template_kwargs, self.seed = max_total_tokens, template_kwargs, seed
        self.eos_token_ids = set(eos_token_ids or [tokenizer.eos_token_id])
        self.trajectory_so_far: Optional[Trajectory] = None
        self._messages: list[dict] = []   # chat: the conversation so far, the last reply included
        self._tools: Optional[list] = None
        self._text = ""                   # completions: prompt + completions so far
        self._ended_with_eos = True
        self.turns = self.tool_calls = 0
        self.tools: dict = {}             # name -> Tool (workflow.tools), for call_tools
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self._chat_create))
        self.completions = SimpleNamespace(create=self._completion_create)

    # ---- the episode ------------------------------------------------------------------
    def trajectory(self, reward: Optional[float] = None, **info: Any) -> Trajectory:
        """The episode recorded so far, with its reward and any info the workflow adds."""
        if self.trajectory_so_far is None:
            raise ValueError("the workflow made no model call: nothing to train on")
        traj = self.trajectory_so_far
        traj.reward = reward if reward is not None else traj.reward
        traj.info.update({"turns": self.turns, "tool_calls": self.tool_calls, "session_id": self.session_id, **info})
        return traj

    async def _sample(self, max_tokens: Optional[int], temperature: Optional[float], n: int):
        if n != 1:
            raise ValueError("a workflow samples one reply per call (n=1); the runtime runs rollout.n episodes")
        if temperature is not None and abs(temperature - self.params.temperature) > 1e-9:
            raise ValueError(f"temperature={temperature}: workflows sample at rollout.temperature="
                             f"{self.params.temperature} (the trainer recomputes log-probs at it)")
        traj = self.trajectory_so_far
        room = self.max_total_tokens - len(traj.context)
        budget = min(max_tokens or self.params.max_tokens, self.params.max_tokens, room)
        if budget <= 0:
            raise ContextLengthExceeded(f"episode at {len(traj.context)} tokens, limit {self.max_total_tokens}")
        seed = None if self.seed is None else self.seed * 1009 + self.turns
        completion = await self.generator.generate(traj.context, turn_params(self.params, budget, seed),
                                                   self.session_id)
        traj.add_sampled(completion.token_ids, completion.logprobs or [0.0] * len(completion.token_ids),
                         completion.versions)
        traj.finish_reason = completion.finish_reason
        self._ended_with_eos = bool(completion.token_ids) and completion.token_ids[-1] in self.eos_token_ids
        self.turns += 1
        return completion

    async def call_tools(self, message) -> list[dict]:
        """Run every tool call of an assistant message with the episode's tools; returns the
        ``role: tool`` messages to append (an unknown tool is answered with an error text)."""
        msg = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
        replies = []
        for call in msg.get("tool_calls") or []:
            fn = call["function"]
            tool = self.tools.get(fn["name"])
            content = await tool(fn.get("arguments") or "{}") if tool else f"error: unknown tool {fn['name']!r}"
            replies.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": content})
        return replies

    # ---- chat ---------------------------------------------------------------------------
    async def _chat_create(self, *, messages, model: str = "policy", tools=None, tool_choice=None,
                           max_tokens: Optional[int] = None, max_completion_tokens: Optional[int] = None,
                           temperature: Optional[float] = None, n: int = 1, logprobs: bool = False, **_ignored):
        active = None if tool_choice == "none" else tools
        messages = normalize_messages(messages)
        self._extend_chat(messages, active)
        completion = await self._sample(max_completion_tokens or max_tokens, temperature, n)
        choice = R.chat_choice(0, completion, self.tokenizer, self.tool_parser, bool(active), logprobs, True)
        self.tool_calls += len(choice["message"].get("tool_calls") or [])
        self._messages = messages + normalize_messages([choice["message"]])
        body = R.response_body("chat.completion", R.new_id("chatcmpl"), model, [choice],
                               len(self.trajectory_so_far.context) - len(completion.token_ids),
                               len(completion.token_ids))
        from openai.types.chat import ChatCompletion
        return ChatCompletion.model_validate(body)

    def _extend_chat(self, messages: list[dict], tools) -> None:
        """Record the prompt of this call: the whole rendering on the first call, else the
        continuation after the last reply."""
        if self.trajectory_so_far is None:
            self._tools = tools
            self.trajectory_so_far = Trajectory(render_ids(self.tokenizer, messages, tools,
                                                           template_kwargs=self.template_kwargs))
            return
        if self._text:
            raise ConversationMismatch("this episode used completions.create; do not mix it with chat")
        if json.dumps(tools, sort_keys=True) != json.dumps(self._tools, sort_keys=True):
            raise ConversationMismatch("tools changed within an episode (they are part of the prompt)")
        known = len(self._messages)
        if len(messages) <= known or not _same_conversation(messages[:known], self._messages):
            raise ConversationMismatch(
                "messages must extend the previous call's messages plus the reply it returned "
                "(asyncrl records the sampled tokens; it cannot rewrite an episode's history)")
        self.trajectory_so_far.add_inserted(continuation_ids(
            self.tokenizer, messages[known:], tools, self._ended_with_eos, self.eos_token_ids, self.template_kwargs))

    # ---- completions (base models) --------------------------------------------------------
    async def _completion_create(self, *, prompt: str, model: str = "policy", max_tokens: Optional[int] = None,
                                 temperature: Optional[float] = None, n: int = 1, logprobs=None, **_ignored):
        if not isinstance(prompt, str):
            raise ValueError("workflow completions take a text prompt")
        if self.trajectory_so_far is None:
            self.trajectory_so_far = Trajectory(list(self.tokenizer(prompt)["input_ids"]))
        else:
            if self._messages:
                raise ConversationMismatch("this episode used chat.completions.create; do not mix it with completions")
            if not prompt.startswith(self._text):
                raise ConversationMismatch("prompt must extend the previous prompt plus its completion")
            new = prompt[len(self._text):]
            self.trajectory_so_far.add_inserted(list(self.tokenizer.encode(new, add_special_tokens=False)))
        completion = await self._sample(max_tokens, temperature, n)
        self._text = prompt + completion.text
        choice = R.completion_choice(0, completion, self.tokenizer, logprobs is not None, True)
        body = R.response_body("text_completion", R.new_id("cmpl"), model, [choice],
                               len(self.trajectory_so_far.context) - len(completion.token_ids),
                               len(completion.token_ids))
        from openai.types import Completion as OpenAICompletion
        return OpenAICompletion.model_validate(body)


def _same_conversation(given: list[dict], recorded: list[dict]) -> bool:
    """Roles match, and every non-assistant message is unchanged (assistant replies may come
    back as the returned object or a dict with the same content)."""
    for a, b in zip(given, recorded):
        if a.get("role") != b.get("role"):
            return False
        if a["role"] != "assistant" and a.get("content") != b.get("content"):
            return False
    return True
