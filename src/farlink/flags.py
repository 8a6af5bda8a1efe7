"""Command-line flags generated from :class:`~farlink.config.RunConfig`: one ``--flag`` per
field, so a new option needs one line in :mod:`farlink.config` and nothing in any command; values
given on the command line override the TOML file. ``farlink train``, ``join``, ``worker`` and
``swarm start`` all take them."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional, get_args, get_origin

import typer

from farlink.config import INVOCATION_FIELDS, LATEST_RUN, ConfigError, RunConfig, load_config


def _flag_type(annotation: Any) -> Any:
    origin = get_origin(annotation)
    args = [a for a in get_args(annotation) if a is not type(None)]
    if origin is not None and args:
        if all(isinstance(a, str) for a in args):  # Literal["a", "b"]
            return str
        return _flag_type(args[0])
    return annotation


def flag_help(description: str | None, default: Any) -> str:
    """A flag's help: its description and its default, said once. A description that explains
    its own default keeps it; an empty or absent default (an unset option) is not printed."""
    text = description or ""
    if "(default" in text or default is None or default == "":
        return text
    return f"{text} (default: {default})".strip()


def config_options(func: Any) -> Any:
    """Give ``func`` one ``--flag`` per RunConfig field (None = not given) plus ``--config``."""
    params = [
        inspect.Parameter(
            "config", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
            default=typer.Option(None, "--config", "-c", help="TOML file (keys of a train table, or top-level)"),
        )
    ]
    for name, field in RunConfig.model_fields.items():
        kind = _flag_type(field.annotation)
        flag = "--" + name.replace("_", "-")
        decl = [f"{flag}/--no-{name.replace('_', '-')}"] if kind is bool else [flag]
        params.append(
            inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[kind],
                default=typer.Option(None, *decl, help=flag_help(field.description,
                                                                 field.default),
                                     show_default=False),
            )
        )
    original = inspect.signature(func)
    extra = [p for p in original.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    func.__signature__ = original.replace(parameters=extra + params)
    return func


def config_from(values: dict[str, Any]) -> RunConfig:
    """The config of this invocation; ``--resume`` without ``--config`` starts from the run's
    saved config (the run dir defaults to ``runs/latest``, the newest run)."""
    config_path = values.pop("config", None)
    ignore: frozenset[str] = frozenset()
    if values.get("resume") and config_path is None:
        values["run_dir"] = values.get("run_dir") or LATEST_RUN
        saved = Path(values["run_dir"]) / "config.toml"
        if saved.is_file():  # a run saved by an older farlink may hold invocation fields
            config_path, ignore = saved, INVOCATION_FIELDS
    try:
        return load_config(config_path, values, ignore=ignore)
    except ConfigError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
