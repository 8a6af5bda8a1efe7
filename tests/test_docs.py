"""The docs cannot drift from the code: the site builds strictly, and every shell and Python block
in the README and docs/ is run, or parsed by farlink's own CLI, or says why it is neither.

Each fenced ``bash``/``sh``/``python`` block is preceded by ``<!-- docs-test: MODE [why] -->``:

- ``fast``: run here, in the default suite (in a scratch directory, ``examples/`` beside it);
- ``slow``: run here under ``-m slow`` (a real multi-process run of a minute or more);
- ``check WHY``: not run (WHY: a run of minutes to hours, or one that needs a live run), but
  every ``farlink ...`` command in it is parsed by the real CLI and its options validated as a
  run's config, so a renamed flag or a refused pair fails here;
- ``skip WHY``: neither (a sketch with the user's names, root-only tools, a signature listing).

The README's first block is the two set-up commands CI runs (.ci/run): checked to be exactly those.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SETUP = ("python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/farlink train",
         ".venv/bin/python -m pytest -n auto")
MARK = re.compile(r"<!-- docs-test: (fast|slow|check|skip)(?: (.+?))? -->$")
FENCE = re.compile(r"^```(bash|sh|python)\s*$")
# commands whose options are a run's config (RunConfig fields as flags)
CONFIG_COMMANDS = {("train",), ("join",), ("worker",), ("swarm", "start")}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    mode: str | None
    why: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md"] + sorted(p for p in DOCS.rglob("*.md")
                                         if "_hooks" not in p.parts)


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if lines[i].startswith("```") and not fence:  # another language: skip to its end
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            i += 1
            continue
        if fence:
            start, code = i, []
            i += 1
            while not lines[i].startswith("```"):
                code.append(lines[i])
                i += 1
            mark = MARK.match(lines[start - 1]) if start else None
            found.append(Block(path, start + 1, fence.group(1), "\n".join(code) + "\n",
                               mark.group(1) if mark else None,
                               (mark.group(2) or "") if mark else ""))
        i += 1
    return found


BLOCKS = [b for p in pages() for b in blocks_of(p)]
SETUP_BLOCK = BLOCKS[0]
MARKED = BLOCKS[1:]


# --- the README ------------------------------------------------------------------------------


def test_readme_begins_with_the_two_setup_commands_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    assert readme[:6] == ["# farlink", "", "```bash", *SETUP, "```"]
    assert SETUP_BLOCK.path.name == "README.md" and SETUP_BLOCK.line == 3
    ci = (ROOT / ".ci" / "run").read_text().replace("pip install -q -e", "pip install -e")
    assert all(command in ci for command in SETUP)  # CI installs quietly, otherwise the same


def test_readme_is_a_landing_page_with_the_measured_table() -> None:
    sys.path.insert(0, str(DOCS / "_hooks"))
    try:
        import generate
    finally:
        sys.path.remove(str(DOCS / "_hooks"))
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert generate.frontier_table() in readme  # the numbers of docs/results/frontier.json
    for way in ("`farlink train`", "farlink.Optimizer", "`farlink swarm join`"):
        assert way in readme


def test_every_block_says_how_it_is_tested() -> None:
    unmarked = [b.id for b in MARKED if b.mode is None]
    assert not unmarked, f"blocks without <!-- docs-test: ... -->: {unmarked}"
    no_reason = [b.id for b in MARKED if b.mode in ("check", "skip") and len(b.why) < 10]
    assert not no_reason, f"check/skip blocks must say why: {no_reason}"


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    """``mkdocs build --strict``: every page in the nav, every link and anchor resolves, the API
    reference renders from the docstrings and the CLI reference from the commands."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "farlink swarm join" in cli and "--log-to" in cli
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert 'id="farlink.optimizer.Optimizer.step"' in api


# --- commands: parsed by the real CLI ------------------------------------------------------


