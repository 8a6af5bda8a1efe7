"""RunConfig composes the components' own configs, and what runs wrote before still loads.

tests/data/main-f9798a6/ holds the config.toml and config.json that ``write_run_config`` of
main at f9798a6 (before the components) wrote for a streaming_diloco run; it must load and resume
unchanged. A config file may also give a component's keys in its section (``[exchange]``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from farlink.config import (COMPONENTS, INVOCATION_FIELDS, SECTION_OF, ConfigError, RunConfig,
                            flatten, load_config)
from farlink.emulate.pairwise import EmulationOptions
from farlink.parallel.pipeline import PipelineOptions
from farlink.parallel.sharding import ReplicaGroupOptions
from farlink.robust.auth import TrustOptions
from farlink.sync.exchange import ExchangeOptions

SAVED = Path(__file__).parent / "data" / "main-f9798a6"


def test_a_config_toml_written_before_the_components_loads_and_resumes(tmp_path: Path) -> None:
    from farlink.train.rundir import plan_run_dir

    run_dir = tmp_path / "run"
    shutil.copytree(SAVED, run_dir)
    saved = json.loads((SAVED / "config.json").read_text())
    # as `farlink train --resume --config run/config.toml` reads it
    cfg = load_config(run_dir / "config.toml", {"resume": True, "run_dir": run_dir})
    dumped = cfg.model_dump(mode="json")
    # every saved value as it was; a field added since takes its default (its behaviour then)
    defaults = RunConfig().model_dump(mode="json")
    assert {k: v for k, v in dumped.items() if k != "run_dir"} == \
        {k: saved.get(k, defaults[k]) for k in dumped if k != "run_dir"}
    assert set(saved) <= set(dumped)
    assert (cfg.algorithm, cfg.codec, cfg.fragments, cfg.emulate_link) == \
        ("streaming_diloco", "int8+ef", 2, "home")
    resumed, link = plan_run_dir(cfg)  # RunDirError if the run's fixed fields changed
    assert resumed.run_dir == run_dir and link is None
    # as a worker reads it back (its invocation's own fields left to the command line)
    worker = load_config(run_dir / "config.toml", {"run_dir": run_dir}, ignore=INVOCATION_FIELDS)
    assert worker.model_dump() == {**cfg.model_dump(), "run_dir": run_dir}


def test_a_section_per_component_loads_as_the_flat_keys(tmp_path: Path) -> None:
    flat = tmp_path / "flat.toml"
    flat.write_text('[train]\nalgorithm = "diloco"\ncodec = "int8"\nauth = "secret"\n'
                    'ranks_per_worker = 2\nemulate_link = "home"\ninner_steps = 10\n')
    nested = tmp_path / "nested.toml"
    nested.write_text('algorithm = "diloco"\n[exchange]\ncodec = "int8"\n[trust]\n'
                      'auth = "secret"\n[replica_group]\nranks_per_worker = 2\n[emulation]\n'
                      'emulate_link = "home"\n[sync]\ninner_steps = 10\n')
    assert load_config(nested) == load_config(flat)
    assert load_config(nested).tree()["exchange"] == {"codec": "int8", "aggregator": "mean",
                                                      "screen_ratio": 10.0, "score": "none",
                                                      "score_rows": 2, "score_threshold": 0.25,
                                                      "score_turns": 3}


def test_a_config_file_with_the_earlier_site_section_loads_as_replica_group(tmp_path: Path) -> None:
    """``[site]`` was the replica group's section before it had that name."""
    earlier = tmp_path / "earlier.toml"
    earlier.write_text('[site]\nranks_per_worker = 2\nsharding = "ddp"\n')
    cfg = load_config(earlier)
    assert (cfg.ranks_per_worker, cfg.sharding) == (2, "ddp")
    assert cfg.tree()["replica_group"] == {"ranks_per_worker": 2, "sharding": "ddp"}
    twice = tmp_path / "twice.toml"
    twice.write_text("[site]\nranks_per_worker = 2\n[replica_group]\nranks_per_worker = 2\n")
    with pytest.raises(ConfigError, match="ranks_per_worker is given twice"):
        load_config(twice)


@pytest.mark.parametrize("text, says", [
    ('[exchange]\nauth = "secret"\n', r"\[exchange\] has no key 'auth': it belongs in \[trust\]"),
    ('[exchange]\nworkers = 2\n', "it is a top-level key"),
    ('[exchange]\ncodex = "int8"\n', "no such setting"),
    ('[network]\ntopology = "0,1|2,3"\n', r"\[network\] is not a section"),
    ('codec = "int8"\n[exchange]\ncodec = "int4"\n', "codec is given twice"),
])
def test_a_key_in_the_wrong_section_is_refused(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says):
        load_config(path)


def test_the_tree_holds_every_field_once_and_flattens_back() -> None:
    cfg = RunConfig(algorithm="hierarchical_diloco", islands="0,1|2,3", codec="int4+ef",
                    pipeline_micro_batches=2, slowdown="1,2")
    tree = cfg.tree()
    assert set(tree) >= set(COMPONENTS)
    assert flatten(tree) == cfg.model_dump()
    assert tree["sync"]["islands"] == "0,1|2,3" and tree["emulation"]["slowdown"] == "1,2"
    assert tree["exchange"]["codec"] == "int4+ef" and tree["algorithm"] == "hierarchical_diloco"
    for section, models in COMPONENTS.items():
        for model in models:
            assert all(SECTION_OF[name] == section for name in model.model_fields), model


def test_each_component_is_its_own_config_and_checks_its_own_values() -> None:
    cfg = RunConfig(codec="int8", auth="secret", ranks_per_worker=2, emulate_link="home")
    assert cfg.component("exchange") == ExchangeOptions(codec="int8")
    assert cfg.component("trust") == TrustOptions(auth="secret")
    assert cfg.component("replica_group") == ReplicaGroupOptions(ranks_per_worker=2)
    assert cfg.component("emulation") == EmulationOptions(emulate_link="home")
    assert type(cfg.component("sync")).__name__ == "DiLoCoOptions"
    with pytest.raises(ValueError, match="would reject honest updates"):
        ExchangeOptions(screen_ratio=0.5)
    with pytest.raises(ValueError, match="unknown codec"):
        ExchangeOptions(codec="int3")
    with pytest.raises(ValueError, match="auth 'x' unknown"):
        TrustOptions(auth="x")
    with pytest.raises(ValueError, match="activation_codec"):
        PipelineOptions(pipeline_stages=2, activation_codec="int3")
    with pytest.raises(ValueError, match="inter_link: unknown link profile 'moon'"):
        EmulationOptions(inter_link="moon")
    with pytest.raises(ValueError, match="slowdown factors must be >= 1"):
        EmulationOptions(slowdown="0.5")


def test_an_option_the_algorithm_does_not_read_is_refused_not_ignored() -> None:
    with pytest.raises(ConfigError, match="fragments is an option of streaming_diloco; diloco "
                       "does not read it: drop --fragments"):
        load_config(None, {"algorithm": "diloco", "fragments": 2})
    with pytest.raises(ConfigError, match="demo_lr is an option of demo"):
        load_config(None, {"algorithm": "sparseloco", "demo_lr": 0.01})
    # at its default, an option of another algorithm is what every saved config.toml holds
    assert load_config(None, {"algorithm": "diloco", "fragments": 4}).fragments == 4
