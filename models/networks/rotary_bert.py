"""Post-norm BERTs with rotary positions: NomicBERT (Nussbaum et al. 2024, arXiv:2402.01613),
GTE's "new" architecture (gte-*-v1.5, gte-multilingual; Zhang et al. 2024, arXiv:2407.19669)
and Jina v3 (XLM-RoBERTa with rotary positions and per-task LoRA; Sturua et al. 2024,
arXiv:2409.10173).

The three share one network: word (+ token-type) embeddings and a LayerNorm, no position
table; each layer is x = norm(x + attn(x)), x = norm(x + mlp(x)) with RoPE on q and k. They
differ in biases, the MLP (NomicBERT and GTE: gated, act(gate(x)) * up(x); Jina: plain) and
the rotary schedule, all read from config.json. Every layer attends globally, so the spec's
method replaces all of them.

Both the names transformers saves and those of the published remote-code checkpoints load
(models.networks.NETWORKS); fused projections are split by the loader.

On a GPU (`fuse_projections`, which the loader calls for CUDA models without task adapters) a
layer runs q, k and v as one product and rotates q and k in one launch, gate and up as one
product and the activation times up in one kernel, and each residual add with its LayerNorm
in one kernel (kernels.add_layer_norm, kernels.gated): six launches fewer a layer and no
intermediate through memory. On a CPU the layers stay unfused, op for op as before.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from clusterserve.kernels import AttentionSpec, add_layer_norm, apply_rotary, attention, gated
from clusterserve.models.batch.packing import Packed
from clusterserve.models.batch.passes import Pass
from clusterserve.models.config import ACTIVATIONS, EncoderConfig
from clusterserve.models.networks.linear import Linear, fused
from clusterserve.models.networks.lora import AdaptedEmbedding, AdaptedLinear
from clusterserve.models.networks.rotary import packed_rotary
from clusterserve.models.networks.rows import by_rows


class RotaryBertEmbeddings(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.word = AdaptedEmbedding(config.vocab_size, config.hidden_size, config)
        # Inputs are single segments: only row 0 of the token-type table is ever used.
        self.token_type = (
            AdaptedEmbedding(config.type_vocab_size, config.hidden_size, config) if config.type_vocab_size else None
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, input_ids: Tensor, adapter: int | None) -> Tensor:
        x = self.word(input_ids, adapter)
        if self.token_type is not None:
            x = x + self.token_type(torch.zeros_like(input_ids[:1]), adapter)  # (1, C)
        return self.norm(x)


class RotaryBertAttention(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.interleaved = config.rope_interleaved
        c, bias = config.hidden_size, config.attention_bias
        self.q = AdaptedLinear(c, c, bias, config)
        self.k = AdaptedLinear(c, c, bias, config)
        self.v = AdaptedLinear(c, c, bias, config)
        self.out = AdaptedLinear(c, c, bias, config)
        self.qkv: Linear | None = None  # q, k and v as one product, once fuse() made it

    def fuse(self) -> None:
        self.qkv = fused(self.q, self.k, self.v)
        del self.q, self.k, self.v

    def forward(
        self, x: Tensor, packed: Packed, rotary: tuple[Tensor, Tensor], adapter: int | None, backend: str = "auto"
    ) -> Tensor:
        """x: (T, C) packed; rotary: cos, sin (T, 1, D) -> (T, C)."""
        t, c = x.shape

        def heads(y: Tensor) -> Tensor:
            return y.view(t, self.num_heads, -1)  # (T, H, D)

        def attend(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mask: Tensor | None) -> Tensor:
            return attention(q, k, v, spec, key_padding_mask=mask, backend=backend, check=packed.check)

        if self.qkv is not None:
            h = self.num_heads
            qkv = self.qkv(x).view(t, 3 * h, -1)  # (T, 3H, D): q's heads, k's, v's
            qk = apply_rotary(qkv[:, : 2 * h], *rotary, interleaved=self.interleaved, backend=backend)
            q, k, v = qk[:, :h], qk[:, h:], qkv[:, 2 * h :]
        else:
            q = apply_rotary(heads(self.q(x, adapter)), *rotary, interleaved=self.interleaved, backend=backend)
            k = apply_rotary(heads(self.k(x, adapter)), *rotary, interleaved=self.interleaved, backend=backend)
            v = heads(self.v(x, adapter))
        o = packed.attend(q, k, v, attend)
        return self.out(o.reshape(t, c), adapter)


class RotaryBertLayer(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        c, inner = config.hidden_size, config.intermediate_size
        self.attn = RotaryBertAttention(config)
        self.attn_norm = nn.LayerNorm(c, eps=config.norm_eps)
        self.gated = config.mlp_gated
        if self.gated:
            self.mlp_gate = AdaptedLinear(c, inner, config.mlp_bias, config)
            self.mlp_up = AdaptedLinear(c, inner, config.mlp_bias, config)
        else:
            self.mlp_in = AdaptedLinear(c, inner, config.mlp_bias, config)
        self.mlp_out = AdaptedLinear(inner, c, config.mlp_out_bias, config)
        self.mlp_norm = nn.LayerNorm(c, eps=config.norm_eps)
        self.mlp_gate_up: Linear | None = None  # gate and up as one product, once fuse() made it
        self.activation = config.activation
        self.act = ACTIVATIONS[config.activation]

    def fuse(self) -> None:
        self.attn.fuse()
        if self.gated:
            self.mlp_gate_up = fused(self.mlp_gate, self.mlp_up)
            del self.mlp_gate, self.mlp_up

    def mlp(self, x: Tensor, adapter: int | None, backend: str = "auto") -> Tensor:
        if self.mlp_gate_up is not None:
            return self.mlp_out(gated(self.mlp_gate_up(x), self.activation, backend))
        if self.gated:
            return self.mlp_out(self.act(self.mlp_gate(x, adapter)).mul_(self.mlp_up(x, adapter)), adapter)
        return self.mlp_out(self.act(self.mlp_in(x, adapter)), adapter)

    def forward(
        self, x: Tensor, packed: Packed, rotary: tuple[Tensor, Tensor], adapter: int | None, backend: str = "auto"
    ) -> Tensor:
        def add_norm(x: Tensor, branch: Tensor, norm: nn.LayerNorm) -> Tensor:
            return add_layer_norm(x, branch, norm.weight, norm.bias, norm.eps, backend)

        x = add_norm(x, self.attn(x, packed, rotary, adapter, backend), self.attn_norm)
        return add_norm(x, by_rows(lambda rows: self.mlp(rows, adapter, backend), x), self.mlp_norm)


class RotaryBertModel(nn.Module):
    """NomicBERT / GTE / Jina v3 encoder without any task head."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.embeddings = RotaryBertEmbeddings(config)
        self.layers = nn.ModuleList(RotaryBertLayer(config) for _ in range(config.num_layers))

    def fuse_projections(self) -> None:
        """One product for q, k and v and one for gate and up in every layer, in place of the
        separate ones (the module docstring); a model with task adapters keeps its products apart."""
        if not self.config.adapters:
            for layer in self.layers:
                layer.fuse()

    def begin(self, input_ids: Tensor, packed: Packed, backend: str = "auto", adapter: int | None = None) -> Pass:
        return Pass(self.embeddings(input_ids, adapter), packed, backend, adapter)

    def tables(self, state: Pass) -> None:
        """The rotary angles of every token, in `state.cache`."""
        cfg = self.config
        state.cached("rotary", lambda: packed_rotary(
            state.packed, cfg.head_dim, cfg.rope_theta, state.x.device,
            cfg.rope_type, cfg.rope_factor, cfg.rope_original_positions, cfg.rope_interleaved,
        ))  # fmt: skip

    def advance(self, state: Pass) -> None:
        self.tables(state)
        rotary = state.cache["rotary"]
        state.x = self.layers[state.done](state.x, state.packed, rotary, state.adapter, state.backend)
        state.done += 1

    def end(self, state: Pass) -> Tensor:
        return state.x
