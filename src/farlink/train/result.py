"""What a launched run returns: its run dir, the workers' exit codes and the summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunResult:
    run_dir: Path
    returncodes: list[int]
    summary: dict = field(default_factory=dict)
    interrupted: bool = False
    problem: str | None = None  # the run ended but its result is wrong (see never_averaged)
