"""A whole ``farlink train`` run with its workers as threads of the calling process.

:func:`farlink.train.launcher.launch` starts a Lighthouse process and one Python process per
worker; most of a short test run's time is then interpreters importing torch. Here the workers
are :class:`farlink.train.worker.Worker` objects in threads, meeting at torchft's real
Lighthouse served in-process (with ``--auth``, the launcher's gated Lighthouse; island runs add
the launcher's island Lighthouses) and averaging over real Gloo, and the run dir ends as the launcher
leaves it (metrics, checkpoints, final replicas, ``summary.json``, the exported model), so a test
asserts on the same files and the same :class:`~farlink.train.launcher.RunResult`.

What only processes show (SIGKILL, orphans, Ctrl-C, a worker's exit code from the CLI) stays with
``launch``; a worker that raises here is a test failure, not an exit code.
"""

from __future__ import annotations

import json
import threading
import time

from farlink.testing.lighthouse import lighthouse_server
from farlink.testing.threads import in_threads

__all__ = ["launch_in_threads"]


def launch_in_threads(cfg, timeout: float = 300.0):
    """Run ``cfg`` (a :class:`farlink.config.RunConfig` for the torchft backend) to the end with
    its workers as threads; the :class:`~farlink.train.launcher.RunResult` ``launch`` returns.
    ``cfg.stop_at_step`` and ``cfg.resume`` work as with ``launch``; so do islands
    (hierarchical runs, whose island Lighthouses are the launcher's processes) and ``--auth``
    (the launcher's gated Lighthouse process; without it, torchft's served in-process)."""
    from farlink.config import ConfigError
    from farlink.data import prepare_data
    from farlink.train.launcher import (
        RunResult,
        _report_checkpoint_fallbacks,
        check_data,
        check_launch,
        checkpoint_fallbacks,
        export_model,
        never_averaged,
        summarize,
        write_model_files,
    )
    from farlink.robust.auth import run_authenticator
    from farlink.train.lighthouse import Lighthouse
    from farlink.train.network import network_summary, prepare_network
    from farlink.train.rundir import open_run_dir, plan_run_dir
    from farlink.train.worker import Worker

    if cfg.backend != "torchft" or cfg.ranks_per_worker != 1 or cfg.pipeline_stages > 1:
        raise ConfigError("launch_in_threads runs flat torchft runs of one rank per worker")
    cfg, latest_link = plan_run_dir(cfg)
    check_launch(cfg)
    data = prepare_data(cfg.corpus, cfg.vocab_size, cfg.cache_dir, tokenizer=cfg.given_tokenizer)
    check_data(cfg, data)
    open_run_dir(cfg, latest_link)
    write_model_files(cfg, data)
    # every worker's Manager heartbeats before the first quorum is asked for (the launcher's
    # start line): otherwise the first worker up commits its first rounds alone
    start_line = threading.Barrier(cfg.workers)
    # a worker seeds torch's RNG, which is the process's, then builds its model from it: one
    # at a time, so that every replica starts from the same weights, as processes do
    building = threading.Lock()

    def work(index: int, _member: object) -> int:
        thread_started = time.time()
        try:
            with building:
                worker = Worker(cfg, index, address)
        except BaseException:
            start_line.abort()  # the others stop waiting for a worker that will not come
            raise
        start_line.wait(cfg.join_timeout)
        worker.started_at = thread_started  # its wall clock counts from its thread's start
        try:
            return worker.run()
        finally:
            worker.close()

    # islands (hierarchical runs, --topology): planned, and their Lighthouses started, by the
    # launcher's own function
    net_plan, island_lighthouses = prepare_network(cfg, data.vocab_size)
    gate = run_authenticator(cfg, "lighthouse-gate", verifier=True)
    try:
        if gate is None:
            with lighthouse_server(cfg.min_replicas, join_timeout_s=cfg.join_timeout,
                                   heartbeat_timeout_s=cfg.heartbeat_timeout) as address:
                codes = in_threads(work, dict.fromkeys(range(cfg.workers)), timeout=timeout)
        else:  # --auth: the launcher's gated Lighthouse (a process behind this process's gate)
            lighthouse = Lighthouse(cfg.host, min_replicas=cfg.min_replicas,
                                    join_timeout=cfg.join_timeout,
                                    heartbeat_timeout=cfg.heartbeat_timeout,
                                    log_path=cfg.run_dir / "lighthouse.log",
                                    authenticator=gate).start()
            address = lighthouse.address
            try:
                codes = in_threads(work, dict.fromkeys(range(cfg.workers)), timeout=timeout)
            finally:
                lighthouse.stop()
    finally:
        for island_lighthouse in island_lighthouses:
            island_lighthouse.stop()
    codes = [codes[i] for i in range(cfg.workers)]
    summary = summarize(cfg)
    if net_plan is not None:
        summary.update(network_summary(net_plan, cfg, summary["per_worker"]))
    summary["returncodes"] = codes
    summary["checkpoint_fallbacks"] = checkpoint_fallbacks(cfg)
    _report_checkpoint_fallbacks(summary["checkpoint_fallbacks"])  # as the launcher says them
    problem = never_averaged(cfg, summary)
    if problem is not None:
        summary["problem"] = problem
    model_path = export_model(cfg, summary["final_replicas"]["holders"])
    if model_path is not None:
        summary["model"] = str(model_path)
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return RunResult(cfg.run_dir, codes, summary, False, problem)

