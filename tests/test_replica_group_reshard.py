"""A run checkpointed by replica groups of 2 ranks goes on with 1 rank per replica group, and back
(resharding).

The cutting rule on hand-made parts first (FSDP2's uneven ``chunk`` shards, a DDP replica group's
``tensor_split`` slices, whole values, counters), then real runs: 2 replica groups of 2 ranks, FSDP2
or DDP inside (torchrun, Gloo), and a torchft Lighthouse, resumed with ``ranks_per_worker=1``
and then again with 2. A finished run resumed writes its final model from the state it loaded,
so the model files before and after each change of ranks are compared byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from farlink.parallel.reshard import ReshardError, reshard

WHOLE = torch.arange(35, dtype=torch.float32).view(7, 5)  # 7 rows: uneven over 2 or 4 ranks


def fsdp_parts(k: int) -> list[dict[str, torch.Tensor]]:
    """What k FSDP2 ranks hold: dim-0 chunks of the parameter and of its Adam state, each rank's
    own RNG state and a step counter."""
    return [{"local.w": rows.clone(), "inner.0.exp_avg": 2 * rows, "inner.0.step": torch.tensor(3.),
             "rng.torch": torch.full((4,), r, dtype=torch.uint8)}
            for r, rows in enumerate(torch.chunk(WHOLE, k) + (WHOLE[:0],) * (k - len(
                torch.chunk(WHOLE, k))))]


def layout_of(parts: list[dict[str, torch.Tensor]]) -> list[dict[str, tuple[int, ...]]]:
    """The shapes new ranks report: their live tensors, and for Adam's state made later the
    parameter's shape under the ``inner.0.`` prefix."""
    return [{"local.w": tuple(p["local.w"].shape), "inner.0.": tuple(p["local.w"].shape),
             "rng.torch": (4,)} for p in parts]


