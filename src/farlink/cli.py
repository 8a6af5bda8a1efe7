"""``farlink train | join | worker | swarm | export | generate | bench | plan | report | matrix``.

Each subsystem registers its own commands (``register(app, bench_app)`` in its ``command``
module), so this file only wires them together and stays import-light: heavy imports (torch,
hivemind) happen inside the commands.
"""

from __future__ import annotations

import importlib
import logging

import typer

app = typer.Typer(
    name="farlink",
    help="Train one language model across islands of compute joined by slow links.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(help="Side-by-side scenarios; each writes a JSON table and PNG plots.")
app.add_typer(bench_app, name="bench")

COMMAND_MODULES = [
    "farlink.train.command",
    "farlink.plan.command",
    "farlink.bench.command",
    "farlink.emulate.command",
    "farlink.robust.command",
    "farlink.swarm.command",
    "farlink.worker",
    "farlink.rl_command",
]


@app.command("matrix")
def matrix_command(
    refused_only: bool = typer.Option(False, "--refused", help="only the pairs refused"),
    as_json: bool = typer.Option(False, "--json", help="the rows as a JSON list"),
) -> None:
    """The feature matrix: which pairs of features run together, and for each one that does
    not, why and what to do instead (the refusals `farlink train` raises, from one table)."""
    import json

    from farlink.config import RunConfig
    from farlink.matrix import rows

    table = [r for r in rows(RunConfig) if not (refused_only and r.supported)]
    if as_json:
        typer.echo(json.dumps([r.as_dict() for r in table], indent=1))
        return
    for row in table:
        where = f" [{row.scope}]" if row.scope else ""
        pair = f"{row.first} x {row.second}{where}"
        typer.echo(f"supported  {pair}" if row.supported else f"REFUSED    {pair}\n"
                   f"           {row.reason}")
    refused = sum(not r.supported for r in table)
    typer.echo(f"{len(table)} pairs: {len(table) - refused} supported, {refused} refused")


def _register_all() -> None:
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(app, bench_app)


_register_all()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    # `kill` (SIGTERM) gets the same orderly stop as Ctrl-C: workers stopped between steps,
    # checkpoints kept, emulated namespaces deleted
    from farlink import interrupt

    interrupt.install()
    from farlink.extras import MissingExtra

    try:
        app()
    except MissingExtra as exc:  # an optional dependency: one line naming the extra, no trace
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
