"""``Engine``: continuous batching over a paged KV cache, whole-step CUDA graphs, expert parallelism.

One ``Engine`` runs on each EP rank. Attention is data-parallel: a rank owns the requests added to it
and schedules them alone. The experts are expert-parallel, so every rank runs every step: at the
start of a step the ranks exchange four numbers (one ``all_gather``): whether any rank has work, and
the largest step's tokens, prefill chunks and decode rows. If some rank prefills, every rank runs an
eager step (a rank with no tokens joins the MoE collectives with an empty batch); if all ranks only
decode, every rank replays the CUDA graph of the same batch bucket (a rank with fewer rows pads).

Usage (one process)::

    engine = Engine(EngineConfig(model="/path/to/checkpoint"))
    outputs = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

Step API (the server's): ``add_request``, ``step() -> list[RequestOutput]``, ``abort``,
``has_unfinished``.
"""

from __future__ import annotations

import itertools
import numbers
import os
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from epmoe.comm import Comm
from epmoe.engine.attention import register_attention
from epmoe.engine.config import EngineConfig
from epmoe.engine.fused_norm import fuse_norms
from epmoe.engine.kv_cache import BlockAllocator, KVCache, KVLayout, blocks_for_memory
from epmoe.engine.model_runner import ModelRunner, graph_buckets
from epmoe.engine.request import RequestOutput, Sequence
from epmoe.engine.sampling import SamplingParams, sample
from epmoe.engine.scheduler import Scheduler, StepPlan
from epmoe.layer import MoELayerOptions, check_tp_sizes
from epmoe.loads import ExpertLoadRecorder, slots_to_logical
from epmoe.models.hf import EPModel, load_ep_model, load_tp_model
from epmoe.placement import ExpertPlacement
from epmoe.spec import language_model_config, load_moe_spec, read_config

_CPU_KV_BYTES = 1 << 30  # KV budget on CPU (no memory query there)


