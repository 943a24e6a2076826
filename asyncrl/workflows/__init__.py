"""Multi-turn episodes: agent loops against an OpenAI-style client bound to the policy.

    async def rollout(client, example) -> Trajectory | float

``PolicyClient`` records every token as sampled (tool output masked out of the loss),
``WorkflowBackend`` runs ``rollout.n`` episodes per prompt on the engine or a server, and the
runtime trains them like single-turn groups (docs/workflows.md).
"""
from asyncrl.workflows.backend import WorkflowBackend
from asyncrl.workflows.client import ContextLengthExceeded, ConversationMismatch, PolicyClient
from asyncrl.workflows.tools import CALCULATOR, PYTHON, Tool
from asyncrl.workflows.trajectory import Trajectory

__all__ = ["CALCULATOR", "PYTHON", "ContextLengthExceeded", "ConversationMismatch", "PolicyClient", "Tool",
           "Trajectory", "WorkflowBackend"]
