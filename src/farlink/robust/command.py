"""``farlink keys generate | show``: make and inspect the Ed25519 keys of a run's members."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    keys_app = typer.Typer(help="Ed25519 member keys for --auth ed25519.", no_args_is_help=True)

    @keys_app.command("generate")
    def generate(
        out: Annotated[Path, typer.Option("--out", help="Directory for NAME.key, NAME.key.pub.")],
        name: Annotated[str, typer.Option("--name", help="File stem for this peer's key.")] = "peer",
        force: Annotated[bool, typer.Option("--force", help="Replace an existing key.")] = False,
    ) -> None:
        """Create a private key (mode 0600) and its public key; send only the .pub file."""
        from farlink.robust.keys import KeyFileError, generate_keypair, key_id, parse_public_key

        path = out / f"{name}.key"
        try:
            public = generate_keypair(path, overwrite=force)
        except KeyFileError as exc:
            raise typer.BadParameter(str(exc), param_hint="--out") from exc
        typer.echo(f"private key: {path}")
        typer.echo(f"public key:  {path}.pub")
        typer.echo(f"key id:      {key_id(parse_public_key(public))}")
        typer.echo(public)

    @keys_app.command("show")
    def show(
        path: Annotated[Path, typer.Argument(help="A private key, a .pub file, an allowed-keys "
                                                  "file or a directory of .pub files.")],
    ) -> None:
        """List the key ids and public keys a file or directory holds."""
        from rich.console import Console
        from rich.table import Table

        from farlink.robust.keys import (
            KeyFileError,
            key_id,
            load_private_key,
            load_public_keys,
            public_key_text,
        )

        try:
            if path.is_file() and path.read_bytes().lstrip().startswith(b"-----BEGIN"):
                keys = [load_private_key(path).public_key()]
            else:
                keys = load_public_keys(path)
        except (KeyFileError, OSError) as exc:
            raise typer.BadParameter(str(exc), param_hint="PATH") from exc
        table = Table(title=str(path))
        table.add_column("key id (peer id)")
        table.add_column("public key")
        for k in keys:
            table.add_row(key_id(k), public_key_text(k))
        Console(width=120).print(table)

    app.add_typer(keys_app, name="keys")
