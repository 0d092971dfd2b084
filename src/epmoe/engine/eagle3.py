"""``eagle3``: the EAGLE-3 draft head (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"), in the layout of SGLang's and vLLM's ``LlamaForCausalLMEagle3``.

The head reads the target's hidden states: the outputs of three decoder layers of the target (the config's
``eagle_config.eagle_aux_hidden_state_layer_ids``, else SGLang's default: the inputs of layers ``2``,
``L // 2`` and ``L - 3``, i.e. the outputs of the layers before them), concatenated and fused by ``fc``
(``[3 D] -> [D]``). Its one decoder layer attends over ``[input_layernorm(embed(token)), hidden_norm(hidden)]``
(``2 D`` wide), with the hidden state as the residual; its LM head covers ``draft_vocab_size`` tokens, mapped
to the target's ids by ``d2t`` (``target = draft + d2t[draft]``). The row of target position ``p`` pairs the
target's features at ``p`` with the token at ``p + 1`` and predicts the token at ``p + 2``; the following
draft steps feed the head's own output hidden state instead of the target's features.

The head is dense and small: every rank holds it whole (no placement, no collectives). Its keys live in a
KV pool of its own with the target's block ids. Weights come from the directory's safetensors when there
are any (``midlayer.*`` or ``layers.0.*`` names, ``fc``, ``norm``, ``lm_head``, ``d2t``; the embedding is the
target's unless the file has one), else they are random (seeded): proposals are then poor, the output
still exactly the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from epmoe.checks import read_text_file
from epmoe.engine.attention import register_attention
from epmoe.engine.kv_cache import KVCache, KVLayout
from epmoe.engine.packing import Feed, pack
from epmoe.engine.speculative import Proposal, Proposer, propose_tokens
from epmoe.engine.transfer import to_device

_STD = 0.02


def aux_layer_ids(config: dict, num_target_layers: int) -> tuple[int, ...]:
    """Target decoder layers whose outputs the head reads.

    Raises:
        ValueError: a configured id outside the target's layers (named).
    """
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        n = num_target_layers
        return tuple(min(max(c - 1, 0), n - 1) for c in (2, n // 2, n - 3))
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_target_layers]
    if bad or not ids:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {ids!r} must name decoder layers of the "
                         f"{num_target_layers}-layer target, got {bad or ids}")
    return tuple(ids)


class Eagle3Layer(nn.Module):
    """The head's decoder layer: Llama attention over ``2 D`` inputs, a SwiGLU MLP."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(d, eps=eps)
        self.hidden_norm = LlamaRMSNorm(d, eps=eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        bias = bool(getattr(config, "attention_bias", False))
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(self.self_attn, name)
            setattr(self.self_attn, name, nn.Linear(2 * d, old.out_features, bias=bias))
        self.post_attention_layernorm = LlamaRMSNorm(d, eps=eps)
        self.mlp = LlamaMLP(config)


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft head.

    Args:
        config: its transformers ``LlamaConfig`` (from the draft's ``config.json``).
        num_aux: target layers read (``fc`` takes ``num_aux x hidden_size``).
        embed_tokens: the embedding (the target's, shared), ``[V, D]``.
    """

    def __init__(self, config, num_aux: int, embed_tokens: nn.Module) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        d = config.hidden_size
        draft_vocab = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.embed_tokens = embed_tokens
        self.fc = nn.Linear(num_aux * d, d, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, batch,
                rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the head.

        Args:
            input_ids: ``[T]`` int64 tokens (the token after each row's position).
            hidden: ``[T, D]`` fused target features (``fc`` applied) or the head's own previous output.
            positions: ``[T]`` int64.
            batch: the step's ``AttnBatch`` over the head's KV pool.
            rows: ``[S]`` int64 rows whose logits and hidden states are returned.

        Returns:
            ``[S, draft_vocab]`` logits and ``[S, D]`` output hidden states (the next draft step's input).
        """
        layer = self.midlayer
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1).unsqueeze(0)
        cos, sin = self.rotary_emb(x, positions.unsqueeze(0))
        attn, _ = layer.self_attn(x, position_embeddings=(cos, sin), attention_mask=None, epmoe_batch=batch)
        h = hidden + attn[0]
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = h.index_select(0, rows)
        return self.lm_head(self.norm(h)), h


def _load_weights(head: Eagle3Head, directory: Path, device, dtype, seed: int) -> str:
    """Fill the head from the directory's safetensors, else with seeded random weights; returns which."""
    files = sorted(directory.glob("*.safetensors"))
    own = {n: t for n, t in head.state_dict().items() if not n.startswith(("embed_tokens.", "rotary_emb."))}
    if not files:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, t in own.items():
                if name == "d2t":
                    continue
                if t.dim() == 1:
                    t.fill_(1.0)  # norm weights
                else:
                    t.copy_(torch.randn(t.shape, generator=gen) * _STD)
        return "random weights"
    from safetensors.torch import load_file

    state = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            state[name.replace("layers.0.", "midlayer.").removeprefix("model.")] = t
    if "embed_tokens.weight" in state:
        head.embed_tokens = nn.Embedding(*state["embed_tokens.weight"].shape).to(device=device, dtype=dtype)
        own["embed_tokens.weight"] = head.embed_tokens.weight
    missing = [n for n in own if n not in state]
    if missing:
        raise KeyError(f"EAGLE-3 draft {directory} is missing tensor(s) {missing[:5]}")
    with torch.no_grad():
        for name, t in own.items():
            if tuple(state[name].shape) != tuple(t.shape):
                raise ValueError(f"EAGLE-3 draft {directory}: tensor {name} has shape {tuple(state[name].shape)}, "
                                 f"its config.json gives {tuple(t.shape)}")
            t.copy_(state[name])
    return f"weights of {len(files)} safetensors file(s)"


def check_eagle3_fits(raw: dict, what: str, target: str, hidden_size: int, vocab_size: int) -> None:
    """Refuse an EAGLE-3 head (its ``config.json`` as ``raw``; ``what`` names it) whose hidden or vocabulary size is
    not the target's (``target`` names it): the head reads the target's hidden states and token ids. The engine
    checks it as it builds the head, ``epmoe run`` and ``epmoe serve`` before any rank starts
    (``group.check_group``).

    Raises:
        ValueError: a size that is not an integer, or the first that differs, both values named.
    """
    for field_name, mine, theirs in (("hidden_size", raw.get("hidden_size"), hidden_size),
                                     ("vocab_size", raw.get("vocab_size"), vocab_size)):
        if isinstance(mine, bool) or not isinstance(mine, int):
            raise ValueError(f"{what}: field {field_name!r} of its config.json must be an integer, got {mine!r}")
        if mine != theirs:
            raise ValueError(f"{what} has {field_name} {mine!r} but the target model {target} has {theirs}: an "
                             f"EAGLE-3 head reads the target's hidden states and token ids")


class Eagle3Proposer(Proposer):
    """EAGLE-3 speculation for the engine's target.

    Args:
        engine: the target's engine (its config names the head's directory).

    Raises:
        ValueError: a head whose hidden or vocabulary size differs from the target's, a bad layer id, a
            placement given for it (each naming the draft).
        KeyError: a tensor missing from the head's safetensors.
    """

    name = "eagle3"

    def __init__(self, engine) -> None:
        from transformers import LlamaConfig

        cfg = engine.config
        self.path = Path(cfg.speculative_draft_model)
        raw = json.loads(read_text_file(self.path / "config.json", "EAGLE-3 draft config"))
        target = engine.ep_model.model
        tcfg = target.config
        what = f"EAGLE-3 draft {self.path}"
        check_eagle3_fits(raw, what, cfg.model, tcfg.hidden_size, engine.vocab_size)
        draft_vocab = raw.get("draft_vocab_size") or raw["vocab_size"]
        if not isinstance(draft_vocab, int) or not 0 < draft_vocab <= engine.vocab_size:
            raise ValueError(f"{what}: draft_vocab_size {draft_vocab!r} must be in [1, vocab_size "
                             f"{engine.vocab_size}]")
        try:
            self.aux_layers = aux_layer_ids(raw, tcfg.num_hidden_layers)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        keep = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "source", "auto_map")}
        config = LlamaConfig(**keep)
        config._attn_implementation = register_attention()
        self.k = engine.num_spec_tokens
        self.device, self.dtype = engine.device, cfg.torch_dtype
        self.vocab = engine.vocab_size
        head = Eagle3Head(config, len(self.aux_layers), target.model.embed_tokens)
        head.to(device=self.device, dtype=self.dtype)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        head.rotary_emb = LlamaRotaryEmbedding(config).to(self.device)  # its tables in float32, as built
        self.weights = _load_weights(head, self.path, self.device, self.dtype, cfg.seed)
        self.head = head.eval()
        self.layout = KVLayout(1, config.num_key_value_heads, head.midlayer.self_attn.head_dim,
                               head.midlayer.self_attn.head_dim)
        self.kv_bytes_per_token = self.layout.bytes_per_token(self.dtype)
        self.max_model_len = engine.max_model_len
        self.kv: KVCache | None = None
        self.pending: dict[str, tuple[int, torch.Tensor]] = {}  # request id -> (first position, [r, n D] features)
        self._describe = (f"eagle3 {self.path}: dense EAGLE-3 head, draft vocab {draft_vocab}, reads the outputs of "
                          f"target layers {list(self.aux_layers)}, whole on every rank (no placement, no "
                          f"collectives), {self.weights}")

    def describe(self) -> str:
        """The head, the target layers it reads, its weights."""
        return self._describe

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """The head's KV pool."""
        self.kv = KVCache(self.layout, num_blocks, block_size, self.dtype, self.device)
        self.max_blocks = -(-self.max_model_len // block_size)

    def observe(self, seq, start: int, num_valid: int, aux: torch.Tensor | None) -> None:
        """Queue the target's features of the positions that stand."""
        if aux is None or num_valid == 0:
            return
        rid = seq.request_id
        rows = aux[:num_valid].detach().clone()  # a graph replay's output buffer is overwritten by the next one
        if rid in self.pending:
            first, old = self.pending[rid]
            self.pending[rid] = (first, torch.cat([old, rows]))
        else:
            self.pending[rid] = (start, rows)

    def release(self, seq) -> None:
        """Drop ``seq``'s queued features."""
        self.pending.pop(seq.request_id, None)

    @torch.no_grad()
    def _step(self, feeds: list[Feed], hidden: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and output hidden state of each feed's last row, in feed order."""
        packed = pack(feeds, self.kv.block_size, self.max_blocks)
        order = [i for i, f in enumerate(feeds) if f.rowwise] + [i for i, f in enumerate(feeds) if not f.rowwise]
        h = torch.cat([hidden[i] for i in order])
        batch = packed.attn_batch(self.kv, self.device)
        last = to_device(_last_packed_rows(feeds), self.device, torch.int64)
        return self.head(to_device(packed.input_ids, self.device), h, to_device(packed.positions, self.device), batch,
                         last)

    def _to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """``[N, Vd]`` draft logits as ``[N, V]`` target logits (``-inf`` off the draft vocabulary)."""
        full = torch.full((logits.shape[0], self.vocab), float("-inf"), device=logits.device)
        ids = torch.arange(logits.shape[1], device=logits.device) + self.head.d2t
        return full.index_copy(1, ids, logits.float())

    @torch.no_grad()
    def propose(self, chunks: list, limits: list[int], engine) -> list[Proposal]:
        """Feed each request's queued target features, then run the head ``limits[i]`` steps."""
        live = [i for i, c in enumerate(chunks) if c.seq.request_id in self.pending]
        tokens: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor]] = [[] for _ in chunks]
        feeds, hidden = [], []
        for i in live:
            seq = chunks[i].seq
            first, rows = self.pending.pop(seq.request_id)
            ids = seq.tokens(first + 1, first + 1 + rows.shape[0])
            rowwise = rows.shape[0] <= self.k + 1
            feeds.append(Feed(ids, first, seq.block_table, rowwise, len(ids) if rowwise else 1))
            hidden.append(self.head.fc(rows.to(self.dtype)))
        j = 0
        while feeds:
            logits, out = self._step(feeds, hidden)
            nxt_feeds, nxt_hidden, nxt_live = [], [], []
            seqs = [chunks[i].seq for i in live]
            picked = propose_tokens(self._to_target(logits), [s.params for s in seqs],
                                    [s.generator if s.generator is not None else engine.generator for s in seqs])
            for f_i, (i, (tok, q)) in enumerate(zip(live, picked)):
                seq = chunks[i].seq
                tokens[i].append(tok)
                if q is not None:
                    probs[i].append(q)
                if limits[i] > j + 1:
                    pos = feeds[f_i].start + len(feeds[f_i].token_ids)
                    nxt_feeds.append(Feed([tok], pos, seq.block_table, True, 1))
                    nxt_hidden.append(out[f_i].unsqueeze(0))
                    nxt_live.append(i)
            feeds, hidden, live = nxt_feeds, nxt_hidden, nxt_live
            j += 1
        return [Proposal(tuple(tokens[i]), torch.stack(probs[i]) if probs[i] else None) for i in range(len(chunks))]


def _last_packed_rows(feeds: list[Feed]) -> list[int]:
    """Per feed, its last token's row in the packed step (row-wise feeds first, then chunks)."""
    order = [i for i, f in enumerate(feeds) if f.rowwise] + [i for i, f in enumerate(feeds) if not f.rowwise]
    out = [0] * len(feeds)
    row = 0
    for i in order:
        row += len(feeds[i].token_ids)
        out[i] = row - 1
    return out
