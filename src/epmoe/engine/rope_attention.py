"""The engine's attention module for the rotary grouped-query families: one projection, one kernel before
attention.

transformers' attention of Qwen3-MoE, Qwen2-MoE, Mixtral, GLM-4.5 and gpt-oss projects queries, keys and
values with three matrix products, normalises queries and keys per head (Qwen3, GLM with ``use_qk_norm``),
rotates them (about ten elementwise kernels: ``rotate_half``, products, sums, concatenations) and then the
engine writes keys and values into the paged cache (two scatters): some fifteen launches per layer before
attention reads anything, which at one decode token cost several times the layer's weight reads.
``RopeAttention`` replaces such a module (``install_rope_attention``) by:

1. one matrix product with the concatenated ``q``/``k``/``v`` weights (and biases) (at one or two rows on
   Hopper ``gemv.linear``'s kernel, which reads the weight while the norm before it runs; cuBLAS otherwise);
2. one kernel (``rope_qkv``), a program per token (at prefill sizes per ``ROPE_PREFILL_TOKENS`` tokens) and head:
   RMS-normalise the head (if the family does), rotate it, and store a query head into the query tensor, or a key
   head and its value head into the token's cache slot;
3. the engine's attention over the cache (``attention.attend``), then ``o_proj`` (through ``gemv.linear``).

Rotary embedding: ``x[:R]`` of a head is rotated by halves, ``(x1, x2) -> (x1 c - x2 s, x2 c + x1 s)`` with
``c, s`` the cosine and sine of the token's position (``R/2`` values, from the model's own rotary module, so
every scaling variant it implements is kept) and ``x[R:]`` passed through (GLM's partial rotary). transformers
gives the cosine as ``[T, R]`` with both halves equal (``rotate_half`` families) or as ``[T, R/2]``
(gpt-oss's ``_apply_rotary_emb``); both reduce to the half form here. Norm: the mean of squares in float32,
the normalised head cast to the model dtype and multiplied by the weight, as transformers' RMSNorm does.
CUDA runs the Triton kernel, CPU ``rope_qkv_reference`` (the same arithmetic in PyTorch).

Llama-4 (complex interleaved rotary, layers without it, L2 query/key norm) and MLA (``engine.mla``) keep
their own modules.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from epmoe.engine.attention import AttnBatch, attend, engine_batch
from epmoe.engine.gemv import linear, linear_after_norm, norm_folds
from epmoe.experts.triton.pdl import pdl_launch
from epmoe.layer import FoldedNorm

# model types whose attention is q/k/v projections, optional per-head RMSNorm, rotate-by-halves rotary,
# attention (causal, sliding window, sinks) and o_proj. Value: (the cosine is given for half the rotated dims,
# where the sliding window transformers passes to the attention function comes from: the module's
# ``sliding_window``, the config's, or none passed)
ROPE_FAMILIES = {"qwen3_moe": (False, "module"), "qwen2_moe": (False, None), "mixtral": (False, "config"),
                 "glm4_moe": (False, None), "gpt_oss": (True, "module")}


ROPE_PREFILL_MIN_ROWS = 1024
"""From this many tokens a step (prefill chunks; the decode graphs' buckets stay below it) a ``rope_qkv`` program
takes ``ROPE_PREFILL_TOKENS`` tokens of one head instead of one: a program a token and head is a short task, and at a
4096-token prompt the GPU spends its time placing them, not moving the bytes."""

ROPE_PREFILL_TOKENS = 16
"""Tokens a ``rope_qkv`` program takes, one after the other, from ``ROPE_PREFILL_MIN_ROWS`` tokens on."""


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_qkv_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, v_ptr, slot_ptr,
                        T, stride_t, stride_c, stride_qt, eps,
                        H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                        PASS: tl.constexpr, PASS_PAD: tl.constexpr, NORM: tl.constexpr, TOKENS: tl.constexpr,
                        PDL: tl.constexpr):
        if PDL:  # nothing it reads is constant but the norm weights: wait at once
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        head = tl.program_id(1)
        is_q = head < H
        lo = tl.arange(0, HALF)
        rest = 2 * HALF + tl.arange(0, PASS_PAD)
        rest_ok = tl.arange(0, PASS_PAD) < PASS
        dt = qkv_ptr.dtype.element_ty
        if NORM:  # the head's norm weight, the same for each of the program's tokens
            if is_q:
                w1 = tl.load(qw_ptr + lo).to(tl.float32)
                w2 = tl.load(qw_ptr + HALF + lo).to(tl.float32)
                wp = tl.load(qw_ptr + rest, mask=rest_ok, other=0.0).to(tl.float32)
            else:
                w1 = tl.load(kw_ptr + lo).to(tl.float32)
                w2 = tl.load(kw_ptr + HALF + lo).to(tl.float32)
                wp = tl.load(kw_ptr + rest, mask=rest_ok, other=0.0).to(tl.float32)
        for i in range(TOKENS):
            t = tl.program_id(0).to(tl.int64) * TOKENS + i
            if t < T:
                src = qkv_ptr + t * stride_t + head * D
                x1 = tl.load(src + lo).to(tl.float32)
                x2 = tl.load(src + HALF + lo).to(tl.float32)
                xp = tl.load(src + rest, mask=rest_ok, other=0.0).to(tl.float32)
                if NORM:
                    r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0) + tl.sum(xp * xp, 0)) / D + eps)
                    x1 = (x1 * r).to(dt).to(tl.float32) * w1
                    x2 = (x2 * r).to(dt).to(tl.float32) * w2
                    xp = (xp * r).to(dt).to(tl.float32) * wp
                    x1 = x1.to(dt).to(tl.float32)
                    x2 = x2.to(dt).to(tl.float32)
                    xp = xp.to(dt).to(tl.float32)
                c = tl.load(cos_ptr + t * stride_c + lo).to(tl.float32)
                s = tl.load(sin_ptr + t * stride_c + lo).to(tl.float32)
                o1 = x1 * c - x2 * s
                o2 = x2 * c + x1 * s
                if is_q:
                    dst = q_ptr + t * stride_qt + head * D
                else:
                    slot = tl.load(slot_ptr + t)
                    j = head - H
                    dst = k_ptr + (slot * HKV + j) * D
                    v_src = qkv_ptr + t * stride_t + (H + HKV + j) * D
                    v_dst = v_ptr + (slot * HKV + j) * D
                    tl.store(v_dst + lo, tl.load(v_src + lo))
                    tl.store(v_dst + HALF + lo, tl.load(v_src + HALF + lo))
                    tl.store(v_dst + rest, tl.load(v_src + rest, mask=rest_ok), mask=rest_ok)
                out_t = dst.dtype.element_ty
                tl.store(dst + lo, o1.to(out_t))
                tl.store(dst + HALF + lo, o2.to(out_t))
                tl.store(dst + rest, xp.to(out_t), mask=rest_ok)

    return triton, rope_qkv_kernel


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: float32 mean of squares, the normalised row cast back, times the weight."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` values of ``x [T, heads, D]`` by halves; ``cos, sin [T, R/2]``."""
    half = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def rope_qkv_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                       q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """``rope_qkv`` in PyTorch (CPU, and the kernel's test reference); same arguments and result."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    q, k, v = torch.split(qkv.view(t, num_heads + 2 * num_kv_heads, d), [num_heads, num_kv_heads, num_kv_heads], 1)
    if q_norm is not None:
        q, k = _norm(q, q_norm, eps), _norm(k, k_norm, eps)
    q, k = _rotate(q, cos, sin).to(qkv.dtype), _rotate(k, cos, sin).to(qkv.dtype)
    k_cache.view(-1, num_kv_heads, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q.contiguous()


def rope_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
             q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
             k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Per-head norm and rotary embedding of a step's projected tokens; keys and values into the cache.

    CUDA tensors run one Triton launch (grid ``(T, H + Hkv)``, or ``(T / ROPE_PREFILL_TOKENS, H + Hkv)`` from
    ``ROPE_PREFILL_MIN_ROWS`` tokens on), CPU tensors ``rope_qkv_reference``. No host synchronisation (CUDA-graph
    safe).

    Args:
        qkv: ``[T, (H + 2 Hkv) D]`` the fused projection's output (queries, keys, values, head after head),
            contiguous along the last dimension.
        cos, sin: ``[T, R/2]`` the rotary cosine and sine of each token's position (the first ``R`` values
            of a head are rotated, ``R <= D``), contiguous along the last dimension, with the same strides.
        num_heads, num_kv_heads: ``H`` and ``Hkv``.
        q_norm, k_norm: ``[D]`` per-head RMSNorm weights, both or neither (``None``: no norm); eps: its epsilon.
        k_cache, v_cache: ``[NB, BS, Hkv, D]`` the layer's pools, contiguous, in ``qkv.dtype``.
        slot_mapping: ``[T]`` int64 flat cache slot (``block * BS + offset``) of each token.

    Returns:
        ``[T, H, D]`` the queries, normalised and rotated, in ``qkv.dtype``.

    Raises:
        ValueError: shapes that do not agree (named), or only one of the two norm weights.
    """
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    half = cos.shape[-1]
    if qkv.shape[-1] != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"qkv has {qkv.shape[-1]} columns; (H + 2 Hkv) D = {(num_heads + 2 * num_kv_heads) * d}")
    if cos.shape != (t, half) or sin.shape != (t, half) or not 0 < 2 * half <= d:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [T={t}, R/2] with R <= "
                         f"head_dim {d}")
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"cos and sin must share their strides, contiguous along the last dimension; got "
                         f"{cos.stride()} and {sin.stride()}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm go together: give both weights or neither")
    run = rope_qkv_triton if qkv.device.type == "cuda" else rope_qkv_reference
    return run(qkv, cos, sin, num_heads, num_kv_heads, q_norm, k_norm, eps, k_cache, v_cache, slot_mapping)