def trivial_or_file_placement(config: EngineConfig, num_layers: int, num_experts: int,
                              ep_size: int) -> ExpertPlacement:
    """The placement the options ask for: the file, or the trivial one.

    Raises:
        ValueError: the placement does not fit the model or the group (named).
    """
    if config.placement:
        placement = ExpertPlacement.load(config.placement, ep_size=ep_size)
    else:
        try:
            placement = ExpertPlacement.trivial(num_layers, num_experts, ep_size, config.redundant, config.layout)
        except ValueError as exc:
            raise ValueError(f"EP size {ep_size} with redundant {config.redundant}: {exc}") from None
    placement.check_model(num_layers, num_experts, what=f"model {config.model}")
    return placement


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or ``None`` when it has none (prompts are then UTF-8 bytes).

    Raises:
        ValueError: the tokenizer files cannot be read (the broken JSON file named, with the parser's reason).
    """
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any((Path(model_dir) / f).is_file() for f in names):
        return None
    import json

    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            path = Path(model_dir) / name
            try:
                if path.is_file():
                    json.loads(path.read_text())
            except (ValueError, OSError) as bad:
                raise ValueError(f"tokenizer file {str(path)!r} cannot be read: {bad}") from None
        raise ValueError(f"the tokenizer of {model_dir!r} cannot be loaded: {type(exc).__name__}: {exc}") from None


def encode_text(tokenizer, vocab_size: int, text: str) -> list[int]:
    """Token ids of ``text``: the tokenizer's (no special tokens added), or without one its UTF-8 bytes
    modulo ``vocab_size``.

    Raises:
        ValueError: ``text`` is not valid Unicode (a lone surrogate: bytes that were not UTF-8), its position named.
    """
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"prompt {text!r} is not valid UTF-8 text (position {exc.start})") from None
    if tokenizer is None:
        return [b % vocab_size for b in text.encode()]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eos_token_ids(model_dir: str, tokenizer) -> frozenset[int]:
    """The end-of-sequence token ids of the checkpoint: its config's ``eos_token_id`` (one or a list) and the
    tokenizer's."""
    raw = language_model_config(read_config(model_dir)[0])
    ids: set[int] = set()
    for source in (raw.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(i for i in source if isinstance(i, int))
    return frozenset(ids)


class Engine:
    """The inference engine of one rank.

    Args:
        config: the options (``EngineConfig``); ``parallel='tp'`` runs the experts tensor-parallel
            (``epmoe.layer.DPTPMoELayer``) with the same data-parallel attention and step protocol.
        comm: the EP (or TP) group (``Comm(None)`` for one process, the default).

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
        raw = language_model_config(read_config(config.model)[0])
        self.max_model_len = int(config.max_model_len or raw.get("max_position_embeddings") or 4096)
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
                                           window=max(1, config.eplb_interval), device=self.device)
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
        if self.device.type == "cuda":
            fuse_norms(self.ep_model.model)
        self.tokenizer = load_tokenizer(config.model)
        self.eos_ids = eos_token_ids(config.model, self.tokenizer)
        self.vocab_size = self.spec.vocab_size
        layout = KVLayout.from_config(self.ep_model.model.config)
        num_blocks = self._num_kv_blocks(layout)
        self.kv = KVCache(layout, num_blocks, config.block_size, config.torch_dtype, self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(self.allocator, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        max_blocks = -(-self.max_model_len // config.block_size)
        self.runner = ModelRunner(self.ep_model.model, self.kv, max_blocks, self.device)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self._seqs: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []
        self._counter = itertools.count()
        self.num_steps = 0
        self.last_step_busy = False
        self.slot_totals = torch.zeros(self.spec.num_moe_layers, num_slots, dtype=torch.int64,
                                       device=self.device)
        # logical loads of the placements served before the last live rebalance, and the slot totals then
        self._loads_before = torch.zeros(self.spec.num_moe_layers, self.spec.num_experts, dtype=torch.int64,
                                         device=self.device)
        self._slots_before = torch.zeros_like(self.slot_totals)
        self.stats = {"eager_steps": 0, "graph_steps": 0, "idle_steps": 0, "preemptions": 0}
        self.eplb = None
        if config.eplb_interval:
            from epmoe.runtime.rebalance import EPLBController

            self.eplb = EPLBController(self.ep_model, self.recorder, config.eplb_interval,
                                       max_moves=config.eplb_max_moves)
        if config.static_decode:
            say("capturing CUDA graphs" if config.use_graphs else "preparing static decode buckets")
            self._capture()

    # ---- set-up ---------------------------------------------------------------------------------

    def _num_kv_blocks(self, layout: KVLayout) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            want = cfg.num_kv_blocks * cfg.block_size * layout.bytes_per_token(cfg.torch_dtype)
            have = (torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda"
                    else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
            if want > have:
                raise ValueError(f"num_kv_blocks {cfg.num_kv_blocks} needs {want / 2**30:.1f} GiB of KV cache; "
                                 f"{have / 2**30:.1f} GiB are free on {self.device}")
            return int(cfg.num_kv_blocks)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - int((1 - cfg.mem_fraction_static) * total)
            what = (f"mem_fraction_static {cfg.mem_fraction_static} of {total / 2**30:.1f} GiB leaves "
                    f"{budget / 2**30:.2f} GiB for the KV cache after the weights")
        else:
            budget = _CPU_KV_BYTES
            what = f"the CPU KV budget of {_CPU_KV_BYTES >> 20} MiB"
        blocks = blocks_for_memory(max(0, budget), layout, cfg.block_size, cfg.torch_dtype)
        blocks = min(blocks, cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size) + 1)
        if blocks < 2:
            raise ValueError(f"no room for a KV cache: {what}")
        return blocks

    def _capture(self) -> None:
        sizes = [b for b in graph_buckets(self.config.cuda_graph_max_bs) if b <= self.config.max_num_seqs]
        if self.tp:
            def activate(bs: int, valid_rows: torch.Tensor) -> None:  # every rank runs bucket bs: no size exchange
                for layer in self.ep_model.moe_layers:
                    layer.set_static_tokens(bs)

            def deactivate() -> None:
                for layer in self.ep_model.moe_layers:
                    layer.set_static_tokens(None)
        else:
            activate, deactivate = self._ep_static_hooks()
        try:
            self.runner.capture(sizes, activate, deactivate, cuda_graphs=self.device.type == "cuda")
        except torch.cuda.OutOfMemoryError:
            raise ValueError(f"cuda_graph_max_bs {self.config.cuda_graph_max_bs}: capturing the decode graphs "
                             f"ran out of GPU memory; lower it or mem_fraction_static") from None

    def _ep_static_hooks(self):
        """The static decode step's hooks in EP: fixed-capacity dispatchers of the bucket's size, masked loads."""
        comm, slots = self.comm, self.placement.slots_per_rank
        from epmoe.dispatch import make_dispatcher

        def activate(bs: int, valid_rows: torch.Tensor) -> None:
            self.recorder.mask_rows(valid_rows)
            for layer in self.ep_model.moe_layers:  # capacity bs: a token goes to a rank at most once
                layer.set_dispatcher(make_dispatcher("local", comm, slots) if comm.size == 1 else
                                     make_dispatcher("fixed_capacity", comm, slots, capacity=bs))

        def deactivate() -> None:
            self.recorder.mask_rows(None)
            for layer in self.ep_model.moe_layers:
                layer.set_dispatcher(make_dispatcher(self.eager_dispatcher, comm, slots))

        return activate, deactivate

    def logical_loads(self) -> torch.Tensor:
        """Tokens this rank routed to each logical expert since start, through every placement it served.

        Returns:
            ``[L, E]`` int64 on the CPU (padding rows of graph steps not counted).

        Raises:
            ValueError: tensor-parallel experts (``parallel='tp'``) record no loads.
        """
        if self.tp:
            raise ValueError("parallel 'tp' records no expert loads: every rank computes a slice of every expert")
        since = slots_to_logical(self.slot_totals - self._slots_before, self.ep_model.placement)
        return (self._loads_before + since).cpu()

    def kv_report(self, context: int | None = None) -> dict:
        """The KV pool: blocks, tokens, bytes, and how many sequences of ``context`` tokens fit at once
        (``None`` = ``max_model_len``)."""
        ctx = context or self.max_model_len
        tokens = self.allocator.capacity * self.config.block_size
        return {"blocks": self.allocator.capacity, "block_size": self.config.block_size, "tokens": tokens,
                "bytes": self.kv.nbytes, "context": ctx,
                "max_concurrency": self.allocator.capacity // -(-ctx // self.config.block_size),
                "graph_buckets": self.runner.buckets}

    # ---- requests -------------------------------------------------------------------------------

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (a string through the tokenizer, or ids as given).

        Raises:
            TypeError: a prompt that is neither a string nor a list/tuple of token ids.
            ValueError: an empty prompt, or ids outside the vocabulary.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = encode_text(self.tokenizer, self.vocab_size, prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("prompt must have at least one token")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)
               or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}")
        return [int(t) for t in ids]

    def check_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, if the request can be served; nothing is queued.

        Raises:
            TypeError: ``params`` is not a ``SamplingParams``; a prompt of another type.
            ValueError: an empty prompt, ids outside the vocabulary, a prompt as long as the context
                (``max_model_len``), or a prompt whose keys and values with ``max_tokens`` more would not
                fit in the whole KV pool (it could only be cut short).
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room in the context of max_model_len "
                             f"{self.max_model_len} tokens")
        pool = self.allocator.capacity * self.config.block_size
        # the last token sampled is never fed back: its KV is not needed
        need = min(len(ids) + params.max_tokens - 1, self.max_model_len)
        if need > pool:
            raise ValueError(f"prompt of {len(ids)} tokens with max_tokens {params.max_tokens} needs {need} KV slots; "
                             f"the KV pool holds {pool} tokens ({self.allocator.capacity} blocks of "
                             f"{self.config.block_size}): lower max_tokens or give the cache more blocks")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; it joins the running batch at a coming step.

        Args:
            prompt: text or token ids.
            params: sampling options (``SamplingParams()`` when ``None``).
            request_id: the caller's id (a fresh one when ``None``).

        Returns:
            The request id.

        Raises:
            ValueError: a duplicate id, an empty prompt, a prompt as long as the context
                (``max_model_len``) or longer than the whole KV pool: nothing is queued.
            TypeError: ``params`` is not a ``SamplingParams``.
        """
        params = params if params is not None else SamplingParams()
        ids = self.check_request(prompt, params)
        if request_id is not None and request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        number = next(self._counter)
        rid = request_id if request_id is not None else f"req-{number}"
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(rid, ids, params, arrival=number, generator=gen)
        self._seqs[rid] = seq
        self.scheduler.add(seq)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks. The next ``step()`` reports it once more, finished.

        Returns:
            Its final output (``finish_reason='abort'``), or ``None`` if it is unknown or already done.
        """
        seq = self._seqs.get(request_id)
        if seq is None or seq.finished:
            return None
        self.scheduler.finish(seq, "abort")
        out = self._output(seq, [])
        self._aborted.append(out)
        return out

    def has_unfinished(self) -> bool:
        """True while any request of this rank waits or runs."""
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------------

    def _agree(self, plan: StepPlan, pending: bool) -> tuple[bool, int, bool, int]:
        local = torch.tensor([int(pending or self.has_unfinished() or bool(plan.chunks)), plan.num_tokens,
                              int(bool(plan.prefills)), len(plan.decodes)], dtype=torch.int64)
        if self.comm.size == 1:
            glob = local
        else:
            dev = self.device if self.device.type == "cuda" else torch.device("cpu")
            glob = self.comm.all_gather(local.to(dev)).amax(dim=0).cpu()
        work, tokens, prefill, decodes = glob.tolist()
        return bool(work), tokens, bool(prefill), decodes

    def step(self, pending: bool = False) -> list[RequestOutput]:
        """Run one step: schedule, run the model (every rank together), sample, update the requests.

        Args:
            pending: this rank expects more requests (staggered arrivals): it keeps stepping with the
                others even with nothing queued.

        Returns:
            One ``RequestOutput`` per request that got a token or finished at this step (aborted ones
            included, once).
        """
        plan = self.scheduler.schedule()
        self.stats["preemptions"] += len(plan.preempted)
        outputs = self._aborted + [self._output(s, []) for s in plan.finished]
        self._aborted = []
        work, _, any_prefill, max_decodes = self._agree(plan, pending)
        self.last_step_busy = work
        if not work:
            return outputs
        bucket = None
        if self.config.static_decode and not any_prefill and max_decodes:
            bucket = self.runner.bucket_for(max_decodes)
        if bucket is None and not plan.chunks:
            self.ep_model.idle_step()
            self.stats["idle_steps"] += 1
        else:
            logits = self.runner.run(plan, bucket)
            self.stats["graph_steps" if bucket is not None else "eager_steps"] += 1
            outputs += self._advance(plan, logits)
        self.num_steps += 1
        self.slot_totals += self.recorder.current_counts()
        self.recorder.step()
        if self.eplb is not None and self.num_steps % self.eplb.interval == 0:
            serving = self.ep_model.placement
            self.eplb.on_step(self.num_steps)
            if self.eplb.events and self.eplb.events[-1].committed:
                self._loads_before += slots_to_logical(self.slot_totals - self._slots_before, serving)
                self._slots_before = self.slot_totals.clone()
                if self.config.static_decode:
                    self._capture()  # the committed weights and slot tables are new tensors
        return outputs

    def _advance(self, plan: StepPlan, logits: torch.Tensor) -> list[RequestOutput]:
        for c in plan.chunks:
            c.seq.num_computed = c.start + c.num_tokens
        sampling = plan.sampling
        if not sampling:
            return []
        seqs = [c.seq for c in sampling]
        tokens = sample(logits[:, : self.vocab_size], [s.params for s in seqs], [s.generator for s in seqs],
                        self.generator).tolist()
        now = time.perf_counter()
        outputs = []
        for seq, tok in zip(seqs, tokens):
            seq.output_token_ids.append(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._finish_reason(seq, tok)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(self._output(seq, [tok]))
        return outputs

    def _finish_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        n = len(seq.output_token_ids)
        if n >= p.min_tokens and ((tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids):
            return "stop"
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if hits:
                seq.stop_text_len = min(hits)
                return "stop"
        if n >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        text = None
        if self.tokenizer is not None and seq.finished:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            if seq.stop_text_len is not None:
                text = text[: seq.stop_text_len]
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        if seq.finished:
            self._seqs.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, list(seq.output_token_ids), new, text,
                             seq.finished, seq.finish_reason, seq.num_preemptions, ttft)

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
                that differ.
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
        return [results[r] for r in ids]
