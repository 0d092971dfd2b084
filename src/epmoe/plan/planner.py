"""The planner: tensor or expert parallelism for this model, machine and batch size.

For every batch size and every strategy it estimates one decode step (or one speculative-decoding
verify step, ``S + 1`` positions per sequence) on the busiest rank, split into attention and dense
compute, expert compute and communication, and the memory each GPU needs. For each prompt length of
``PlanRequest.input_lens`` it also estimates that prompt's prefill alone, its time to first token (``_prefill``).
Pure: numbers in, frozen values out (the request and result values are in ``request``).

Strategies over ``G`` GPUs (``t x e = G``):

- ``TP{G}``: attention and experts tensor-parallel; two all-reduces per decoder layer.
- ``TP{t}xEP{e}``: attention TP over ``G``; experts spread over ``e`` groups, each expert sliced ``t``
  ways; every rank computes its experts for all tokens, then one all-reduce (vLLM's EP over the TP
  group is ``TP1xEP{G}``).
- ``EP{G}+TPattn``: attention TP; the attention output is reduce-scattered, each rank dispatches its
  ``T/G`` tokens by all-to-all, combines them back and all-gathers (SGLang DeepEP with TP attention).
- ``EP{G}+DPattn``: attention data-parallel (each rank its own ``B/G`` sequences, weights and KV cache
  whole); MoE layers dispatch and combine by all-to-all only (DeepSeek-V3 decode deployment).

Model conventions: embeddings replicated; the LM head vocab-parallel with one logits all-gather
under TP attention, replicated under DP attention; dense MLP layers TP under TP attention and
replicated under DP attention; shared experts sliced under TP attention and replicated in the
all-to-all strategies. Attention and dense kernels are modelled as rooflines on the busiest rank;
routed experts by ``costs.expert_layer_ms`` (weight and activation streaming and matrix work, the
shorter partly hidden under the longer, plus a fixed per-layer cost; overlap and fixed cost fitted to
H200 measurements, the same function ``predict_moe_layer_time`` checks in
benchmarks/planner_vs_h200.py); no overlap between compute and communication.
"""

from __future__ import annotations

import math
from pathlib import Path

from epmoe.plan.costs import (
    ACT_BYTES,
    CollectiveKind,
    MoEDims,
    attention_params,
    attention_score_flops,
    bytes_per_param,
    causal_pairs,
    collective_ms,
    compute_dtype,
    dispatch_layout_ms,
    expected_destination_ranks,
    expected_distinct_experts,
    expected_max_load,
    expert_layer_ms,
    kv_bytes_per_token,
    kv_read_passes,
    prefill_score_flops,
    roofline_ms,
)
from epmoe.plan.hardware import LinkProfile
from epmoe.plan.request import (
    CollectiveCost,
    MemoryEstimate,
    Plan,
    PlanRequest,
    StepEstimate,
    Strategy,
    StrategyPlan,
    counted,
)
from epmoe.spec import MoESpec

# Private memory pool of a set of decode CUDA graphs beyond the largest graph's activations
# (per-graph workspaces, allocator rounding). Estimate, of the order SGLang and vLLM log at capture.
GRAPH_POOL_FIXED_BYTES = 512 * 1024**2