def rope_qkv_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """``rope_qkv``'s Triton launch (CUDA, or CPU tensors under the Triton interpreter); arguments checked there.
    ``R/2`` must be a power of two; ``cos``, ``sin`` and the norm weights are read as float32 after loading."""
    t, d, half = qkv.shape[0], k_cache.shape[-1], cos.shape[-1]
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    if t:
        triton, kernel = _kernel()
        norm = q_norm is not None
        rest = d - 2 * half
        pdl = pdl_launch(qkv)
        tokens = ROPE_PREFILL_TOKENS if t >= ROPE_PREFILL_MIN_ROWS else 1
        kernel[(triton.cdiv(t, tokens), num_heads + num_kv_heads)](
            qkv, cos, sin, q_norm if norm else qkv, k_norm if norm else qkv, q, k_cache, v_cache, slot_mapping,
            t, qkv.stride(0), cos.stride(0), q.stride(0), float(eps),
            H=num_heads, HKV=num_kv_heads, D=d, HALF=half, PASS=rest, PASS_PAD=max(1, triton.next_power_of_2(rest)),
            NORM=norm, TOKENS=tokens, PDL=pdl, num_warps=1, launch_pdl=pdl,
        )
    return q


class RopeAttention(nn.Module):
    """The engine's attention for one decoder layer of a ``ROPE_FAMILIES`` model, on transformers' weights.

    Args:
        attn: the transformers attention module: ``q_proj``, ``k_proj``, ``v_proj`` (their weights and biases are
            concatenated into ``qkv_proj``; the three modules are dropped), ``o_proj`` (kept), ``q_norm`` and
            ``k_norm`` when the family normalises, ``sinks`` (gpt-oss), ``sliding_window``, ``scaling``.

    Raises:
        ValueError: the module's model type is not in ``ROPE_FAMILIES``, or a projection is missing or of the
            wrong size (named), or the rotary half is not a power of two.
    """

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        config = attn.config
        model_type = getattr(config, "model_type", None)
        if model_type not in ROPE_FAMILIES:
            raise ValueError(f"RopeAttention serves model types {sorted(ROPE_FAMILIES)}, not {model_type!r}")
        self.config = config
        self.layer_idx = int(attn.layer_idx)
        self.half_cos, window = ROPE_FAMILIES[model_type]
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.scaling = float(attn.scaling)
        self.sliding_window = {"module": getattr(attn, "sliding_window", None),
                               "config": getattr(config, "sliding_window", None)}.get(window)
        sinks = getattr(attn, "sinks", None)
        self.sinks = sinks if isinstance(sinks, torch.Tensor) else None
        projs = []
        for name, heads in (("q_proj", self.num_heads), ("k_proj", self.num_kv_heads), ("v_proj", self.num_kv_heads)):
            proj = getattr(attn, name, None)
            if not isinstance(proj, nn.Linear) or proj.out_features != heads * self.head_dim:
                raise ValueError(f"{type(attn).__name__} of layer {self.layer_idx}: {name} must be a Linear of "
                                 f"{heads} x {self.head_dim} outputs")
            projs.append(proj)
        q, k, v = projs
        bias = q.bias is not None
        self.qkv_proj = nn.Linear(q.in_features, sum(p.out_features for p in projs), bias=bias,
                                  device=q.weight.device, dtype=q.weight.dtype)
        with torch.no_grad():
            self.qkv_proj.weight.copy_(torch.cat([p.weight for p in projs]))
            if bias:
                self.qkv_proj.bias.copy_(torch.cat([p.bias for p in projs]))
        self.o_proj = attn.o_proj
        norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
        if getattr(attn, "use_qk_norm", True) and all(isinstance(n, nn.Module) for n in norms):
            self.q_norm, self.k_norm = norms
            self.eps = float(getattr(self.q_norm, "variance_epsilon", getattr(self.q_norm, "eps", 1e-6)))
        else:
            self.q_norm = self.k_norm = None
            self.eps = 0.0

    def _cos_sin(self, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = position_embeddings
        cos, sin = cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])
        if not self.half_cos:  # both halves equal: keep one (a view: the kernel takes the row stride)
            half = cos.shape[-1] // 2
            cos, sin = cos[:, :half], sin[:, :half]
        if cos.stride() != sin.stride() or cos.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        return cos, sin

    def folds_norm(self, x: torch.Tensor, weight: torch.Tensor, weight_then_cast: bool) -> bool:
        """Whether ``forward`` takes a ``FoldedNorm`` of rows ``x [1, T, D_model]`` and an RMSNorm of ``weight``
        (the q/k/v projection through ``gemv.linear_after_norm``: one or two rows on Hopper)."""
        return norm_folds(self.qkv_proj, x[0] if x.dim() == 3 else x, weight, weight_then_cast)

    def forward(self, hidden_states: torch.Tensor | FoldedNorm, position_embeddings=None, attention_mask=None,
                epmoe_batch: AttnBatch | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """Attention of the step's packed tokens; writes their keys and values into the cache first.

        Args:
            hidden_states: ``[1, T, D_model]`` the step's tokens, packed; or their input norm still to compute, a
                ``FoldedNorm`` of ``[1, T, D_model]`` rows that ``folds_norm`` accepted (computed within the q/k/v
                projection's launch, the sum written into its ``summed``).
            position_embeddings: ``(cos, sin)`` of the model's rotary module, ``[1, T, R]`` (or ``[1, T, R/2]``).
            attention_mask: ignored (the engine's masks come from positions).
            epmoe_batch: the step's ``AttnBatch``.
            **kwargs: the decoder layer's other keywords (ignored).

        Returns:
            ``([1, T, D_model], None)``, as transformers' attention modules.

        Raises:
            ValueError: no ``epmoe_batch`` (the model runs outside the engine), a batch dimension other than 1.
        """
        folded = hidden_states if isinstance(hidden_states, FoldedNorm) else None
        rows = folded.x if folded is not None else hidden_states
        batch = engine_batch("RopeAttention", rows, epmoe_batch)
        t = rows.shape[1]
        cos, sin = self._cos_sin(position_embeddings)
        if folded is not None:
            qkv = linear_after_norm(self.qkv_proj, folded)[0]
        else:
            qkv = linear(self.qkv_proj, rows[0])
        norm = self.q_norm is not None
        q = rope_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.q_norm.weight if norm else None,
                     self.k_norm.weight if norm else None, self.eps, batch.kv.k[self.layer_idx],
                     batch.kv.v[self.layer_idx], batch.slot_mapping)
        out = attend(self, q, batch, self.scaling, self.sliding_window, self.sinks)
        return linear(self.o_proj, out.reshape(1, t, -1)), None


