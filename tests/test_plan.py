"""Planner: formulas against hand computation, monotonicity, tables, CLI, published checks."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from farlink.links import LinkError, load_links
from farlink.plan import (
    PlanInputError,
    Scenario,
    codec_cost,
    load_hardware,
    parse_model_size,
    plan,
    plan_many,
    predict_round,
    required_bandwidth,
)
from farlink.plan.network import butterfly_allreduce, ring_allgather, ring_allreduce
from farlink.plan.published import published_checks, write_published_report
from farlink.plan.validate import compare, write_validation_report
from farlink.plan.variability import churn_factor, slowest_link_factor, straggler_factor

# --- collectives -----------------------------------------------------------------------------


def test_ring_allreduce_by_hand():
    # 4 workers, 1 GB, 1 Gbit/s, 10 ms: sends 2*3/4 GB = 1.5 GB -> 12 s + 6 hops * 10 ms
    c = ring_allreduce(1e9, 4, 1e9, 0.01)
    assert c.bytes_sent == pytest.approx(1.5e9)
    assert c.seconds == pytest.approx(12.0 + 0.06)


def test_ring_bytes_match_comm_base_accounting():
    from farlink.comm.base import ring_allgather_bytes, ring_allreduce_bytes

    for n in (2, 3, 7, 14):
        assert ring_allreduce(1_000_003, n, 1e9, 0).bytes_sent == pytest.approx(
            ring_allreduce_bytes(1_000_003, n), abs=1)
        assert ring_allgather(1_000_003, n, 1e9, 0).bytes_sent == ring_allgather_bytes(1_000_003, n)


def test_allgather_and_butterfly_by_hand():
    g = ring_allgather(1e6, 5, 8e6, 0.1)  # 4 MB at 1 MB/s + 4 hops
    assert g.bytes_sent == 4e6 and g.seconds == pytest.approx(4.0 + 0.4)
    b = butterfly_allreduce(1e6, 5, 8e6, 0.1)  # 1.6 MB at 1 MB/s + 2 phases
    assert b.bytes_sent == pytest.approx(1.6e6) and b.seconds == pytest.approx(1.6 + 0.2)
    assert ring_allreduce(1e6, 1, 8e6, 0.1).seconds == 0.0


def test_collective_rejects_bad_input():
    with pytest.raises(PlanInputError):
        ring_allreduce(1e6, 4, 0.0, 0.01)


# --- payloads --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec,per_param",
    [("fp32", 4.0), ("none", 4.0), ("fp16", 2.0), ("bf16", 2.0),
     ("int8", 1 + 2 / 64), ("int4", 0.5 + 2 / 64), ("int8+ef", 1 + 2 / 64),
     ("int8:128:fp32", 1 + 4 / 128),
     # fp32 values, varint gaps: 1 byte, a second one for the gaps of 128 or more
     ("topk", 0.01 * (4 + 1 + 0.99**128)), ("topk:0.05:fp16", 0.05 * (2 + 1 + 0.95**128)),
     # DeMo: 32 of the 4096 coefficients of a 64x64 tile, fp32 value and uint16 index each
     ("dct_topk", 32 / 4096 * 6), ("dct_topk:64:32", 32 / 4096 * 6),
     ("dct_topk:64:32:fp16", 32 / 4096 * 4), ("dct_topk:8:16", 16 / 64 * 5)],
)
def test_payload_bytes_per_codec(spec, per_param):
    assert codec_cost(spec).bytes_per_param == pytest.approx(per_param)
    assert codec_cost(spec).payload_bytes(1000) == pytest.approx(1000 * per_param)


# every codec a run can send with, as a run names it; SparseLoCo's own is built by the algorithm
REAL_MODEL_SPECS = ["fp32", "fp16", "bf16", "int8", "int4", "int8:128:fp32", "topk",
                    "topk:0.05:fp16", "dct_topk", "dct_topk:64:32", "dct_topk:64:32:fp16",
                    "dct_topk:32:16", "sparseloco", "sparseloco:1024:8", "sparseloco:tiles",
                    "sparseloco:tiles:32:16"]


@pytest.fixture(scope="module")
def tiny_model_tensors():
    """The bench's model (the tiny preset, a real GPT) and a pseudo-gradient-like update of
    each of its tensors."""
    import torch

    from farlink.model import GPT, preset_config

    torch.manual_seed(0)
    return [torch.randn(p.shape) * 1e-3 for p in GPT(preset_config("tiny")).parameters()]


@pytest.mark.parametrize("spec", REAL_MODEL_SPECS)
def test_planner_payload_is_what_the_codec_encodes_on_a_real_model(spec, tiny_model_tensors):
    """The planner prices a whole model's update from its parameter count; the codec's own
    encoded bytes of every tensor of the tiny preset must agree within 5% (only 1-D tensors
    and partial tiles, a few % of this small model, are not priced exactly). DeMo's
    ``dct_topk:64:32`` was once priced as 32 of every 64 values: 41x its real size."""
    from farlink.codecs import make_codec
    from farlink.sync.sparseloco import SparseTwoBitCodec
    from farlink.sync.sparseloco_tiles import TiledTwoBitCodec

    name, _, arg = spec.partition(":")
    numbers = [int(a) for a in arg.split(":") if a.isdigit()]
    codec = make_codec(spec) if name != "sparseloco" else TiledTwoBitCodec(*numbers) \
        if arg.startswith("tiles") else SparseTwoBitCodec(*numbers)
    encoded = sum(len(codec.encode(t)) for t in tiny_model_tensors)
    n_params = sum(t.numel() for t in tiny_model_tensors)
    assert codec_cost(spec).payload_bytes(n_params) == pytest.approx(encoded, rel=0.05)


@pytest.mark.parametrize("spec", ["zip", "topk:2", "topk:x", "dct_topk:x", "dct_topk:0:32",
                                  "dct_topk:64:32:int8", "int8:0", "int4:64:int8"])
def test_bad_codec_specs(spec):
    with pytest.raises(PlanInputError):
        codec_cost(spec)


# --- rounds ----------------------------------------------------------------------------------


def test_diloco_round_by_hand():
    # 1e9 params fp32 = 4 GB; 8 workers; 1 Gbit/s; 50 ms; 100 steps of 2 s. Gloo hops cost a
    # round trip (14 x 100 ms); the quorum asks a Lighthouse half-way (50 ms round trip), then
    # the members' heal announcements are gathered (two ring all-gathers: 14 x 100 ms).
    r = predict_round("diloco", 8, 2.0, 1e9, 0.05, n_params=1e9, inner_steps=100)
    comm = 2 * 7 / 8 * 4e9 * 8 / 1e9 + 14 * 0.1 + 0.05 + 14 * 0.1
    assert r.compute_seconds == 200.0
    assert r.comm_seconds == pytest.approx(comm)
    assert r.round_seconds == pytest.approx(200.0 + comm)
    assert r.utilization == pytest.approx(200.0 / (200.0 + comm))
    assert r.bytes_sent_per_round == pytest.approx(2 * 7 / 8 * 4e9)


def test_ddp_and_demo_sync_every_step():
    ddp = predict_round("ddp", 4, 1.0, 1e9, 0.0, n_params=1e8, inner_steps=50)
    assert ddp.steps_per_round == 1
    assert ddp.comm_seconds == pytest.approx(2 * 3 / 4 * 4e8 * 8 / 1e9)
    demo = predict_round("demo", 4, 1.0, 1e9, 0.01, n_params=1e8, codec="dct_topk")
    s = 1e8 * 32 / 4096 * 6
    # all-gather of the 8-byte lengths, then of the payloads: 2 x 3 hops of one round trip;
    # then of the 4 received slots' 8-byte digests (lengths, digests): 6 hops more; the heal
    # announcements' gather after the quorum as many again
    digests = 3 * 8 + 3 * 4 * 8
    assert demo.bytes_sent_per_round == pytest.approx(3 * s + 3 * 8 + digests)
    assert demo.comm_seconds == pytest.approx((3 * s + 3 * 8 + digests) * 8 / 1e9 + 6 * 0.02
                                              + 6 * 0.02 + 0.01 + 6 * 0.02)
    with pytest.raises(PlanInputError):
        predict_round("demo", 4, 1.0, 1e9, 0.0, n_params=1e8, codec="int8")


def test_streaming_overlap_by_hand():
    # fragment payload 1e8 params * 4 B / 4 = 1e8 B; 2 workers -> sends 1e8 B = 0.8 s at 1 Gbit/s
    kw = {"n_params": 1e8, "inner_steps": 100, "fragments": 4, "codec": "fp32"}
    frag = 2 * 1 / 2 * 1e8 * 8 / 1e9 + 2 * 0.0
    hidden = predict_round("streaming_diloco", 2, 1.0, 1e9, 0.0, overlap_steps=1, **kw)
    assert hidden.comm_seconds == pytest.approx(4 * frag)
    assert hidden.exposed_comm_seconds == pytest.approx(0.0)  # 0.8 s hides under one 1 s step
    assert hidden.utilization == pytest.approx(1.0)
    partly = predict_round("streaming_diloco", 2, 0.5, 1e9, 0.0, overlap_steps=1, **kw)
    assert partly.exposed_comm_seconds == pytest.approx(4 * (frag - 0.5))
    assert partly.round_seconds == pytest.approx(50.0 + 4 * (frag - 0.5))
    assert partly.hidden_comm_seconds == pytest.approx(4 * 0.5)
    none = predict_round("streaming_diloco", 2, 0.5, 1e9, 0.0, overlap_steps=0, **kw)
    blocking = predict_round("diloco", 2, 0.5, 1e9, 0.0, n_params=1e8, inner_steps=100)
    assert none.round_seconds == pytest.approx(blocking.round_seconds)


def test_streaming_link_saturation_bounds_round():
    # fragments take 30 s each, overlap window is 5 s, compute per round 100 s: the link needs
    # 4 * 30 = 120 s per round, which no overlap can hide.
    r = predict_round("streaming_diloco", 2, 1.0, 8e6, 0.0, payload_bytes=120e6,
                      inner_steps=100, fragments=4, overlap_steps=5)
    assert r.comm_seconds == pytest.approx(120.0)
    assert r.round_seconds == pytest.approx(max(100 + 4 * 25, 120.0))


def test_measured_payload_overrides_codec_estimate():
    r = predict_round("diloco", 3, 1.0, 8e6, 0.0, payload_bytes=3e6, inner_steps=10)
    assert r.payload_bytes == 3e6
    assert r.comm_seconds == pytest.approx(2 * 2 / 3 * 3e6 * 8 / 8e6)


def test_hivemind_backend_has_fewer_latency_terms():
    ring = predict_round("diloco", 16, 1.0, 1e9, 0.1, n_params=1e6, inner_steps=10)
    bfly = predict_round("diloco", 16, 1.0, 1e9, 0.1, n_params=1e6, inner_steps=10,
                         backend="hivemind")
    # 30 ring hops of a round trip plus the Lighthouse quorum and the heal check's 30 more
    # hops, against 2 one-way phases (hivemind runs no heal check)
    assert ring.comm_seconds - bfly.comm_seconds == pytest.approx(
        30 * 0.2 + 0.1 + 30 * 0.2 - 2 * 0.1)


def test_dense_codecs_are_all_reduced_and_sparse_ones_gathered_as_farlink_runs_them():
    # int8 payload P: gathered, each of 4 workers sends 3 P (plus 3 lengths); all-reduced
    # (farlink's compressed all-reduce, the default for dense codecs), 2 * 3/4 P. With 14
    # workers gathering int8 costs more bytes than all-reducing fp32; all-reducing it, about a
    # quarter (INTELLECT-1's int8 ring). A gather is followed by one of the received slots'
    # digests (4 x 8 bytes, after their lengths), which checks for equivocation.
    digests = 3 * 8 + 3 * 4 * 8
    p = 1e6 * (1 + 2 / 64)
    gathered = predict_round("diloco", 4, 1.0, 1e9, 0.0, n_params=1e6, codec="int8",
                             exchange="gather")
    reduced = predict_round("diloco", 4, 1.0, 1e9, 0.0, n_params=1e6, codec="int8")
    assert gathered.bytes_sent_per_round == pytest.approx(3 * p + 3 * 8 + digests)
    assert reduced.bytes_sent_per_round == pytest.approx(1.5 * p)
    int8_14 = predict_round("diloco", 14, 1.0, 1e9, 0.0, n_params=1e6, codec="int8",
                            exchange="gather")
    fp32_14 = predict_round("diloco", 14, 1.0, 1e9, 0.0, n_params=1e6, codec="fp32")
    assert int8_14.bytes_sent_per_round > fp32_14.bytes_sent_per_round
    int8_auto = predict_round("diloco", 14, 1.0, 1e9, 0.0, n_params=1e6, codec="int8")
    assert int8_auto.bytes_sent_per_round == pytest.approx(
        fp32_14.bytes_sent_per_round * (1 + 2 / 64) / 4)
    # sparse payloads stay gathered: top-k and SparseLoCo (now priced: 2-bit values and 12-bit
    # indices of 64 entries per 4096)
    topk = predict_round("diloco", 4, 1.0, 1e9, 0.0, n_params=1e6, codec="topk")
    topk_bytes = 1e6 * 0.01 * (4 + 1 + 0.99**128)  # fp32 values, varint gaps
    assert topk.bytes_sent_per_round == pytest.approx(3 * topk_bytes + 3 * 8 + digests)
    sparse = predict_round("sparseloco", 4, 1.0, 1e9, 0.0, n_params=4096e3,
                           codec="sparseloco")
    assert sparse.bytes_sent_per_round == pytest.approx(3 * 1000 * 64 * 14 / 8 + 3 * 8 + digests)
    with pytest.raises(PlanInputError, match="exchange"):
        predict_round("diloco", 4, 1.0, 1e9, 0.0, n_params=1e6, exchange="magic")


def test_local_seconds_and_coordinator_round_trip_add_to_every_sync():
    base = predict_round("streaming_diloco", 4, 1.0, 1e9, 0.0, n_params=1e6, inner_steps=40,
                         fragments=4, overlap_steps=0)
    more = predict_round("streaming_diloco", 4, 1.0, 1e9, 0.0, n_params=1e6, inner_steps=40,
                         fragments=4, overlap_steps=0, local_seconds=0.5, coordinator_rtt_s=0.25)
    assert more.round_seconds - base.round_seconds == pytest.approx(4 * 0.75)
    alone = predict_round("ddp", 1, 1.0, 1e9, 0.1, n_params=1e6)
    assert alone.round_seconds == pytest.approx(1.0)  # a lone worker asks no quorum


def test_every_torchft_sync_pays_the_heal_checks_round_trips():
    """After each quorum the torchft backend gathers every member's heal announcement (step and
    state fingerprint): two ring all-gathers, 2 (n-1) Gloo hops of a round trip each. A 4-worker
    cross-region DDP run (40 ms) measured 0.76 s of quorum per step where the planner, without
    it, priced 0.04 s plus stragglers. hivemind and in-process emulation run no such check."""
    from farlink.plan.network import heal_check

    assert heal_check("torchft", 4, 0.04).seconds == pytest.approx(6 * 0.08)
    assert heal_check("torchft", 4, 0.04).bytes_sent == 0.0  # outside the round's byte count
    assert heal_check("torchft", 1, 0.04).seconds == 0.0
    assert heal_check("hivemind", 4, 0.04).seconds == heal_check("inprocess", 4, 0.04).seconds == 0.0
    ddp = predict_round("ddp", 4, 0.6, 150e6, 0.04, n_params=1e6)
    ring = 2 * 3 / 4 * 4e6 * 8 / 150e6 + 6 * 0.08
    assert ddp.comm_seconds == pytest.approx(ring + 0.04 + 6 * 0.08)
    assert ddp.bytes_sent_per_round == pytest.approx(2 * 3 / 4 * 4e6)


def test_a_gathered_exchange_also_gathers_the_digests_of_what_each_member_received():
    """farlink's gathered exchange checks for equivocation: after the messages, every member's
    digests of the slots it received are all-gathered and compared. That second gather's hops
    (2 (n-1) round trips on torchft) are what DeMo's every-step exchange measured beyond the
    first gather: 1.10 s per step where one gather priced 0.49 s (4 workers, 40 ms)."""
    from farlink.plan.network import SLOT_DIGEST_BYTES, allgather_bytes, gathered_exchange
    from farlink.robust.equivocation import SLOT_DIGEST

    assert SLOT_DIGEST_BYTES == SLOT_DIGEST
    one = allgather_bytes("torchft", 67392, 4, 150e6, 0.04)
    both = gathered_exchange("torchft", 67392, 4, 150e6, 0.04)
    assert both.seconds - one.seconds == pytest.approx(6 * 0.08 + (3 * 8 + 3 * 32) * 8 / 150e6)
    assert both.bytes_sent - one.bytes_sent == pytest.approx(3 * 8 + 3 * 32)
    assert gathered_exchange("torchft", 67392, 1, 150e6, 0.04).seconds == 0.0


# --- required bandwidth ----------------------------------------------------------------------


def test_required_bandwidth_matches_closed_form_and_round_trips():
    kw = {"algorithm": "diloco", "n_workers": 14, "step_seconds": 22.8, "latency_s": 0.1,
              "n_params": 10e9, "codec": "int8", "inner_steps": 100, "exchange": "allreduce"}
    b = required_bandwidth(0.95, **kw)
    compute = 2280.0
    sent = 2 * 13 / 14 * 10e9 * (1 + 2 / 64)
    # int8 goes by the compressed all-reduce: two all-to-alls (2 Gloo round trips each) and two
    # all-gathers of bytes (2 ring all-gathers of 13 round trips each): 4 + 4 x 13 = 56 hops of
    # 0.2 s (the dense ring's 26 before), plus the quorum's 0.1 s and the heal check's
    # 2 x 13 hops
    closed = 8 * sent / (compute * (1 / 0.95 - 1) - 56 * 0.2 - 0.1 - 26 * 0.2)
    assert b == pytest.approx(closed, rel=1e-6)
    assert predict_round(bandwidth_bps=b, **kw).utilization == pytest.approx(0.95, abs=1e-6)


@pytest.mark.parametrize("algorithm", ["diloco", "streaming_diloco", "ddp"])
def test_required_bandwidth_inverse_with_stragglers_and_churn(algorithm):
    # 5 ms: DDP's 28 round trips a step (ring and heal check) leave 90% reachable
    kw = {"algorithm": algorithm, "n_workers": 8, "step_seconds": 5.0, "latency_s": 0.005,
              "n_params": 1e8, "inner_steps": 100, "fragments": 4, "straggler_sigma": 0.01,
              "failures_per_hour": 0.01, "rejoin_seconds": 30.0}
    b = required_bandwidth(0.9, **kw)
    assert math.isfinite(b)
    assert predict_round(bandwidth_bps=b, **kw).utilization == pytest.approx(0.9, abs=1e-6)


def test_required_bandwidth_unreachable_when_latency_dominates():
    # DDP with 0.5 s steps and 26 hops of a 240 ms round trip: latency alone exceeds 5%.
    b = required_bandwidth(0.95, algorithm="ddp", n_workers=14, step_seconds=0.5,
                           latency_s=0.12, n_params=1e9)
    assert b == math.inf


# --- monotonicity ----------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["ddp", "diloco", "streaming_diloco", "demo"])
def test_more_bandwidth_never_lowers_utilization(algorithm):
    codec = "dct_topk" if algorithm == "demo" else "int8"
    utils = [predict_round(algorithm, 8, 2.0, bps, 0.03, n_params=1e9, codec=codec,
                           inner_steps=100, fragments=4).utilization
             for bps in (1e7, 1e8, 1e9, 1e10, 1e11)]
    assert utils == sorted(utils)
    assert utils[-1] > utils[0]


def test_bigger_h_sends_fewer_bytes_per_token():
    base = Scenario(n_params=1e9, n_workers=8, profile="cross-region")
    from dataclasses import replace

    per_token = [plan(replace(base, inner_steps=h)).bytes_per_token for h in (1, 10, 100, 500)]
    assert per_token == sorted(per_token, reverse=True)
    assert per_token[0] / per_token[-1] == pytest.approx(500)


# --- variability -----------------------------------------------------------------------------


def test_straggler_factor_properties():
    assert straggler_factor(1, 0.5) == 1.0 and straggler_factor(8, 0.0) == 1.0
    f8, f64 = straggler_factor(8, 0.2), straggler_factor(64, 0.2)
    assert 1.0 < f8 < f64
    assert straggler_factor(8, 0.2) == straggler_factor(8, 0.2)  # fixed seed
    # two workers: E[max] of two mean-1 lognormals = 1 + E|X1 - X2| / 2 (here via Phi):
    # E[max(X1,X2)] = 2 * Phi(sigma / sqrt 2) for mean-1 lognormals.
    from statistics import NormalDist

    sigma = 0.3
    assert straggler_factor(2, sigma) == pytest.approx(2 * NormalDist().cdf(sigma / math.sqrt(2)),
                                                       rel=0.01)


def test_slowest_link_factor_single_link_mean():
    # one link log-uniform in [r, 1]: E[1/B] = (1/r - 1) / ln(1/r)
    r = 0.125
    assert slowest_link_factor(1, r) == pytest.approx((1 / r - 1) / math.log(1 / r), rel=0.02)
    assert slowest_link_factor(14, r) > slowest_link_factor(2, r)
    assert slowest_link_factor(14, None) == 1.0


def test_churn_factor_by_hand():
    # 1 failure per worker-hour, 600 s rounds, 60 s exposed, 120 s rejoin, 4 workers
    lam = 1 / 3600
    expect = 1 - lam * (300 + 120) - 4 * lam * 60**2 / (2 * 600)
    assert churn_factor(4, 1.0, 600, 60, 120) == pytest.approx(expect)
    assert churn_factor(4, 0.0, 600, 60, 120) == 1.0


# --- tables ----------------------------------------------------------------------------------


def test_builtin_tables_have_the_documented_entries():
    hw, links = load_hardware(), load_links()
    assert {"h100", "a100", "rtx3080", "rtx4090", "cpu-core"} <= set(hw)
    assert {"datacenter", "cross-region", "intercontinental", "home", "loopback"} <= set(links)
    assert links["intercontinental"].bandwidth_bps == 200e6
    assert links["intercontinental"].latency_s == pytest.approx(0.12)
    assert links["datacenter"].bandwidth_bps == 10e9 and links["datacenter"].latency_ms == 0.5
    assert links["cross-region"].bandwidth_bps == 1e9 and links["cross-region"].latency_ms == 40
    assert links["home"].bandwidth_bps == 50e6 and links["home"].latency_ms == 60
    assert all(g.spot_usd_per_hour <= g.on_demand_usd_per_hour for g in hw.values())


def test_bad_table_files_give_clear_errors(tmp_path):
    bad = tmp_path / "hw.toml"
    bad.write_text('[gpu.x]\nbf16_tflops = -1\nmemory_gib = 8\non_demand_usd_per_hour = 1\n')
    with pytest.raises(PlanInputError) as err:
        load_hardware(bad)
    text = str(err.value)
    assert "gpu.x.bf16_tflops" in text and "spot_usd_per_hour" in text and str(bad) in text
    broken = tmp_path / "links.toml"
    broken.write_text("[link.a\nbandwidth_mbit = 1")
    with pytest.raises(LinkError, match="not valid TOML"):
        load_links(broken)
    inverted = tmp_path / "inv.toml"
    inverted.write_text("[link.a]\nbandwidth_mbit = 10\nbandwidth_min_mbit = 20\nlatency_ms = 1\n")
    with pytest.raises(LinkError, match="bandwidth_min_mbit"):
        load_links(inverted)
    with pytest.raises(LinkError, match="cannot read"):
        load_links(tmp_path / "missing.toml")


# --- model sizes and plan() ------------------------------------------------------------------


def test_model_sizes():
    assert parse_model_size("1.3b")[0] == pytest.approx(1.3e9)
    assert parse_model_size("150M")[0] == pytest.approx(150e6)
    assert parse_model_size("7e9")[0] == 7e9
    assert parse_model_size(3_000_000)[0] == 3e6
    from farlink.model.config import PRESETS

    assert parse_model_size("10B")[0] == PRESETS["10b"].num_parameters()
    assert parse_model_size("tiny")[0] == PRESETS["tiny"].num_parameters()
    assert parse_model_size("125M")[0] == PRESETS["125m"].num_parameters()  # presets win
    for bad in ("banana", "-5B", "0"):
        with pytest.raises(PlanInputError):
            parse_model_size(bad)


def test_plan_compute_time_cost_and_wall_clock():
    s = Scenario(n_params=1e9, n_workers=4, gpu="a100", profile="datacenter", inner_steps=50,
                 gpus_per_worker=2, batch_tokens=1000, tokens=4e6, mfu=0.5)
    r = plan(s)
    step = 6 * 1e9 * 1000 / (312e12 * 0.5 * 2)
    assert r.round.step_seconds == pytest.approx(step)
    rounds = 4e6 / (4 * 1000 * 50)
    assert r.wall_clock_seconds == pytest.approx(rounds * r.round.round_seconds)
    assert r.gpu_hours == pytest.approx(r.wall_clock_seconds / 3600 * 8)
    assert r.cost_on_demand_usd == pytest.approx(r.gpu_hours * 1.79)
    assert r.cost_spot_usd < r.cost_on_demand_usd
    assert r.bytes_per_token == pytest.approx(r.round.bytes_sent_per_round / (1000 * 50))


def test_plan_flags_models_that_do_not_fit():
    r = plan(Scenario(n_params=10e9, n_workers=50, gpu="rtx3080", profile="home"))
    assert not r.fits_memory and r.notes


def test_plan_unknown_names():
    with pytest.raises(PlanInputError, match="unknown gpu"):
        plan(Scenario(n_params=1e9, n_workers=2, gpu="tpu9"))
    with pytest.raises(PlanInputError, match="unknown link profile"):
        plan(Scenario(n_params=1e9, n_workers=2, profile="mars"))
    with pytest.raises(PlanInputError, match="unknown algorithm"):
        plan(Scenario(n_params=1e9, n_workers=2, algorithm="gossip"))


def test_plan_many_orders_algorithms_sensibly_over_slow_links():
    results = {r.algorithm: r for r in plan_many(
        Scenario(n_params=10e9, n_workers=14, profile="intercontinental", codec="int8"))}
    assert results["ddp"].round.utilization < results["diloco"].round.utilization
    assert results["diloco"].round.utilization <= results["streaming_diloco"].round.utilization
    assert results["local_sgd"].round.round_seconds == results["diloco"].round.round_seconds


# --- CLI -------------------------------------------------------------------------------------


def _cli(*args):
    from farlink.cli import app

    return CliRunner().invoke(app, list(args))


def test_cli_table():
    res = _cli("plan", "--model", "10B", "--workers", "14", "--gpu", "h100", "--profile",
               "intercontinental", "--algorithm", "all", "--codec", "int8")
    assert res.exit_code == 0, res.output
    for word in ("ddp", "diloco", "streaming_diloco", "demo", "compute utilization",
                 "bandwidth for 95% utilization", "cost spot"):
        assert word in res.output


def test_cli_json_matches_api():
    res = _cli("plan", "--model", "1.3b", "--workers", "4", "--profile", "cross-region",
               "--algorithm", "diloco", "--inner-steps", "50", "--tokens", "1e11", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    (row,) = data["results"]
    api = plan(Scenario(n_params=1.3e9, n_workers=4, profile="cross-region", inner_steps=50,
                        tokens=1e11))
    assert row["algorithm"] == "diloco"
    assert row["round"]["utilization"] == pytest.approx(api.round.utilization)
    assert row["cost_spot_usd"] == pytest.approx(api.cost_spot_usd)


def test_cli_json_encodes_unreachable_bandwidth_as_null():
    res = _cli("plan", "--model", "10B", "--workers", "14", "--algorithm", "ddp", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["results"][0]["bandwidth_for_target_bps"] is None


@pytest.mark.parametrize(
    "args,message",
    [(("--gpu", "tpu9"), "unknown gpu"),
     (("--profile", "mars"), "unknown link profile"),
     (("--model", "banana"), "cannot read model size"),
     (("--codec", "zip"), "unknown codec"),
     (("--algorithm", "gossip"), "unknown algorithm")],
)
def test_cli_clear_errors(args, message):
    options = {"--model": "1b", "--workers": "4"} | dict(zip(args[::2], args[1::2]))
    argv = ["plan"] + [item for pair in options.items() for item in pair]
    res = _cli(*argv)
    assert res.exit_code == 2
    assert message in res.stderr
    assert "Traceback" not in res.output


def test_cli_user_table_files(tmp_path):
    links = tmp_path / "links.toml"
    links.write_text('[link.lab]\nbandwidth_mbit = 100\nlatency_ms = 5\n')
    res = _cli("plan", "--model", "125M", "--workers", "2", "--profile", "lab", "--links-file",
               str(links), "--algorithm", "diloco", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["results"][0]["link"]["bandwidth_mbit"] == 100
    bad = tmp_path / "bad.toml"
    bad.write_text('[link.lab]\nbandwidth_mbit = "fast"\nlatency_ms = 5\n')
    res = _cli("plan", "--model", "125M", "--workers", "2", "--links-file", str(bad))
    assert res.exit_code == 2 and "link.lab.bandwidth_mbit" in res.stderr


# --- published figures and validation reports ------------------------------------------------


def test_intellect1_lands_in_reported_range():
    checks = {c["name"]: c for c in published_checks()}
    util = checks["intellect1_compute_utilization"]
    assert 0.83 <= util["predicted"] <= 0.96 and util["passed"]
    assert checks["intellect1_allreduce_seconds"]["passed"]
    # bracketing: all links at 4 Gbit/s is better, all at 0.5 Gbit/s is worse
    d = util["details"]
    assert d["utilization_all_links_0.5gbit"] < util["predicted"] < d["utilization_all_links_4gbit"]


def test_communication_reduction_checks():
    checks = {c["name"]: c for c in published_checks()}
    assert checks["diloco_500x_less_communication"]["predicted"] == pytest.approx(500)
    assert checks["intellect1_bandwidth_reduction"]["predicted"] == pytest.approx(4 / (1 + 2 / 64) * 100)
    assert all(c["passed"] for c in checks.values())


def test_bench_planner_cli_writes_json_and_png(tmp_path):
    res = _cli("bench", "planner", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "planner_checks.json").read_text())
    assert {c["name"] for c in data["checks"]} >= {"intellect1_compute_utilization"}
    assert (tmp_path / "planner_checks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_relative_errors_by_hand(tmp_path):
    measured = [{"name": "a", "round_seconds": 10.0, "utilization": 0.5},
                {"name": "b", "round_seconds": 20.0, "utilization": 0.8}]
    predicted = [{"name": "b", "round_seconds": 22.0, "utilization": 0.8},
                 {"name": "a", "round_seconds": 9.0, "utilization": 0.55}]
    out = compare(measured, predicted)
    rs = out["metrics"]["round_seconds"]
    assert rs["n"] == 2
    assert rs["mean_abs_relative_error"] == pytest.approx((0.1 + 0.1) / 2)
    assert rs["mean_relative_error"] == pytest.approx((-0.1 + 0.1) / 2)
    assert out["metrics"]["utilization"]["max_abs_relative_error"] == pytest.approx(0.1)
    paths = write_validation_report(measured, predicted, tmp_path)
    assert json.loads(paths["json"].read_text())["metrics"]["round_seconds"]["n"] == 2
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no prediction"):
        compare(measured, predicted[:1])


def test_published_report_files(tmp_path):
    paths = write_published_report(tmp_path)
    assert paths["json"].exists() and paths["png"].stat().st_size > 1000


def test_steady_rounds_by_hand(tmp_path):
    """Two workers, H=2, three rounds; the first round (setup) is left out of every figure."""
    from farlink.bench.rounds import steady_rounds

    (tmp_path / "metrics").mkdir()
    # cumulative (compute, blocked, quorum, network, rounds) at the end of rounds 1..3
    logs = {"w0": [(2.0, 5.0, 0.5, 1.0, 5.0), (4.0, 6.0, 0.6, 1.4, 6.0), (6.0, 7.0, 0.7, 1.8, 7.0)],
            "w1": [(2.0, 5.0, 0.5, 1.0, 5.0), (4.4, 5.6, 0.5, 1.3, 5.6), (6.8, 6.2, 0.5, 1.6, 6.2)]}
    for worker, ends in logs.items():
        lines = [json.dumps({"kind": "start", "worker": worker})]
        for i, (c, b, q, n, r) in enumerate(ends, start=1):
            lines.append(json.dumps({"kind": "sync", "step": 2 * i, "compute_s": c, "comm_s": b,
                                     "quorum_s": q, "network_s": n, "rounds_s": r}))
        lines.append(json.dumps({"kind": "step", "step": 3, "compute_s": 99, "comm_s": 0}))
        (tmp_path / "metrics" / f"{worker}.jsonl").write_text("\n".join(lines) + "\n")
    s = steady_rounds(tmp_path, steps_per_round=2)
    # w0: 2 rounds of 4 s compute + 2 s blocked; w1: 4.8 s compute + 1.2 s blocked
    assert s.rounds == 2 and s.round_seconds == pytest.approx(3.0)
    assert s.utilization == pytest.approx((4 / 6 + 4.8 / 6) / 2)
    assert s.step_seconds == pytest.approx((1.0 + 1.2) / 2)
    # local per sync: w0 (2 - 0.2 - 0.8) / 2 = 0.5; w1 (1.2 - 0 - 0.6) / 2 = 0.3
    assert s.local_seconds == pytest.approx(0.4)
    assert s.quorum_seconds == pytest.approx(0.05) and s.network_seconds == pytest.approx(0.35)
    # per-round compute (2, 2.4) twice: log-deviations +-log(2.2/2) ... around the mean 2.2
    devs = [math.log(2 / 2.2), math.log(2.4 / 2.2)] * 2
    mean = sum(devs) / 4
    assert s.straggler_sigma == pytest.approx(math.sqrt(sum((d - mean) ** 2 for d in devs) / 4))
    assert s.first_round_extra_seconds == pytest.approx(7.0 - 3.0)
    with pytest.raises(ValueError, match="fewer than two"):
        steady_rounds(tmp_path, steps_per_round=4)


# --- the compressed all-reduce on a shared bottleneck -----------------------------------------


def test_straggler_spread_of_a_fragmented_round_is_measured_between_its_syncs(tmp_path):
    """A Streaming DiLoCo round holds several syncs, and each waits for the slowest worker since
    the previous one. Two workers whose compute between syncs alternates (1 s and 3 s, then 3 s
    and 1 s) spend the same 4 s per round: the per-round spread (0, once measured) hid the
    waits, the per-sync spread (log 1/2 and log 3/2 around the mean of 2 s) prices them."""
    from farlink.bench.rounds import steady_rounds

    (tmp_path / "metrics").mkdir()
    for worker, pattern in (("w0", (1.0, 3.0)), ("w1", (3.0, 1.0))):
        lines, compute = [], 0.0
        for sync in range(1, 9):  # H=4, two fragments: a sync every 2 steps, 4 rounds
            compute += pattern[sync % 2]
            lines.append(json.dumps({"kind": "sync", "step": 2 * sync, "compute_s": compute,
                                     "comm_s": 0.5 * sync, "quorum_s": 0.0,
                                     "network_s": 0.4 * sync, "rounds_s": 0.5 * sync}))
        (tmp_path / "metrics" / f"{worker}.jsonl").write_text("\n".join(lines) + "\n")
    whole_rounds = steady_rounds(tmp_path, steps_per_round=4)
    per_sync = steady_rounds(tmp_path, steps_per_round=4, syncs_per_round=2)
    assert whole_rounds.straggler_sigma == pytest.approx(0.0)
    assert per_sync.straggler_sigma == pytest.approx(
        (abs(math.log(1 / 2)) + abs(math.log(3 / 2))) / 2, rel=0.02)
    assert per_sync.straggler_sigma > 0.5
    # the prediction from it waits for the slowest worker at every sync
    kw = {"n_params": 1e6, "inner_steps": 4, "fragments": 2, "overlap_steps": 0}
    slow = predict_round("streaming_diloco", 2, 1.0, 1e9, 0.0,
                         straggler_sigma=per_sync.straggler_sigma, **kw)
    even = predict_round("streaming_diloco", 2, 1.0, 1e9, 0.0, **kw)
    assert slow.round_seconds > even.round_seconds + 1.0


def test_compressed_allreduce_prices_its_schedule_and_a_shared_link_splits_the_rate():
    """In-process emulation runs two all-to-alls (one hop each) and two ring all-gathers of
    control bytes (n-1 hops each); on a shared link every worker's bytes cross one wire, so each
    gets 1/n of its rate. fp32 stays on the dense ring."""
    from farlink.plan.network import compressed_allreduce

    cost = compressed_allreduce("inprocess", 8e6, 8, 1e8, 0.005)
    assert cost.bytes_sent == pytest.approx(2 * 7 / 8 * 8e6)
    assert cost.seconds == pytest.approx(8 * 14e6 / 1e8 + (2 + 2 * 7) * 0.005)
    own = predict_round("diloco", 8, 1.0, 1e8, 0.005, payload_bytes=8e6, codec="int8",
                        backend="inprocess")
    shared = predict_round("diloco", 8, 1.0, 1e8, 0.005, payload_bytes=8e6, codec="int8",
                           backend="inprocess", shared_link=True)
    assert own.comm_seconds == pytest.approx(cost.seconds)
    assert shared.comm_seconds == pytest.approx(8 * 8 * 14e6 / 1e8 + 16 * 0.005)
    assert shared.bytes_sent_per_round == own.bytes_sent_per_round
    fp32 = predict_round("diloco", 8, 1.0, 1e8, 0.005, payload_bytes=8e6, codec="fp32",
                         backend="inprocess")
    assert fp32.comm_seconds == pytest.approx(ring_allreduce(8e6, 8, 1e8, 0.005).seconds)
    assert load_links()["shared-20mbit"].shared


def test_the_planner_prices_an_emulated_compressed_all_reduce_on_a_shared_link():
    """Four peers as threads run the compressed all-reduce (int8 + error feedback) with every
    byte queued on one emulated 10 Mbit/s wire: the planner, given the measured local work,
    predicts the bytes within 1% and the round time within 20% (the bench's 5% target is
    checked on its full runs, docs/results/planner_validation-scale.json; a loaded test machine
    makes one short run noisier)."""
    from farlink.bench.scale_planner import NANO, measure
    from farlink.codecs import make_compressor
    from farlink.comm.base import LinkModel
    from farlink.links import LinkProfile

    profile = LinkProfile(name="shared-10", bandwidth_mbit=10, latency_ms=5, shared=True)
    local = measure(4, "int8+ef", "mean", None, rounds=3)
    shaped = measure(4, "int8+ef", "mean", LinkModel.of_profile(profile), rounds=3)
    numel = sum(math.prod(s) for s in NANO.values())
    payload = make_compressor("int8+ef").codec.max_payload_nbytes((numel,))
    guess = predict_round("diloco", 4, 1e-9, profile.bandwidth_bps, profile.latency_s,
                          payload_bytes=payload, codec="int8", backend="inprocess",
                          local_seconds=local["round_seconds"], shared_link=True)
    assert shaped["path"] == "allreduce"
    assert guess.bytes_sent_per_round == pytest.approx(shaped["bytes_sent_per_round"], rel=0.01)
    assert guess.round_seconds == pytest.approx(shaped["round_seconds"], rel=0.2), (
        guess.round_seconds, shaped, local)
