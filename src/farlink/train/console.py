"""The console ``farlink train`` reports on (stderr, so stdout stays the run's result): one
object shared by the launcher and the pipeline run, so their lines and progress bars never
interleave."""

from rich.console import Console

console = Console(stderr=True)
