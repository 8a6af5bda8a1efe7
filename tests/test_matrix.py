"""The feature matrix (farlink.matrix) is the code's refusals, not a description of them.

Both directions: every refused row, built as a configuration, is refused with the row's reason
(and every supported row runs); and every refusal that validating a pair of features raises is
a row of the table (pairs of every feature a run can turn on, every algorithm and backend).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from farlink import matrix
from farlink.config import ConfigError, RunConfig, load_config
from farlink.sync import ALGORITHMS

ROWS = matrix.rows(RunConfig)
REFUSED = [r for r in ROWS if not r.supported]
SUPPORTED = [r for r in ROWS if r.supported]


def _id(row: matrix.Row) -> str:
    return f"{row.first} x {row.second}" + (f" [{row.scope}]" if row.scope else "")


def _built(values: dict[str, Any]) -> RunConfig:
    """``values`` validated as a run's config, without this machine's files and devices (an
    example names a CUDA device or an hf: directory that need not be here)."""
    return RunConfig.model_validate(values, context={"stored": True})


@pytest.mark.parametrize("row", REFUSED, ids=_id)
def test_every_refused_row_is_raised_with_its_reason(row: matrix.Row) -> None:
    if row.scope is None:  # the run's config itself refuses it, as farlink train reads it
        with pytest.raises(ConfigError) as info:
            load_config(None, row.example)
    else:  # a valid config that the command of the row's scope refuses before starting
        cfg = _built(row.example)
        if row.scope == "swarm":
            with pytest.raises(ValueError) as info:
                matrix.check(cfg, ["swarm"])
        else:
            from farlink.train.launcher import check_launch

            network = object() if row.scope == "namespaces" else None  # only its presence counts
            with pytest.raises(ConfigError) as info:
                check_launch(cfg, network)  # type: ignore[arg-type]
    assert row.reason and row.reason in str(info.value), (row.reason, str(info.value))


@pytest.mark.parametrize("row", SUPPORTED, ids=_id)
def test_every_supported_row_validates(row: matrix.Row) -> None:
    cfg = _built(row.example)
    matrix.check(cfg, [row.scope] if row.scope else [])
    for name, value in row.example.items():
        assert getattr(cfg, name) == value


def test_capability_rows_follow_the_algorithms_capabilities() -> None:
    """A rule that needs a capability is one row per algorithm, decided by the capability: an
    algorithm that gains it (a time budget for streaming_diloco, say) flips its row with no
    edit of the table."""
    from farlink.sync import capabilities

    rows = {r.first: r.supported for r in ROWS if r.second == "round_seconds"
            and r.first.startswith("algorithm=")}
    assert rows == {f"algorithm={n}": capabilities(n).time_budget for n in ALGORITHMS}
    rows = {r.first: r.supported for r in ROWS if r.second == "group_size"}
    assert rows == {f"algorithm={n}": capabilities(n).partial_groups for n in ALGORITHMS}


# Every setting a run can turn on that may combine badly with another: each a valid value on
# its own (or refused by a row). Pairs of them must validate or be refused by a row.
SETTINGS: list[dict[str, Any]] = [
    *({"algorithm": name} for name in ALGORITHMS),
    *({"backend": name} for name in matrix.BACKENDS),
    {"round_seconds": 5.0}, {"group_size": 2}, {"islands": "0,1|2,3"}, {"island_seconds": 2.0},
    {"overlap_global": True}, {"island_steps": 5}, {"fragments": 2}, {"ranks_per_worker": 2},
    {"sharding": "ddp"}, {"pipeline_stages": 2}, {"peers_per_stage": 2, "workers": 4},
    {"pipeline_micro_batches": 2}, {"activation_codec": "int8"}, {"stage_peer_timeout": 60.0},
    {"topology": "0,1|2,3"}, {"intra_link": "home"}, {"inter_link": "dsl"},
    {"emulate_link": "datacenter"}, {"lighthouse": "127.0.0.1:29510"},
    {"initial_peers": "/ip4/127.0.0.1/tcp/1/p2p/x"}, {"min_replicas": 2},
    {"codec": "int8"}, {"codec": "topk:0.1+ef"}, {"codec": "dct_topk"}, {"aggregator": "median"}, {"score": "loss"},
    {"members": "open"},
    {"screen_ratio": 0.0}, {"auth": "secret"}, {"auth": "ed25519"}, {"secret": "s3cret"},
    {"secret_file": "secret.txt"}, {"key_file": "key"}, {"allowed_keys": "keys"},
    {"attackers": "1"}, {"attack": "sign_flip", "attackers": "1"},
    *({"attack": name} for name in matrix.NOT_ON_TORCHFT),
    {"model": "hf:model-dir"}, {"tokenizer": "tokenizer.json"}, {"corpus": "text.txt"},
    {"grad_accum": 2}, {"precision": "bf16"}, {"device": "cuda"}, {"device": "cuda:0"},
    {"device": "cpu"}, {"slowdown": "1,2"}, {"pace_seconds": 0.5}, {"threads": 2},
    {"resume": True}, {"overwrite": True}, {"inner": "muon"}, {"outer_overlap": "delayed"},
    {"outer_overlap": "eager"}, {"stop_at_step": 10}, {"host": "10.0.0.1"},
]
# Fields whose values have no pair rule: each checked on its own (a bound, a parse) or read by
# one component only. A new field goes above (it may refuse a pair) or here, deliberately.
ON_THEIR_OWN = {
    "inner_steps", "steps", "lr", "warmup_steps", "weight_decay", "grad_clip", "round_retries",
    "demo_beta", "demo_chunk", "demo_topk", "demo_lr", "outer_lr", "outer_momentum",
    "sparseloco_lr", "sparseloco_beta", "sparseloco_chunk", "sparseloco_topk", "overlap_steps",
    "sparseloco_variant", "sparseloco_tile",
    "mix_alpha", "vocab_size", "seq_len", "batch_size", "seed", "round_timeout",
    "join_timeout", "heartbeat_timeout", "quorum_timeout", "run_dir", "cache_dir", "eval_every",
    "eval_batches", "checkpoint_every", "log_every", "log_to", "score_rows", "score_threshold",
    "score_turns",
}


def test_the_settings_cover_every_field() -> None:
    covered = {k for setting in SETTINGS for k in setting} | ON_THEIR_OWN
    assert set(RunConfig.model_fields) == covered, set(RunConfig.model_fields) ^ covered


def test_every_refusal_of_a_pair_is_a_row_of_the_table() -> None:
    """Validate every pair of settings: what is refused must be refused by the first rule of
    the table that the pair trips, with that rule's words; a refusal written anywhere else
    (a check in config.py, an algorithm's check_run) fails here, naming the pair."""
    outside, refused = [], 0
    for a, b in itertools.combinations_with_replacement(SETTINGS, 2):
        if set(a) & set(b) and a != b:
            continue  # two values of one field
        values = {**a, **b}
        try:
            _built(values)
            continue
        except ValueError as exc:
            message = str(exc)
        rule = next((r for r in matrix.RULES if r.scope is None
                     and r.refuses(RunConfig.model_construct(**values))), None)
        if rule is None or rule.why(RunConfig.model_construct(**values)) not in message:
            outside.append((values, " ".join(message.split())[-220:]))
        refused += 1
    assert not outside, "\n".join(f"{v}: {m}" for v, m in outside)
    assert refused > 50  # the pairs do reach the table's rows


def test_refusals_are_raised_in_one_place() -> None:
    """No copy of a row's words in the sources outside farlink/matrix.py: a refusal raised
    elsewhere could drift from its row."""
    from pathlib import Path

    import farlink

    root = Path(farlink.__file__).parent
    sources = {p: p.read_text() for p in root.rglob("*.py") if p.name != "matrix.py"}
    phrases = ["does not run with this", "overlap_global apply to", "time-budgeted rounds) applies",
               "Moshpit groups smaller than the swarm) runs", "cannot take its islands",
               "starts its own Lighthouses", "use in-process link emulation",
               "emulated namespaces use the torchft", "a swarm trains on the hivemind",
               "give the run secret once", "give either topology", "island_seconds needs",
               "exchanges each rank's gradient shard", "ranks of a replica group on one GPU",
               "sends DCT top-k coefficients", "own error feedback in the momentum"]
    found = {(str(p.relative_to(root)), phrase) for p, text in sources.items()
             for phrase in phrases if phrase in text}
    # the library's own guards, for callers that no RunConfig checked (farlink.Optimizer's
    # users build algorithms and secrets themselves)
    library_guards = {("robust/auth.py", "give the run secret once"),
                      ("sync/demo.py", "sends DCT top-k coefficients"),
                      ("sync/demo.py", "own error feedback in the momentum")}
    assert found == library_guards, found - library_guards


def test_farlink_matrix_prints_the_table_and_its_json() -> None:
    def run(*args: str) -> str:  # the CLI app in this process: it only prints
        from typer.testing import CliRunner

        from farlink.cli import app

        result = CliRunner().invoke(app, ["matrix", *args])
        assert result.exit_code == 0 and result.exception is None, result.output
        return result.stdout

    text = run()
    assert f"{len(ROWS)} pairs: {len(SUPPORTED)} supported, {len(REFUSED)} refused" in text
    assert "REFUSED    algorithm=demo x round_seconds\n" in text
    assert "supported  algorithm=diloco x round_seconds\n" in text
    rows = json.loads(run("--json", "--refused"))
    assert len(rows) == len(REFUSED) and all(not r["supported"] and r["reason"] for r in rows)
    assert {r["reason"] for r in rows} == {r.reason for r in REFUSED}
