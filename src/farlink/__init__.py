"""farlink: train one language model across islands of compute joined by slow links.

The public API is :class:`farlink.Optimizer` (see :mod:`farlink.optimizer`): it wraps your
``nn.Module`` and your inner optimizer and runs any of farlink's outer algorithms (the registry
:data:`ALGORITHMS` names them all: DDP, local SGD, DiLoCo and its streaming and hierarchical
forms, DeMo, SparseLoCo, ...) on any backend (``torchft``, ``hivemind``, ``inprocess``) with any
codec and aggregator; ``farlink train`` and ``farlink join`` are its first clients. Also
exported: :class:`RunConfig` (every option, the same as the CLI flags), :data:`ALGORITHMS`, and
:class:`Reporter` with :func:`open_sinks` (TensorBoard and W&B, :mod:`farlink.loggers`).

Data flows one way: ``data`` -> ``train`` (inner steps) -> ``sync`` (outer step through ``comm``,
with ``codecs`` and ``robust`` aggregation) -> ``train``. An algorithm never imports a backend;
a backend never knows the model.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "Optimizer": "farlink.optimizer",
    "RunConfig": "farlink.config",
    "ALGORITHMS": "farlink.sync",
    "StepOutcome": "farlink.sync",
    "Reporter": "farlink.loggers",
    "open_sinks": "farlink.loggers",
}
# _EXPORTS by name: a literal list, so that linters and IDEs read it
__all__ = ["__version__", "Optimizer", "RunConfig", "ALGORITHMS", "StepOutcome", "Reporter",
           "open_sinks"]


def __getattr__(name: str) -> object:
    """Imported on first use: ``import farlink`` stays light for the CLI (no torch)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'farlink' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
