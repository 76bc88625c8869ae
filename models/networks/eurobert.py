"""EuroBERT (Boizard et al. 2025, arXiv:2503.05500): a Llama-style bidirectional encoder.

Pre-norm layers with RMSNorm, rotary positions, grouped-query attention (key / value heads
shared by num_heads / num_kv_heads query heads), a SwiGLU MLP and a final RMSNorm. Every layer
attends globally, so the spec's method replaces all of them. Parameter names are those of the
published checkpoints and of transformers (both Llama's).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from clusterserve.kernels import AttentionSpec, apply_rotary, attention
from clusterserve.models.batch.packing import Packed
from clusterserve.models.batch.passes import Pass
from clusterserve.models.config import ACTIVATIONS, EncoderConfig
from clusterserve.models.networks.linear import Linear
from clusterserve.models.networks.rotary import packed_rotary
from clusterserve.models.networks.rows import by_rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()  # the mean square in float32, as Llama computes it
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class EuroBertAttention(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        c, bias = config.hidden_size, config.attention_bias
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads or config.num_heads
        kv = self.num_kv_heads * config.head_dim
        self.q_proj = Linear(c, c, bias=bias)
        self.k_proj = Linear(c, kv, bias=bias)
        self.v_proj = Linear(c, kv, bias=bias)
        self.o_proj = Linear(c, c, bias=bias)

    def forward(self, x: Tensor, packed: Packed, rotary: tuple[Tensor, Tensor], backend: str = "auto") -> Tensor:
        """x: (T, C) packed; rotary: cos, sin (T, 1, D) -> (T, C)."""
        t, c = x.shape
        q = self.q_proj(x).view(t, self.num_heads, -1)  # (T, H, D)
        k = self.k_proj(x).view(t, self.num_kv_heads, -1)  # (T, Hkv, D)
        v = self.v_proj(x).view(t, self.num_kv_heads, -1)
        q, k = apply_rotary(q, *rotary, backend=backend), apply_rotary(k, *rotary, backend=backend)
        # Query head h reads key / value head h // group: repeat to one layout, (T, H, D).
        group = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

        def attend(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mask: Tensor | None) -> Tensor:
            return attention(q, k, v, spec, key_padding_mask=mask, backend=backend, check=packed.check)

        return self.o_proj(packed.attend(q, k, v, attend).reshape(t, c))


class EuroBertMLP(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        c, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(c, inner, bias=bias)
        self.up_proj = Linear(c, inner, bias=bias)
        self.down_proj = Linear(inner, c, bias=bias)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)).mul_(self.up_proj(x)))


class EuroBertLayer(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = EuroBertAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = EuroBertMLP(config)

    def forward(self, x: Tensor, packed: Packed, rotary: tuple[Tensor, Tensor], backend: str = "auto") -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), packed, rotary, backend)
        return x + by_rows(self.mlp, self.post_attention_layernorm(x))


class EuroBertModel(nn.Module):
    """EuroBERT encoder without any task head."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(EuroBertLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)

    def begin(self, input_ids: Tensor, packed: Packed, backend: str = "auto", adapter: int | None = None) -> Pass:
        return Pass(self.embed_tokens(input_ids), packed, backend)

    def tables(self, state: Pass) -> None:
        """The rotary angles of every token, in `state.cache`."""
        cfg = self.config
        state.cached("rotary", lambda: packed_rotary(
            state.packed, cfg.head_dim, cfg.rope_theta, state.x.device,
            cfg.rope_type, cfg.rope_factor, cfg.rope_original_positions,
        ))  # fmt: skip

    def advance(self, state: Pass) -> None:
        self.tables(state)
        state.x = self.layers[state.done](state.x, state.packed, state.cache["rotary"], state.backend)
        state.done += 1

    def end(self, state: Pass) -> Tensor:
        return self.norm(state.x)
