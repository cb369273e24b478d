"""The decoder shared by every supported architecture; they differ only in a few flags
(`ModelConfig`, from `models/architectures.py`).

Parameter names follow the HF checkpoints, with q/k/v merged into `qkv_proj` and gate/up into
`gate_up_proj` (see `models/weights.py`).
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl_backend.core import Context, get_global_ctx
from minisgl_backend.device_copy import host_to_device
from minisgl_backend.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl_backend.layers.fast_ops import gelu_tanh_and_mul, silu_and_mul, use_triton_kernels
from minisgl_backend.layers.linear import (MergedColumnParallelLinear, ParallelLinear,
                                           QKVParallelLinear, RowParallelLinear)
from minisgl_backend.layers.moe import MoEMLP
from minisgl_backend.layers.norm import GemmaRMSNorm, RMSNorm
from minisgl_backend.layers.rotary import RotaryEmbedding
from minisgl_backend.models.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.num_heads,
                                          config.num_kv_heads, config.head_dim, config.qkv_bias)
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size,
                                        config.o_bias)
        norm = _norm_class(config)
        if config.qk_norm:
            self.q_norm = norm(config.head_dim, config.rms_norm_eps)
            self.k_norm = norm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # The fused prologue kernel knows the plain RMSNorm only.
        self.fused_prologue_fits = not config.gemma
        window = config.window(layer_id)
        # Full-attention layers make the plain backend call (windows cost them nothing).
        self.backend_kwargs = {"window": window} if window else {}
        # Scales of an FP8 KV cache (stored = value / scale): the checkpoint's, else 1.0.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # The backends scale scores by head_dim ** -0.5; another scale is folded into q.
        scalar = config.query_pre_attn_scalar
        self.q_scale = (config.head_dim / scalar) ** 0.5 \
            if scalar and scalar != config.head_dim else 1.0

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                rope: RotaryEmbedding) -> torch.Tensor:
        return self.o_proj(self.attend(*self.qkv_proj(x), positions, rope))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               rope: RotaryEmbedding) -> torch.Tensor:
        """Attention of the projected q, k, v [tokens, heads * head_dim] (q/k norms, RoPE, the
        K/V store into the pool included); returns the output before o_proj. `positions`: the
        tokens' rows of the RoPE table (`RotaryEmbedding.table_rows`)."""
        q = q.view(q.shape[0], -1, self.head_dim)
        k = k.view(k.shape[0], -1, self.head_dim)
        v = v.view(v.shape[0], -1, self.head_dim)
        ctx = get_global_ctx()
        if use_triton_kernels(q) and self.fused_prologue_fits:
            # One kernel: q/k RMSNorm, RoPE, and K/V straight into the pool (one launch
            # instead of five to seven per layer, which is what small decode batches pay).
            q = self._fused_prologue(q, k, v, positions, rope, ctx)
            k = v = None  # already stored
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope.apply(positions, q, k)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return ctx.attn_backend.forward(q, k, v, self.layer_id, ctx.batch, **self.backend_kwargs)

    def _fused_prologue(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor, rope: RotaryEmbedding, ctx: Context
                        ) -> torch.Tensor:
        from kernels.qkv_prologue import fused_qk_norm_rope_store

        norm = self.q_norm is not None
        pool, layer = ctx.kv_pool, self.layer_id
        return fused_qk_norm_rope_store(
            q, k, v, positions, rope.cos_sin_cache(), ctx.batch.out_slots,
            pool.k_cache(layer), pool.v_cache(layer),
            q_norm_weight=self.q_norm.weight if norm else None,
            k_norm_weight=self.k_norm.weight if norm else None,
            eps=self.q_norm.eps if norm else 1e-6,
            k_scale=pool.k_scale(layer), v_scale=pool.v_scale(layer))


