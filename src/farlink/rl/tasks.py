"""Verifiable tasks that need no download: problems made from a seed, answers checked by code.

Post-training by reinforcement needs prompts and a reward the trainer computes itself (a
worker's word is never taken), so every task here is a prompt generator plus a verifier.
Shipped: multi-digit addition, sorting, countdown; a user brings their own as a Python callable
(:class:`CallableTask`) or a JSONL of prompts and answers (:class:`JsonlTask`).

Held-out problems are the ones whose prompt hashes into the held-out slice (about 1 in 10):
training draws never return them, so held-out accuracy measures generalisation, not recall.
:func:`demonstrations` writes the synthetic pre-training corpus of a task family: worked
examples, a set fraction of them deliberately wrong, which gives a base model that knows the
format and is right only part of the time (the starting point RL improves on).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HELDOUT_SLICES = 10  # one prompt in this many is held out


class TaskError(ValueError):
    """A task that cannot be used: a verifier that raised or returned something not a reward,
    a JSONL file that is not one, a problem generator that keeps failing."""


@dataclass(frozen=True)
class Problem:
    prompt: str  # what the policy sees, e.g. "37+85="
    answer: str  # the reference answer (what a demonstration writes after the prompt)
    data: tuple = field(default=(), compare=False)  # what the verifier needs beyond the text


def is_heldout(prompt: str) -> bool:
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) % HELDOUT_SLICES == 0


class Task:
    """A family of problems: ``make(rng)`` draws one, ``score(problem, completion)`` in [0, 1]."""

    name = "task"

    def make(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def score(self, problem: Problem, completion: str) -> float:
        raise NotImplementedError

    def corrupt(self, problem: Problem, rng: random.Random) -> str:
        """A plausible wrong answer, for noisy demonstrations."""
        digits = list(problem.answer) or ["0"]
        i = rng.randrange(len(digits))
        if digits[i].isdigit():
            digits[i] = str((int(digits[i]) + rng.randint(1, 9)) % 10)
        return "".join(digits)

    def reward(self, problem: Problem, completion: str) -> float:
        """The verifier's reward, checked: a verifier that raises or returns anything but a
        number in [0, 1] is the task's error (named), never a silent zero."""
        try:
            value = self.score(problem, completion)
        except Exception as exc:  # noqa: BLE001 - the user's verifier may raise anything
            raise TaskError(f"the verifier of task {self.name!r} failed on prompt "
                            f"{problem.prompt!r} and completion {completion!r}: "
                            f"{type(exc).__name__}: {exc}") from exc
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value <= 1:
            raise TaskError(f"the verifier of task {self.name!r} returned {value!r} for prompt "
                            f"{problem.prompt!r}; a reward is a number in [0, 1]")
        return float(value)

    def draw(self, rng: random.Random, heldout: bool = False, tries: int = 1000) -> Problem:
        """A training problem (never a held-out one), or with ``heldout`` a held-out one."""
        for _ in range(tries):
            problem = self.make(rng)
            if is_heldout(problem.prompt) == heldout:
                return problem
        raise TaskError(f"task {self.name!r} drew no {'held-out' if heldout else 'training'} "
                        f"problem in {tries} tries (too few distinct prompts?)")

    def heldout_set(self, n: int, seed: int = 12345) -> list[Problem]:
        rng = random.Random(seed)
        return [self.draw(rng, heldout=True) for _ in range(n)]


def _completion_text(completion: str) -> str:
    return completion.strip().split("\n", 1)[0].strip()


class Addition(Task):
    """``a+b=`` with ``digits``-digit operands; the answer is the sum."""

    def __init__(self, digits: int = 2) -> None:
        if digits < 1:
            raise ValueError(f"addition needs at least 1 digit, got {digits}")
        self.digits = digits
        self.name = f"addition:{digits}"

    def make(self, rng: random.Random) -> Problem:
        hi = 10**self.digits - 1
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        return Problem(f"{a}+{b}=", str(a + b))

    def score(self, problem: Problem, completion: str) -> float:
        return float(_completion_text(completion) == problem.answer)


class Sorting(Task):
    """``sort 5 2 9:`` -> `` 2 5 9``: ``length`` one-digit numbers in ascending order."""

    def __init__(self, length: int = 4) -> None:
        if length < 2:
            raise ValueError(f"sorting needs at least 2 numbers, got {length}")
        self.length = length
        self.name = f"sorting:{length}"

    def make(self, rng: random.Random) -> Problem:
        values = [rng.randint(0, 9) for _ in range(self.length)]
        return Problem("sort " + " ".join(map(str, values)) + ":",
                       " ".join(map(str, sorted(values))))

    def score(self, problem: Problem, completion: str) -> float:
        return float(_completion_text(completion) == problem.answer)

    def corrupt(self, problem: Problem, rng: random.Random) -> str:
        values = problem.answer.split()
        i, j = rng.sample(range(len(values)), 2)
        values[i], values[j] = values[j], values[i]
        if values == problem.answer.split():
            values[i] = str((int(values[i]) + 1) % 10)
        return " ".join(values)