@pytest.mark.parametrize(("old", "new"), [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_fsdp_shards_are_cut_again_for_another_rank_count(old, new):
    parts, target = fsdp_parts(old), fsdp_parts(new)
    for rank in range(new):
        state = reshard(parts, rank, layout_of(target))
        assert torch.equal(state["local.w"], target[rank]["local.w"])
        assert torch.equal(state["inner.0.exp_avg"], target[rank]["inner.0.exp_avg"])
        assert state["inner.0.step"].item() == 3.0
        # a rank's own value: old rank r's, the last old rank's for ranks beyond
        assert state["rng.torch"].tolist() == [min(rank, old - 1)] * 4


def test_ddp_slices_and_whole_replicas():
    """A DDP replica group of 2: each rank holds the whole replica (``local``) and a flat 1/2 slice
    of the global copy (``tensor_split``: 18 and 17 of 35). One rank holds the global copy in the
    parameter's shape; 3 ranks hold slices of 12, 12 and 11."""
    slices = torch.tensor_split(WHOLE.view(-1), 2)
    parts = [{"local.w": WHOLE.clone(), "global.w": s.clone()} for s in slices]
    one = reshard(parts, 0, [{"local.w": (7, 5), "global.w": (7, 5)}])
    assert torch.equal(one["global.w"], WHOLE) and torch.equal(one["local.w"], WHOLE)
    three = [{"local.w": (7, 5), "global.w": (n,)} for n in (12, 12, 11)]
    cut = [reshard(parts, r, three) for r in range(3)]
    assert [c["global.w"].tolist() for c in cut] == \
        [t.tolist() for t in torch.tensor_split(WHOLE.view(-1), 3)]
    assert all(torch.equal(c["local.w"], WHOLE) for c in cut)


def test_parts_that_fit_neither_kind_are_refused_naming_the_rank_count():
    parts = [{"w": torch.zeros(3)}, {"w": torch.zeros(3)}]
    with pytest.raises(ReshardError, match="resume with --ranks-per-worker 2"):
        reshard(parts, 0, [{"w": (5,)}])
    with pytest.raises(ReshardError, match="not held by every rank"):
        reshard(parts, 0, [{"v": (6,)}])


# --- real runs ------------------------------------------------------------------------------

RUN = {"workers": 2, "steps": 30, "inner_steps": 10, "warmup_steps": 10, "batch_size": 8,
       "vocab_size": 512, "seq_len": 64, "eval_batches": 2, "join_timeout": 10,
       "heartbeat_timeout": 3}


def final_models(run_dir: Path) -> list[bytes]:
    return [(run_dir / "final" / f"w{i}.safetensors").read_bytes() for i in range(2)]


@pytest.mark.slow  # four runs of two replica groups: 3.5 min at load 30
@pytest.mark.parametrize("sharding", ["fsdp", "ddp"])
def test_a_run_resumes_with_another_rank_count_from_the_same_parameters(tmp_path, cache_dir,
                                                                       sharding):
    pytest.importorskip("torchft")
    from farlink.config import load_config
    from farlink.train.launcher import launch

    cfg = load_config(None, {**RUN, "run_dir": tmp_path / "run", "cache_dir": cache_dir,
                             "ranks_per_worker": 2, "sharding": sharding})
    first = launch(cfg, show_progress=False)
    assert first.returncodes == [0, 0]
    saved_by_two = final_models(cfg.run_dir)
    assert saved_by_two[0] == saved_by_two[1]

    def resume(**changes):  # noqa: ANN003, ANN202
        run = launch(cfg.model_copy(update={"resume": True, **changes}), show_progress=False)
        assert run.returncodes == [0, 0], [
            (cfg.run_dir / "logs" / f"w{i}.log").read_text()[-3000:] for i in range(2)]
        return run

    # 2 -> 1: the finished run, loaded by one rank per replica group, is the same model bit for bit
    resume(ranks_per_worker=1)
    assert final_models(cfg.run_dir) == saved_by_two
    # ... and trains on with one rank: 10 more steps, one more round, both replica groups on one
    # model
    longer = resume(ranks_per_worker=1, steps=40)
    assert longer.summary["final_replicas"]["consistent"], longer.summary
    assert [s for s, _ in longer.summary["final_replicas"]["states"].values()] == [4, 4]
    saved_by_one = final_models(cfg.run_dir)
    assert saved_by_one != saved_by_two
    newest = sorted((cfg.run_dir / "checkpoints" / "w0").glob("step-*"))[-1]
    assert newest.name == "step-0000040" and "site_ranks" not in json.loads(
        (newest / "meta.json").read_text())  # written by one rank
    # 1 -> 2: back on two ranks per replica group, again the same model bit for bit
    resume(ranks_per_worker=2, steps=40)
    assert final_models(cfg.run_dir) == saved_by_one
    saved = json.loads((cfg.run_dir / "config.json").read_text())
    assert saved["ranks_per_worker"] == 2  # the run dir says how it runs now


def test_a_peer_whose_shards_are_cut_otherwise_is_not_healed_from():
    """Healing pairs rank r with rank r: a state cut for another rank count (here half of each
    tensor, as rank 0 of a 2-rank replica group holds it) is refused whole, naming the settings to
    match, and nothing of it is loaded."""
    import farlink
    from farlink.sync.digest import StateTransferError

    def replica(rows: int, seed: int = 0) -> farlink.Optimizer:
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, rows)
        return farlink.Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 backend="inprocess", algorithm="diloco", steps=10,
                                 inner_steps=5)

    whole, half = replica(6), replica(3)
    before = whole.fingerprint()
    with pytest.raises(StateTransferError, match="--ranks-per-worker and --sharding"):
        whole.algorithm.import_state(half.algorithm.export_state())
    assert whole.fingerprint() == before
    same = replica(6, seed=1)  # the same cut: healed as before
    assert same.fingerprint() != before
    same.algorithm.import_state(whole.algorithm.export_state())
    assert same.fingerprint() == before
    for sync in (whole, half, same):
        sync.close()
