"""Cost model pieces the planner composes: parameter counts, roofline kernel times, collective times,
expected load imbalance and all-to-all fan-out.

Everything here is a pure function of numbers (no devices, no process groups). Times are in ms,
sizes in bytes, throughputs in bytes/s and FLOP/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import numpy as np

from epmoe.plan.hardware import HardwareProfile, LinkProfile
from epmoe.spec import MoESpec

ACT_BYTES = 2  # activations, KV cache, dispatch payloads: bf16
# Bytes per parameter of each storage format, scales included:
#   fp8_block128: 1 B + one fp32 scale per 128x128 block (DeepSeek-V3 checkpoint format)
#   int4_group32: 4 bit + one bf16 scale per 32 weights (Kimi-K2.5, compressed-tensors)
#   mxfp4:        4 bit + one 8-bit shared exponent per 32 weights (OCP MX spec, gpt-oss)
BYTES_PER_PARAM = MappingProxyType({
    "bf16": 2.0,
    "fp8": 1.0,
    "fp8_block128": 1.0 + 4.0 / (128 * 128),
    "int4_group32": 0.5 + 2.0 / 32,
    "mxfp4": 0.5 + 1.0 / 32,
})
# ``--weights`` choices -> storage format; the ones ``smaller_weight_choices`` advises, by bytes.
WEIGHT_CHOICES = MappingProxyType({"bf16": "bf16", "fp8": "fp8_block128", "int4": "int4_group32",
                                   "mxfp4": "mxfp4"})
_ADVISED = ("fp8", "int4")

CollectiveKind = Literal["all_reduce", "reduce_scatter", "all_gather", "all_to_all"]


def bytes_per_param(weight_format: str) -> float:
    """Bytes per parameter of a storage format, scales included.

    Raises:
        ValueError: an unknown format (the known ones are listed).
    """
    group = weight_format.removeprefix("int4_group")
    if weight_format not in BYTES_PER_PARAM and group.isdigit() and int(group) > 0:
        return 0.5 + 2.0 / int(group)  # compressed-tensors INT4 with another group size: one bf16 scale per group
    if weight_format not in BYTES_PER_PARAM:
        raise ValueError(f"weight format {weight_format!r} is not known; known: {', '.join(BYTES_PER_PARAM)}, "
                         f"int4_group<G>")
    return BYTES_PER_PARAM[weight_format]


def smaller_weight_choices(weight_format: str) -> list[str]:
    """The ``--weights`` choices advised for storing routed experts in fewer bytes than ``weight_format``
    (``fp8_block128`` -> ``["int4"]``; ``int4_group32`` -> ``[]``), smallest saving first; ``mxfp4`` is priced on
    request but never advised (at 4 bits, as INT4).

    Raises:
        ValueError: an unknown format (as ``bytes_per_param``).
    """
    current = bytes_per_param(weight_format)
    return [c for c in _ADVISED if BYTES_PER_PARAM[WEIGHT_CHOICES[c]] < current]


def weights_hint(weight_format: str) -> str:
    """``--weights fp8/int4``-style advice listing only formats smaller than ``weight_format``; ``""`` when none is."""
    smaller = smaller_weight_choices(weight_format)
    return f"--weights {'/'.join(smaller)}" if smaller else ""


def compute_dtype(weight_format: str) -> str:
    """The matmul rate (a ``HardwareProfile.matmul_flops_per_s`` key) of weights stored as ``weight_format``, as
    epmoe's kernels multiply them: ``w4a16`` for INT4 and MXFP4 (the W4A16 expert kernels' bf16 products of 4-bit
    weights widened in registers), ``w8a16`` for FP8 (its expert kernels widen the values to bf16 in registers, as
    ``benchmarks/moe_layer.py``'s ``dsv3_fp8`` case times them, not on FP8 tensor cores), else ``bf16``; a profile
    without the figure gives the bf16 rate."""
    if weight_format.startswith("fp8"):
        return "w8a16"
    return "w4a16" if weight_format.startswith("int4") or weight_format == "mxfp4" else "bf16"


@dataclass(frozen=True)
class MoEDims:
    """The shape of one MoE layer: ``D`` hidden, ``F`` expert intermediate, ``E`` experts, ``K`` top-k."""

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int

    @classmethod
    def from_spec(cls, spec: MoESpec) -> "MoEDims":
        """The MoE-layer shape of a model."""
        return cls(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts, spec.top_k)

    def expert_params(self) -> int:
        """Parameters of one SwiGLU expert: gate, up ``[F, D]`` and down ``[D, F]``: ``3 D F``."""
        return 3 * self.hidden_size * self.moe_intermediate_size


@dataclass(frozen=True)
class AttentionParams:
    """Parameters of one attention block, split into the part every TP rank keeps whole and the part
    divided over TP ranks.

    For MLA (DeepSeek-V3): ``q_a [q_lora, D]`` and ``kv_a [kv_lora + rope, D]`` are replicated (SGLang's
    fused ``qkv_a`` projection); ``q_b``, ``kv_b`` and ``o`` are split by heads. For GQA: ``q`` and ``o``
    split by heads; ``k`` and ``v`` split by KV heads (``kv_params``).
    """

    replicated: int
    split: int
    kv_params: int

    def per_rank(self, tp: int, num_kv_heads: int) -> float:
        """Parameters one rank holds under attention TP ``tp`` (KV heads replicated when fewer than ``tp``)."""
        kv_share = self.kv_params / num_kv_heads * max(1, num_kv_heads // tp) if self.kv_params else 0.0
        return self.replicated + self.split / tp + kv_share


def attention_params(spec: MoESpec) -> AttentionParams:
    """Attention parameters of one decoder layer of ``spec`` (biases and norms left out)."""
    a, d = spec.attention, spec.hidden_size
    if a.is_mla:
        nope = a.head_dim - a.qk_rope_head_dim
        q_in = a.q_lora_rank or d
        replicated = (d * a.q_lora_rank if a.q_lora_rank else 0) + d * (a.kv_lora_rank + a.qk_rope_head_dim)
        split = q_in * a.num_heads * a.head_dim + a.kv_lora_rank * a.num_heads * (nope + a.v_head_dim)
        split += a.num_heads * a.v_head_dim * d
        return AttentionParams(replicated=replicated, split=split, kv_params=0)
    q_o = d * a.num_heads * a.head_dim + a.num_heads * a.v_head_dim * d
    return AttentionParams(replicated=0, split=q_o, kv_params=d * a.num_kv_heads * (a.head_dim + a.v_head_dim))


def model_params(spec: MoESpec) -> int:
    """Parameters of the whole unsharded model (biases of attention and norms left out): the embedding and the LM
    head (once where the config ties them, ``MoESpec.tie_word_embeddings``), each layer's attention, each MoE
    layer's routed experts, gate and shared experts, each dense layer's MLP."""
    d, v = spec.hidden_size, spec.vocab_size
    a = attention_params(spec)
    attention = a.replicated + a.split + a.kv_params
    shared = 3 * d * spec.shared_intermediate_size + (d if spec.shared_expert_gate else 0)
    moe = spec.num_experts * (spec.expert_params() + d) + shared
    dense = 3 * d * spec.dense_intermediate_size
    tables = 1 if spec.tie_word_embeddings else 2
    return spec.num_layers * attention + spec.num_moe_layers * moe + len(spec.dense_layers) * dense + tables * v * d


def kv_bytes_per_token(spec: MoESpec, tp: int) -> float:
    """KV-cache bytes one rank stores per token per layer under attention TP ``tp`` (bf16 cache).

    MLA stores the compressed latent ``kv_lora_rank + qk_rope_head_dim`` once per token, shared by all
    heads, so every TP rank holds all of it. GQA stores ``2 * kv_heads * head_dim`` values, split over TP
    ranks, one KV head per rank at least.
    """
    a = spec.attention
    if a.is_mla:
        return (a.kv_lora_rank + a.qk_rope_head_dim) * ACT_BYTES
    return max(1, a.num_kv_heads // tp) * (a.head_dim + a.v_head_dim) * ACT_BYTES


MLA_DECODE_HEADS_PER_READ = 16
"""Query heads the engine's MLA decode kernel serves per read of a latent row (``engine.mla_decode``'s head block).
The kernel's 64-head programs (``mla_decode.mla_decode_tiles``: at batches whose programs outnumber the SMs, and by the
batch's longest context from ``mla_decode.WIDE_MIN_KEYS`` keys) are not priced. They read each latent row a quarter as
often but do not run four times as fast (little faster at the threshold, more at long contexts), and the attention
is a small part of the large batches' steps. Pricing their reads (one pass per 64 heads) made the plan cheaper at
the threshold's context than below it; unpriced, the plan is high at long contexts (README "Where the engine
stands")."""


