"""``draft``: speculation by a separate small model of any served family, MoE or dense.

The draft has its own everything: weights, KV pool (as many blocks as the target's, addressed by the
target's block ids, so a sequence's draft keys need no allocator of their own), and, for an MoE draft, its
own ``ExpertPlacement`` and dispatchers. Nothing is shared with the target implicitly: a rebalance of the
target never touches the draft, and the draft is never handed the target's placement. An MoE draft runs
``ep`` (its experts spread over the same ranks with its placement: the file given, else the trivial one of
the draft's own experts; its steps are collectives every rank joins) or ``replicated`` (every rank holds all
its experts: no collectives). A dense draft has no placement and is never asked for one.

Each step the draft first catches up on the tokens it has not seen (the prompt at first, then the token the
target appended and any proposals it did not feed), which proposes the first token, then runs ``K - 1``
single-token steps. Proposed tokens' keys stay in its cache where they were accepted.
"""

from __future__ import annotations

import torch

from epmoe.comm import Comm
from epmoe.engine.attention import register_attention
from epmoe.engine.capture import ep_static_hooks
from epmoe.engine.kv_cache import KVCache, KVLayout
from epmoe.engine.mla import install_mla
from epmoe.engine.model_runner import ModelRunner, StepOutput
from epmoe.engine.packing import Feed
from epmoe.engine.speculative import Proposal, Proposer, last_rows, propose_tokens
from epmoe.engine.tokenizer import load_tokenizer
from epmoe.engine.transfer import to_device
from epmoe.integrations.placements import load_served_placement
from epmoe.layer import MoELayerOptions
from epmoe.placement import ExpertPlacement
from epmoe.spec import DenseModelError, language_model_config, load_moe_spec, read_config

_CATCH_UP_ROWS = 2  # catch-ups this short run as decode rows (static buckets), longer ones as a prefill chunk


def check_draft_vocab(draft: str, target: str, target_vocab: int, target_tokenizer,
                      trust_remote_code: bool = False) -> None:
    """Refuse a draft whose token ids mean other tokens than the target's.

    Raises:
        ValueError: the vocabulary sizes differ, or both have tokenizers whose vocabularies differ (both
            directories named).
    """
    raw = language_model_config(read_config(draft)[0])
    vocab = raw.get("vocab_size")
    if vocab != target_vocab:
        raise ValueError(f"draft model {draft} has vocab_size {vocab!r} but the target model {target} has "
                         f"{target_vocab}: the draft must share the target's tokenizer")
    tok = load_tokenizer(draft, trust_remote_code)
    if tok is not None and target_tokenizer is not None and tok.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"draft model {draft} has another tokenizer than the target model {target} (their "
                         f"vocabularies differ): the draft must share the target's tokenizer")


def draft_placement(config, group_size: int) -> tuple[ExpertPlacement | None, str]:
    """The placement of ``config``'s draft model (``speculative_draft_model``) and where it comes from, before any
    of its weights load (``epmoe run`` and ``epmoe serve`` call it before any rank starts, the draft when it loads).

    Args:
        config: the engine's ``EngineConfig``, with a draft model.
        group_size: ranks in the engine's group. An ``ep`` draft is placed over all of them, a ``replicated``
            one over one.

    Returns:
        ``(None, "dense")`` for a dense draft; for an MoE draft the ``ExpertPlacement`` of
        ``speculative_draft_placement`` (the file), else the trivial one of the draft's own experts, and a phrase
        naming which.

    Raises:
        ValueError: a placement given for a dense draft; a placement that does not cover the draft's layers and
            experts or does not fit the ranks (the draft and the file named).
    """
    path = str(config.speculative_draft_model)
    try:
        spec = load_moe_spec(path)
    except DenseModelError:
        if config.speculative_draft_placement is not None:
            raise ValueError(f"draft model {path} is dense: it has no experts to place; leave "
                             f"speculative_draft_placement unset") from None
        return None, "dense"
    ep_size = 1 if config.speculative_draft_parallel == "replicated" else group_size
    what = f"draft model {path}"
    try:
        if config.speculative_draft_placement is not None:
            placement = load_served_placement(config.speculative_draft_placement, ep_size=ep_size, spec=spec)
            where = f"placement file {config.speculative_draft_placement}"
        else:
            placement = ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, ep_size)
            where = "its own trivial placement"
        placement.check_model(spec.num_moe_layers, spec.num_experts, what=what)
    except ValueError as exc:
        raise ValueError(f"{what} (an MoE draft, {spec.num_moe_layers} MoE layers x {spec.num_experts} experts) "
                         f"cannot be placed on {ep_size} rank(s): {exc}") from None
    return placement, where