def strategies_for(spec: MoESpec, gpus: int, redundant: int = 0) -> tuple[list[Strategy], list[str]]:
    """The strategies that can run ``spec`` on ``gpus`` GPUs, and a reason for each one that cannot."""
    g, slots, a = gpus, spec.num_experts + redundant, spec.attention
    if g == 1:
        return [Strategy("TP1", "one GPU holds the whole model", 1, 1, 1, "all_reduce")], []
    out: list[Strategy] = []
    skipped: list[str] = []
    tp_attn_ok = a.num_heads % g == 0
    if not tp_attn_ok:
        skipped.append(f"TP attention over {g} GPUs: {a.num_heads} attention heads are not divisible by {g}")
    for t in sorted((d for d in range(1, g + 1) if g % d == 0), reverse=True):
        e = g // t
        name = f"TP{g}" if e == 1 else f"TP{t}xEP{e}"
        if not tp_attn_ok:
            continue
        if spec.moe_intermediate_size % t:
            skipped.append(f"{name}: expert intermediate size {spec.moe_intermediate_size} is not divisible by {t}")
            continue
        if e > 1 and slots % e:
            skipped.append(f"{name}: {slots} expert slots are not divisible by EP {e}; use --redundant "
                           f"{redundant + -slots % e}")
            continue
        desc = (f"attention TP{g}, each expert sliced {g} ways, 2 all-reduces per layer" if e == 1 else
                f"attention TP{g}, experts EP{e} x sliced {t} ways, all tokens on every rank, all-reduce per layer")
        out.append(Strategy(name, desc, g, t, e, "all_reduce"))
    if slots % g:
        skipped.append(f"EP{g} with all-to-all: {slots} expert slots are not divisible by {g}; use --redundant "
                       f"{redundant + -slots % g}")
        return out, skipped
    if tp_attn_ok:
        out.append(Strategy(f"EP{g}+TPattn", f"attention TP{g}; experts EP{g}: reduce-scatter, dispatch and combine "
                            "all-to-all, all-gather per MoE layer", g, 1, g, "a2a_tp_attn"))
    out.append(Strategy(f"EP{g}+DPattn", f"attention DP{g} (weights and KV whole per rank); experts EP{g}: dispatch "
                        "and combine all-to-all per MoE layer", 1, 1, g, "a2a_dp_attn"))
    return out, skipped


def collective_link(req: PlanRequest) -> LinkProfile:
    """The link a collective over all ``G`` GPUs is priced on: inter-node when it spans nodes."""
    return req.hardware.inter_node if req.nodes > 1 else req.hardware.intra_node


