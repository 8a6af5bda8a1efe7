"""Optional extras: what the core install leaves out, and the error when a path needs one.

The extras are installed here (the test extra pulls them all), so their absence is simulated
the way Python itself reports it: ``sys.modules[name] = None`` makes every import of ``name``
raise ``ImportError``, in a fresh interpreter that then runs the real CLI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import typer

from farlink.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]

# Runs each command with the four optional packages unimportable; prints exit code and stderr.
SCRIPT = textwrap.dedent("""
    import contextlib, io, json, sys
    for name in ("transformers", "datasets", "hivemind", "matplotlib"):
        sys.modules[name] = None
    from farlink.cli import main
    results = []
    for argv in json.loads(sys.argv[1]):
        sys.argv = ["farlink", *argv]
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException as exc:  # noqa: BLE001 - reported, the test fails on it
                code, err = -1, io.StringIO(f"{type(exc).__name__}: {exc}")
        results.append({"argv": argv, "code": code, "err": err.getvalue(),
                        "out": out.getvalue()})
    print(json.dumps(results))
""")


def run_without_extras(commands: list[list[str]], cwd: Path) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(commands)], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_missing_extras_give_an_error_naming_the_extra(tmp_path: Path) -> None:
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a"}\n')
    run = ["--run-dir", str(tmp_path / "run"), "--cache-dir", str(tmp_path / "cache")]
    help_out, *failures = run_without_extras([
        ["--help"],
        ["train", "--model", f"hf:{model_dir}", *run],
        ["train", "--corpus", f"hf:{data}", *run],
        ["train", "--backend", "hivemind", *run],
        ["swarm", "start"],
        ["bench", "algorithms", "--out", str(tmp_path / "bench")],
        ["export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")],
    ], cwd=tmp_path)
    assert help_out["code"] == 0 and "train" in help_out["out"]  # the core CLI needs no extra
    expected = ["hf", "hf", "community", "community", "plots", "hf"]
    for result, extra in zip(failures, expected, strict=True):
        assert result["code"] == 2, result
        assert f"pip install 'farlink[{extra}]'" in result["err"], result
        assert "Traceback" not in result["err"], result
    assert not (tmp_path / "bench").exists()  # refused before any benchmark ran


def test_core_dependencies_leave_the_heavy_paths_to_extras() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {dep.split("=")[0].split(">")[0].split("<")[0].strip().lower()
            for dep in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert "tqdm" not in core  # nothing uses it
    for module, extra in EXTRAS.items():
        assert module not in core, module
        assert any(dep.startswith(module) for dep in extras[extra]), (module, extra)
    assert extras["all"] == ["farlink[hf,community,plots]"]
    assert "farlink[all]" in extras["test"]  # README's `pip install -e '.[test]'` runs every test


def test_flag_help_says_each_default_once_and_lists_every_preset() -> None:
    from farlink.cli import app
    from farlink.model import PRESETS

    command = typer.main.get_command(app)
    with typer.Context(command) as ctx:
        for name in ("train", "join"):
            sub = command.get_command(ctx, name)
            helps = {p.name: p.help or "" for p in sub.params if p.param_type_name == "option"}
            for flag, text in helps.items():
                assert text.count("(default") <= 1, (flag, text)
                assert not text.endswith(("(default: )", "(default: None)")), (flag, text)
            assert helps["islands"].endswith("between the workers)")
            assert helps["steps"].endswith("(default: 500)")
            assert all(preset in helps["model"] for preset in PRESETS)
    assert "10b" in PRESETS