class DraftModelProposer(Proposer):
    """A draft model proposing ``K`` tokens per step for each decoding request.

    Args:
        engine: the target's engine (its config names the draft; its group, device and KV block size are used).

    Raises:
        ValueError: a draft of another vocabulary or tokenizer; a placement given for a dense draft; an MoE
            draft's placement that does not cover its layers and experts, or does not fit the group (each
            naming the draft).
    """

    name = "draft"

    def __init__(self, engine) -> None:
        cfg = engine.config
        self.path = str(cfg.speculative_draft_model)
        self.k = engine.num_spec_tokens
        self.device = engine.device
        self.dtype = cfg.torch_dtype
        self.vocab = engine.vocab_size
        check_draft_vocab(self.path, cfg.model, engine.vocab_size, engine.tokenizer, cfg.trust_remote_code)
        placement, where = draft_placement(cfg, engine.comm.size)
        attn = register_attention()
        self.ep_model = None
        self.placement = None
        self.comm = Comm(None)
        if placement is None:
            from epmoe.models.hf import load_dense_model

            model = load_dense_model(self.path, dtype=self.dtype, device=self.device, load_format=cfg.load_format,
                                     attn_implementation=attn, seed=cfg.seed)
            self._describe = f"draft {self.path}: dense, whole on every rank (no placement, no collectives)"
        else:
            model = self._load_moe(engine, placement, where, attn)
        mla_layers = install_mla(model)  # a DeepSeek/Kimi draft: attention over its own latent KV cache
        self.model = model
        self.collective = self.comm.size > 1
        self.layout = KVLayout.from_config(model.config)
        if self.layout.latent and mla_layers != self.layout.num_layers:
            raise ValueError(f"draft model {self.path}: its config asks for MLA's latent KV cache (kv_lora_rank) "
                             f"but {mla_layers} of {self.layout.num_layers} attention modules are MLA")
        self.kv_bytes_per_token = self.layout.bytes_per_token(self.dtype)
        self.max_model_len = engine.max_model_len
        self.kv: KVCache | None = None
        self.runner: ModelRunner | None = None
        self.done: dict[str, int] = {}  # request id -> leading tokens whose draft keys are in the cache
        self.fed: dict[str, tuple[int, int]] = {}  # request id -> (its tokens, proposals fed) at the last propose

    def _load_moe(self, engine, placement: ExpertPlacement, where: str, attn):
        cfg = engine.config
        from epmoe.models.hf import load_ep_model

        if cfg.speculative_draft_parallel != "replicated":
            self.comm = engine.comm
        self.placement = placement
        self.eager_dispatcher = "local" if self.comm.size == 1 else "all_to_all"
        ep = load_ep_model(self.path, placement, self.comm,
                           options=MoELayerOptions(dispatcher=self.eager_dispatcher,
                                                   expert_backend=cfg.expert_backend),
                           dtype=self.dtype, device=self.device, load_format=cfg.load_format,
                           attn_implementation=attn, seed=cfg.seed)
        ep.set_routing_simulation(cfg.moe_routing_simulation)
        self.ep_model = ep
        mode = ("replicated: every rank holds all its experts (no collectives)" if self.comm.size == 1 and
                engine.comm.size > 1 else f"expert-parallel over {self.comm.size} rank(s), dispatcher "
                f"{self.eager_dispatcher}")
        self._describe = (f"draft {self.path}: MoE, {placement.num_layers} MoE layers x {placement.num_experts} "
                          f"experts, {where} ({placement.num_slots} slots), {mode}")
        return ep.model

    def describe(self) -> str:
        """Where the draft's weights are and how its experts are placed."""
        return self._describe

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The draft's KV pool (``num_blocks`` like the target's) and its runner."""
        self.kv = KVCache(self.layout, num_blocks, block_size, self.dtype, self.device)
        max_blocks = -(-self.max_model_len // block_size)
        self.runner = ModelRunner(self.model, self.kv, max_blocks, self.device)

    def capture(self, sizes: list[int]) -> None:
        """Static steps of the draft for these row counts (CUDA graphs on a GPU), with fixed-capacity dispatch
        for an expert-parallel MoE draft."""
        if self.ep_model is not None:
            activate, deactivate = ep_static_hooks(self.ep_model, self.eager_dispatcher)
        else:
            def activate(bs: int, valid_rows: torch.Tensor) -> None:
                return None

            def deactivate() -> None:
                return None
        self.runner.capture(sizes, activate, deactivate, cuda_graphs=self.device.type == "cuda")

    def _step(self, feeds: list[Feed], engine) -> StepOutput | None:
        """One draft forward; with a collective draft every rank runs it (an agreement on the static bucket
        first, an empty or padded batch where a rank has nothing)."""
        chunked = int(any(not f.rowwise for f in feeds))
        rows = sum(len(f.token_ids) for f in feeds if f.rowwise)
        longest = max((f.start + len(f.token_ids) for f in feeds), default=0)
        if self.collective:  # the longest context too: a long-context graph of the bucket alike on every rank
            chunked, rows, longest = engine.agree_max([chunked, rows, longest])
        bucket = self.runner.bucket_for(rows) if self.runner.graphs and not chunked and rows else None
        if bucket is None and not feeds:
            if self.collective:
                self.ep_model.idle_step()
            return None
        return self.runner.execute(feeds, bucket, max_context=longest if self.collective else None)

    def propose(self, chunks: list, limits: list[int], engine) -> list[Proposal]:
        """Catch up, then propose up to ``limits[i]`` tokens for chunk ``i`` (``K`` forwards on every rank when
        the draft is collective)."""
        tokens: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor]] = [[] for _ in chunks]
        feeds = []
        for c in chunks:
            seq = c.seq
            done = self.done.get(seq.request_id, 0)
            ids = seq.tokens(done, seq.num_tokens)
            rowwise = len(ids) <= _CATCH_UP_ROWS
            feeds.append(Feed(ids, done, seq.block_table, rowwise, len(ids) if rowwise else 1))
        rounds = self.k if self.collective else max(limits, default=0)
        live = list(range(len(chunks)))
        for j in range(rounds):
            out = self._step(feeds, engine)
            if out is None:
                feeds = []
                continue
            rows = to_device(last_rows(feeds), out.logits.device, torch.int64)
            seqs = [chunks[i].seq for i in live]
            picked = propose_tokens(out.logits.index_select(0, rows)[:, : self.vocab], [s.params for s in seqs],
                                    [s.generator if s.generator is not None else engine.generator for s in seqs])
            for i, (tok, q) in zip(live, picked):
                tokens[i].append(tok)
                if q is not None:
                    probs[i].append(q)
            live = [i for i in live if limits[i] > j + 1]
            feeds = [Feed([tokens[i][-1]], chunks[i].seq.num_tokens + j, chunks[i].seq.block_table, True, 1)
                     for i in live]
        for i, c in enumerate(chunks):
            self.done[c.seq.request_id] = c.seq.num_tokens
            self.fed[c.seq.request_id] = (c.seq.num_tokens, limits[i] - 1)
        out_props = []
        for i, c in enumerate(chunks):
            q = torch.stack(probs[i][: limits[i]]) if probs[i] else None
            out_props.append(Proposal(tuple(tokens[i][: limits[i]]), q))
        return out_props

    def observe(self, seq, start: int, num_valid: int, aux) -> None:
        """The accepted proposals' draft keys stand; those after them are past the draft's length."""
        fed = self.fed.pop(seq.request_id, None)
        if fed is not None:
            n, proposals_fed = fed
            self.done[seq.request_id] = min(start + num_valid, n + proposals_fed)

    def release(self, seq) -> None:
        """Forget ``seq``'s draft keys (its blocks are gone)."""
        self.done.pop(seq.request_id, None)
        self.fed.pop(seq.request_id, None)
