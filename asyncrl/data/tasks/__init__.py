"""Synthetic verifiable tasks with exact checkers and held-out splits."""
from asyncrl.data.tasks.arithmetic import ArithmeticTask
from asyncrl.data.tasks.base import SyntheticTask
from asyncrl.data.tasks.calculator import CalculatorTask
from asyncrl.data.tasks.countdown import CountdownTask

__all__ = ["ArithmeticTask", "CalculatorTask", "CountdownTask", "SyntheticTask", "build_task"]


def build_task(cfg, seed: int) -> SyntheticTask:
    """The task named by ``cfg`` (a ``TaskConfig``)."""
    if cfg.name == "arithmetic":
        return ArithmeticTask(seed, cfg.num_eval, cfg.min_digits, cfg.max_digits, tuple(cfg.operations))
    if cfg.name == "calculator":
        return CalculatorTask(seed, cfg.num_eval, cfg.min_digits, cfg.max_digits, cfg.tool_share)
    if cfg.name == "countdown":
        return CountdownTask(seed, cfg.num_eval, cfg.num_numbers, cfg.max_number, cfg.max_target)
    raise ValueError(f"unknown task {cfg.name!r}")
