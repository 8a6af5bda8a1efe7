"""Hugging Face ``transformers`` models in and out of farlink (the optional ``hf`` extra).

In: ``--model hf:DIR`` trains a local model directory (a ``config.json``, and its weights when
it has them: continued pre-training). The algorithms only see an ``nn.Module``; what they need
from it is farlink's model contract, ``forward(idx, targets) -> (logits, loss)``, which
:class:`CausalLM` provides around any causal LM.

Out: farlink's own GPT *is* a Llama (pre-norm RMSNorm, rotary with the rotate-half pairing that
``transformers`` also uses, SwiGLU, no biases, tied embeddings), so :func:`to_llama` maps it onto
``LlamaForCausalLM`` by renaming tensors and splitting the fused q/k/v projection into three; no
weight is permuted or changed, and the logits agree to float rounding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from farlink.errors import ConfigError
from farlink.extras import require
from farlink.model.config import GPTConfig
from farlink.model.gpt import GPT

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def transformers(purpose: str = "Hugging Face models (hf:DIR, export --hf)"):  # noqa: ANN201
    return require("transformers", purpose)


class CausalLM(nn.Module):
    """A ``transformers`` causal LM behind farlink's model contract.

    farlink's sampler hands out ``(x, y)`` with ``y`` already shifted by one token, and farlink's
    GPT scores every one of the T positions. Passing ``labels=x`` to a Hugging Face model would
    make it shift again internally and score only T-1 positions, so the loss here is the
    cross-entropy of the model's logits against ``y`` itself: the same loss, on the same tokens,
    as for farlink's own model.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.hf = model

    @property
    def seq_len(self) -> int:
        return int(self.hf.config.max_position_embeddings)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.hf(input_ids=idx, use_cache=False).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def has_weights(directory: Path) -> bool:
    return any((directory / name).is_file() for name in WEIGHT_FILES)


def load_config(directory: Path) -> Any:
    """The directory's ``PretrainedConfig``, read locally (farlink never downloads)."""
    if not (Path(directory) / "config.json").is_file():
        raise ConfigError(f"{directory} has no config.json; give a directory written by a "
                          "transformers model's save_pretrained()")
    return transformers().AutoConfig.from_pretrained(str(directory), local_files_only=True)


def check_causal_lm(directory: Path, config: Any) -> None:
    """Refuse a directory whose model does not predict the next token (an encoder, a
    seq2seq or vision model): farlink trains and samples causal LMs only, and would otherwise
    fail later inside transformers with a message about mapping classes."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        kinds = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
        raise ConfigError(f"{directory} holds a {config.model_type!r} model ({kinds}), not a "
                          "causal language model; give a directory of a decoder that "
                          "AutoModelForCausalLM loads (Llama, GPT-2, Qwen, ...)")


def config_dict(directory: Path) -> dict:
    """The model config as JSON-ready data, for a run directory to keep."""
    return json.loads(load_config(directory).to_json_string(use_diff=False))


def from_config_dict(data: dict) -> CausalLM:
    """A freshly initialised model of the shape ``config_dict`` recorded (weights loaded later)."""
    tf = transformers()
    data = dict(data)
    config = tf.AutoConfig.for_model(data.pop("model_type"), **data)
    return CausalLM(tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32))


def check_fits(directory: Path, vocab_size: int, seq_len: int) -> Any:
    """The directory's config, once it is known to embed every token id and position the run
    will feed it (the launcher checks before any worker starts)."""
    config = load_config(directory)
    check_causal_lm(directory, config)
    if vocab_size > config.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} tokens but {directory}'s model embeds "
                          f"only {config.vocab_size}; give the model's own tokenizer "
                          "(--tokenizer) or a config.json with a larger vocab_size")
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and seq_len > max_positions:
        raise ConfigError(f"seq_len {seq_len} exceeds {directory}'s max_position_embeddings "
                          f"{max_positions}; lower --seq-len")
    return config


def load_model(directory: Path, vocab_size: int, seq_len: int) -> CausalLM:
    """The model of ``directory``: its weights if it has them (continued pre-training), else a
    fresh init from the global torch generator, so a shared seed gives every worker the same
    start. Refuses a tokenizer with more ids than the model has embeddings."""
    tf = transformers(f"--model hf:{directory}")
    config = check_fits(directory, vocab_size, seq_len)
    if has_weights(directory):
        model = tf.AutoModelForCausalLM.from_pretrained(str(directory), local_files_only=True,
                                                        dtype=torch.float32)
    else:
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return CausalLM(model)


def llama_config(config: GPTConfig, eos_token_id: int | None = None) -> Any:
    """The ``LlamaConfig`` of farlink's GPT of shape ``config``."""
    tf = transformers("export --hf")
    return tf.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.d_ff,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        num_key_value_heads=config.n_head,  # full multi-head attention, no grouped queries
        head_dim=config.head_dim,
        max_position_embeddings=config.seq_len,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        architectures=["LlamaForCausalLM"],
    )


def llama_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """farlink's GPT weights under ``LlamaForCausalLM``'s names (q/k/v split from ``qkv``)."""
    d = model.config.d_model
    out = {"model.embed_tokens.weight": model.embed.weight,
           "model.norm.weight": model.norm.weight,
           "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.blocks):
        prefix = f"model.layers.{i}."
        q, k, v = block.attn.qkv.weight.split(d, dim=0)  # forward splits the output the same way
        out.update({
            prefix + "input_layernorm.weight": block.attn_norm.weight,
            prefix + "self_attn.q_proj.weight": q,
            prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.o_proj.weight": block.attn.proj.weight,
            prefix + "post_attention_layernorm.weight": block.mlp_norm.weight,
            prefix + "mlp.gate_proj.weight": block.mlp.gate.weight,
            prefix + "mlp.up_proj.weight": block.mlp.up.weight,
            prefix + "mlp.down_proj.weight": block.mlp.proj.weight,
        })
    return {name: tensor.detach().clone() for name, tensor in out.items()}


def to_llama(model: GPT, eos_token_id: int | None = None) -> nn.Module:
    """A ``LlamaForCausalLM`` holding ``model``'s weights (every tensor checked: strict load)."""
    tf = transformers("export --hf")
    llama = tf.LlamaForCausalLM(llama_config(model.config, eos_token_id))
    llama.load_state_dict(llama_state_dict(model), strict=True)
    return llama.eval()
