"""Parts of the docs written from the code and the measured results at build time, so they
cannot drift: a page holds a marker ``<!-- generated: KIND [ARG] -->`` and this MkDocs hook
replaces it with

- ``cli``: the reference of every ``farlink`` command, from the commands themselves (Typer/Click);
- ``knobs ALGORITHM``: the algorithm's own options (name, default, what it sets), from its
  options model;
- ``frontier``: the table of every method's measured bytes per token and held-out loss
  (``docs/results/frontier.json``); ``frontier ALGORITHM``: that algorithm's rows.

The README's table is :func:`frontier_table` too (a test compares them).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
MARKER = re.compile(r"<!-- generated: (\w+)(?: ([\w-]+))? -->")

# --- measured results ----------------------------------------------------------------------


def _frontier() -> dict:
    return json.loads((RESULTS / "frontier.json").read_text())


def _settings_of(row: dict) -> str:
    cfg = row["config"]
    knobs = [f"H={cfg['inner_steps']}" if "inner_steps" in cfg else ""]
    if cfg.get("codec"):
        knobs.append(cfg["codec"])
    if "sparseloco_topk" in cfg:
        knobs.append(f"top-{cfg['sparseloco_topk']} of 4096")
    if row["label"] == "ddp-small-batch":
        knobs.append("2 sequences per step")
    return ", ".join(k for k in knobs if k) or "-"


def _times(factor: float) -> str:
    return f"{factor:,.0f}x" if factor >= 10 else f"{factor:.2g}x"


def frontier_table(algorithm: str | None = None) -> str:
    """Measured bytes per token and held-out loss of ``farlink bench frontier`` (every method
    at the lrs of its own sweep, the same token budget), as a Markdown table."""
    data = _frontier()
    rows = [r for r in data["rows"] if algorithm is None or r["config"]["algorithm"] == algorithm]
    lines = ["| method | algorithm | settings | bytes/token | fewer bytes than DDP | "
             "held-out loss | vs DDP |", "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['label']} | `{r['config']['algorithm']}` | {_settings_of(r)} | "
                     f"{r['bytes_per_token']:,.1f} | {_times(r['bytes_per_token_reduction_vs_ddp'])} | "
                     f"{r['final_heldout_loss']:.3f} | {100 * r['loss_vs_ddp']:+.1f}% |")
    return "\n".join(lines)


def other_results(algorithm: str) -> str:
    """Rows of the runs that measured an algorithm the frontier does not sweep."""
    if algorithm == "local_sgd":
        data = json.loads((RESULTS / "algorithms.json").read_text())
        source = "`farlink bench algorithms --steps 500 --inner-steps 100` (algorithms.json)"
    elif algorithm == "hierarchical_diloco":
        data = json.loads((RESULTS / "hetero-islands.json").read_text())
        source = "`farlink bench hetero --scenario islands` (hetero-islands.json)"
    else:
        return ""
    lines = [f"Measured by {source}:", "",
             "| run | algorithm | bytes/token | held-out loss |", "|---|---|---:|---:|"]
    for r in data["rows"]:
        lines.append(f"| {r['label']} | `{r['algorithm']}` | {r['bytes_per_token']:,.1f} | "
                     f"{r['final_heldout_loss']:.3f} |")
    return "\n".join(lines)


# --- the code's own descriptions -----------------------------------------------------------


def _import_farlink() -> None:
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))


def knobs_table(algorithm: str) -> str:
    """The options an algorithm adds to the shared ones (from its pydantic options model)."""
    _import_farlink()
    from farlink.sync import algorithm_class
    from farlink.sync.base import SyncOptions

    options = algorithm_class(algorithm).Options
    shared = set(SyncOptions.model_fields)
    lines = ["| flag | default | what it sets |", "|---|---|---|"]
    for name, field in options.model_fields.items():
        if name in shared and algorithm != "ddp":
            continue
        flag = "--" + name.replace("_", "-")
        text = (field.description or "").replace("|", "\\|")
        lines.append(f"| `{flag}` | `{field.default}` | {text} |")
    return "\n".join(lines)


def cli_reference() -> str:
    """Every ``farlink`` command with its help and options, from the command tree Typer builds
    (duck-typed: Typer carries its own copy of Click)."""
    _import_farlink()
    import typer

    from farlink.cli import app

    out: list[str] = []

    def walk(command, path: list[str], parent) -> None:  # noqa: ANN001
        ctx = command.context_class(command, info_name=path[-1], parent=parent)
        if path[1:]:
            out.append(f"## `{' '.join(path)}`\n")
            if command.help:
                out.append(command.help.strip().split("\f")[0] + "\n")
            args = [p.name for p in command.params if p.param_type_name == "argument"]
            if args:
                out.append("Arguments: " + ", ".join(f"`{a.upper()}`" for a in args) + "\n")
            rows = []
            for param in command.params:
                if param.param_type_name != "option" or getattr(param, "hidden", False):
                    continue
                names = ", ".join(f"`{o}`" for o in [*param.opts, *param.secondary_opts])
                text = (param.help or "").replace("|", "\\|").replace("\n", " ")
                rows.append(f"| {names} | {text} |")
            if rows:
                out.append("| option | what it does |\n|---|---|\n" + "\n".join(rows) + "\n")
        if hasattr(command, "list_commands"):
            for name in command.list_commands(ctx):
                walk(command.get_command(ctx, name), [*path, name], ctx)

    walk(typer.main.get_command(app), ["farlink"], None)
    return "\n".join(out)


def render(kind: str, arg: str | None) -> str:
    if kind == "cli":
        return cli_reference()
    if kind == "knobs":
        return knobs_table(arg)
    if kind == "frontier":
        return frontier_table(arg)
    if kind == "other_results":
        return other_results(arg)
    raise ValueError(f"unknown generated part {kind!r}")


def on_page_markdown(markdown: str, **_: object) -> str:
    return MARKER.sub(lambda m: render(m.group(1), m.group(2)), markdown)
