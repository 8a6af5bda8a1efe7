"""``farlink rl --model hf:DIR``: a local transformers causal LM as the policy.

A tiny Llama built from a config and saved with ``save_pretrained`` (nothing is downloaded):
the recipe pre-trains it, the trainer, threaded workers and a worker process sample and train
it, and the verifier's recomputation of fingerprints works on it (honest workers pass, a worker
sampling with another model is caught). A directory that is not a causal LM is refused by name.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from transformers import DistilBertConfig, LlamaConfig  # noqa: E402

from farlink.errors import ConfigError  # noqa: E402
from farlink.model.hf import CausalLM  # noqa: E402
from farlink.rl.loop import run_group  # noqa: E402
from farlink.rl.tasks import CallableTask  # noqa: E402
from farlink.rl.trainer import RLConfig  # noqa: E402
from farlink.robust.keys import key_id, load_private_key  # noqa: E402
from farlink.train.rl import Base, make_base, make_session, serve, spawn_workers  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")


def tiny_llama(directory: Path) -> Path:
    LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2,
                max_position_embeddings=64).save_pretrained(directory)
    return directory


def _even_task() -> CallableTask:
    """A reward any policy earns half the time: every group has spread, so steps train."""
    return CallableTask("even", lambda rng: (f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=", "4"),
                        lambda prompt, answer, completion: sum(map(ord, completion)) % 2 == 0)


def _accepted(session, worker: str) -> int:  # noqa: ANN001
    ledger = session.trainer.ledger
    return ledger.get(worker).updates_accepted if worker in ledger.peers() else 0


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    directory = tiny_llama(tmp_path_factory.mktemp("llama"))
    base = make_base("addition:1", pretrain_steps=30, seed=0, heldout=5,
                     model_name=f"hf:{directory}")
    return Base(base.model, base.codec, _even_task(), [])


def test_a_local_llama_is_post_trained_by_threaded_workers_and_a_wrong_model_is_caught(
        llama_base: Base) -> None:
    assert isinstance(llama_base.model, CausalLM)
    before = {k: v.clone() for k, v in llama_base.model.named_parameters()}
    cfg = RLConfig(group_size=4, groups_per_step=2, deadline_s=30.0, fingerprint_every=2,
                   max_staleness=2, max_new_tokens=4)
    session = make_session(llama_base, cfg, workers=2, lr=1e-2, malicious=["wrong_model"])
    logs = run_group(session.trainer, session.workers, 4, max_wall_s=240)
    assert [log.step for log in logs] == list(range(4)) and session.publisher.version == 4
    # the verifier recomputed the Llama's fingerprints: the honest workers pass, the one
    # sampling with a perturbed copy is rejected and banned
    assert {worker for worker, _ in session.trainer.rejections} == {"wrong_model-2"}
    assert _accepted(session, "wrong_model-2") == 0
    used = sum(log.groups for log in logs)
    assert used >= 4 and _accepted(session, "honest-0") + _accepted(session, "honest-1") == used
    moved = [k for k, v in llama_base.model.named_parameters() if not torch.equal(v, before[k])]
    assert moved, "no GRPO step changed the policy"
    # each honest worker's Llama is bit-identical to the version it last fetched
    compared = 0
    for worker in session.workers[:2]:
        served = session.publisher._weights.get(worker.replica.version)
        if served is not None:  # kept for the last max_staleness + 2 versions
            assert all(torch.equal(p, served[k]) for k, p in worker.model.named_parameters())
            compared += 1
    assert compared == 2


def test_a_worker_process_builds_the_llama_from_the_trainers_description(
        llama_base: Base, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The process has no model directory: it builds the architecture from the hello's
    config, fetches the weights in hashed chunks, and its rollouts verify."""
    monkeypatch.setenv("PYTHONPATH", SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfg = RLConfig(group_size=4, groups_per_step=2, deadline_s=60.0, fingerprint_every=2,
                   max_staleness=4, max_new_tokens=4, verify_fraction=1.0)
    session = make_session(llama_base, cfg, workers=0, lr=1e-2)
    server = serve(session, "int4")
    children = spawn_workers(server.address, 1, identity_dir=tmp_path)
    try:
        logs = run_group(session.trainer, [], 3, max_wall_s=240, remote=True)
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=30)
        server.close()
    assert [log.step for log in logs] == [0, 1, 2]
    assert session.trainer.rejections == []  # every group recomputed, every one matched
    assert _accepted(session, key_id(load_private_key(tmp_path / "proc-0.key").public_key())) \
        == 3 * 2


def test_a_directory_that_is_not_a_causal_lm_is_refused_by_name(tmp_path: Path) -> None:
    encoder = tmp_path / "encoder"
    DistilBertConfig(vocab_size=320, dim=32, hidden_dim=64, n_layers=1,
                     n_heads=2).save_pretrained(encoder)
    with pytest.raises(ConfigError, match="'distilbert' model .* not a causal language model"):
        make_base("addition:1", pretrain_steps=1, model_name=f"hf:{encoder}")
    with pytest.raises(ConfigError, match="has no config.json"):
        make_base("addition:1", pretrain_steps=1, model_name=f"hf:{tmp_path / 'empty'}")
