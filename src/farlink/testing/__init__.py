"""A fault harness for tests of farlink and of code built on it.

Replicas run as threads of the test's process: against torchft's real Lighthouse served
in-process with real Gloo (:func:`lighthouse_server`), or in an in-process group
(:class:`HealingGroup`) that can lose a member and heal it; :func:`torchft_replicas` runs a
body per replica, each with its own torchft collective. Faults are injected at named points
of a round (:class:`Faults`: fail replica r at round k, fail the exchange at round k, drop or
delay a payload, a barrier at a point) by wrapping any collective (:class:`FaultyCollective`);
:func:`run_replicas` restarts a replica that crashed, as torchft's ``Runner`` does.
:func:`launch_in_threads` (in :mod:`farlink.testing.runs`, which needs the training
application) runs a whole ``farlink train`` run that way and leaves the run dir as the launcher
does. What only processes show (SIGKILL, orphans, Ctrl-C, the CLI) is not here.
"""

from farlink.testing.faults import FaultyCollective, Faults, InjectedFailure, run_replicas
from farlink.testing.group import HealingGroup, HealingMember
from farlink.testing.lighthouse import lighthouse_server, torchft_replicas
from farlink.testing.threads import in_threads

__all__ = ["FaultyCollective", "Faults", "HealingGroup", "HealingMember", "InjectedFailure",
           "in_threads", "lighthouse_server", "run_replicas",
           "torchft_replicas"]
