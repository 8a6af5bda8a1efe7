"""farlink's figures in the loggers of the frameworks people train with.

A Hugging Face ``Trainer`` reports to TensorBoard and W&B itself (``report_to``); these hooks add
a :class:`farlink.Optimizer`'s figures (bytes sent, round time and its phases, outer step, live
peers, rejected updates per peer: :func:`farlink.loggers.optimizer_scalars`) to what it logs, so
they land where the loss does. Lightning users call ``self.log_dict(optimizer_scalars(sync))``
in ``on_train_batch_end`` (docs: guides/metrics).
"""

from __future__ import annotations

from typing import Any

from farlink.extras import require
from farlink.loggers import optimizer_scalars


def trainer_callback(sync: Any) -> Any:
    """A ``transformers.TrainerCallback`` that adds ``sync``'s figures to every log."""
    TrainerCallback = require("transformers", "the Trainer callback").TrainerCallback

    class FarlinkMetrics(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
                   **kwargs: Any) -> None:
            if logs is not None:
                logs.update(optimizer_scalars(sync))

    return FarlinkMetrics()


def add_to_trainer(trainer: Any, sync: Any) -> Any:
    """Add :func:`trainer_callback` to ``trainer`` ahead of its own reporting callbacks (the
    Trainer calls them in order with one ``logs`` dict, so the figures must be in it before
    its TensorBoard and W&B callbacks read it); the callback."""
    callback = trainer_callback(sync)
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback
