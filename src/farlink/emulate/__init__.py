"""Wide-area links on one machine.

Two levels, clearly distinct in reports:

* namespace emulation (:class:`Topology`): real packets through veth pairs, tbf shaping and an
  NFQUEUE delayer, between processes in per-worker network namespaces (needs root);
* in-process emulation (:class:`ShapedLink`, :class:`ShapedCollective`): callers are held as
  long as their bytes would take; for fast tests and machines without namespaces.

Both read their links from :mod:`farlink.links`, the table the planner prices. Names resolve
lazily so ``farlink --help`` does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EmulationError": "errors",
    "Capabilities": "capabilities", "detect_capabilities": "capabilities",
    "Topology": "topology",
    "LinkMeasurement": "measure", "measure_link": "measure",
    "cleanup_stale": "registry", "ForeignResourceError": "registry",
    "WorkerHandle": "launch", "launch_workers": "launch", "start_lighthouse": "launch",
    "wait_for_port": "launch", "wait_all": "launch",
    "ShapedLink": "shaper", "ShapedCollective": "shaper",
}

__all__ = [  # noqa: RUF022 - grouped by module, like _EXPORTS
    "EmulationError",
    "Capabilities", "detect_capabilities", "Topology", "LinkMeasurement", "measure_link",
    "cleanup_stale", "ForeignResourceError", "WorkerHandle", "launch_workers",
    "start_lighthouse", "wait_for_port", "wait_all", "ShapedLink", "ShapedCollective",
]
assert set(__all__) == set(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'farlink.emulate' has no attribute {name!r}")
    return getattr(importlib.import_module(f"farlink.emulate.{_EXPORTS[name]}"), name)
