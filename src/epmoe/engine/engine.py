"""``Engine``: continuous batching over a paged KV cache, whole-step CUDA graphs, expert parallelism.

One ``Engine`` runs on each EP rank. Attention is data-parallel: a rank owns the requests added to it
and schedules them alone. The experts are expert-parallel, so every rank runs every step: at the
start of a step the ranks exchange four numbers (one ``all_gather``, over a gloo group of the same ranks: host
values, so it never waits for the device): whether any rank has work, the
most rows of a step, whether some rank has a prompt chunk too long for a graph step, and the most
single-token rows. A prompt chunk that ends within ``cuda_graph_max_tokens`` runs as single-token rows
(each attending over the keys before it) next to the decodes, and every rank replays the CUDA graph of the same
bucket of rows (a rank with fewer rows pads). If some rank has a longer chunk, or more rows than the largest
bucket, every rank replays the piecewise graphs of the same bucket of tokens (``engine.piecewise``: attention
eager between the pieces), or, past the largest of those, runs an eager step (a rank with no tokens joins the
MoE collectives with an empty batch).

Usage (one process)::

    engine = Engine(EngineConfig(model="/path/to/checkpoint"))
    outputs = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

Step API (the server's): ``add_request``, ``step() -> list[RequestOutput]``, ``abort``,
``has_unfinished``.

Overlap schedule (SGLang's, vLLM's async scheduling; on unless ``EngineConfig.disable_overlap_schedule`` or
speculative decoding): a step's tokens are sampled on the device and copied back without waiting; the host
plans and launches the next step first (the sequences grow by a placeholder token, which that step reads
from the device token buffer, ``ModelRunner.keep_sampled``) and only then reads them back, checks stop
conditions and reports them. So ``step()`` returns a step's tokens one call later, the GPU is not left idle
while the host samples, schedules and launches, and a sequence that stops (EOS, a stop string) may be fed
once more, its extra token dropped. A sequence is never fed past ``max_tokens`` or the context.

With speculative decoding (``EngineConfig.speculative_algorithm``), a proposer (``epmoe.engine.ngram``,
``draft``, ``eagle3``) proposes up to K tokens per decoding request before the model runs; the step then
verifies them (``epmoe.engine.speculative``): a decode step of ``B (K + 1)`` rows, replayed from its own
CUDA-graph buckets, after which each request advances by the proposals that stand plus one token.
"""

from __future__ import annotations

import itertools
import numbers
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from epmoe.comm import Comm
from epmoe.engine.admission import Admission
from epmoe.engine.attention import register_attention
from epmoe.engine.capacity import draft_sizes, graph_sizes, kv_blocks, piece_sizes
from epmoe.engine.config import EPLB_WINDOW_STEPS, EngineConfig
from epmoe.engine.fused_norm import fuse_norms
from epmoe.engine.group import trivial_or_file_placement
from epmoe.engine.kv_cache import BlockAllocator, KVCache, KVLayout
from epmoe.engine.logprobs import (
    RowLogprobs,
    emitted_logprobs,
    logprob_entries,
    record_prompt_logprobs,
    token_logprobs,
)
from epmoe.engine.mla import install_mla
from epmoe.engine.model_runner import ModelRunner, StepOutput, ep_static_hooks
from epmoe.engine.proposers import make_proposer
from epmoe.engine.request import PENDING_TOKEN, RequestOutput, Sequence
from epmoe.engine.rope_attention import install_rope_attention
from epmoe.engine.sampling import SamplingParams, TokenCounts, sample
from epmoe.engine.scheduler import Scheduler, StepPlan
from epmoe.engine.speculative import Proposal, SpecStats, verify, verify_greedy
from epmoe.engine.stopping import banned_tokens, final_text, finish_reason
from epmoe.engine.structured import StructuredOutputs, allows_besides, apply_token_bitmask
from epmoe.engine.tokenizer import eos_token_ids, load_tokenizer
from epmoe.engine.transfer import to_device
from epmoe.layer import MoELayerOptions, check_tp_sizes
from epmoe.loads import ExpertLoadRecorder, LoadTotals
from epmoe.models.hf import EPModel, load_ep_model, load_tp_model
from epmoe.spec import load_moe_spec

if TYPE_CHECKING:
    from epmoe.runtime.rebalance import RebalanceEvent