_EXPRESSION = re.compile(r"^[0-9+\-*() ]+$")


def evaluate(expression: str) -> int | None:
    """The integer value of an expression of digits, + - * and parentheses, or None."""
    if not _EXPRESSION.match(expression) or len(expression) > 64:
        return None
    try:
        value = eval(compile(expression, "<countdown>", "eval"), {"__builtins__": {}}, {})  # noqa: S307 - only digits and + - * ( ) pass the pattern
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError):
        return None
    return value if isinstance(value, int) else None


class Countdown(Task):
    """``3 5 7 -> 22:`` -> ``3*5+7``: combine the numbers (each at most once) with + - * to
    make the target; every problem is made from a solution, so every one is solvable."""

    def __init__(self, count: int = 3) -> None:
        if count < 2:
            raise ValueError(f"countdown needs at least 2 numbers, got {count}")
        self.count = count
        self.name = f"countdown:{count}"

    def make(self, rng: random.Random) -> Problem:
        numbers = [rng.randint(1, 9) for _ in range(self.count)]
        solution = str(numbers[0])
        for n in numbers[1:]:
            solution += rng.choice("+-*") + str(n)
        target = evaluate(solution)
        shown = sorted(numbers)
        return Problem(" ".join(map(str, shown)) + f" -> {target}:", solution,
                       (tuple(shown), target))

    def score(self, problem: Problem, completion: str) -> float:
        numbers, target = problem.data
        text = _completion_text(completion)
        used = [int(d) for d in re.findall(r"\d+", text)]
        pool = list(numbers)
        for n in used:
            if n not in pool:
                return 0.0
            pool.remove(n)
        return float(bool(used) and evaluate(text) == target)

    def corrupt(self, problem: Problem, rng: random.Random) -> str:
        numbers, _ = problem.data
        shuffled = list(numbers)
        rng.shuffle(shuffled)
        return "".join(str(n) + rng.choice("+-*") for n in shuffled)[:-1]


class CallableTask(Task):
    """A user's task from two callables: ``make(rng) -> (prompt, answer)`` and
    ``verify(prompt, answer, completion) -> reward in [0, 1]``."""

    def __init__(self, name: str, make: Callable[[random.Random], tuple[str, str]],
                 verify: Callable[[str, str, str], float]) -> None:
        self.name, self._make, self._verify = name, make, verify

    def make(self, rng: random.Random) -> Problem:
        prompt, answer = self._make(rng)
        return Problem(str(prompt), str(answer))

    def score(self, problem: Problem, completion: str) -> float:
        return self._verify(problem.prompt, problem.answer, completion)


class JsonlTask(Task):
    """Prompts and answers from a JSONL file (``{"prompt": ..., "answer": ...}`` a line);
    the reward is an exact match of the completion's first line with the answer."""

    def __init__(self, path: Path) -> None:
        self.name = f"jsonl:{Path(path).name}"
        self.problems: list[Problem] = []
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise TaskError(f"cannot read task file {path}: {exc.strerror or exc}") from exc
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                self.problems.append(Problem(str(row["prompt"]), str(row["answer"]).strip()))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise TaskError(f"{path}:{number}: not a JSON object with 'prompt' and "
                                f"'answer' ({exc})") from exc
        if not self.problems:
            raise TaskError(f"task file {path} holds no problems")

    def make(self, rng: random.Random) -> Problem:
        return rng.choice(self.problems)

    def score(self, problem: Problem, completion: str) -> float:
        return float(_completion_text(completion) == problem.answer)


SHIPPED: dict[str, Callable[[int | None], Task]] = {
    "addition": lambda n: Addition(n or 2),
    "sorting": lambda n: Sorting(n or 4),
    "countdown": lambda n: Countdown(n or 3),
}


def make_task(spec: str) -> Task:
    """``addition[:DIGITS]``, ``sorting[:LENGTH]``, ``countdown[:COUNT]`` or ``FILE.jsonl``."""
    if spec.endswith(".jsonl"):
        return JsonlTask(Path(spec))
    name, _, arg = spec.partition(":")
    if name not in SHIPPED:
        raise TaskError(f"unknown task {spec!r}; choose {', '.join(SHIPPED)} or a .jsonl file")
    try:
        size = int(arg) if arg else None
    except ValueError:
        raise TaskError(f"task size must be an integer, got {arg!r}") from None
    return SHIPPED[name](size)


def demonstrations(task: Task, count: int, correct_fraction: float, seed: int = 0) -> list[str]:
    """``count`` worked examples (prompt then answer) of training problems, of which about
    ``correct_fraction`` are right and the rest plausibly wrong: a base model trained on them
    knows the format and is right only some of the time."""
    if not 0 <= correct_fraction <= 1:
        raise ValueError(f"correct_fraction must be in [0, 1], got {correct_fraction}")
    rng = random.Random(seed)
    documents = []
    for _ in range(count):
        problem = task.draw(rng)
        right = rng.random() < correct_fraction
        documents.append(problem.prompt + (problem.answer if right else task.corrupt(problem, rng)))
    return documents