def _rotary_half_ok(attn: nn.Module) -> bool:
    """The rotated half of a head is a power of two (the kernel's tile), from the config's rotary fraction: its
    ``rope_parameters["partial_rotary_factor"]``, where transformers' rotary modules read it, else a top-level
    ``partial_rotary_factor``."""
    d = int(attn.head_dim)
    rope = getattr(attn.config, "rope_parameters", None)
    factor = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    if factor is None:
        factor = getattr(attn.config, "partial_rotary_factor", None)
    rotated = int(d * float(factor or 1.0))
    half = rotated // 2
    return half > 0 and half & (half - 1) == 0


def install_rope_attention(model: nn.Module) -> int:
    """Replace the attention module of every decoder layer of a ``ROPE_FAMILIES`` model by a ``RopeAttention``
    (idempotent; other models are left as they are).

    Args:
        model: a transformers causal LM (``model.model.layers[i].self_attn``).

    Returns:
        The number of layers whose attention is a ``RopeAttention``.
    """
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    count = 0
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if isinstance(attn, RopeAttention):
            count += 1
        elif (attn is not None and getattr(getattr(attn, "config", None), "model_type", None) in ROPE_FAMILIES
              and _rotary_half_ok(attn)):
            layer.self_attn = RopeAttention(attn)
            count += 1
    return count