def _rows(aux: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    return None if aux is None else aux[start:start + n]


class _Logprobs(NamedTuple):
    """Log-probabilities of some rows of a launch on their way to the host (``logprobs.token_logprobs``' tensors,
    copied into pinned host memory on CUDA): ``index`` the rows, ``ks`` their requests' alternatives."""

    index: list[int]
    ks: list[int]
    rows: RowLogprobs


class _Launch(NamedTuple):
    """A step whose sampled tokens are on their way to the host: per sampling sequence, where its placeholder
    is in ``output_token_ids``; the host buffer they are copied into, in the same order, and the event after
    the copy (``None`` on CPU); the log-probabilities of the rows whose requests ask for them."""

    rows: list[tuple[Sequence, int]]
    host: torch.Tensor | None
    event: torch.cuda.Event | None
    logprobs: _Logprobs | None = None


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: a non-blocking copy into pinned memory for a CUDA tensor (valid once the stream passes
    an event recorded after it), ``t`` itself on the CPU."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class Engine:
    """The inference engine of one rank.

    Args:
        config: the options (``EngineConfig``); ``parallel='tp'`` runs the experts tensor-parallel
            (``epmoe.layer.DPTPMoELayer``) with the same data-parallel attention and step protocol.
        comm: the EP (or TP) group (``Comm(None)`` for one process, the default).

    Attributes:
        overlap: the overlap schedule is on (see the module docstring); may be turned off between steps (the
            next step's tokens are then read back at once), and on again only where it was on at start.

    Raises:
        ValueError: a bad option, a placement that does not fit, a graph bucket that does not fit in
            memory, an expert intermediate size the TP group does not divide (named).
        FileNotFoundError: no checkpoint.
    """

    def __init__(self, config: EngineConfig, comm: Comm | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"Engine needs an EngineConfig, got {type(config).__name__}")
        self.config = config
        self.comm = comm if comm is not None else Comm(None)
        say = progress or (lambda _msg: None)
        if config.device == "cuda":
            index = torch.cuda.current_device()
            self.device = torch.device("cuda", index)
        else:
            self.device = torch.device("cpu")
        self.spec = load_moe_spec(config.model)
        self.max_model_len = config.max_model_len or self.spec.max_position_embeddings
        self.tp = config.parallel == "tp"
        if self.tp:
            check_tp_sizes(self.spec, self.comm.size)
            self.placement = None
            self.eager_dispatcher = None
        else:
            self.placement = trivial_or_file_placement(config, self.spec.num_moe_layers, self.spec.num_experts,
                                                       self.comm.size)
            if config.dispatcher == "local" and self.comm.size > 1:
                raise ValueError(f"dispatcher 'local' serves one rank; the EP group has {self.comm.size}")
            self.eager_dispatcher = config.dispatcher or ("local" if self.comm.size == 1 else "all_to_all")
        # tp: no slots to count (the recorder stays empty, one column per expert)
        num_slots = self.spec.num_experts if self.tp else self.placement.num_slots
        self.recorder = ExpertLoadRecorder(self.spec.num_moe_layers, num_slots,
                                           window=max(1, min(config.eplb_interval, EPLB_WINDOW_STEPS)),
                                           device=self.device)
        say("loading weights")
        if self.tp:
            self.ep_model: EPModel = load_tp_model(
                config.model, self.comm, expert_backend=config.expert_backend, dtype=config.torch_dtype,
                device=self.device, load_format=config.load_format, attn_implementation=register_attention(),
                seed=config.seed,
            )
        else:
            self.ep_model = load_ep_model(
                config.model, self.placement, self.comm,
                options=MoELayerOptions(dispatcher=self.eager_dispatcher, expert_backend=config.expert_backend,
                                        load_recorder=self.recorder, replica_policy=config.replica_policy),
                dtype=config.torch_dtype, device=self.device, load_format=config.load_format,
                attn_implementation=register_attention(), seed=config.seed,
            )
        mla_layers = install_mla(self.ep_model.model)  # DeepSeek/Kimi: attention over the latent KV cache
        install_rope_attention(self.ep_model.model)  # Qwen, Mixtral, GLM, gpt-oss: fused projection and rotary
        if self.device.type == "cuda":
            fuse_norms(self.ep_model.model)
        self.tokenizer = load_tokenizer(config.model, config.trust_remote_code)
        self.eos_ids = eos_token_ids(config.model, self.tokenizer, config.generation_config, self.spec.vocab_size)
        self.vocab_size = self.spec.vocab_size
        self.num_spec_tokens = config.num_speculative_tokens
        self.spec_stats = SpecStats()
        self.proposer = None
        self._token_counts: TokenCounts | None = None  # the penalized requests' tokens, made on the first one
        if config.speculative_algorithm is not None:
            say(f"loading the {config.speculative_algorithm} proposer")
            self.proposer = make_proposer(self)
        layout = KVLayout.from_config(self.ep_model.model.config)
        if layout.latent and mla_layers != layout.num_layers:
            raise ValueError(f"the config asks for MLA's latent KV cache (kv_lora_rank) but {mla_layers} of "
                             f"{layout.num_layers} attention modules are MLA")
        extra = self.proposer.kv_bytes_per_token if self.proposer is not None else 0
        num_blocks = kv_blocks(config, layout, self.device, self.max_model_len, extra)
        self.kv = KVCache(layout, num_blocks, config.block_size, config.torch_dtype, self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.admission = Admission(self.tokenizer, self.vocab_size, self.eos_ids, self.max_model_len,
                                   self.allocator.capacity, config.block_size, config.speculative_algorithm)
        graph_rows = max(graph_sizes(config, self.num_spec_tokens)) if config.static_decode else 0
        self.scheduler = Scheduler(self.allocator, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, lookahead=self.num_spec_tokens,
                                   max_model_len=self.max_model_len, graph_tokens=config.cuda_graph_max_tokens,
                                   graph_rows=graph_rows, prefix_caching=config.prefix_caching)
        self.max_blocks = -(-self.max_model_len // config.block_size)
        aux = self.proposer.aux_layers if self.proposer is not None else ()
        # the overlap schedule reads each step's sampled tokens one step late (the proposers need them at once)
        self._overlap = not config.disable_overlap_schedule and self.proposer is None
        self.runner = ModelRunner(self.ep_model.model, self.kv, self.max_blocks, self.device, aux_layers=aux,
                                  token_rows=config.max_num_seqs if self._overlap else 0)
        pin = self.device.type == "cuda"
        self._host_tokens = [torch.zeros(config.max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._inflight: _Launch | None = None
        self._launches = 0
        self._ready: list[RequestOutput] = []  # read back outside step() (before a rebalance), reported by it
        # the step's agreement over a gloo group of the same ranks: over the device group it would wait for the
        # step in flight (a collective on the stream, then a copy to the host), which the overlap schedule hides
        self._host_comm = None
        if self.comm.size > 1 and dist.get_world_size() == self.comm.size:
            self._host_comm = Comm(dist.new_group(list(range(self.comm.size)), backend="gloo"), self.comm.stats)
        if self.proposer is not None:
            self.proposer.allocate(num_blocks, config.block_size)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []
        self._counter = itertools.count()
        self.num_steps = 0
        self.last_step_busy = False
        # tokens this rank fed to the model at the last step: decode rows (each with its draft tokens) plus
        # prompt tokens; None when the last step ran no model pass (no work on any rank, or an idle step)
        self.last_step_tokens: int | None = None
        self.loads = LoadTotals(self.spec.num_moe_layers, num_slots, self.spec.num_experts, self.device)
        self.stats = {"eager_steps": 0, "graph_steps": 0, "graph_prefill_steps": 0, "piecewise_steps": 0,
                      "long_context_graph_steps": 0, "idle_steps": 0, "preemptions": 0}
        self.eplb = None
        self._eplb_on_demand = None
        if config.eplb_interval:
            from epmoe.runtime.rebalance import EPLBController

            self.eplb = EPLBController(self.ep_model, self.recorder, config.eplb_interval,
                                       max_moves=config.eplb_max_moves, on_commit=self.loads.fold)
        if config.static_decode:
            say("capturing CUDA graphs" if config.use_graphs else "preparing static decode buckets")
            self._capture()
            if self.proposer is not None:
                self.proposer.capture(draft_sizes(config))

    # ---- set-up ---------------------------------------------------------------------------------

    def _capture(self) -> None:
        sizes = graph_sizes(self.config, self.num_spec_tokens)
        if self.tp:
            def activate(bs: int, valid_rows: torch.Tensor) -> None:  # every rank runs bucket bs: no size exchange
                for layer in self.ep_model.moe_layers:
                    layer.set_static_tokens(bs)

            def deactivate() -> None:
                for layer in self.ep_model.moe_layers:
                    layer.set_static_tokens(None)
        else:
            activate, deactivate = self._ep_static_hooks()
        pieces = piece_sizes(self.config)
        if self.device.type == "cuda":
            # a capture cannot hand the allocator's cached blocks back to the driver (that would synchronise), so
            # a graph pool needing memory held there would run out: hand them back first
            torch.cuda.empty_cache()
        try:
            self.runner.capture_pieces(pieces, activate, deactivate, cuda_graphs=self.device.type == "cuda")
            self.runner.capture(sizes, activate, deactivate, cuda_graphs=self.device.type == "cuda")
        except torch.cuda.OutOfMemoryError:
            cfg = self.config
            raise ValueError(f"cuda_graph_max_bs {cfg.cuda_graph_max_bs}, cuda_graph_max_tokens "
                             f"{cfg.cuda_graph_max_tokens}, piecewise_cuda_graph_max_tokens "
                             f"{cfg.piecewise_cuda_graph_max_tokens}: capturing graphs of up to "
                             f"{max(sizes + pieces)} rows ran out of GPU memory; lower them or "
                             f"mem_fraction_static") from None

    def _ep_static_hooks(self):
        """The static decode step's hooks in EP: fixed-capacity dispatchers of the bucket's size, masked loads."""
        return ep_static_hooks(self.ep_model, self.eager_dispatcher, self.recorder)

    def kv_report(self, context: int | None = None) -> dict:
        """The KV pool: blocks, tokens, bytes, the bytes of one token's entry in one layer and its kind
        (``latent`` for MLA, else ``expanded``), how many sequences of ``context`` tokens fit at once
        (``None`` = ``max_model_len``), the graph buckets and whether prefix caching is on."""
        ctx = context or self.max_model_len
        tokens = self.allocator.capacity * self.config.block_size
        layout = self.kv.layout
        return {"blocks": self.allocator.capacity, "block_size": self.config.block_size, "tokens": tokens,
                "bytes": self.kv.nbytes, "kind": "latent" if layout.latent else "expanded",
                "bytes_per_token_layer": layout.bytes_per_token_layer(self.config.torch_dtype), "context": ctx,
                "max_concurrency": self.allocator.capacity // -(-ctx // self.config.block_size),
                "graph_buckets": self.runner.buckets, "piecewise_buckets": self.runner.piece_buckets,
                "prefix_caching": self.config.prefix_caching}

    # ---- requests -------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (``Admission.encode``: a string through the tokenizer, or ids as given; its
        errors)."""
        return self.admission.encode(prompt)

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, if the request can be served; nothing is queued (``Admission.check``: its
        errors)."""
        return self.admission.check(prompt, params)[0]

    def constraint_ready(self, spec: StructuredOutputs) -> bool:
        """Whether ``add_request`` with ``spec`` would find its grammar compiled (``Admission.constraint_ready``)."""
        return self.admission.constraint_ready(spec)

    def compile_constraint(self, spec: StructuredOutputs) -> None:
        """Compile ``spec``'s grammar ahead of its ``add_request``, in any thread (``Admission.compile_constraint``:
        its errors). The server's ranks do, so that a large grammar does not hold up every running request's
        steps."""
        self.admission.compile_constraint(spec)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; it joins the running batch at a coming step.

        Args:
            prompt: text or token ids.
            params: sampling options (``SamplingParams()`` when ``None``).
            request_id: the caller's id (when ``None``, a fresh ``req-N`` that no live request holds).

        Returns:
            The request id.

        Raises:
            ValueError: a duplicate id, an empty prompt, a prompt as long as the context
                (``max_model_len``) or longer than the whole KV pool: nothing is queued.
            TypeError: ``params`` is not a ``SamplingParams``, or ``request_id`` is not a string.
        """
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__} {request_id!r}")
        params = params if params is not None else SamplingParams()
        ids, matcher = self.admission.check(prompt, params)
        if request_id is not None and request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        number = next(self._counter)
        rid = request_id
        if rid is None:
            rid, again = f"req-{number}", 0
            while rid in self._seqs:  # a caller's own id may look like the ones made here
                again += 1
                rid = f"req-{number}-{again}"
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(rid, ids, params, arrival=number, generator=gen,
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else [], matcher=matcher)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks. The next ``step()`` reports it once more, finished.

        Returns:
            Its final output (``finish_reason='abort'``), or ``None`` if it is unknown or already done.

        Raises:
            TypeError: ``request_id`` is not a string.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__} {request_id!r}")
        seq = self._seqs.get(request_id)
        if seq is None or seq.finished:
            return None
        self._finish(seq, "abort")
        out = self._output(seq, [])
        self._aborted.append(out)
        return out

    @property
    def overlap(self) -> bool:
        return self._overlap

    @overlap.setter
    def overlap(self, on: bool) -> None:
        if on and self.runner.tokens is None:
            raise ValueError("the overlap schedule can only be turned back on: this engine started without it "
                             "(disable_overlap_schedule, or speculative decoding)")
        self._overlap = bool(on)

    def has_unfinished(self) -> bool:
        """True while any request of this rank waits or runs, or a step's tokens are still to be read back or an
        abort to be reported."""
        return (self.scheduler.has_unfinished() or self._inflight is not None or bool(self._ready)
                or bool(self._aborted))

    # ---- the step -------------------------------------------------------------------------------

    def _agree(self, plan: StepPlan, pending: bool, eager: bool, rows: int,
               all_rows: int, longest: int) -> tuple[bool, int, bool, int, int]:
        """Over the ranks: whether any has work, the most rows of a step (every token fed, verify rows included),
        whether any has a prompt chunk that is not fed row-wise, the most single-token rows, the longest context."""
        local = torch.tensor([int(pending or self.has_unfinished() or bool(plan.chunks)), all_rows,
                              int(eager), rows, longest], dtype=torch.int64)
        if self.comm.size == 1:
            glob = local
        elif self._host_comm is not None:  # host values over gloo: never waits for the step in flight
            glob = self._host_comm.all_gather(local).amax(dim=0)
        else:
            dev = self.device if self.device.type == "cuda" else torch.device("cpu")
            glob = self.comm.all_gather(local.to(dev)).amax(dim=0).cpu()
        work, tokens, prefill, decodes, longest = glob.tolist()
        return bool(work), tokens, bool(prefill), decodes, longest

    def agree_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the ranks (one ``all_gather``; the values themselves on
        one rank). Every rank calls it at the same point (a collective proposer's steps)."""
        local = torch.tensor(values, dtype=torch.int64)
        if self.comm.size == 1:
            return values
        dev = self.device if self.device.type == "cuda" else torch.device("cpu")
        return self.comm.all_gather(local.to(dev)).amax(dim=0).cpu().tolist()

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.drop_pending()
        if seq.count_row is not None:
            self._token_counts.close(seq.count_row)
            seq.count_row = None
        self.scheduler.finish(seq, reason)
        if self.proposer is not None:
            self.proposer.release(seq)

    def _propose(self, plan: StepPlan) -> list[Proposal]:
        """One ``Proposal`` per decode chunk (empty where it has no lookahead, or while its request may not yet
        end: a verified proposal could be a banned EOS)."""
        wants = [bool(c.lookahead) and banned_tokens(c.seq, self.eos_ids, self.vocab_size) is None
                 for c in plan.decodes]
        chunks = [c for c, w in zip(plan.decodes, wants) if w]
        got = iter(self.proposer.propose(chunks, [c.lookahead for c in chunks], self))
        return [next(got) if w else Proposal() for w in wants]

    def step(self, pending: bool = False) -> list[RequestOutput]:
        """Run one step: schedule, propose (speculative decoding), run the model (every rank together), sample
        or verify, update the requests.

        Args:
            pending: this rank expects more requests (staggered arrivals): it keeps stepping with the
                others even with nothing queued.

        Returns:
            One ``RequestOutput`` per request that got tokens or finished at this step (aborted ones
            included, once).
        """
        plan = self.scheduler.schedule()
        self.last_step_tokens = None
        self.stats["preemptions"] += len(plan.preempted)
        if self.proposer is not None:
            for seq in plan.preempted + plan.finished:
                self.proposer.release(seq)
        outputs = self._ready + self._aborted + [self._output(s, []) for s in plan.finished]
        self._ready, self._aborted = [], []
        if not plan.chunks:  # no step of this rank to overlap with: read the last one back now
            outputs += self._resolve()
        proposals = None
        collective = self.proposer is not None and self.proposer.collective
        if self.proposer is not None and not collective:
            proposals = self._propose(plan)
            rows = sum(1 + len(p.token_ids) for p in proposals)
        else:
            rows = sum(1 + c.lookahead for c in plan.decodes)
        rowwise = bool(plan.prefills) and plan.rowwise_prefills
        prompt_rows = sum(c.num_tokens for c in plan.prefills)
        if rowwise:
            rows += prompt_rows
        # the step's longest context (every row's keys at most): picks an MLA bucket's long-context graph alike on all
        longest = max((c.start + c.num_tokens + c.lookahead for c in plan.chunks), default=0)
        work, all_rows, any_eager, max_rows, longest = self._agree(
            plan, pending, bool(plan.prefills) and not rowwise, rows, rows if rowwise else rows + prompt_rows, longest)
        self.last_step_busy = work
        if not work:
            return outputs
        if collective and max_rows:
            proposals = self._propose(plan)
        bucket = piece = None
        if self.config.static_decode and not any_eager and max_rows:
            bucket = self.runner.bucket_for(max_rows)
        if self.config.static_decode and bucket is None and all_rows:
            piece = self.runner.piece_bucket_for(all_rows)
        if bucket is None and piece is None and not plan.chunks:
            self.ep_model.idle_step()
            self.stats["idle_steps"] += 1
        else:
            drafts = [p.token_ids for p in proposals] if proposals is not None else None
            out = self.runner.run(plan, bucket, drafts, piece, max_context=longest)
            kind = "graph_steps" if bucket is not None else "piecewise_steps" if piece is not None else "eager_steps"
            self.stats[kind] += 1
            self.stats["graph_prefill_steps"] += int(bucket is not None and bool(plan.prefills))
            self.stats["long_context_graph_steps"] += int(out.long_context)
            decode_rows = (sum(1 + len(p.token_ids) for p in proposals) if proposals is not None
                           else len(plan.decodes))
            self.last_step_tokens = decode_rows + prompt_rows
            for c in plan.chunks:
                c.seq.num_computed = c.start + c.num_tokens
            if self.proposer is not None:
                outputs += self._advance(plan, out, proposals)
            else:
                if any(c.samples and c.seq.matcher is not None and c.seq.num_pending for c in plan.chunks):
                    # a constrained row's next tokens depend on its last one: read the last step back now (this
                    # step's forward is queued already, so the device keeps working meanwhile)
                    outputs += self._resolve()
                launched = self._launch(plan, out)
                outputs += self._resolve()  # the previous step, while this one runs
                self._inflight = launched
                if not self._overlap:
                    outputs += self._resolve()
        self.num_steps += 1
        self.loads.add(self.recorder.current_counts())
        self.recorder.step()
        if self.eplb is not None and self.num_steps % self.eplb.interval == 0:
            outputs += self._resolve()  # nothing in flight while weights move and graphs are captured again
            self.eplb.on_step(self.num_steps)
            if self.eplb.events and self.eplb.events[-1].committed and self.config.static_decode:
                self._capture()  # the committed weights and slot tables are new tensors
        return outputs

    def _launch(self, plan: StepPlan, out: StepOutput) -> _Launch:
        """Sample the step's tokens on the device, keep them in the runner's token buffer and start their copy to
        the host; each sampling sequence grows by a placeholder (``PENDING_TOKEN``) until ``_resolve``."""
        # logits rows: one per decode, then each prefill chunk's prefill_logit_rows (its last samples)
        spans, row = [], 0
        for c, n in [(c, 1) for c in plan.decodes] + [(c, c.prefill_logit_rows) for c in plan.prefills]:
            spans.append((c, row, n))
            row += n
        logits = out.logits[:, : self.vocab_size]
        if row != sum(c.samples for c, _, _ in spans):  # rows of prompts whose log-probabilities are asked for
            record_prompt_logprobs(logits, spans)
        # the sampling rows, but those of a sequence finished since the plan (by a constrained row's read-back
        # just before: ``step``)
        sampling = [(c, r + n - 1) for c, r, n in spans if c.samples and not c.seq.finished]
        if len(sampling) != row:
            logits = logits.index_select(0, to_device([r for _, r in sampling], logits.device, torch.int64))
        sampling = [c for c, _ in sampling]
        if not sampling:
            return _Launch([], None, None)
        banned = [banned_tokens(c.seq, self.eos_ids, self.vocab_size) for c in sampling]
        constrained = [i for i, c in enumerate(sampling) if c.seq.matcher is not None]
        if constrained:  # before any other adjustment: the tokens the constraints allow (vLLM's order)
            mask = self.admission.grammars.bitmask([sampling[i].seq.matcher for i in constrained])
            apply_token_bitmask(logits, constrained, mask)
            for j, i in enumerate(constrained):  # min_tokens' bans yield where they would leave no allowed token
                if banned[i] is not None and not allows_besides(mask[j], banned[i]):
                    banned[i] = None
        penalized = [i for i, c in enumerate(sampling) if c.seq.params.penalized]
        for i in penalized:
            seq = sampling[i].seq
            if seq.count_row is None:  # its first sample: every token it has is on the host
                if self._token_counts is None:
                    self._token_counts = TokenCounts(self.vocab_size, logits.device)
                seq.count_row = self._token_counts.open(seq.prompt_token_ids, seq.resolved_output)
        toks = sample(logits, [c.seq.params for c in sampling], [c.seq.generator for c in sampling], self.generator,
                      self._token_counts, [c.seq.count_row for c in sampling], banned)
        if penalized:  # the penalties of the next steps count these tokens (still on the device)
            self._token_counts.count([sampling[i].seq.count_row for i in penalized],
                                     toks.index_select(0, to_device(penalized, toks.device, torch.int64)))
        host = self._host_tokens[self._launches % 2][: len(sampling)]
        self._launches += 1
        event = None
        if self._overlap:
            self.runner.keep_sampled(toks)
        want = [i for i, c in enumerate(sampling) if c.seq.params.logprobs is not None]
        logprobs = None
        if want:
            ks = [sampling[i].seq.params.logprobs for i in want]
            idx = to_device(want, logits.device, torch.int64)
            rows = token_logprobs(logits.index_select(0, idx), toks.index_select(0, idx), max(ks))
            logprobs = _Logprobs(want, ks, RowLogprobs(*(_host_copy(t) for t in rows)))
        if toks.is_cuda:
            host.copy_(toks, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host.copy_(toks)
        rows = []
        for i, c in enumerate(sampling):
            seq = c.seq
            seq.output_token_ids.append(PENDING_TOKEN)
            seq.num_pending += 1
            seq.device_row = i
            rows.append((seq, len(seq.output_token_ids) - 1))
        return _Launch(rows, host, event, logprobs)

    def _resolve(self) -> list[RequestOutput]:
        """Read back the tokens of the step in flight (waiting for its copy), put them in place of their
        placeholders, finish the sequences they stop and report them; a sequence finished or aborted since
        drops its token."""
        launch, self._inflight = self._inflight, None
        if launch is None or not launch.rows:
            return []
        if launch.event is not None:
            launch.event.synchronize()
        now = time.perf_counter()
        tokens = launch.host.tolist()
        entries = {}
        if launch.logprobs is not None:
            lp = launch.logprobs
            entries = dict(zip(lp.index, logprob_entries([tokens[i] for i in lp.index], lp.rows, lp.ks)))
        outputs = []
        for i, ((seq, at), tok) in enumerate(zip(launch.rows, tokens)):
            if seq.finished:
                continue
            seq.output_token_ids[at] = tok
            seq.num_pending -= 1
            if i in entries:
                seq.output_logprobs.append(entries[i])
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.matcher is not None:
                seq.matcher.accept(tok)  # allowed by its mask (EOS where the constraint may end)
            reason = finish_reason(seq, tok, self.eos_ids, self.tokenizer, self.max_model_len)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(self._output(seq, [tok]))
        return outputs

    def _advance(self, plan: StepPlan, out: StepOutput, proposals: list[Proposal] | None) -> list[RequestOutput]:
        logits = out.logits[:, : self.vocab_size]
        # rows of the packed step: each decode chunk 1 + k (all sampled), then each prefill chunk's tokens
        sampled: list[tuple] = []  # (chunk, first logits row, proposal or None)
        first_row: list[int] = []  # packed row of each chunk's first token (aux hidden states)
        logit_row = packed_row = 0
        for i, c in enumerate(plan.decodes):
            prop = proposals[i] if proposals is not None else Proposal()
            sampled.append((c, logit_row, prop))
            first_row.append(packed_row)
            logit_row += 1 + len(prop.token_ids)
            packed_row += 1 + len(prop.token_ids)
        spans = []  # prefill chunks: (chunk, first logits row, rows)
        for c in plan.prefills:
            first_row.append(packed_row)
            packed_row += c.num_tokens
            n = c.prefill_logit_rows
            spans.append((c, logit_row, n))
            if c.samples:
                sampled.append((c, logit_row + n - 1, None))
            logit_row += n
        record_prompt_logprobs(logits, spans)
        emitted: dict[int, tuple[list[int], int]] = {}
        plain = [(c, r) for c, r, p in sampled if p is None or not p.token_ids]
        if plain:
            rows = to_device([r for _, r in plain], logits.device, torch.int64)
            toks = sample(logits.index_select(0, rows), [c.seq.params for c, _ in plain],
                          [c.seq.generator for c, _ in plain], self.generator,
                          banned=[banned_tokens(c.seq, self.eos_ids, self.vocab_size) for c, _ in plain]).tolist()
            for (c, _), t in zip(plain, toks):
                emitted[id(c)] = ([t], 0)
        spec = [(c, r, p) for c, r, p in sampled if p is not None and p.token_ids]
        top = logits.argmax(dim=-1).tolist() if any(c.seq.params.greedy for c, _, _ in spec) else []
        for c, r, p in spec:
            k = len(p.token_ids)
            if c.seq.params.greedy:
                emitted[id(c)] = verify_greedy(top[r:r + k + 1], p.token_ids)
            else:
                gen = c.seq.generator if c.seq.generator is not None else self.generator
                emitted[id(c)] = verify(logits[r:r + k + 1], p, c.seq.params, gen)
            c.seq.spec.add(k, emitted[id(c)][1])
            self.spec_stats.add(k, emitted[id(c)][1])
        entries = emitted_logprobs(logits, sampled, emitted)
        now = time.perf_counter()
        outputs = []
        for c, row in zip(plan.chunks, first_row):
            seq = c.seq
            if id(c) not in emitted:
                if self.proposer is not None:
                    self.proposer.observe(seq, c.start, c.num_tokens, _rows(out.aux, row, c.num_tokens))
                continue
            tokens, accepted = emitted[id(c)]
            new = []
            for j, tok in enumerate(tokens):
                seq.output_token_ids.append(tok)
                new.append(tok)
                if id(c) in entries:
                    seq.output_logprobs.append(entries[id(c)][j])
                reason = finish_reason(seq, tok, self.eos_ids, self.tokenizer, self.max_model_len)
                if reason is not None:
                    self._finish(seq, reason)
                    break
            if seq.first_token_time is None:
                seq.first_token_time = now
            if not seq.finished:
                seq.num_computed += accepted  # the accepted proposals' keys are in the cache; the rest are past it
                if self.proposer is not None:
                    valid = c.num_tokens + accepted
                    self.proposer.observe(seq, c.start, valid, _rows(out.aux, row, valid))
            outputs.append(self._output(seq, new))
        return outputs

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        text = final_text(seq, self.tokenizer) if seq.finished else None
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        if seq.finished:
            self._seqs.pop(seq.request_id, None)
        logprobs = list(seq.output_logprobs) if seq.params.logprobs is not None else None
        prompt_logprobs = list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.resolved_output, new, text,
                             seq.finished, seq.finish_reason, seq.num_preemptions, ttft, seq.spec.verify_steps,
                             seq.spec.draft_tokens, seq.spec.accepted_tokens, logprobs, prompt_logprobs, seq.error)

    # ---- expert loads and live rebalancing ---------------------------------------------------------

    def logical_loads(self, since_rebalance: bool = False) -> torch.Tensor:
        """Tokens this rank routed to each logical expert (the format ``epmoe balance --loads`` reads).

        Args:
            since_rebalance: count only the steps since the last committed rebalance (or start), under the
                placement serving now; ``False`` = since start, across rebalances.

        Returns:
            ``[L, E]`` int64 on the CPU, this rank only.

        Raises:
            ValueError: ``parallel='tp'`` (no placement, nothing is recorded).
        """
        if self.tp:
            raise ValueError("parallel 'tp' records no expert loads: every rank computes a slice of every expert")
        return self.loads.logical(self.ep_model.placement, since_rebalance).cpu()

    def rebalance_now(self, max_moves: int | None = None) -> RebalanceEvent:
        """One live rebalance now, from the loads since the last committed one (``logical_loads(True)`` summed
        over the group); between steps, every rank together with the same arguments. On a commit the decode
        graphs are captured again (the weights and slot tables are new tensors).

        Args:
            max_moves: most expert copies to move (``None`` = the configured ``eplb_max_moves``, else as few
                as reach the balancer's target).

        Returns:
            The ``RebalanceEvent``: balancedness before and after, copies moved, committed, or why it did not
            commit.

        Raises:
            ValueError: ``parallel='tp'``, or ``max_moves`` negative (before anything moves).
        """
        if max_moves is not None and (isinstance(max_moves, bool) or not isinstance(max_moves, numbers.Integral)
                                      or max_moves < 0):
            raise ValueError(f"max_moves must be a non-negative integer, got {max_moves!r}")
        self._ready += self._resolve()  # nothing in flight while weights move; the next step() reports them
        load = self.logical_loads(since_rebalance=True).to(self.device)
        if self.comm.size > 1:
            load = self.comm.all_reduce(load)
        controller = self.eplb
        if controller is None:
            if self._eplb_on_demand is None:
                from epmoe.runtime.rebalance import EPLBController

                self._eplb_on_demand = EPLBController(self.ep_model, self.recorder, 0, on_commit=self.loads.fold)
            controller = self._eplb_on_demand
        event = controller.rebalance(self.num_steps, load.cpu(), max_moves)
        if event.committed and self.config.static_decode:
            self._capture()
        return event

    # ---- offline ----------------------------------------------------------------------------------

    def generate(self, prompts: Seq[str | list[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 arrival_times: Seq[float] | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns the final outputs in prompt order.

        Every rank of the group calls it (each with its own prompts, possibly none); it returns when
        every rank is done.

        Args:
            prompts: texts or token-id lists.
            params: one ``SamplingParams`` for all, or one per prompt.
            arrival_times: per prompt, seconds after the call at which it is added (staggered arrivals,
                as with a request rate); ``None`` = all at once.
            on_output: called with every step output (progress bars, streaming).

        Raises:
            ValueError: a bad prompt, option or arrival time (before any request is queued), or lengths
                that differ. An exception of a step propagates after this call's requests are aborted (their
                KV blocks freed), so the engine serves later calls (one rank; a rank's failure ends a group).
        """
        if isinstance(prompts, str):  # one prompt, not its characters
            prompts = [prompts]
        n = len(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * n
        arrivals = [float(t) for t in arrival_times] if arrival_times is not None else [0.0] * n
        if len(plist) != n or len(arrivals) != n:
            raise ValueError(f"{n} prompts need as many params ({len(plist)}) and arrival times ({len(arrivals)})")
        if any(not t >= 0 for t in arrivals):
            raise ValueError(f"arrival times must be non-negative seconds, got {arrivals}")
        prompt_ids = [self.check_request(p, sp) for p, sp in zip(prompts, plist)]
        order = sorted(range(n), key=lambda i: arrivals[i])
        ids: list[str | None] = [None] * n
        results: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        nxt = 0
        try:
            while True:
                now = time.perf_counter() - start
                while nxt < n and arrivals[order[nxt]] <= now:
                    i = order[nxt]
                    ids[i] = self.add_request(prompt_ids[i], plist[i])
                    nxt += 1
                for out in self.step(pending=nxt < n):
                    if on_output is not None:
                        on_output(out)
                    if out.finished:
                        results[out.request_id] = out
                if not self.last_step_busy:
                    break
        except BaseException:  # a step failed (or Ctrl-C): this call's requests go, their blocks with them
            for rid in ids:
                if rid is not None and self.abort(rid) is not None:
                    self._aborted.pop()  # nobody will read that report
            raise
        return [results[r] for r in ids]