def kv_read_passes(spec: MoESpec, tp: int) -> int:
    """How many times a decode step reads each cached token of one layer under attention TP ``tp``: once for
    grouped-query attention (a kv head's rows serve its query heads in one program); for MLA once per block of
    ``MLA_DECODE_HEADS_PER_READ`` of the rank's ``max(1, H // tp)`` query heads, rounded up (DeepSeek-V3's 128
    heads read the latent eight times on one GPU, Kimi-K2.5's 64 four times)."""
    a = spec.attention
    if not a.is_mla:
        return 1
    return -(-max(1, a.num_heads // tp) // MLA_DECODE_HEADS_PER_READ)


def attention_score_flops(spec: MoESpec) -> float:
    """FLOPs per query position per context position per layer for all heads (decode kernels).

    GQA: ``QK^T`` and ``PV``: ``2 H (head_dim + v_head_dim)``. MLA with absorbed projections
    (DeepSeek-V2 paper, section 2.1): ``2 H (kv_lora + rope) + 2 H kv_lora``.
    """
    a = spec.attention
    if a.is_mla:
        return 2 * a.num_heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim)
    return 2 * a.num_heads * (a.head_dim + a.v_head_dim)


def prefill_score_flops(spec: MoESpec) -> float:
    """FLOPs per (query, key) pair per layer for all heads in a prefill: ``QK^T`` and ``PV`` over the per-head keys
    and values, ``2 H (head_dim + v_head_dim)`` (MLA's prefill expands the latent into per-head keys and values, its
    ``head_dim`` the ``nope + rope`` query-key width)."""
    a = spec.attention
    return 2 * a.num_heads * (a.head_dim + a.v_head_dim)


def causal_pairs(n: int, span: int) -> float:
    """(query, key) pairs of a causal prefill of ``n`` tokens whose queries attend at most the ``span`` latest
    positions (``span >= n``: every earlier position; a chunked layer is priced as a window of its chunk, an upper
    bound)."""
    if span >= n:
        return n * (n + 1) / 2
    return span * (span + 1) / 2 + (n - span) * span


def roofline_ms(bytes_read: float, flops: float, hbm_bytes_per_s: float, flops_per_s: float) -> float:
    """Roofline time of a kernel: ``max(bytes / bandwidth, flops / peak)``, ms."""
    return max(bytes_read / hbm_bytes_per_s, flops / flops_per_s) * 1e3


def expected_max_load(num_items: float, num_bins: int, balancedness: float = 1.0) -> float:
    """Expected load of the busiest of ``num_bins`` bins receiving ``num_items`` items.

    Each bin's load is modelled as ``Binomial(n, 1/bins)``; the skew of real routing is modelled by one
    hot bin with share ``1 / (bins * balancedness)`` (balancedness = mean / max, DESIGN.md). The
    bins are treated as independent: ``E[max] = sum_k P(max >= k) = sum_k 1 - F_hot(k-1) F(k-1)^(bins-1)``.
    At small loads this is the sampling imbalance (8 picks over 8 ranks: about 2.2 on the busiest),
    at large loads it tends to ``mean / balancedness``.

    Raises:
        ValueError: ``num_bins`` < 1 or ``balancedness`` outside (0, 1].
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    if not 0 < balancedness <= 1:
        raise ValueError(f"balancedness must lie in (0, 1], got {balancedness}")
    n = int(round(num_items))
    if num_bins == 1 or n == 0:
        return float(n)
    p, q = 1.0 / num_bins, min(1.0, 1.0 / (num_bins * balancedness))
    # scipy is imported here, not at the top: rank processes and the CLI import this package without needing it
    from scipy.stats import binom

    # P(max > k) is 1 to double precision more than 12 standard deviations below the hot bin's mean and
    # 0 that far above it: sum only the window between (O(sqrt(n)) terms, also at billions of items).
    spread = 12 * math.sqrt(n * q) + 12
    low, top = max(0, int(n * q - spread)), min(n, int(n * q + spread))
    k = np.arange(low, top)
    below = binom.cdf(k, n, q) * binom.cdf(k, n, p) ** (num_bins - 1)
    return float(low + np.sum(1.0 - below))


def expected_distinct_experts(num_tokens: float, num_experts: int, top_k: int, num_local: float | None = None) -> float:
    """Expected number of distinct experts among ``num_local`` given ones that ``T`` tokens choose, each
    token picking ``K`` distinct experts of ``E`` uniformly: ``n_local * (1 - (1 - K/E)^T)``.

    A given expert is among one token's ``K`` choices with probability ``K/E``, missed by all ``T``
    independent tokens with probability ``(1 - K/E)^T``; linearity of expectation over the ``n_local``
    experts gives the sum. Qwen3-30B-A3B (E 128, K 8) at T 8: ``128 (1 - (15/16)^8) = 51.6`` of 128
    experts (their weights are what a decode step reads); a DeepSeek-V3 EP8 shard (32 of 256, K 8) at
    T 1: ``32 * 8/256 = 1``.

    Args:
        num_tokens: ``T`` tokens routed, >= 0.
        num_experts: ``E`` experts the tokens choose among (logical experts, or slots when replicas
            share their expert's load evenly).
        top_k: ``K`` distinct choices per token, ``1..E``.
        num_local: how many of the ``E`` experts to count, ``0..E`` (default all ``E``).

    Raises:
        ValueError: ``E`` < 1, ``K`` outside ``[1, E]``, ``T`` < 0, or ``num_local`` outside ``[0, E]``.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must lie in [1, num_experts={num_experts}]")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    local = num_experts if num_local is None else num_local
    if not 0 <= local <= num_experts:
        raise ValueError(f"num_local ({num_local}) must lie in [0, num_experts={num_experts}]")
    return local * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def expected_destination_ranks(num_experts: int, top_k: int, num_ranks: int) -> float:
    """Expected number of distinct EP ranks holding a token's ``K`` experts (``E/G`` experts per rank).

    A token picks ``K`` distinct experts uniformly; a given rank holds none of them with probability
    ``prod_{i<K} (E - E/G - i) / (E - i)`` (hypergeometric), so the expectation is ``G`` times one minus
    that. DeepSeek-V3 (E 256, K 8) on 8 ranks: 5.25 ranks per token.
    """
    if num_ranks <= 1:
        return 1.0
    per_rank = num_experts / num_ranks
    miss = 1.0
    for i in range(top_k):
        miss *= max(0.0, (num_experts - per_rank - i) / (num_experts - i))
    return num_ranks * (1.0 - miss)


def _interpolate_ms(curve: tuple[tuple[float, float], ...], buffer_bytes: float, busbw: float, factor: float) -> float:
    """ms at ``buffer_bytes`` on a measured curve: linear in log-log between points, flat below the first,
    the last point plus the extra bytes at ``busbw`` (times ``factor``, the bus-bytes convention) above."""
    if buffer_bytes <= curve[0][0]:
        return curve[0][1]
    last_b, last_ms = curve[-1]
    if buffer_bytes >= last_b:
        return last_ms + factor * (buffer_bytes - last_b) / busbw * 1e3
    hi = next(i for i, (b, _) in enumerate(curve) if b >= buffer_bytes)
    (b0, m0), (b1, m1) = curve[hi - 1], curve[hi]
    if m0 <= 0 or m1 <= 0:
        return m0 + (m1 - m0) * (buffer_bytes - b0) / (b1 - b0)
    w = math.log(buffer_bytes / b0) / math.log(b1 / b0)
    return math.exp(math.log(m0) + w * (math.log(m1) - math.log(m0)))


def collective_ms(kind: CollectiveKind, nbytes: float, num_ranks: int, link: LinkProfile) -> float:
    """Time of one collective on ``num_ranks`` ranks, ms.

    ``nbytes`` is the buffer of each rank for all-reduce, reduce-scatter (input) and all-gather (output),
    and the bytes each rank sends to other ranks for all-to-all. With a measured curve on the link
    (``LinkProfile.all_reduce_ms_by_bytes`` / ``all_to_all_ms_by_bytes``, written by ``epmoe calibrate``)
    the time is read off it (an all-to-all of ``nbytes`` sent has a buffer of ``nbytes * n / (n-1)``;
    reduce-scatter and all-gather move half an all-reduce's bytes, so they read the all-reduce curve at
    ``nbytes / 2``); NCCL's protocol changes make mid-size messages slower than a latency + bandwidth
    line (2 MiB all-reduce on two H200s, CUDA-graph timed: 29 µs measured, 16 µs on the line). Without
    a curve: latency + bytes / bus bandwidth, factors after nccl-tests' PERFORMANCE.md: all-reduce
    ``2 (n-1)/n``, reduce-scatter and all-gather ``(n-1)/n``.

    Raises:
        ValueError: an unknown kind.
    """
    if num_ranks <= 1:
        return 0.0
    n = num_ranks
    if kind == "all_reduce":
        if link.all_reduce_ms_by_bytes:
            return _interpolate_ms(link.all_reduce_ms_by_bytes, nbytes, link.all_reduce_busbw_bytes_per_s,
                                   2 * (n - 1) / n)
        return link.all_reduce_latency_us * 1e-3 + 2 * (n - 1) / n * nbytes / link.all_reduce_busbw_bytes_per_s * 1e3
    if kind in ("reduce_scatter", "all_gather"):
        if link.all_reduce_ms_by_bytes:
            return _interpolate_ms(link.all_reduce_ms_by_bytes, nbytes / 2, link.all_reduce_busbw_bytes_per_s,
                                   2 * (n - 1) / n)
        return link.all_reduce_latency_us * 1e-3 + (n - 1) / n * nbytes / link.all_reduce_busbw_bytes_per_s * 1e3
    if kind == "all_to_all":
        if link.all_to_all_ms_by_bytes:
            return _interpolate_ms(link.all_to_all_ms_by_bytes, nbytes * n / (n - 1), link.all_to_all_busbw_bytes_per_s,
                                   (n - 1) / n)
        return link.all_to_all_latency_us * 1e-3 + nbytes / link.all_to_all_busbw_bytes_per_s * 1e3
    raise ValueError(f"collective kind {kind!r} is not one of all_reduce, reduce_scatter, all_gather, all_to_all")


def dispatch_layout_ms(rows: float, tokens: float, hidden: int, hbm_bytes_per_s: float, fixed_us: float) -> float:
    """Local time of the send-buffer layout of one expert-parallel dispatch + combine on one rank, ms.

    ``dispatch.layout``'s pack reads each sent row and writes it into the send buffer, and combine's sum
    reads each returned row and writes one row per token: ``(3 * rows + tokens) * hidden`` activations
    over HBM bandwidth, plus ``fixed_us`` for the four layout launches (route, pack, unpack, combine).

    Args:
        rows: rows this rank sends, its own block included (tokens times the ranks each reaches).
        tokens: this rank's tokens.
        hidden: ``D``.
        hbm_bytes_per_s: device memory bandwidth, bytes/s.
        fixed_us: ``HardwareProfile.dispatch_layout_fixed_us``.
    """
    return fixed_us * 1e-3 + (3 * rows + tokens) * hidden * ACT_BYTES / hbm_bytes_per_s * 1e3


def expert_activation_bytes(dims: MoEDims, rows: float, tp: int = 1) -> float:
    """Activation bytes one rank's grouped expert MLP moves for ``rows`` routed rows (bf16).

    Per row: its input gathered (``D``), its intermediate written by the gate/up GEMM and read back by the
    down GEMM (``2 F / tp``: the two GEMMs are separate kernels), its output written and read again by the
    weighted sum over ``K`` (``2 D``): ``rows * (3 D + 2 F / tp) * 2`` B.
    """
    return rows * (3 * dims.hidden_size + 2 * dims.moe_intermediate_size / tp) * ACT_BYTES


def expert_layer_ms(
    dims: MoEDims,
    rows: float,
    touched: float,
    tp: int,
    hardware: HardwareProfile,
    weight_format: str,
) -> float:
    """Time of one rank's grouped expert MLP over ``rows`` routed rows hitting ``touched`` experts, ms.

    ``max(stream, matrix) + (1 - overlap) * min(stream, matrix) + fixed`` with
    - stream: bytes / hbm, the bytes being a ``1/tp`` slice of the weights of the ``touched`` experts
      (``3 D F`` parameters each, in ``weight_format``) plus ``expert_activation_bytes``;
    - matrix: ``2 * 3 D F / tp`` FLOPs per row at the profile's matmul rate for the format's compute dtype;
    - overlap: the profile's ``moe_stream_matrix_overlap``, the share of the shorter of the two that the
      kernels hide under the longer (0: added; 1: a ``max`` roofline);
    - fixed: the profile's ``moe_layer_fixed_us`` (alignment, launches, pipeline fill and drain of the
      kernels of one layer).
    INT4 and MXFP4 experts (read packed at every size by the W4A16 kernels: the decode kernels, then the
    tensor-core kernels widening the words in registers) have their own figures where the profile holds them: the
    ``w4a16`` matrix rate, ``moe_w4a16_layer_fixed_us``, and the weights and activations streamed at
    ``moe_w4a16_stream_efficiency`` of the bandwidth (fitted to the kernels' measurements by
    ``benchmarks/planner_vs_h200.py --int4-results``: the H200 profile to INT4 rows, the H100 profile to MXFP4
    rows), MXFP4 experts the ``moe_mxfp4_*`` figures where the profile has them (the H200 profile, fitted to
    MXFP4 rows); block-FP8 experts (read as stored, widened to bf16 in registers) likewise the ``w8a16`` figures
    (``--fp8-results``).
    Overlap and fixed cost are fitted together to measurements (benchmarks/planner_vs_h200.py, the
    profile's sources). The H200 Triton kernels stream weight tiles while they multiply, but not
    completely (H200 run of benchmarks/results/moe_layer_h200.json, overlap 0.579, fixed 11.1 us):
    Qwen3-30B-A3B at 4096 tokens streams weights 284 + activations 118 = 403 us against 456 us of matrix
    work; the sum (+ fixed) is 870 us, 1.29x the 673 us measured, the ``max`` 467 us, 0.69x; the partial
    overlap gives ``456 + 0.421 x 403 + 11.1 = 637`` us, 0.95x. A DeepSeek-V3 EP8 shard at 4096 tokens:
    stream 713, matrix 532 us, 948 us predicted against 935 measured (sum 1.34x, ``max`` 0.77x). Known
    gap: at a few tokens the layer streams below the profile's bandwidth, so the model is low there
    (Qwen3 at 8 tokens 0.89x).

    Args:
        dims: the MoE-layer shape.
        rows: routed (token, expert) rows computed on the rank, e.g. ``T K n_local / E`` or the busiest
            rank's load.
        touched: distinct experts among the rank's slots that receive at least one row
            (``expected_distinct_experts``); their weights are read once.
        tp: slices of each expert (expert tensor parallelism); 1 = whole experts.
        hardware: the GPU's profile.
        weight_format: expert weight storage format (``BYTES_PER_PARAM``).
    """
    weight_bytes = touched * dims.expert_params() * bytes_per_param(weight_format) / tp
    flops = rows * 2 * dims.expert_params() / tp
    kind = compute_dtype(weight_format)
    peak = hardware.flops_per_s(kind)
    bandwidth, fixed_us = hardware.hbm_bytes_per_s, hardware.moe_layer_fixed_us
    if kind in ("w4a16", "w8a16"):  # the quantized expert kernels' own figures, where the profile has them
        efficiency, fixed_us = hardware.quantized_expert_figures(kind, mxfp4=weight_format == "mxfp4")
        bandwidth *= efficiency
    stream_s = (weight_bytes + expert_activation_bytes(dims, rows, tp)) / bandwidth
    matrix_s = flops / peak
    overlapped_s = max(stream_s, matrix_s) + (1.0 - hardware.moe_stream_matrix_overlap) * min(stream_s, matrix_s)
    return overlapped_s * 1e3 + fixed_us * 1e-3


def predict_moe_layer_time(
    spec_or_dims: MoESpec | MoEDims,
    num_tokens: int,
    num_local_experts: int,
    hardware: HardwareProfile,
    dtype: str = "bf16",
) -> float:
    """Predicted time of one MoE layer's expert compute on one GPU, ms (for checks against benchmarks).

    ``num_tokens`` tokens are routed top-``K`` uniformly over the ``E`` logical experts; the GPU holds
    ``num_local_experts`` of them (all ``E`` for a single-GPU layer, ``E/G`` for an EP shard) and computes
    the ``T K n_local / E`` rows that land on them, reading the weights of the ``n_local (1 - (1 - K/E)^T)``
    of them expected to be hit (``expert_layer_ms`` gives the formula; benchmarks/planner_vs_h200.py
    checks it against the H200 measurements). Examples: the Qwen3-30B-A3B layer (128 of 128 experts)
    and a DeepSeek-V3 EP shard (32 of 256, D 7168, F 2048).

    Args:
        spec_or_dims: the model, or its MoE-layer shape.
        num_tokens: ``T`` tokens entering the layer.
        num_local_experts: experts held by this GPU, ``1..E``.
        hardware: the GPU's profile.
        dtype: expert weight storage: a ``--weights`` choice (``bf16``, ``fp8``, ``int4``) or a format name.

    Raises:
        ValueError: ``num_tokens`` < 1, ``num_local_experts`` outside ``[1, E]``, or an unknown dtype.
    """
    dims = MoEDims.from_spec(spec_or_dims) if isinstance(spec_or_dims, MoESpec) else spec_or_dims
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if not 1 <= num_local_experts <= dims.num_experts:
        raise ValueError(f"num_local_experts ({num_local_experts}) must lie in [1, {dims.num_experts}]")
    fmt = WEIGHT_CHOICES.get(dtype, dtype)
    rows = num_tokens * dims.top_k * num_local_experts / dims.num_experts
    touched = expected_distinct_experts(num_tokens, dims.num_experts, dims.top_k, num_local_experts)
    return expert_layer_ms(dims, rows, touched, 1, hardware, fmt)
