"""The server's Prometheus metrics (``GET /metrics``), in a registry of their own (no global one).

Names follow vLLM's (``vllm:num_requests_running`` -> ``epmoe:num_requests_running``), so dashboards
built for it need only the prefix changed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from epmoe.server.ranks import STEP_KINDS

_LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                      20.0, 40.0, 80.0)
_ROUND_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                    0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)  # vLLM's

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Every metric of one server.

    Attributes:
        running, waiting: sequences scheduled / queued, summed over ranks.
        kv_blocks_used, kv_blocks_free: KV blocks in use / free, summed over ranks.
        kv_usage: used over usable blocks, 0..1.
        prompt_tokens, generation_tokens: tokens prefilled / generated (rates: ``rate()`` in PromQL).
        requests: finished requests by ``finish_reason`` (``stop``, ``length``, ``abort``, ``error``).
        preemptions: sequences preempted (recomputed) so far.
        prefix_cache_queries, prefix_cache_hits: with ``--enable-prefix-caching``, tokens of the sequences admitted
            with nothing computed, and of those the ones their cached blocks held (vLLM's prefix-cache counters).
        collectives_per_step: collectives of the engine's group per engine step, by kind (rank 0, the latest
            round that stepped).
        ttft, tpot: time to first token and time per output token after it, seconds.
        layer_balancedness: per MoE layer (label ``layer``), mean over ranks / max over ranks of the tokens
            routed to each rank's experts, over the last sample (about a second of traffic); EP only.
        spec_verify_steps, spec_draft_tokens, spec_accepted_tokens: speculative decoding: verify steps, proposed
            tokens verified, proposed tokens accepted (vLLM's ``spec_decode_num_drafts``, ``_num_draft_tokens``,
            ``_num_accepted_tokens``), all ranks.
        spec_accepted_length, spec_acceptance_rate: mean tokens per verify step and accepted over proposed
            tokens since start, all ranks.
        spec_request_accepted_length: per finished request, its mean tokens per verify step.
        engine_steps: engine steps of rank 0 (every rank steps together) by ``kind``: ``graph`` (one CUDA-graph
            replay), ``graph_prefill`` (the graph steps that also carried prompt tokens as single-token rows: a
            subset of ``graph``, not counted again in the total), ``piecewise`` (a step with longer prompt chunks
            through the piecewise graphs, attention eager), ``eager``, ``idle`` (an eager step in which rank 0 had
            no rows while another rank had: a padded empty pass; in a graph step it replays the graph). Engine
            steps = graph + piecewise + eager + idle.
        core_busy_seconds, core_idle_seconds: wall seconds of the engine core's process inside rounds that
            stepped / everything else (waiting for and reading requests, sending reports, rounds without a
            step). Busy over busy + idle near 1 under load: engine-bound; well below: the HTTP side is late.
        iteration_tokens: per graph or eager step, the tokens rank 0 fed to the model (decode rows with their
            draft tokens, prompt tokens; 0 when only other ranks had rows), vLLM's ``iteration_tokens_total``.
        round_seconds: wall seconds of each engine-core round that stepped (broadcast, step, gather).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("epmoe:num_requests_running", "Sequences scheduled, all ranks", registry=r)
        self.waiting = Gauge("epmoe:num_requests_waiting", "Sequences queued, all ranks", registry=r)
        self.kv_blocks_used = Gauge("epmoe:kv_blocks_used", "KV blocks in use, all ranks", registry=r)
        self.kv_blocks_free = Gauge("epmoe:kv_blocks_free", "KV blocks free, all ranks", registry=r)
        self.kv_usage = Gauge("epmoe:kv_cache_usage_perc", "KV blocks used over usable (0..1)", registry=r)
        self.prompt_tokens = Counter("epmoe:prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("epmoe:generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("epmoe:request_success", "Finished requests by finish reason", ["finished_reason"],
                                registry=r)
        self.preemptions = Counter("epmoe:num_preemptions", "Sequences preempted (recomputed)", registry=r)
        self.prefix_cache_queries = Counter("epmoe:prefix_cache_queries", "Tokens of the sequences admitted with "
                                            "nothing computed (prefix caching), all ranks", registry=r)
        self.prefix_cache_hits = Counter("epmoe:prefix_cache_hits", "Of those, the tokens found in the prefix "
                                         "cache, all ranks", registry=r)
        self.collectives_per_step = Gauge("epmoe:collectives_per_step",
                                          "Collectives of the engine's group per step (rank 0, latest step)",
                                          ["kind"], registry=r)
        self.ttft = Histogram("epmoe:time_to_first_token_seconds", "Time to first token, s",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("epmoe:time_per_output_token_seconds", "Time per output token after the first, s",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.layer_balancedness = Gauge("epmoe:eplb_balancedness",
                                        "Per MoE layer: mean over ranks / max over ranks of the tokens routed to "
                                        "each rank (1 = balanced), over the last sample", ["layer"], registry=r)

        self.spec_verify_steps = Counter("epmoe:spec_decode_num_drafts", "Speculative verify steps, all ranks",
                                         registry=r)
        self.spec_draft_tokens = Counter("epmoe:spec_decode_num_draft_tokens", "Proposed tokens verified",
                                         registry=r)
        self.spec_accepted_tokens = Counter("epmoe:spec_decode_num_accepted_tokens", "Proposed tokens accepted",
                                            registry=r)
        self.spec_accepted_length = Gauge("epmoe:spec_decode_mean_accepted_length",
                                          "Mean tokens per verify step since start (accepted + 1)", registry=r)
        self.spec_acceptance_rate = Gauge("epmoe:spec_decode_acceptance_rate",
                                          "Accepted over proposed tokens since start", registry=r)
        self.spec_request_accepted_length = Histogram(
            "epmoe:spec_decode_request_accepted_length", "Mean tokens per verify step of each finished request",
            buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 17.0), registry=r)

        self.engine_steps = Counter("epmoe:engine_steps",
                                    "Engine steps of rank 0 by kind; graph_prefill steps are graph steps that "
                                    "carried prompt tokens (a subset of graph): steps = graph + piecewise + eager + "
                                    "idle",
                                    ["kind"], registry=r)
        for kind in STEP_KINDS:
            self.engine_steps.labels(kind=kind)
        self.core_busy_seconds = Counter("epmoe:engine_core_busy_seconds",
                                         "Wall seconds of the engine core inside rounds that stepped", registry=r)
        self.core_idle_seconds = Counter("epmoe:engine_core_idle_seconds",
                                         "Wall seconds of the engine core outside rounds that stepped (waiting "
                                         "for requests, reading them, sending reports)", registry=r)
        self.iteration_tokens = Histogram("epmoe:iteration_tokens_total",
                                          "Tokens rank 0 fed to the model per graph or eager step",
                                          buckets=_ITERATION_TOKEN_BUCKETS, registry=r)
        self.round_seconds = Histogram("epmoe:engine_round_seconds",
                                       "Wall seconds of each engine-core round that stepped",
                                       buckets=_ROUND_BUCKETS_S, registry=r)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
