"""Multi-head latent attention (MLA) over the engine's latent KV cache, for the DeepSeek-V2/V3 family.

DeepSeek-V2/V3/R1 and Kimi-K2/K2.5 compress a token's keys and values into a latent ``c_kv``
(``kv_lora_rank`` values, after ``kv_a_layernorm``) plus one rotary key ``k_rope``
(``qk_rope_head_dim`` values) shared by every head; ``kv_b_proj`` (``W_UK``, ``W_UV`` per head)
expands them (DeepSeek-V2 paper, section 2.1). transformers' attention modules expand every step; the
engine replaces each with ``MLAAttention`` (``install_mla``), which keeps the module's own
projections, norms and rotary function and caches only ``[c_kv, k_rope]`` per token and layer
(``KVLayout``'s latent kind): 576 values for DeepSeek-V3 and Kimi-K2.5 instead of 128 or 64 heads of
192-wide keys and 128-wide values.

* Prefill chunks read the sequence's latent prefix, expand keys and values with ``kv_b_proj`` and run
  causal attention over them (``attention.dense_attention``), as transformers does.
* Decode rows absorb the up-projections (DeepSeek-V2 paper, appendix; SGLang and vLLM do the same):
  the query becomes ``[q_nope W_UK, q_rope]`` per head, attention runs over the latent entries
  (``mla_decode.mla_decode_attention``: Triton on CUDA, PyTorch on CPU), and the latent output is
  mapped by ``W_UV`` before ``o_proj``. Same math as transformers up to rounding order. The projections run
  through ``gemv.linear`` (its early-reading kernel at one or two rows on Hopper, for weights it holds).

The softmax scale is the module's ``scaling`` (``qk_head_dim ** -0.5`` with yarn's ``mscale`` squared
where the rope scaling asks for it, as transformers computes it); the rotary embedding is the model
module's own function (DeepSeek-V3: ``apply_rotary_pos_emb`` or, with ``rope_interleave``,
``apply_rotary_pos_emb_interleave``; DeepSeek-V2: ``apply_rotary_emb`` on its complex frequencies).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from epmoe.engine.attention import AttnBatch, dense_attention, engine_batch
from epmoe.engine.gemv import linear
from epmoe.engine.mla_decode import mla_decode_attention
from epmoe.engine.mla_rope import mla_rope_write

_ROTARY = {"deepseek_v2": "apply_rotary_emb", "deepseek_v3": "apply_rotary_pos_emb"}
_PROJECTIONS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def is_mla_attention(module: nn.Module) -> bool:
    """True for a transformers MLA attention module (``kv_a_proj_with_mqa`` and ``kv_b_proj`` present)."""
    return all(isinstance(getattr(module, name, None), nn.Module) for name in ("kv_a_proj_with_mqa", "kv_b_proj"))


class MLAAttention(nn.Module):
    """The engine's attention for one MLA decoder layer, on the modules of transformers' own.

    Args:
        attn: the transformers attention module (``DeepseekV2Attention`` / ``DeepseekV3Attention``): its
            projections and norms become this module's children (shared, not copied), its ``scaling``,
            head sizes and rotary function are taken over.

    Raises:
        ValueError: ``attn`` is not an MLA module, its config's model type has no known rotary function,
            or a projection is missing (named).
    """

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        if not is_mla_attention(attn):
            raise ValueError(f"{type(attn).__name__} is not an MLA attention module (no kv_a_proj_with_mqa / "
                             f"kv_b_proj)")
        self.config = attn.config
        self.layer_idx = int(attn.layer_idx)
        model_type = getattr(attn.config, "model_type", None)
        modeling = sys.modules[type(attn).__module__]
        if model_type not in _ROTARY:
            raise ValueError(f"MLA attention of model type {model_type!r}: known are {sorted(_ROTARY)}")
        self.complex_rope = model_type == "deepseek_v2"
        name = _ROTARY[model_type]
        self.interleave = model_type == "deepseek_v3" and bool(getattr(attn.config, "rope_interleave", False))
        if self.interleave:
            name = "apply_rotary_pos_emb_interleave"
        self.rotary = getattr(modeling, name, None)
        if self.rotary is None:
            raise ValueError(f"{modeling.__name__} has no {name}: this transformers version is not supported")
        self.num_heads = int(attn.num_heads)
        self.q_lora_rank = attn.q_lora_rank
        self.kv_lora_rank = int(attn.kv_lora_rank)
        self.qk_nope_head_dim = int(attn.qk_nope_head_dim)
        self.qk_rope_head_dim = int(attn.qk_rope_head_dim)
        self.v_head_dim = int(attn.v_head_dim)
        self.scaling = float(attn.scaling)
        query = ("q_proj",) if self.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
        for name in query + _PROJECTIONS:
            module = getattr(attn, name, None)
            if not isinstance(module, nn.Module):
                raise ValueError(f"{type(attn).__name__} of layer {self.layer_idx} has no {name} module")
            self.add_module(name, module)

    def _latent_norm(self) -> tuple[torch.Tensor, float] | None:
        """``kv_a_layernorm``'s weight and epsilon where ``mla_rope_write`` computes what it does (an RMSNorm that
        casts the normalised row before the weight, transformers' own or ``FusedRMSNorm``) and the rotary is by
        pairs of real values; ``None`` otherwise (DeepSeek-V2's complex rotary, another norm)."""
        norm = self.kv_a_layernorm
        weight = getattr(norm, "weight", None)
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        llama_style = type(norm).__name__.endswith("RMSNorm") and not getattr(norm, "weight_then_cast", False)
        if (self.complex_rope or not llama_style or not isinstance(weight, torch.Tensor) or weight.dim() != 1
                or eps is None):
            return None
        return weight, float(eps)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [H, qk_nope_head_dim, kv_lora_rank]`` and ``W_UV [H, v_head_dim, kv_lora_rank]``: views of
        ``kv_b_proj.weight`` (read at every call, so replaced weights are seen)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                epmoe_batch: AttnBatch | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """Attention of the step's packed tokens; writes their latent entries into the cache first.

        Args:
            hidden_states: ``[1, T, D]`` the step's tokens, packed (decode rows first, then prefill chunks).
            position_embeddings: the model's rotary embedding of the tokens' positions (DeepSeek-V3:
                ``(cos, sin)`` each ``[1, T, qk_rope_head_dim]``; DeepSeek-V2: complex ``[1, T, rope / 2]``).
            attention_mask: ignored (the engine's masks come from positions).
            epmoe_batch: the step's ``AttnBatch`` over a latent ``KVCache``.
            **kwargs: the decoder layer's other keywords (ignored).

        Returns:
            ``([1, T, D], None)``, as transformers' attention modules.

        Raises:
            ValueError: no ``epmoe_batch`` (the model runs outside the engine), a batch dimension other than 1.
        """
        batch = engine_batch("MLAAttention", hidden_states, epmoe_batch)
        t = hidden_states.shape[1]
        h, dn, dr, dv, rank = (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
                               self.kv_lora_rank)
        if self.q_lora_rank is None:
            q = linear(self.q_proj, hidden_states)
        else:
            q = linear(self.q_b_proj, self.q_a_layernorm(linear(self.q_a_proj, hidden_states)))
        compressed = linear(self.kv_a_proj_with_mqa, hidden_states)
        norm = self._latent_norm()
        if hidden_states.is_cuda and norm is not None:  # one kernel: norm, rotary, cache write (engine.mla_rope)
            q = q.view(t, h, dn + dr)
            cos, sin = position_embeddings
            mla_rope_write(q, compressed.view(t, rank + dr), cos.view(t, dr), sin.view(t, dr), norm[0], norm[1],
                           batch.kv.latent_pool(self.layer_idx), batch.slot_mapping, dn, self.interleave)
            q_nope, q_rope = q[..., :dn], q[..., dn:]                      # [T, H, dn], [T, H, dr]
        else:
            q = q.view(1, t, h, dn + dr).transpose(1, 2)                   # [1, H, T, dn + dr]
            q_nope, q_rope = torch.split(q, [dn, dr], dim=-1)
            c_kv, k_rope = torch.split(compressed, [rank, dr], dim=-1)
            c_kv = self.kv_a_layernorm(c_kv)[0]                            # [T, R]
            k_rope = k_rope.view(1, 1, t, dr)
            if self.complex_rope:
                q_rope, k_rope = self.rotary(q_rope, k_rope, position_embeddings.to(q_rope.device))
            else:
                cos, sin = position_embeddings
                q_rope, k_rope = self.rotary(q_rope, k_rope, cos, sin)
            batch.kv.write_latent(self.layer_idx, c_kv, k_rope[0, 0], batch.slot_mapping)
            q_nope, q_rope = q_nope[0].transpose(0, 1), q_rope[0].transpose(0, 1)  # [T, H, dn], [T, H, dr]
        if batch.pieces is not None:  # a piecewise forward: the cut runs the attention on the step's real batch
            out = batch.pieces.cut(self._attend, (h, dv), q_nope.dtype, q_nope, q_rope)
        else:
            out = self._attend(batch, q_nope, q_rope)
        return linear(self.o_proj, out.reshape(1, t, h * dv)), None

    def _attend(self, batch: AttnBatch, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """Attention of the step's rows, their entries already in the cache: ``[T, H, dn]``, ``[T, H, dr]`` ->
        ``[T, H, dv]``."""
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
        nd = batch.num_decode
        if nd:
            self._decode(q_nope[:nd], q_rope[:nd], batch, out[:nd])
        for p in batch.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            out[rows] = self._prefill(q_nope[rows], q_rope[rows], p.kv_slots, p.start_pos, batch)
        return out

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, batch: AttnBatch, out: torch.Tensor) -> None:
        """Absorbed decode of ``nd`` single-token rows: ``[nd, H, dn]``, ``[nd, H, dr]`` -> ``out [nd, H, dv]``
        (both absorbed products write into their destinations' strided views: no copies after them)."""
        w_uk, w_uv = self._up_weights()
        nd, rank = q_nope.shape[0], self.kv_lora_rank
        query = q_nope.new_empty(nd, self.num_heads, rank + self.qk_rope_head_dim)
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=query[:, :, :rank].transpose(0, 1))   # [H, nd, R] view
        query[:, :, rank:] = q_rope
        cache = batch.kv.k[self.layer_idx]
        if batch.workspace is not None:  # graph capture: the kernel writes in place, split-K in the given scratch
            o_latent = query.new_empty(nd, self.num_heads, rank)
            mla_decode_attention(query, cache, batch.block_tables, batch.context_lens, self.scaling, rank,
                                 out=o_latent, workspace=batch.workspace, max_context=batch.max_context)
        else:
            o_latent = mla_decode_attention(query, cache, batch.block_tables, batch.context_lens, self.scaling, rank,
                                            max_context=batch.max_context)
        torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))

    def _prefill(self, q_nope: torch.Tensor, q_rope: torch.Tensor, kv_slots: torch.Tensor, start_pos: int,
                 batch: AttnBatch) -> torch.Tensor:
        """A prefill chunk over its sequence's cached prefix, keys and values expanded from the latent:
        ``[n, H, dn]``, ``[n, H, dr]`` -> ``[n, H, dv]``."""
        entries = batch.kv.read_latent(self.layer_idx, kv_slots)          # [N, R + dr]
        n_keys = entries.shape[0]
        h, dn, dr = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        kv = self.kv_b_proj(entries[:, : self.kv_lora_rank]).view(n_keys, h, dn + self.v_head_dim)
        k_nope, values = torch.split(kv, [dn, self.v_head_dim], dim=-1)
        keys = torch.cat([k_nope, entries[:, None, self.kv_lora_rank:].expand(n_keys, h, dr)], dim=-1)
        return dense_attention(torch.cat([q_nope, q_rope], dim=-1), keys, values, start_pos, self.scaling)


def install_mla(model: nn.Module) -> int:
    """Replace the attention module of every MLA decoder layer of ``model`` by an ``MLAAttention`` sharing
    its weights (idempotent).

    Args:
        model: a transformers causal LM (``model.model.layers[i].self_attn``).

    Returns:
        The number of layers whose attention is MLA (replaced now or before).

    Raises:
        ValueError: as ``MLAAttention``.
    """
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    count = 0
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if isinstance(attn, MLAAttention):
            count += 1
        elif attn is not None and is_mla_attention(attn):
            layer.self_attn = MLAAttention(attn)
            count += 1
    return count
