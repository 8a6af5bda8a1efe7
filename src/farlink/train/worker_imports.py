"""What a local worker of the default job imports before its first step, imported once by the
fork server (:mod:`farlink.train.forkserver`) so that no worker imports it again.

A module missing here still works (the worker imports it itself); one here that a worker never
uses costs only the fork server's memory. Nothing here may start threads, CUDA or a process group
when imported: every worker is a fork of the process that imported it.
"""

import torch._dynamo  # noqa: F401  (torch imports it lazily during a worker's first steps)
import torchft  # noqa: F401

import farlink.comm.torchft_backend  # noqa: F401
import farlink.comm.torchft_listeners  # noqa: F401
import farlink.compose  # noqa: F401
import farlink.data  # noqa: F401
import farlink.lifeline  # noqa: F401
import farlink.model.build  # noqa: F401
import farlink.optimizer  # noqa: F401
import farlink.robust.heal  # noqa: F401
import farlink.train.compute  # noqa: F401
import farlink.train.network  # noqa: F401
import farlink.train.index_lock  # noqa: F401
import farlink.train.start_line  # noqa: F401
import farlink.train.worker  # noqa: F401
import farlink.worker  # noqa: F401
