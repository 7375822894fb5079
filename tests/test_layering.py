"""The seams of the code, checked statically: what the scheduler asks of the model runner, and how
long a function may grow. (Import directions are import-linter's contracts in pyproject.toml.)"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("srt", "launcher", "scheduler", "mem_cache", "model_executor", "consensus")

# What crosses the line from the scheduler (docs/architecture.md, "One step across the line"): the
# step and the ids an earlier pipeline stage gets back, the memory it is handed at construction,
# the device its batches go to, the vocabulary its grammars cover, the PP link its stages pass
# messages on, what /server_info reports, the LoRA adapters the registry attaches or drops, and the
# weights an update from disk loads beside the serving ones (scheduler/weight_registry.py).
# Nothing reaches through the runner to its parts.
RUNNER_INTERFACE = {
    "step",
    "receive_ids",
    "memory",
    "device",
    "vocab_size",
    "stage_link",
    "info",
    "state",
    "set_lora_adapter",
    "stage_weights",
}


def python_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def runner_attributes(tree: ast.AST) -> set[str]:
    """X of every `runner.X` and `self.runner.X` (also `runner.X.Y`: X is what is reached)."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "runner") or (
            isinstance(owner, ast.Attribute) and owner.attr == "runner"
        ):
            found.add(node.attr)
    return found


def test_the_scheduler_asks_the_runner_only_through_its_interface() -> None:
    used: dict[str, set[str]] = {}
    for path in python_files("scheduler"):
        for attr in runner_attributes(ast.parse(path.read_text())):
            used.setdefault(attr, set()).add(path.name)
    outside = {attr: files for attr, files in used.items() if attr not in RUNNER_INTERFACE}
    assert not outside, f"scheduler/ reaches into the runner beyond its interface: {outside}"
    assert len(used) <= 10


def test_runner_attributes_are_found() -> None:  # the check above could not pass by finding nothing
    tree = ast.parse("self.runner.allocator.free_slots(x)\nrunner.kv_pool\nother.device\n")
    assert runner_attributes(tree) == {"allocator", "kv_pool"}


def test_no_function_is_over_100_lines() -> None:
    long = []
    for package in PACKAGES:
        for path in python_files(package):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > 100:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
