"""Optional dependencies, and the one error that says which extra installs them.

The default job (torchft backend, shipped corpus, farlink's own model) needs none of these, and
together they weigh hundreds of megabytes, so each path that needs one imports it through
:func:`require`: a user who asks for that path without the extra gets a message naming the
``pip install`` that fixes it instead of a bare ``ModuleNotFoundError`` from deep inside.
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: top-level module -> the farlink extra that installs it
EXTRAS = {
    "transformers": "hf",
    "datasets": "hf",
    "hivemind": "community",
    "matplotlib": "plots",
    "tensorboard": "metrics",
    "wandb": "metrics",
}
#: extras ``farlink[all]`` leaves out (``farlink[test]`` installs them as well)
NOT_IN_ALL = frozenset({"metrics"})


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""


def install_hint(extra: str) -> str:
    return f"pip install 'farlink[{extra}]'"


def require(module: str, purpose: str) -> ModuleType:
    """Import ``module`` (a top-level name in :data:`EXTRAS`, or a submodule of one) for
    ``purpose``, or raise :class:`MissingExtra` naming the extra that provides it."""
    top = module.split(".")[0]
    extra = EXTRAS[top]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the package is there but one of its own dependencies is broken: show that
        also = "" if extra in NOT_IN_ALL else " (or 'farlink[all]')"
        raise MissingExtra(f"{purpose} needs {top}, which is not installed: "
                           f"{install_hint(extra)}{also}") from exc
