"""Errors any layer may raise and the CLI reports as one line (never a traceback)."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field and the fix."""
