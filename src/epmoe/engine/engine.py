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

Overlap schedule (on unless ``EngineConfig.disable_overlap_schedule`` or speculative decoding): ``step()``
returns a step's tokens one call later, read back while the next step runs (``epmoe.engine.overlap``).

With speculative decoding (``EngineConfig.speculative_algorithm``), a proposer proposes up to K tokens per
decoding request before the model runs; the step then verifies them (``epmoe.engine.verify_step``).
"""

from __future__ import annotations

import itertools
import math
import numbers
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from epmoe.comm import Comm
from epmoe.engine.admission import Admission
from epmoe.engine.agreement import agree, agree_max, host_group
from epmoe.engine.capacity import draft_sizes, graph_sizes, kv_blocks
from epmoe.engine.capture import capture_graphs, ep_static_hooks, tp_static_hooks
from epmoe.engine.config import EPLB_WINDOW_STEPS, EngineConfig
from epmoe.engine.kv_cache import BlockAllocator, KVCache, KVLayout
from epmoe.engine.loading import load_model, placement_and_dispatcher
from epmoe.engine.model_runner import ModelRunner, StepOutput
from epmoe.engine.overlap import Launch, resolve, sample_rows, sampling_rows, start_copy
from epmoe.engine.proposers import make_proposer
from epmoe.engine.request import RequestOutput, Sequence
from epmoe.engine.sampling import SamplingParams, TokenCounts
from epmoe.engine.scheduler import Scheduler, StepPlan
from epmoe.engine.speculative import Proposal, SpecStats
from epmoe.engine.stopping import banned_tokens, final_text
from epmoe.engine.structured import StructuredOutputs
from epmoe.engine.tokenizer import eos_token_ids, load_tokenizer
from epmoe.engine.verify_step import advance
from epmoe.loads import ExpertLoadRecorder, LoadTotals
from epmoe.spec import load_moe_spec

if TYPE_CHECKING:
    from epmoe.runtime.rebalance import RebalanceEvent


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
        if comm is not None and not isinstance(comm, Comm):
            raise TypeError(f"comm must be an epmoe.comm.Comm (Comm(group) wraps a process group) or None, got "
                            f"{type(comm).__name__}")
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
        self.placement, self.eager_dispatcher = placement_and_dispatcher(config, self.spec, self.comm)
        # tp: no slots to count (the recorder stays empty, one column per expert)
        num_slots = self.spec.num_experts if self.tp else self.placement.num_slots
        self.recorder = ExpertLoadRecorder(self.spec.num_moe_layers, num_slots,
                                           window=max(1, min(config.eplb_interval, EPLB_WINDOW_STEPS)),
                                           device=self.device)
        say("loading weights")
        self.ep_model, mla_layers = load_model(config, self.comm, self.device, self.placement,
                                               self.eager_dispatcher, self.recorder)
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
        self._inflight: Launch | None = None
        self._launches = 0
        self._ready: list[RequestOutput] = []  # read back outside step() (before a rebalance), reported by it
        # the step's agreement over a gloo group of the same ranks (``agreement.host_group``)
        self._host_comm = host_group(self.comm)
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
        activate, deactivate = tp_static_hooks(self.ep_model) if self.tp else self._ep_static_hooks()
        capture_graphs(self.runner, self.config, self.num_spec_tokens, self.device, activate, deactivate)

    def _ep_static_hooks(self):
        """The static decode step's hooks in EP: fixed-capacity dispatchers of the bucket's size, masked loads."""
        return ep_static_hooks(self.ep_model, self.eager_dispatcher, self.recorder)

    def kv_report(self, context: int | None = None) -> dict:
        """The KV pool: blocks, tokens, bytes, the bytes of one token's entry in one layer and its kind
        (``latent`` for MLA, else ``expanded``), how many sequences of ``context`` tokens fit at once
        (``None`` = ``max_model_len``), the graph buckets and whether prefix caching is on.

        Raises:
            ValueError: ``context`` not a positive integer, or past ``max_model_len``.
        """
        if context is not None and (isinstance(context, bool) or not isinstance(context, numbers.Integral)
                                    or context < 1):
            raise ValueError(f"context must be a positive integer of tokens, got {context!r}")
        if context is not None and context > self.max_model_len:
            raise ValueError(f"context ({context}) is past max_model_len ({self.max_model_len}): no sequence is "
                             f"that long")
        ctx = int(context or self.max_model_len)
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
            ValueError: a duplicate id (also one whose abort the next ``step()`` reports), an empty prompt, a prompt
                as long as the context
                (``max_model_len``) or longer than the whole KV pool: nothing is queued.
            TypeError: ``params`` is not a ``SamplingParams``, or ``request_id`` is not a string.
        """
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__} {request_id!r}")
        params = params if params is not None else SamplingParams()
        ids, matcher = self.admission.check(prompt, params)
        if request_id is not None and self._in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use" + (
                "" if request_id in self._seqs else " (its abort is reported by the next step())"))
        number = next(self._counter)
        rid = request_id
        if rid is None:
            rid, again = f"req-{number}", 0
            while self._in_use(rid):  # a caller's own id may look like the ones made here
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

    def _in_use(self, request_id: str) -> bool:
        """A request of this id waits, runs, or has an abort or a finish still to be reported (two requests of one id
        in one step's outputs could not be told apart)."""
        return request_id in self._seqs or any(o.request_id == request_id for o in (*self._aborted, *self._ready))

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
        work, tokens, prefill, decodes, longest = agree(local, self.comm, self._host_comm, self.device)
        return bool(work), tokens, bool(prefill), decodes, longest

    def agree_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of ``values`` over the ranks (one ``all_gather``; the values themselves on
        one rank). Every rank calls it at the same point (a collective proposer's steps)."""
        return agree_max(values, self.comm, self.device)

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
                outputs += advance(plan, out, proposals, vocab_size=self.vocab_size, eos_ids=self.eos_ids,
                                   tokenizer=self.tokenizer, max_model_len=self.max_model_len,
                                   generator=self.generator, spec_stats=self.spec_stats, proposer=self.proposer,
                                   finish=self._finish, output=self._output)
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
        if self.eplb is not None and self.num_steps % self.eplb.interval == 0:
            outputs += self._resolve()  # nothing in flight while weights move and graphs are captured again
            self.eplb.on_step(self.num_steps)  # its window holds this step too: the recorder advances after
            if self.eplb.events and self.eplb.events[-1].committed and self.config.static_decode:
                self._capture()  # the committed weights and slot tables are new tensors
        self.recorder.step()
        return outputs

    def _launch(self, plan: StepPlan, out: StepOutput) -> Launch:
        """Sample the step's tokens on the device, keep them in the runner's token buffer and start their copy to
        the host; each sampling sequence grows by a placeholder (``PENDING_TOKEN``) until ``_resolve``."""
        sampling, logits = sampling_rows(plan, out.logits[:, : self.vocab_size])
        if not sampling:
            return Launch([], None, None)
        toks, self._token_counts = sample_rows(sampling, logits, self.eos_ids, self.vocab_size,
                                               self.admission.grammars, self._token_counts, self.generator)
        host = self._host_tokens[self._launches % 2][: len(sampling)]
        self._launches += 1
        if self._overlap:
            self.runner.keep_sampled(toks)
        return start_copy(sampling, logits, toks, host)

    def _resolve(self) -> list[RequestOutput]:
        """Read back the tokens of the step in flight (``overlap.resolve``) and report them."""
        launch, self._inflight = self._inflight, None
        return resolve(launch, self.eos_ids, self.tokenizer, self.max_model_len, self._finish, self._output)

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        text = final_text(seq, self.tokenizer) if seq.finished else None
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        if seq.finished:
            self._seqs.pop(seq.request_id, None)
        logprobs = list(seq.output_logprobs) if seq.params.logprobs is not None else None
        prompt_logprobs = list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.resolved_output, new, text,
                             seq.finished, seq.finish_reason, seq.num_preemptions, ttft, seq.spec.verify_steps,
                             seq.spec.draft_tokens, seq.spec.accepted_tokens, logprobs, prompt_logprobs, seq.error,
                             seq.num_cached_tokens)

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
        times = list(arrival_times) if arrival_times is not None else [0.0] * n
        if isinstance(arrival_times, str) or any(isinstance(t, bool) or not isinstance(t, numbers.Real)
                                                 for t in times):
            raise ValueError(f"arrival_times must be numbers of seconds, got {arrival_times!r}")
        try:
            arrivals = [float(t) for t in times]
        except OverflowError:
            raise ValueError(f"arrival_times must be finite non-negative seconds, got {arrival_times!r}") from None
        if len(plist) != n or len(arrivals) != n:
            raise ValueError(f"{n} prompts need as many params ({len(plist)}) and arrival times ({len(arrivals)})")
        if any(not 0 <= t < math.inf for t in arrivals):  # an infinite one would never arrive: generate would not end
            raise ValueError(f"arrival_times must be finite non-negative seconds, got {arrivals}")
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
