"""User-editable TOML tables read through a pydantic model.

The built-in tables (GPUs, links) ship as TOML so a user can read and change them without
touching code, and a user's own file goes through the same model, so a typo or a negative
bandwidth is reported with the file, the entry and the field instead of surfacing later as a
nonsensical number.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

Model = TypeVar("Model", bound=BaseModel)


def read_toml(path: Path, error: type[ValueError], what: str = "") -> dict[str, Any]:
    """The TOML file ``path`` as a dict; a file that cannot be read, is not text (a binary file
    given by mistake) or is not TOML raises ``error`` naming ``what`` and the file, in one line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"cannot read {what}{path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise error(f"{what}{path} is not a text file (byte {exc.start} is not UTF-8); give "
                    "a TOML text file") from exc
    return _parse(text, f"{what}{path}", error)


def _parse(text: str, origin: str, error: type[ValueError]) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{origin} is not valid TOML: {exc}") from exc


def load_table(model: type[Model], path: str | Path | None, package: str, resource: str,
               error: type[ValueError]) -> Model:
    """``path`` (or the built-in ``package``/``resource``) validated by ``model``; any problem
    (unreadable, not TOML, an invalid entry) raises ``error`` naming the file and the fields."""
    if path is None:
        origin = f"built-in {Path(resource).name}"
        raw = _parse(resources.files(package).joinpath(resource).read_text(), origin, error)
    else:
        origin = str(path)
        raw = read_toml(Path(path), error)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        count = exc.error_count()
        lines = [f"{origin} has {count} invalid entr{'y' if count == 1 else 'ies'}:"]
        for err in exc.errors():
            lines.append(f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']}")
        raise error("\n".join(lines)) from None
