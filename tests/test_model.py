"""Tests for the GPT decoder: shapes, causality, tying, sizing, rotary geometry, learnability."""

from __future__ import annotations

import math

import pytest
import torch

from farlink.model import GPT, PRESETS, GPTConfig, apply_rotary, preset_config, rotary_tables

torch.set_num_threads(1)

MICRO = GPTConfig(vocab_size=97, n_layer=2, n_head=2, d_model=32, d_ff=64, seq_len=16)


def test_forward_shapes_and_loss() -> None:
    torch.manual_seed(0)
    model = GPT(MICRO)
    idx = torch.randint(0, MICRO.vocab_size, (3, 10))
    logits, loss = model(idx)
    assert logits.shape == (3, 10, MICRO.vocab_size)
    assert loss is None
    logits, loss = model(idx, idx)
    assert loss is not None and loss.shape == () and torch.isfinite(loss)


def test_rejects_bad_input() -> None:
    model = GPT(MICRO)
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.zeros(1, MICRO.seq_len + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="batch, time"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="targets shape"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))


def test_causal_future_token_does_not_change_past_logits() -> None:
    torch.manual_seed(1)
    model = GPT(MICRO).eval()
    idx = torch.randint(0, MICRO.vocab_size, (2, 12))
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % MICRO.vocab_size
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_tied_embeddings_share_storage() -> None:
    model = GPT(MICRO)
    assert model.lm_head.weight is model.embed.weight
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert "lm_head.weight" not in dict(model.named_parameters())


@pytest.mark.parametrize("name", ["nano", "tiny", "small"])
def test_parameter_count_analytic_matches_module(name: str) -> None:
    config = PRESETS[name]
    assert GPT(config).num_parameters() == config.num_parameters()


def test_preset_sizes_are_in_their_class() -> None:
    expected = {"nano": (2e5, 5e5), "tiny": (1e6, 2e6), "small": (5e6, 8e6), "125m": (110e6, 140e6),
                "350m": (330e6, 380e6), "1b": (1.0e9, 1.5e9), "10b": (9.5e9, 11.5e9)}
    for name, (low, high) in expected.items():
        assert low <= PRESETS[name].num_parameters() <= high, name


def test_flops_per_token_formula() -> None:
    c = PRESETS["125m"]
    assert c.flops_per_token() == 6 * c.num_parameters() + 12 * c.n_layer * c.d_model * c.seq_len
    assert c.flops_per_token(seq_len=1) < c.flops_per_token()


def test_preset_config_overrides_and_unknown_name() -> None:
    config = preset_config("tiny", vocab_size=300, seq_len=64)
    assert (config.vocab_size, config.seq_len) == (300, 64)
    assert PRESETS["tiny"].vocab_size == 4096  # the preset itself is untouched
    with pytest.raises(ValueError, match="tiny.*small.*125m"):
        preset_config("huge")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(vocab_size=10, n_layer=1, n_head=3, d_model=32, d_ff=64, seq_len=8)
    with pytest.raises(ValueError, match="positive"):
        GPTConfig(vocab_size=0, n_layer=1, n_head=2, d_model=32, d_ff=64, seq_len=8)


def test_init_is_deterministic_and_gpt2_scaled() -> None:
    torch.manual_seed(123)
    a = GPT(PRESETS["tiny"])
    torch.manual_seed(123)
    b = GPT(PRESETS["tiny"])
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    n_layer = PRESETS["tiny"].n_layer
    residual_std = a.blocks[0].mlp.proj.weight.std().item()
    assert residual_std == pytest.approx(0.02 / math.sqrt(2 * n_layer), rel=0.05)
    assert a.blocks[0].mlp.gate.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert a.embed.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_loss_at_init_is_about_log_vocab() -> None:
    torch.manual_seed(0)
    config = PRESETS["tiny"]
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (4, 64))
    targets = torch.randint(0, config.vocab_size, (4, 64))
    _, loss = model(idx, targets)
    assert loss is not None
    assert abs(loss.item() - math.log(config.vocab_size)) < 0.1


def test_rotary_dot_product_depends_only_on_offset() -> None:
    torch.manual_seed(0)
    head_dim, seq_len = 16, 64
    cos, sin = rotary_tables(head_dim, seq_len)
    q = torch.randn(head_dim, dtype=torch.float64)
    k = torch.randn(head_dim, dtype=torch.float64)
    # Same vector placed at every position, then rotated.
    rq = apply_rotary(q.expand(seq_len, head_dim), cos.double(), sin.double())
    rk = apply_rotary(k.expand(seq_len, head_dim), cos.double(), sin.double())
    for offset in (0, 3, 17):
        dots = torch.stack([rq[m] @ rk[m - offset] for m in range(offset, seq_len)])
        torch.testing.assert_close(dots, dots[0].expand_as(dots), rtol=1e-5, atol=1e-5)
    # ... and it does change with the offset, so the check above is not vacuous.
    assert not torch.isclose(rq[10] @ rk[10], rq[10] @ rk[7])
    # Rotation preserves norms.
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(seq_len))


def test_tiny_model_overfits_one_batch() -> None:
    torch.manual_seed(0)
    config = preset_config("tiny", vocab_size=256, seq_len=32)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (4, 33))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _, initial = model(inputs, targets)
    assert initial is not None
    for _ in range(50):
        _, loss = model(inputs, targets)
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.3 * initial.item()
