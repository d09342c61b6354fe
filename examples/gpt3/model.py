"""A GPT model built with megatron-core (its local layer spec) and synthetic tokens."""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_config import TransformerConfig


class HostDotProductAttention(DotProductAttention):
    """megatron-core's DotProductAttention without its CUDA-only parts (a
    scratch buffer on the current GPU, the CUDA RNG tracker around dropout),
    so the model also trains on CPU. Same maths: scaled scores, megatron's
    masked softmax, weighted values. Used only when ``device=cpu``."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=2), value.repeat_interleave(groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, h] -> [b, n, s, h]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        probs = self.attention_dropout(self.scale_mask_softmax(scores, attention_mask, self.softmax_offset))
        context = torch.matmul(probs, v).permute(2, 0, 1, 3).contiguous()
        return context.view(*context.shape[:2], self.hidden_size_per_partition)


def build(cfg, *, tensor_parallel: int, device: str) -> GPTModel:
    """The GPT of ``cfg.model`` (sizes) for this rank's tensor-parallel slice."""
    m = cfg.model
    config = TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size, tensor_model_parallel_size=tensor_parallel,
        hidden_dropout=m.dropout, attention_dropout=m.dropout, use_cpu_initialization=True,
        bf16=bool(cfg.get("bf16", False)), params_dtype=torch.bfloat16 if cfg.get("bf16", False) else torch.float32,
        pipeline_dtype=torch.bfloat16 if cfg.get("bf16", False) else torch.float32)
    spec = get_gpt_layer_local_spec()
    if device == "cpu":
        spec.submodules.self_attention.submodules.core_attention = HostDotProductAttention
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=m.vocab_size,
                     max_sequence_length=m.seq_length, position_embedding_type="learned_absolute")
    return model.to(device)


def batch(seed: int, iteration: int, dp_rank: int, *, micro_batch: int, seq_length: int, vocab_size: int,
          device: str) -> dict:
    """Synthetic tokens, a function of (seed, iteration, data-parallel rank):
    a resumed run sees exactly the batches a fault-free run saw."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + iteration) * 4099 + dp_rank)
    tokens = torch.randint(0, vocab_size, (micro_batch, seq_length + 1), generator=g)
    positions = torch.arange(seq_length).unsqueeze(0).expand(micro_batch, seq_length)
    mask = torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool), diagonal=1)  # True: hidden
    return {"input_ids": tokens[:, :-1].to(device), "position_ids": positions.to(device),
            "attention_mask": mask.to(device), "labels": tokens[:, 1:].to(device)}
