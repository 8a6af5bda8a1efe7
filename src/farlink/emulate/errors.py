"""The emulator's one error type."""


class EmulationError(RuntimeError):
    """Something the emulator was asked to do cannot be done (bad input or a failed command)."""
