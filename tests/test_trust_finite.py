"""State that is adopted is finite: an outer step never applies a NaN aggregate, a Moshpit
group's state average leaves out a member whose committed state is NaN (and names it), and a
checkpoint holding NaN/Inf is neither written nor resumed from."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_sync_diloco import make_algo

from farlink.comm.inprocess import InProcessGroup
from farlink.sync.exchange import ExchangeResult
from farlink.state import checkpoint as ckpt


def test_an_outer_step_never_applies_a_nan_aggregate(caplog) -> None:
    algo = make_algo("diloco", InProcessGroup(1).member(0))
    before = [g.clone() for g in algo.global_params]
    nan = ExchangeResult({n: torch.full_like(g, float("nan"))
                          for n, g in zip(algo.names, algo.global_params)}, total_weight=10.0)
    with caplog.at_level(logging.WARNING, logger="farlink.sync.diloco"):
        algo.outer_update(nan)
    for g, b in zip(algo.global_params, before):
        torch.testing.assert_close(g, b)
    assert any("nonfinite aggregate" in r.getMessage() for r in caplog.records)


def test_state_mixing_leaves_out_a_member_whose_state_is_nan(caplog) -> None:
    """Three members of one Moshpit group with different committed states; member 2's holds
    NaN: the others' average is what every member adopts, and member 2 is named."""
    def member(rank: int, collective):  # noqa: ANN001, ANN202
        collective.partial_groups = True  # hivemind --group-size: groups mix their states
        algo = make_algo("diloco", collective)
        with torch.no_grad():
            algo.global_params[0].fill_(float("nan") if rank == 2 else float(rank))
        info = collective.begin_round()
        algo.mix_group_states(info)
        return algo._mixed_state, f"global.{algo.names[0]}"

    with caplog.at_level(logging.WARNING, logger="farlink.sync.moshpit"):
        states = InProcessGroup(3).run(member)
    for state, name in states:
        assert state is not None
        mixed = state[name]
        torch.testing.assert_close(mixed, torch.full_like(mixed, 0.5))  # members 0 and 1
    assert any("member 2" in r.getMessage() and "not finite" in r.getMessage()
               for r in caplog.records)


def _state(value: float) -> dict[str, torch.Tensor]:
    return {"model.w": torch.full((3,), value), "opt.exp_avg": torch.ones(3)}


def test_a_checkpoint_holding_nan_is_not_written_and_the_last_good_one_stays(tmp_path) -> None:
    good = ckpt.save_checkpoint(tmp_path, 1, _state(1.0), {"algorithm": "diloco"})
    with pytest.raises(ckpt.NonFiniteState, match="model.w") as err:
        ckpt.save_checkpoint(tmp_path, 2, _state(float("nan")), {"algorithm": "diloco"})
    assert str(good) in str(err.value)
    assert ckpt.latest_checkpoint(tmp_path) == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.POINTER, good.name]
    with pytest.raises(ckpt.NonFiniteState):
        ckpt.save_checkpoint(tmp_path, 3, _state(float("inf")), {"algorithm": "diloco"})


def test_resume_refuses_a_checkpoint_holding_nan_and_says_what_to_do(tmp_path) -> None:
    """A checkpoint written with NaN before the check existed, with valid digests."""
    from safetensors.torch import save as serialize

    path = ckpt.save_checkpoint(tmp_path, 1, _state(1.0), {"algorithm": "diloco"})
    blob = serialize(_state(float("nan")))
    (path / ckpt.TENSORS).write_bytes(blob)
    meta = json.loads((path / ckpt.META).read_text())
    meta[ckpt.DIGESTS] = {ckpt.TENSORS: ckpt._sha256(blob)}
    meta.pop(ckpt.META_DIGEST)
    meta[ckpt.META_DIGEST] = ckpt._meta_digest(meta)
    (path / ckpt.META).write_text(json.dumps(meta))
    with pytest.raises(ckpt.NonFiniteState) as err:
        ckpt.load_newest_intact(tmp_path)
    message = str(err.value)
    assert str(path / ckpt.TENSORS) in message and "model.w" in message
    assert "--resume" in message and "move" in message
