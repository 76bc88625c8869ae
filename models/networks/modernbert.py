"""ModernBERT (Warner et al. 2024, arXiv:2412.13663): a long-context pre-norm encoder.

Rotary positions with one theta for the global layers and another for the local ones; every
`global_attn_every_n_layers`-th layer attends over the whole sequence and the rest over a
sliding window of `local_attention` tokens; a GeGLU MLP; LayerNorms without bias; a final
norm. The spec's attention method replaces the global layers only: local layers stay exact
windowed attention (`kernels.reference.local`), already linear in N.
Parameter names are HF's own.
"""

from __future__ import annotations

from torch import Tensor, nn

from clusterserve.kernels import AttentionSpec, apply_rotary, attention
from clusterserve.kernels.reference.local import local_attention
from clusterserve.models.batch.packing import Packed
from clusterserve.models.batch.passes import Pass
from clusterserve.models.config import ACTIVATIONS, EncoderConfig
from clusterserve.models.networks.linear import Linear
from clusterserve.models.networks.rotary import packed_rotary
from clusterserve.models.networks.rows import by_rows


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.norm(self.tok_embeddings(input_ids))


class ModernBertAttention(nn.Module):
    def __init__(self, config: EncoderConfig, is_global: bool):
        super().__init__()
        self.num_heads = config.num_heads
        # None for global layers; the full band width for local ones.
        self.window = None if is_global else config.local_attention
        self.Wqkv = Linear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.Wo = Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)

    def forward(self, x: Tensor, packed: Packed, rotary: tuple[Tensor, Tensor], backend: str = "auto") -> Tensor:
        """x: (T, C) packed; rotary: cos, sin (T, 1, D) per token -> (T, C)."""
        t, c = x.shape
        q, k, v = self.Wqkv(x).view(t, 3, self.num_heads, -1).unbind(1)  # (T, H, D) each
        q, k = apply_rotary(q, *rotary, backend=backend), apply_rotary(k, *rotary, backend=backend)

        def attend(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mask: Tensor | None) -> Tensor:
            if self.window is None:
                return attention(q, k, v, spec, key_padding_mask=mask, backend=backend, check=packed.check)
            return local_attention(q, k, v, self.window, key_padding_mask=mask)

        return self.Wo(packed.attend(q, k, v, attend).reshape(t, c))


class ModernBertMLP(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.Wi = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.Wo = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        inputs, gate = self.Wi(x).chunk(2, dim=-1)  # GeGLU: act(input) * gate
        return self.Wo(self.act(inputs).mul_(gate))


class ModernBertLayer(nn.Module):
    def __init__(self, config: EncoderConfig, index: int):
        super().__init__()
        self.is_global = config.is_global_layer(index)
        # The embedding norm already normalised layer 0's input.
        self.attn_norm = (
            nn.Identity()
            if index == 0
            else nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        )
        self.attn = ModernBertAttention(config, self.is_global)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)
        self.mlp = ModernBertMLP(config)

    def forward(self, x: Tensor, packed: Packed, rotary: tuple[Tensor, Tensor], backend: str = "auto") -> Tensor:
        x = x + self.attn(self.attn_norm(x), packed, rotary, backend)
        return x + by_rows(self.mlp, self.mlp_norm(x))


class ModernBertModel(nn.Module):
    """ModernBERT encoder without any task head."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(ModernBertLayer(config, i) for i in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)

    def begin(self, input_ids: Tensor, packed: Packed, backend: str = "auto", adapter: int | None = None) -> Pass:
        return Pass(self.embeddings(input_ids), packed, backend)

    def tables(self, state: Pass) -> None:
        """The rotary angles of every token for each theta its layers use, in `state.cache`."""
        cfg = self.config
        for theta in {self._theta(layer) for layer in self.layers}:
            state.cached(f"rotary {theta}", lambda: packed_rotary(state.packed, cfg.head_dim, theta, state.x.device))

    def advance(self, state: Pass) -> None:
        layer = self.layers[state.done]
        self.tables(state)
        state.x = layer(state.x, state.packed, state.cache[f"rotary {self._theta(layer)}"], state.backend)
        state.done += 1

    def end(self, state: Pass) -> Tensor:
        return self.final_norm(state.x)

    def _theta(self, layer: ModernBertLayer) -> float:
        return self.config.global_rope_theta if layer.is_global else self.config.local_rope_theta