def _norm_class(config: ModelConfig) -> type[RMSNorm]:
    return GemmaRMSNorm if config.gemma else RMSNorm


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with SiLU or (Gemma) tanh-approximated GELU."""

    def __init__(self, hidden_size: int, intermediate_size: int, gelu_tanh: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_and_mul = gelu_tanh_and_mul if gelu_tanh else silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


# Layers with at most this many projection weights take the fused few-rows GEMVs: folding the
# norms and activations in pays on small layers; cuBLAS reads big weights faster.
FUSED_GEMV_MAX_LAYER_WEIGHTS = 32 * 2**20


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_id)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_id):
            self.mlp = MoEMLP(config.hidden_size, config.moe_intermediate_size,
                              config.num_experts, config.num_experts_per_tok,
                              config.norm_topk_prob)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.gemma)
        norm = _norm_class(config)
        self.input_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        # Gemma: post_attention_layernorm normalizes the attention output; the MLP input norm
        # is pre_feedforward_layernorm and its output is normalized too.
        self.post_attention_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.sandwich_norms = config.gemma
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.uses_local_rope = config.local_rope is not None and layer_id in config.sliding_layers
        self.fused_gemv_fits = (  # a plain dense layer, small enough, without biases
            isinstance(self.mlp, GatedMLP) and not config.gemma and not config.qkv_bias
            and not config.o_bias and self._projection_weights() <= FUSED_GEMV_MAX_LAYER_WEIGHTS)

    def projection(self, name: str) -> ParallelLinear | None:
        """The projection `name` ("self_attn.qkv_proj", "mlp.down_proj", ...); None in an MoE
        layer, whose MLP has experts instead."""
        owner, _, attr = name.partition(".")
        module = getattr(getattr(self, owner), attr, None)
        return module if isinstance(module, ParallelLinear) else None

    def _projection_weights(self) -> int:
        attn, mlp = self.self_attn, self.mlp
        return sum(p.weight.numel() for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                              mlp.down_proj))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`(x, residual)` in and out: the layer's input is their sum (`residual=None`: x)."""
        if self._takes_fused_gemvs(x):
            return self._forward_fused_gemvs(x, residual, positions, rope)
        x, residual = self.input_layernorm.forward_with_residual(x, residual)
        x = self.self_attn(x, positions, rope)
        if self.sandwich_norms:
            x = self.post_attention_layernorm(x)
            x, residual = self.pre_feedforward_layernorm.forward_with_residual(x, residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm.forward_with_residual(x, residual)
        return self.mlp(x), residual

    def _takes_fused_gemvs(self, x: torch.Tensor) -> bool:
        """A decode batch of few rows, on an engine that turned the GEMVs on (GPU, no tensor
        parallelism), in a layer they fit (`fused_gemv_fits`), without LoRA adapters (the
        fused kernels have no adapter delta)."""
        ctx = get_global_ctx()
        return (self.fused_gemv_fits and 0 < x.shape[0] <= ctx.fused_gemv_max_rows
                and ctx.batch.is_decode and ctx.batch.lora is None)

    def _forward_fused_gemvs(self, x: torch.Tensor, residual: torch.Tensor | None,
                             positions: torch.Tensor, rope: RotaryEmbedding
                             ) -> tuple[torch.Tensor, None]:
        """The same layer for a few rows in four GEMV kernels: each norm is folded into the
        projection after it, SiLU-and-mul into down_proj, each residual add into the projection
        before it. The residual stream travels whole in x (tensor parallelism off: with it the
        adds would have to wait for the all-reduce)."""
        from kernels.gemv import fused_gemv

        attn, mlp = self.self_attn, self.mlp
        h = x if residual is None else x + residual
        qkv = fused_gemv(h, attn.qkv_proj.weight, norm_weight=self.input_layernorm.weight,
                         eps=self.input_layernorm.eps)
        o = attn.attend(*attn.qkv_proj.split(qkv), positions, rope)
        h = fused_gemv(o, attn.o_proj.weight, residual=h)
        gate_up = fused_gemv(h, mlp.gate_up_proj.weight,
                             norm_weight=self.post_attention_layernorm.weight,
                             eps=self.post_attention_layernorm.eps)
        return fused_gemv(gate_up, mlp.down_proj.weight, gated=True, residual=h), None


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = _norm_class(config)(config.hidden_size, config.rms_norm_eps)
        self.embed_scale = config.hidden_size**0.5 if config.gemma else 1.0

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        if self.embed_scale == 1.0:
            return x
        # HF rounds the scale to the weights' dtype first (sqrt(3072) is 55.5 in bfloat16).
        return x * torch.tensor(self.embed_scale, dtype=x.dtype).item()


class CausalLM(nn.Module):
    """`forward()` reads the batch from the context and returns logits of each request's last
    token, [batch, vocab] in the model's dtype (the sampler reads half-precision logits as they
    are: writing a float32 copy would cost a pass over [batch, vocab] per step)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        # Plain attributes, not buffers: they are computed, never loaded (see `move_rope_to`).
        # `local_rope`: that of the sliding-window layers where it differs (Gemma 3).
        self.rope = RotaryEmbedding.for_config(config.head_dim, config.rope,
                                               config.max_position_embeddings)
        self.local_rope = None if config.local_rope is None else RotaryEmbedding.for_config(
            config.head_dim, config.local_rope, config.max_position_embeddings)

    def move_rope_to(self, device: torch.device) -> None:
        for rope in (self.rope, self.local_rope):
            if rope is not None:
                rope.to(device)

    def forward(self) -> torch.Tensor:
        batch = get_global_ctx().batch
        x = self.model.embed(batch.input_ids)
        residual = None
        rows = self.rope.table_rows(batch)
        local_rows = None if self.local_rope is None else self.local_rope.table_rows(batch)
        for layer in self.model.layers:
            if layer.uses_local_rope:
                x, residual = layer(x, residual, local_rows, self.local_rope)
            else:
                x, residual = layer(x, residual, rows, self.rope)
        if batch.is_prefill:  # only the last token of each request is sampled
            last = host_to_device(batch.extend_lens, x.device).cumsum(0) - 1
            if batch.logit_tokens is not None:
                # Other tokens' logits too (prompt logits, verify steps' drafts): one head
                # pass over both, so that the head's weights are read once.
                last = torch.cat([last, batch.logit_tokens])
            x = x[last]
            residual = None if residual is None else residual[last]
        x, _ = self.model.norm.forward_with_residual(x, residual)
        logits = self.lm_head(x)
        if batch.logit_tokens is not None:
            batch.token_logits = logits[batch.size:]
            logits = logits[: batch.size]
        return logits
