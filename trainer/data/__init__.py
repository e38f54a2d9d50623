"""Prompt sources: the built-in arithmetic task and JSON Lines files."""

from rlft.trainer.data.task import Problem, Task, build_task

__all__ = ["Problem", "Task", "build_task"]