def _a2a_ms(req: PlanRequest, nbytes: float) -> float:
    """All-to-all over all ``G`` GPUs: off-node traffic goes over the inter-node link."""
    hw, g = req.hardware, req.gpus
    if req.nodes == 1:
        return collective_ms("all_to_all", nbytes, g, hw.intra_node)
    off_node = (g - g // req.nodes) / (g - 1)
    intra = collective_ms("all_to_all", nbytes * (1 - off_node), g, hw.intra_node)
    inter = collective_ms("all_to_all", nbytes * off_node, g, hw.inter_node)
    return max(intra, inter)


def _memory(req: PlanRequest, s: Strategy, batch: int, tokens_rank: int, seqs_rank: int) -> MemoryEstimate:
    spec, g = req.spec, req.gpus
    d, v = spec.hidden_size, spec.vocab_size
    dense_b, bf16 = bytes_per_param(req.dense_format), bytes_per_param("bf16")
    attn = attention_params(spec).per_rank(s.attn_tp, spec.attention.num_kv_heads)
    mlp_split = s.attn_tp  # dense MLPs and shared experts follow attention TP; replicated under DP attention
    shared_split = mlp_split if s.mode == "all_reduce" else 1
    dense_mlp = 3 * d * spec.dense_intermediate_size / mlp_split
    shared = (3 * d * spec.shared_intermediate_size + (d if spec.shared_expert_gate else 0)) / shared_split
    n_dense, n_moe = len(spec.dense_layers), spec.num_moe_layers
    slots_rank = spec.num_experts / g if s.moe_ep == 1 else (spec.num_experts + req.redundant) / s.moe_ep / s.moe_tp
    expert_w = n_moe * slots_rank * spec.expert_params() * bytes_per_param(req.expert_format)
    lm_head = v * d / (s.attn_tp if s.mode != "a2a_dp_attn" else 1)
    weights = (expert_w + (spec.num_layers * attn + n_dense * dense_mlp + n_moe * shared) * dense_b
               + (n_moe * d * spec.num_experts + v * d + lm_head) * bf16)
    kv = seqs_rank * req.context * spec.num_layers * kv_bytes_per_token(spec, s.attn_tp)
    if s.mode == "all_reduce":
        comm = 2 * tokens_rank * d * ACT_BYTES
    else:
        t_loc = math.ceil(batch * (req.spec_tokens + 1) / g)
        # receive worst case: every rank sends all its tokens here; send: one copy per destination rank
        comm = 2 * (g * t_loc + t_loc * min(spec.top_k, g)) * d * ACT_BYTES
    f_rank = max(spec.dense_intermediate_size / mlp_split, spec.moe_intermediate_size * spec.top_k / s.moe_tp)
    graph = tokens_rank * (8 * d + 3 * f_rank) * ACT_BYTES + tokens_rank * v / s.attn_tp * 4 + GRAPH_POOL_FIXED_BYTES
    return MemoryEstimate(weights=weights, expert_weights=expert_w, kv_cache=kv, comm_buffers=comm,
                          graph_pool=graph, capacity=req.hardware.memory_bytes * req.mem_fraction)


def _expert_rows(req: PlanRequest, s: Strategy, tokens: int) -> tuple[float, float]:
    """Routed rows and experts touched on the busiest rank for ``tokens`` tokens entering the MoE layers.

    Under EP the busiest rank receives ``rows``, ``hot`` times the mean ``T K / e``; it is priced as if ``hot * T``
    tokens were routed (at batch 1 the busiest of 8 ranks holds about 2.2 of a token's 8 experts, not the mean 1).
    With R redundant slots each slot is taken to carry an even share of its expert's load, so a slot is among a
    token's choices with probability K / (E + R)."""
    spec, k = req.spec, req.spec.top_k
    if s.moe_ep == 1:
        return tokens * k, expected_distinct_experts(tokens, spec.num_experts, k)
    rows = expected_max_load(tokens * k, s.moe_ep, req.balancedness)
    hot = rows / (tokens * k / s.moe_ep)
    slots = spec.num_experts + req.redundant
    return rows, expected_distinct_experts(tokens * hot, slots, k, slots / s.moe_ep)


def _collectives(req: PlanRequest, s: Strategy, tokens: int, t_send: int, rows: float,
                 logits_rows: int) -> tuple[CollectiveCost, ...]:
    """The collectives of one forward of ``tokens`` rows under ``s``: all-reduces (TP), reduce-scatters and
    all-gathers around the MoE layers (EP with TP attention), the logits' all-gather of ``logits_rows`` rows under
    TP attention, and the all-to-all dispatch and combine of ``t_send`` rows a rank (the busiest rank receiving
    ``rows`` routed rows; each of the two calls also carries half the local send-buffer layout work,
    ``dispatch.layout``)."""
    spec, hw, g = req.spec, req.hardware, req.gpus
    d, k = spec.hidden_size, spec.top_k
    n_dense, n_moe = len(spec.dense_layers), spec.num_moe_layers
    link = collective_link(req)
    colls: list[CollectiveCost] = []

    def add(kind: CollectiveKind, what: str, count: int, nbytes: float, ms: float | None = None) -> None:
        if count and g > 1:
            each = collective_ms(kind, nbytes, g, link) if ms is None else ms
            colls.append(CollectiveCost(kind, what, count, nbytes, each))

    full = tokens * d * ACT_BYTES
    if s.mode == "all_reduce":
        add("all_reduce", "attention and MLP outputs", 2 * spec.num_layers, full)
    elif s.mode == "a2a_tp_attn":
        add("all_reduce", "dense-layer outputs", 2 * n_dense, full)
        add("reduce_scatter", "attention outputs", n_moe, full)
        add("all_gather", "MoE outputs", n_moe, full)
    if s.mode != "a2a_dp_attn":
        add("all_gather", "logits", 1, logits_rows * spec.vocab_size * ACT_BYTES)
    if s.mode != "all_reduce":
        reach = expected_destination_ranks(spec.num_experts, k, g)
        send = t_send * reach * (g - 1) / g * d * ACT_BYTES
        hot = rows / (tokens * k / g)  # the busiest rank receives this many times the mean
        layout = dispatch_layout_ms(t_send * reach, t_send, d, hw.hbm_bytes_per_s, hw.dispatch_layout_fixed_us)
        add("all_to_all", "dispatch and combine", 2 * n_moe, send, _a2a_ms(req, send * max(1.0, hot)) + layout / 2)
    return tuple(colls)


def _step(req: PlanRequest, s: Strategy, batch: int) -> StepEstimate:
    spec, hw, g = req.spec, req.hardware, req.gpus
    d, v = spec.hidden_size, spec.vocab_size
    positions = req.spec_tokens + 1
    tokens = batch * positions
    dense_b, bf16 = bytes_per_param(req.dense_format), bytes_per_param("bf16")
    dense_flops = hw.flops_per_s(compute_dtype(req.dense_format))
    bw = hw.hbm_bytes_per_s
    dp = s.mode == "a2a_dp_attn"
    seqs_attn = math.ceil(batch / g) if dp else batch  # sequences whose attention this rank computes
    t_attn = seqs_attn * positions
    t_moe = math.ceil(tokens / g) if s.mode != "all_reduce" else tokens  # tokens entering MoE on this rank

    # attention + dense: per-layer rooflines; a windowed or chunked layer reads only its span of the context
    attn_w = attention_params(spec).per_rank(s.attn_tp, spec.attention.num_kv_heads)
    layers_attn_ms = 0.0
    for layers, positions in spec.attention.attended_positions(req.context, spec.num_layers):
        kv_read = seqs_attn * positions * kv_bytes_per_token(spec, s.attn_tp)
        score = t_attn * positions * attention_score_flops(spec) / s.attn_tp
        attn_ms = roofline_ms(attn_w * dense_b + kv_read, 2 * attn_w * t_attn + score, bw, dense_flops)
        if spec.attention.is_mla:  # the latent cache read once per head block, below the copy bandwidth
            attn_ms += kv_read * (kv_read_passes(spec, s.attn_tp) / hw.mla_decode_read_efficiency - 1) / bw * 1e3
        layers_attn_ms += layers * attn_ms
    mlp_split = s.attn_tp
    dense_p = 3 * d * spec.dense_intermediate_size / mlp_split
    dense_ms = roofline_ms(dense_p * dense_b, 2 * dense_p * t_attn, bw, dense_flops)
    shared_split, t_shared = (mlp_split, tokens) if s.mode == "all_reduce" else (1, t_moe)
    shared_p = 3 * d * spec.shared_intermediate_size / shared_split
    router_p = d * spec.num_experts
    moe_side_ms = roofline_ms(shared_p * dense_b + router_p * bf16, 2 * (shared_p * t_shared + router_p * t_moe), bw,
                              dense_flops)
    lm_split = 1 if dp else s.attn_tp
    lm_ms = roofline_ms(v * d / lm_split * bf16, 2 * v * d / lm_split * t_attn, bw, hw.flops_per_s("bf16"))
    n_dense, n_moe = len(spec.dense_layers), spec.num_moe_layers
    attention_ms = layers_attn_ms + n_dense * dense_ms + n_moe * moe_side_ms + lm_ms

    # routed experts on the busiest rank: the rows it receives and the experts they touch (``_expert_rows``)
    rows, touched = _expert_rows(req, s, tokens)
    expert_ms = n_moe * expert_layer_ms(MoEDims.from_spec(spec), rows, touched, s.moe_tp, hw, req.expert_format)
    colls = _collectives(req, s, tokens, t_moe, rows, tokens)
    memory = _memory(req, s, batch, t_attn, seqs_attn)
    engine_ms = (hw.engine_step_us + spec.num_layers * hw.engine_layer_step_us
                 + seqs_attn * hw.engine_seq_step_us) / 1e3
    return StepEstimate(batch, tokens, attention_ms, expert_ms, colls, memory, engine_ms)


def _prefill(req: PlanRequest, s: Strategy, n: int) -> StepEstimate:
    """One prompt of ``n`` tokens prefilled alone under ``s``, on the busiest rank: its first forward, whose time is
    the time to first token. Attention and dense products are rooflines over the prompt's ``n`` rows (the scores over
    its causal pairs, ``costs.causal_pairs``, at ``costs.prefill_score_flops`` each); under DP attention one rank
    computes them all, under TP attention each rank its heads. The routed experts get the prompt's ``n K`` rows
    (the busiest EP rank its ``expected_max_load``) through ``expert_layer_ms``; the collectives carry ``n`` rows
    (all-to-all: from the prompt's rank); one row of logits; the engine's per-layer prefill cost
    (``HardwareProfile.engine_prefill_layer_us``) and its step cost (``engine_step_us``)."""
    spec, hw, g = req.spec, req.hardware, req.gpus
    d, v = spec.hidden_size, spec.vocab_size
    dense_b, bf16 = bytes_per_param(req.dense_format), bytes_per_param("bf16")
    dense_flops = hw.flops_per_s(compute_dtype(req.dense_format))
    bw = hw.hbm_bytes_per_s
    dp = s.mode == "a2a_dp_attn"
    attn_w = attention_params(spec).per_rank(s.attn_tp, spec.attention.num_kv_heads)
    layers_attn_ms = 0.0
    for layers, span in spec.attention.attended_positions(n, spec.num_layers):
        score = causal_pairs(n, span) * prefill_score_flops(spec) / s.attn_tp
        layers_attn_ms += layers * roofline_ms(attn_w * dense_b, 2 * attn_w * n + score, bw, dense_flops)
    dense_p = 3 * d * spec.dense_intermediate_size / s.attn_tp
    dense_ms = roofline_ms(dense_p * dense_b, 2 * dense_p * n, bw, dense_flops)
    # tokens entering the MoE layers on this rank: the prompt's rank holds them all under DP attention, each rank
    # its reduce-scattered share under TP attention with EP, every rank all of them under TP
    t_moe = math.ceil(n / g) if s.mode == "a2a_tp_attn" else n
    shared_split = s.attn_tp if s.mode == "all_reduce" else 1
    shared_p = 3 * d * spec.shared_intermediate_size / shared_split
    router_p = d * spec.num_experts
    moe_side_ms = roofline_ms(shared_p * dense_b + router_p * bf16, 2 * (shared_p + router_p) * t_moe, bw,
                              dense_flops)
    lm_split = 1 if dp else s.attn_tp
    lm_ms = roofline_ms(v * d / lm_split * bf16, 2 * v * d / lm_split, bw, hw.flops_per_s("bf16"))
    n_dense, n_moe = len(spec.dense_layers), spec.num_moe_layers
    attention_ms = layers_attn_ms + n_dense * dense_ms + n_moe * moe_side_ms + lm_ms

    rows, touched = _expert_rows(req, s, n)
    expert_ms = n_moe * expert_layer_ms(MoEDims.from_spec(spec), rows, touched, s.moe_tp, hw, req.expert_format)
    colls = _collectives(req, s, n, t_moe, rows, 1)  # each rank dispatches the rows it holds
    memory = _memory(req, s, 1, n, 1)
    engine_ms = (hw.engine_step_us + spec.num_layers * hw.engine_prefill_layer_us) / 1e3
    return StepEstimate(1, n, attention_ms, expert_ms, colls, memory, engine_ms)


def plan(req: PlanRequest) -> Plan:
    """Estimate every strategy at every batch size of ``req``.

    Returns:
        The ``Plan``; strategies that cannot run (indivisible heads, slots or sizes) are listed in
        ``skipped`` with the reason.

    Raises:
        ValueError: invalid request fields (raised when the ``PlanRequest`` is built), or no strategy can
            run the model on ``gpus`` GPUs (every reason is named).
    """
    strategies, skipped = strategies_for(req.spec, req.gpus, req.redundant)
    if not strategies:
        raise ValueError(f"no strategy can run {Path(req.spec.source).name} on {counted(req.gpus, 'GPU')}: "
                         + "; ".join(skipped))
    plans = tuple(StrategyPlan(s, tuple(_step(req, s, b) for b in req.batches),
                               tuple(_prefill(req, s, n) for n in req.input_lens)) for s in strategies)
    return Plan(req, plans, tuple(skipped))