def farlink_commands(code: str) -> list[list[str]]:
    """Every ``farlink ...`` command of a shell block, as argv after ``farlink`` (line
    continuations joined, comments and leading VAR=value assignments dropped)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        for part in re.split(r"\s(?:&&|\|\||;)\s", line):
            words = shlex.split(part, comments=True)
            while words and re.match(r"^[A-Z_]+=", words[0]):
                words.pop(0)
            if words and words[0] in ("farlink", ".venv/bin/farlink"):
                commands.append(words[1:])
    return commands


def parse(argv: list[str]) -> None:
    """Parse ``farlink ARGV`` with farlink's own CLI without running it; a run's options are
    validated as its config (a bad value or a refused pair raises)."""
    import typer

    from farlink.cli import app
    from farlink.config import RunConfig

    command = typer.main.get_command(app)
    ctx = command.make_context("farlink", list(argv))
    path: list[str] = []
    while hasattr(command, "list_commands"):
        rest = list(getattr(ctx, "_protected_args", []) or getattr(ctx, "protected_args", [])
                    ) + list(ctx.args)
        name, command, rest = command.resolve_command(ctx, rest)
        path.append(name)
        ctx = command.make_context(name, rest, parent=ctx)
    if tuple(path) in CONFIG_COMMANDS:
        values = {k: v for k, v in ctx.params.items()
                  if v is not None and k in RunConfig.model_fields}
        if not ctx.params.get("config") and not values.get("resume"):
            RunConfig.model_validate(values, context={"stored": True})


CHECKED = [b for b in MARKED if b.mode != "skip" and b.language in ("bash", "sh")]


@pytest.mark.parametrize("block", CHECKED, ids=lambda b: b.id)
def test_every_farlink_command_in_the_docs_parses(block: Block) -> None:
    commands = farlink_commands(block.code)
    assert commands or block.mode in ("fast", "slow"), f"{block.id}: no farlink command to check"
    for argv in commands:
        try:
            parse(argv)
        except Exception as exc:  # noqa: BLE001 - the failing command is the message
            pytest.fail(f"{block.id}: farlink {shlex.join(argv)}\n{type(exc).__name__}: {exc}")


def test_a_renamed_flag_fails_the_check() -> None:
    parse(["train", "--algorithm", "sparseloco", "--inner-steps", "15"])
    with pytest.raises(Exception, match="inner-stepz"):
        parse(["train", "--inner-stepz", "15"])
    with pytest.raises(ValueError, match="fragments"):  # an option of another algorithm
        parse(["train", "--algorithm", "diloco", "--fragments", "2"])


# --- blocks that run ---------------------------------------------------------------------------


def run_block(block: Block, tmp_path: Path, timeout: float) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "MPLBACKEND": "Agg", "COLUMNS": "200"}
    if block.language == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", block.code]  # `python`: the venv's, first on PATH
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, (f"{block.id} exited {done.returncode}\n"
                                  f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def run_python_block_here(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast Python block as a script of its own (``__main__``, fresh globals: it must import
    what it uses) in this process, from ``tmp_path`` as its working directory: a fresh
    interpreter's start and imports were most of such a block's cost."""
    import runpy

    (tmp_path / "examples").symlink_to(ROOT / "examples")
    script = tmp_path / "block.py"
    script.write_text(block.code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(sys, "argv", [str(script)])
    runpy.run_path(str(script), run_name="__main__")


@pytest.mark.parametrize("block", [b for b in MARKED if b.mode == "fast"], ids=lambda b: b.id)
def test_fast_blocks_run(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.language == "python":
        run_python_block_here(block, tmp_path, monkeypatch)
    else:  # a shell block runs the commands a user types: `farlink` from the venv
        run_block(block, tmp_path, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in MARKED if b.mode == "slow"], ids=lambda b: b.id)
def test_slow_blocks_run(block: Block, tmp_path: Path) -> None:
    run_block(block, tmp_path, timeout=1800)


def test_nothing_the_old_readme_said_is_lost() -> None:
    """The 370-line README of before the docs site (commit 774710e): every line of its text is
    in the README or a page of docs/ now (its section headings became page titles)."""
    old = subprocess.run(["git", "show", "774710e:README.md"], cwd=ROOT, capture_output=True,
                         text=True)
    if old.returncode != 0:
        pytest.skip(f"the old README is not in this checkout's history: {old.stderr.strip()}")
    text = "\n".join(p.read_text() for p in pages())
    words = " ".join(text.split())  # the same text, however its lines are wrapped now
    lost = [line for line in old.stdout.splitlines()
            if line.strip() and not line.startswith("## ") and line.strip() not in text
            and " ".join(renamed(line).split()) not in words
            and REVISED.get(line.strip(), "\0") not in words]
    assert not lost, "\n".join(lost)


#: names changed since the old README, as its lines say them now: a replica trained by K ranks
#: is a replica group (the field's "site" is a location; issue 29)
RENAMED = [(r"\bfsdp_sites\b", "fsdp_replica_groups"),
           (r"\bsite_agent\b", "replica_group_agent"),
           (r"\bhivemind_site\b", "hivemind_replica_group"),
           (r"\btest_site_", "test_replica_group_"),
           (r"\[site\]", "[replica_group]"), (r"(?<=-)site\b|\bsite(?=-)", "replica-group"),
           (r"\bSites\b", "Replica groups"), (r"\bsites\b", "replica groups"),
           (r"\bsite\b", "replica group")]


def renamed(line: str) -> str:
    for old, new in RENAMED:
        line = re.sub(old, new, line)
    return line


#: lines of the old README said differently since, each with the words that say it now
REVISED = {
    'for an elastic run); the first passes no peers and the others '
    '`lighthouse=",".join(first.addresses)`.':
        "the others `peers=first.addresses` (hivemind's",
    'default test suite (`pytest -m slow` runs the multi-minute scenarios as well).':
        "`pytest -m slow` runs them, and CI runs them after the default suite.",
    "python examples/fsdp_sites.py   # 2 sites x 2 ranks: FSDP2 inside each site, DiLoCo across":
        "python examples/fsdp_replica_groups.py # 2 replica groups x 2 ranks: FSDP2 inside each, "
        "DiLoCo across",
    "runs through torchft with the site as one replica group of K ranks, or through hivemind with "
    "the": "through torchft with the replica group as one torchft replica group, or through "
           "hivemind with the",
    "loopback): every rank holds two torchft Managers, its island's (the site is a replica group "
    "of K": "every rank holds two torchft Managers, its island's (the same K ranks as one torchft "
            "replica group on the island's Lighthouse)",
    "ranks on the island's Lighthouse) and, on a leader site, the global one (the same K ranks on "
    "the": "on the island's Lighthouse) and, on a leader replica group, the global one (the same K "
           "ranks on the",
    "ranks' peer ids and addresses in its matchmaking metadata; it hands the group it found to "
    "the": "ranks' peer ids and addresses in its matchmaking metadata; it hands the mixing group "
           "it found to the",
    "# node A runs site 0, node B site 1 (each its own run dir; only a site's rank 0 writes shared "
    "files):": "# node A runs replica group 0, node B replica group 1 (each its own run dir; "
               "only a group's rank 0 # writes shared files):",
    "--run-dir runs/site0 --workers 2 --steps 30 --inner-steps 10 --warmup-steps 10 \\":
        "--run-dir runs/group0 --workers 2 --steps 30 --inner-steps 10 --warmup-steps 10 \\",
    "python -m farlink.parallel.site_agent --host NODE_ADDRESS --nproc-per-node 2 -m "
    "farlink.worker ...": "python -m farlink.parallel.replica_group_agent --host NODE_ADDRESS "
                          "--nproc-per-node 2 \\ -m farlink.worker ...",
    "farlink bench sites           # a site of 2 ranks (fsdp, ddp) vs one rank vs plain torch, per "
    "rank": "farlink bench replica-groups # a replica group of 2 ranks (fsdp, ddp) vs 1 rank vs "
            "plain torch",
    "farlink bench gpu             # 125m in bf16 on one GPU: tokens/s, MFU, 1 and 2 sites; loss "
    "vs CPU": "farlink bench gpu # 125m in bf16 on one GPU: tokens/s, MFU, 1 and 2 workers; loss "
              "vs CPU",
}


# --- the layout ------------------------------------------------------------------------------


def layout_entries(text: str) -> list[str]:
    """The modules docs/reference/layout.md lists under "Every module", as paths under
    ``src/farlink``: in that section's block, a top-level entry sits 2 spaces in (``name.py``, or
    ``name/`` opening a package) and a package's module 4 spaces in; deeper lines continue a
    description."""
    block = text.split("\n## Every module\n", 1)[1].split("```\n", 2)[1]
    entries, package = [], None
    for line in block.splitlines():
        entry = re.match(r"^(  |    )(\S+)(?: |$)", line)
        if entry is None:
            continue
        indent, name = len(entry.group(1)), entry.group(2)
        if indent == 2 and name.endswith("/"):
            package = name
            entries.append(name)
        elif indent == 2:
            entries.append(name)
        else:
            assert package is not None, line
            entries.append(package + name)
    return entries


def test_the_layout_lists_every_module_once() -> None:
    source = ROOT / "src" / "farlink"
    tree = sorted(
        [p.name + "/" for p in source.iterdir() if (p / "__init__.py").is_file()]
        + [str(p.relative_to(source)) for p in source.rglob("*.py")
           if p.name != "__init__.py" or p.parent == source])
    listed = layout_entries((DOCS / "reference" / "layout.md").read_text())
    twice = sorted({e for e in listed if listed.count(e) > 1})
    assert twice == [], f"listed more than once: {twice}"
    missing, gone = sorted(set(tree) - set(listed)), sorted(set(listed) - set(tree))
    assert (missing, gone) == ([], []), f"missing from the layout: {missing}; gone: {gone}"
