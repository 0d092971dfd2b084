"""``EngineConfig``: every option of the engine, validated once (the CLI parses into it)."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from epmoe.checks import MAX_SPECULATIVE_TOKENS, valid_seed
from epmoe.spec import MoESpec, check_checkpoint_dir, is_checkpoint_dir, load_moe_spec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PARALLEL_MODES = ("ep", "tp")
SPECULATIVE_ALGORITHMS = ("ngram", "draft", "eagle3")
DRAFT_PARALLEL_MODES = ("ep", "replicated")
# the EngineConfig fields of speculative decoding
SPECULATIVE_FIELDS = ("speculative_algorithm", "speculative_draft_model", "speculative_num_tokens",
                      "speculative_draft_placement", "speculative_draft_parallel", "prompt_lookup_min",
                      "prompt_lookup_max")
# the EngineConfig fields that ``epmoe run`` and ``epmoe serve`` both take, each a flag of the same name
# (``eplb_max_moves``: ``--max-moves``), carried unchanged by RunConfig and ServeConfig
COMMAND_FIELDS = ("dtype", "device", "parallel", "placement", "redundant", "layout", "dispatcher", "load_format",
                  "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "mem_fraction_static",
                  "num_kv_blocks", "cuda_graph_max_bs", "cuda_graph_max_tokens", "piecewise_cuda_graph_max_tokens",
                  "disable_overlap_schedule", "enable_prefix_caching", "eplb_interval", "eplb_max_moves",
                  "replica_policy", "moe_routing_simulation", "trust_remote_code", *SPECULATIVE_FIELDS)
# every option ``epmoe run`` and ``epmoe serve`` hand the engine (``COMMAND_FIELDS``, and the two whose command
# defaults ``command_engine_config`` applies), by the flag that sets it
COMMAND_FLAGS = {name: "--" + name.replace("_", "-") for name in ("expert_backend", "enforce_eager", *COMMAND_FIELDS)
                 } | {"eplb_max_moves": "--max-moves"}


DEFAULT_SPECULATIVE_TOKENS = 3
GRAPH_SAFE_BACKENDS = ("triton",)  # the reference backend reads the routing on the host
# the dispatchers of eager steps (``dispatcher``); graph-replayed steps use ``fixed_capacity`` on several ranks
EAGER_DISPATCHERS = ("all_to_all", "local")


# the most sequences (and decode graph rows) and tokens per step an engine takes: its per-sequence and per-row
# buffers are allocated up front, so a mistyped huge value is refused by name instead of failing an allocation
MAX_NUM_SEQS = 1 << 16
MAX_NUM_BATCHED_TOKENS = 1 << 20
# the most steps whose expert loads a live rebalance reads (vLLM's EPLB window default): the recorder keeps one row
# of counts per step of its window, so a longer interval rebalances from the loads of its last this many steps
EPLB_WINDOW_STEPS = 1000
MAX_BLOCK_SIZE = 1024  # tokens per KV block (vLLM offers 8 to 128, SGLang's pages are 1 to 64)


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


# the EngineConfig fields that name files or directories: a path object is taken as its string
_PATH_FIELDS = ("model", "placement", "generation_config", "speculative_draft_model", "speculative_draft_placement")


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine (the same on every rank).

    Attributes:
        model: checkpoint directory (``config.json`` + safetensors; ``config.json`` alone with
            ``load_format='dummy'``).
        dtype: ``float32``, ``bfloat16`` or ``float16``; ``auto`` (the default, vLLM's): ``command_dtype``'s choice
            for the device and checkpoint, which the config holds from its construction on.
        device: ``cpu`` or ``cuda``.
        parallel: ``ep``: attention data-parallel (each rank serves its own requests), experts
            expert-parallel over the group. ``tp``: attention data-parallel as well, experts
            tensor-parallel (every rank a ``1/G`` slice of every expert's intermediate dimension; the
            baseline EP is compared with). The placement, dispatcher and EPLB options apply to ``ep`` only.
        placement: placement file; ``None`` = the trivial placement below.
        redundant: redundant slots per layer of the trivial placement.
        layout: trivial placement layout, ``contiguous`` or ``round_robin``.
        dispatcher: dispatcher of eager steps; ``None`` = ``local`` on one rank, ``all_to_all`` on
            several. Graph-replayed decode steps use ``fixed_capacity`` sized to the bucket on several
            ranks (no token can overflow it) and ``local`` on one.
        expert_backend: expert compute backend (``reference``, ``triton``, ``grouped_mm``).
        load_format: ``auto`` or ``dummy`` (random weights at full size, vLLM's name).
        max_num_seqs: most sequences running at once per rank (at most ``MAX_NUM_SEQS``).
        max_num_batched_tokens: most tokens fed in one step per rank (longer prompts are chunked; at most
            ``MAX_NUM_BATCHED_TOKENS``).
        max_model_len: longest sequence (prompt + output); ``None`` = the model's
            ``max_position_embeddings``.
        block_size: tokens per KV block.
        mem_fraction_static: on CUDA, the fraction of the GPU's memory for weights and KV cache
            (SGLang's name); the KV pool gets what the weights leave of it.
        num_kv_blocks: KV blocks per layer (padding block included), overriding the memory sizing.
        cuda_graph_max_bs: largest decode batch replayed as a CUDA graph (SGLang's name; at most ``MAX_NUM_SEQS``).
        cuda_graph_max_tokens: prompts too run in the replayed steps, one row per token next to the decodes,
            when each prompt chunk ends within this many tokens (its rows attend through the decode kernel, each
            over the keys before it, so the chunk's cost grows with its length times its end) and the step's rows
            fit in a bucket; buckets are captured up to this many rows (vLLM sizes its graphs in tokens too).
            0 = only decode steps replay graphs; steps with longer prompts run eagerly.
        piecewise_cuda_graph_max_tokens: steps with longer prompt chunks (or more rows than the row-wise buckets)
            of up to this many rows replay piecewise CUDA graphs: the forward is captured between the attention
            calls, which run eagerly on the real batch (``engine.piecewise``; SGLang's name). Buckets are captured
            up to the smaller of this and ``max_num_batched_tokens``; 0 = such steps run eagerly.
        enforce_eager: never capture graphs (vLLM's name); always true on CPU.
        disable_overlap_schedule: read each step's sampled tokens back before the next step is planned, instead
            of planning and launching the next step first (SGLang's name; see ``engine``'s overlap schedule).
            Speculative decoding always reads them back at once.
        enable_prefix_caching: keep computed full KV blocks findable by their tokens after their sequence frees
            them, and start a new (or preempted) sequence after the longest run of them matching its tokens
            (vLLM's automatic prefix caching; ``scheduler``). ``None`` (the default, as vLLM's): on, except with a
            draft model (``draft``, ``eagle3``), which it does not combine with; ``prefix_caching`` is the
            resolved value.
        generation_config: a directory whose ``generation_config.json`` gives the extra EOS ids instead of the
            checkpoint's (vLLM's ``--generation-config DIR``); ``None`` = the checkpoint's.
        static_decode_on_cpu: on CPU, run decode-only steps through the graph path's padded batch buckets
            and fixed-capacity dispatch, eagerly (how the CUDA-graph path is tested without a GPU).
        eplb_interval: rebalance experts every this many steps (0 = never), from the loads recorded over the last
            ``min(eplb_interval, EPLB_WINDOW_STEPS)`` steps.
        eplb_max_moves: most expert copies one rebalance moves (``None`` = as few as reach the target).
        replica_policy: how a token picks among an expert's copies: ``static`` (one fixed copy per rank),
            ``round_robin`` or ``random`` (``epmoe.routing.SlotMap``).
        moe_routing_simulation: ``None`` (tokens go where the gates send them) or ``uniform_random``: every MoE
            layer's router still computes its routing, then sends each token to experts drawn uniformly at random
            (``Router.simulation``; vLLM's ``VLLM_MOE_ROUTING_SIMULATION_STRATEGY``). For benchmarks of dummy
            weights, whose tokens of one prompt come to route alike layer by layer; the generated text is not the
            model's. The default generators (which the draws take) are seeded from ``seed`` when the model loads
            (``loading.simulation_seed``): under ``parallel='ep'`` with the rank too, so that ranks draw
            independently; under ``tp`` alike on every rank, which routes the same gathered tokens.
        seed: seed of the dummy weights and of unseeded sampling.
        trust_remote_code: load a tokenizer whose code ships with the checkpoint (Kimi-K2's ``tokenization_kimi.py``,
            named in ``tokenizer_config.json``'s ``auto_map``), the model's and a draft model's (vLLM's name).
            Without it such a tokenizer is refused, naming its file.
        speculative_algorithm: speculative decoding (``ngram``, ``draft``, ``eagle3``; ``None`` = off): each step
            verifies up to ``speculative_num_tokens`` proposed tokens per request after its last token.
        speculative_draft_model: the draft's directory (``draft``: a model of any served family, MoE or dense;
            ``eagle3``: an EAGLE-3 head's ``config.json``, its safetensors optional: random weights without).
        speculative_num_tokens: ``K``, draft tokens verified per step (``None`` = 3 with an algorithm).
        speculative_draft_placement: placement file of an MoE draft (its own; ``None`` = the trivial placement of
            the draft's experts over the group).
        speculative_draft_parallel: an MoE draft's experts ``ep`` (expert-parallel over the same ranks, with its
            own placement and dispatchers; the default) or ``replicated`` (every rank holds all of them, no
            collectives).
        prompt_lookup_min, prompt_lookup_max: ``ngram``'s shortest and longest n-gram matched (vLLM's names).
    """

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    parallel: str = "ep"
    placement: str | None = None
    redundant: int = 0
    layout: str = "contiguous"
    dispatcher: str | None = None
    expert_backend: str = "reference"
    load_format: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    block_size: int = 16
    mem_fraction_static: float = 0.9
    num_kv_blocks: int | None = None
    cuda_graph_max_bs: int = 256
    cuda_graph_max_tokens: int = 512
    piecewise_cuda_graph_max_tokens: int = 8192
    enforce_eager: bool = False
    disable_overlap_schedule: bool = False
    enable_prefix_caching: bool | None = None
    generation_config: str | None = None
    static_decode_on_cpu: bool = False
    eplb_interval: int = 0
    eplb_max_moves: int | None = None
    replica_policy: str = "static"
    moe_routing_simulation: str | None = None
    seed: int = 0
    trust_remote_code: bool = False
    speculative_algorithm: str | None = None
    speculative_draft_model: str | None = None
    speculative_num_tokens: int | None = None
    speculative_draft_placement: str | None = None
    speculative_draft_parallel: str = "ep"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the first bad option (``TypeError`` for a text option that is not a string;
        a ``pathlib.Path`` for a file or directory is taken as its string)."""
        for f in fields(self):  # before any lookup: a list would be "unhashable", a number "not a path"
            value = getattr(self, f.name)
            if f.name in _PATH_FIELDS and isinstance(value, os.PathLike):
                value = os.fspath(value)
                object.__setattr__(self, f.name, value)
            if f.type in ("str", "str | None") and not (isinstance(value, str) or (value is None and f.type != "str")):
                raise TypeError(f"{f.name} must be a string{' or None' if f.type != 'str' else ''}, got "
                                f"{type(value).__name__} {value!r}")
        check_checkpoint_dir(self.model, "model")
        if self.dtype not in COMMAND_DTYPES:
            raise ValueError(f"dtype must be one of {list(COMMAND_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but CUDA is not available on this machine")
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", command_dtype("auto", self.device, load_moe_spec(self.model)))
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "cuda_graph_max_bs"):
            _positive(name, getattr(self, name))
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
            if self.max_model_len < 2:
                raise ValueError(f"max_model_len must be at least 2 (a prompt's token and one generated), got "
                                 f"{self.max_model_len}")
            # the parsed context (transformers' default where config.json has none), not the file's raw field
            try:
                limit = load_moe_spec(self.model).max_position_embeddings
            except ValueError:  # the config's own error, named when the engine reads the model's spec
                limit = None
            if limit is not None and limit < self.max_model_len:
                raise ValueError(f"max_model_len ({self.max_model_len}) is past the model's max_position_embeddings "
                                 f"({limit})")
        if self.block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be at most {MAX_BLOCK_SIZE} tokens (a block is the cache's unit of "
                             f"allocation; one larger than a whole sequence only wastes memory), got {self.block_size}")
        for name in ("cuda_graph_max_tokens", "piecewise_cuda_graph_max_tokens"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {n!r}")
        if self.num_kv_blocks is not None and (isinstance(self.num_kv_blocks, bool) or
                                               not isinstance(self.num_kv_blocks, numbers.Integral) or
                                               self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an integer >= 2 (one is the padding block), "
                             f"got {self.num_kv_blocks!r}")
        for name, limit in (("max_num_seqs", MAX_NUM_SEQS), ("cuda_graph_max_bs", MAX_NUM_SEQS),
                            ("max_num_batched_tokens", MAX_NUM_BATCHED_TOKENS)):
            if getattr(self, name) > limit:
                raise ValueError(f"{name} must be at most {limit}, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({self.max_num_seqs}): raise max_num_batched_tokens or lower "
                             f"max_num_seqs")
        if not isinstance(self.mem_fraction_static, numbers.Real) or not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static!r}")
        if isinstance(self.redundant, bool) or not isinstance(self.redundant, numbers.Integral) or self.redundant < 0:
            raise ValueError(f"redundant must be a non-negative integer, got {self.redundant!r}")
        if self.layout not in ("contiguous", "round_robin"):
            raise ValueError(f"layout must be 'contiguous' or 'round_robin', got {self.layout!r}")
        if self.placement is not None and (self.redundant or self.layout != "contiguous"):
            given = [f"{name} ({value!r})" for name, value, default in (
                ("redundant", self.redundant, 0), ("layout", self.layout, "contiguous")) if value != default]
            one = len(given) == 1
            raise ValueError(f"{', '.join(given)} {'shapes' if one else 'shape'} the default placement; placement "
                             f"({self.placement!r}) is a file that fixes its own slots: leave "
                             f"{'it' if one else 'them'} unset")
        if isinstance(self.eplb_interval, bool) or not isinstance(self.eplb_interval, numbers.Integral) \
                or self.eplb_interval < 0:
            raise ValueError(f"eplb_interval must be a non-negative integer, got {self.eplb_interval!r}")
        if self.eplb_max_moves is not None and (isinstance(self.eplb_max_moves, bool)
                                                or not isinstance(self.eplb_max_moves, numbers.Integral)
                                                or self.eplb_max_moves < 0):
            raise ValueError(f"eplb_max_moves must be a non-negative integer, got {self.eplb_max_moves!r}")
        if not valid_seed(self.seed):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("enforce_eager", "static_decode_on_cpu", "disable_overlap_schedule", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.generation_config is not None and not os.path.isfile(
                os.path.join(str(self.generation_config), "generation_config.json")):
            raise ValueError(f"generation_config must be a directory holding a generation_config.json, got "
                             f"{self.generation_config!r}")
        if self.enable_prefix_caching is not None and not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true, false or None (on unless a draft model is "
                             f"used), got {self.enable_prefix_caching!r}")
        if self.enable_prefix_caching and self.speculative_algorithm not in (None, "ngram"):
            raise ValueError(f"enable_prefix_caching does not combine with speculative_algorithm "
                             f"{self.speculative_algorithm!r}: a draft model's own cache would miss the cached blocks; "
                             f"ngram, which has no cache, combines")
        if self.parallel == "tp":
            given = [name for name, value, default in (
                ("placement", self.placement, None), ("redundant", self.redundant, 0),
                ("layout", self.layout, "contiguous"), ("dispatcher", self.dispatcher, None),
                ("eplb_interval", self.eplb_interval, 0), ("eplb_max_moves", self.eplb_max_moves, None),
                ("replica_policy", self.replica_policy, "static"),
            ) if value != default]
            if given:
                verb = "places or moves" if len(given) == 1 else "place or move"
                raise ValueError(f"{', '.join(given)} {verb} whole experts (parallel 'ep'); parallel 'tp' "
                                 f"slices every expert over the ranks: leave {'it' if len(given) == 1 else 'them'} "
                                 f"unset")
        self._check_speculative()
        if self.eplb_max_moves is not None and not self.eplb_interval:
            raise ValueError("eplb_max_moves limits live rebalancing: give eplb_interval with it")
        from epmoe.experts import EXPERT_BACKENDS
        from epmoe.routing import REPLICA_POLICIES, ROUTING_SIMULATIONS

        if self.replica_policy not in REPLICA_POLICIES:
            raise ValueError(f"replica_policy must be one of {REPLICA_POLICIES}, got {self.replica_policy!r}")
        if self.moe_routing_simulation is not None and self.moe_routing_simulation not in ROUTING_SIMULATIONS:
            raise ValueError(f"moe_routing_simulation must be one of {list(ROUTING_SIMULATIONS)} or left unset (None), "
                             f"got {self.moe_routing_simulation!r}")

        if self.dispatcher == "fixed_capacity":
            raise ValueError("dispatcher 'fixed_capacity' is what graph-replayed decode steps use on several ranks; "
                             "eager steps need 'all_to_all' (or 'local' on one rank)")
        if self.dispatcher is not None and self.dispatcher not in EAGER_DISPATCHERS:
            raise ValueError(f"dispatcher {self.dispatcher!r} is not one of {list(EAGER_DISPATCHERS)}")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ValueError(f"expert_backend {self.expert_backend!r} is not one of {sorted(EXPERT_BACKENDS)}")
        if self.expert_backend == "triton" and self.device == "cuda" and self.dtype == "float32":
            raise ValueError("expert_backend 'triton' computes on CUDA in bfloat16 or float16, got dtype 'float32': "
                             "use expert_backend 'reference' for float32 on CUDA (the commands' default there)")
        if self.use_graphs and (self.expert_backend not in GRAPH_SAFE_BACKENDS or self.dtype == "float32"):
            raise ValueError(
                f"CUDA-graph decode needs a graph-safe expert backend {GRAPH_SAFE_BACKENDS} in bfloat16 or float16; "
                f"got expert_backend {self.expert_backend!r} with dtype {self.dtype!r}: change them, or set "
                f"enforce_eager to run every step eagerly"
            )

    def _check_speculative(self) -> None:
        algo = self.speculative_algorithm
        if algo is None:
            given = [name for name, value, default in (
                ("speculative_draft_model", self.speculative_draft_model, None),
                ("speculative_num_tokens", self.speculative_num_tokens, None),
                ("speculative_draft_placement", self.speculative_draft_placement, None),
                ("speculative_draft_parallel", self.speculative_draft_parallel, "ep"),
                ("prompt_lookup_min", self.prompt_lookup_min, 1), ("prompt_lookup_max", self.prompt_lookup_max, 4),
            ) if value != default]
            if given:
                one = len(given) == 1
                raise ValueError(f"{', '.join(given)} {'configures' if one else 'configure'} speculative decoding: "
                                 f"give speculative_algorithm ({' | '.join(SPECULATIVE_ALGORITHMS)}) with "
                                 f"{'it' if one else 'them'}")
            return
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, got {algo!r}")
        if self.speculative_num_tokens is not None:
            k = self.speculative_num_tokens
            if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"speculative_num_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got "
                                 f"{k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            _positive(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.speculative_draft_parallel not in DRAFT_PARALLEL_MODES:
            raise ValueError(f"speculative_draft_parallel must be one of {DRAFT_PARALLEL_MODES}, "
                             f"got {self.speculative_draft_parallel!r}")
        draft = self.speculative_draft_model
        if algo == "ngram":
            if draft is not None or self.speculative_draft_placement is not None \
                    or self.speculative_draft_parallel != "ep":
                raise ValueError("speculative_algorithm 'ngram' looks up the prompt and needs no draft model: leave "
                                 "speculative_draft_model, speculative_draft_placement and speculative_draft_parallel "
                                 "unset")
            return
        if (self.prompt_lookup_min, self.prompt_lookup_max) != (1, 4):
            raise ValueError(f"prompt_lookup_min and prompt_lookup_max configure speculative_algorithm 'ngram', not "
                             f"{algo!r}: leave them unset")
        if draft is None:
            raise ValueError(f"speculative_algorithm {algo!r} needs its draft: set speculative_draft_model to the "
                             f"draft's directory")
        if not str(draft) or not (Path(draft) / "config.json").is_file():
            raise ValueError(f"speculative_draft_model {draft!r} is not a directory with a config.json (speculative "
                             f"algorithm {algo!r} needs its draft)")
        if algo == "eagle3" and self.speculative_draft_placement is not None:
            raise ValueError("speculative_draft_placement places an MoE draft's experts; an EAGLE-3 head is dense")
        if self.speculative_draft_placement is not None and self.speculative_draft_parallel == "replicated":
            raise ValueError("speculative_draft_placement spreads an MoE draft's experts over the ranks; "
                             "speculative_draft_parallel 'replicated' holds all of them on every rank")

    @property
    def num_speculative_tokens(self) -> int:
        """``K`` draft tokens per verify step (0 without speculative decoding)."""
        if self.speculative_algorithm is None:
            return 0
        return int(self.speculative_num_tokens or DEFAULT_SPECULATIVE_TOKENS)

    @property
    def prefix_caching(self) -> bool:
        """Prefix caching on: ``enable_prefix_caching`` where given, else on unless a draft model proposes."""
        if self.enable_prefix_caching is not None:
            return self.enable_prefix_caching
        return self.speculative_algorithm in (None, "ngram")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype."""
        return DTYPES[self.dtype]

    @property
    def use_graphs(self) -> bool:
        """Decode steps replay CUDA graphs."""
        return self.device == "cuda" and not self.enforce_eager

    @property
    def static_decode(self) -> bool:
        """Decode-only steps run on padded batch buckets (CUDA graphs, or their eager twin on CPU)."""
        return self.use_graphs or (self.device == "cpu" and self.static_decode_on_cpu)


def synthetic_text(load_format: str, moe_routing_simulation: str | None) -> str | None:
    """Why an engine of these options (``EngineConfig.load_format``, ``moe_routing_simulation``) does not generate its
    model's text, for a run's summary and a server's log: ``None`` with the checkpoint's weights routed by their
    gates; else its weights and its routing, each with the flag that chose it."""
    if load_format != "dummy" and moe_routing_simulation is None:
        return None
    weights = "random (--load-format dummy)" if load_format == "dummy" else "the checkpoint's"
    routing = (f"simulated, {moe_routing_simulation} (--moe-routing-simulation)" if moe_routing_simulation
               else "the gates'")
    return f"weights {weights}, MoE routing {routing}: not the model's text"


COMMAND_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""What ``epmoe run`` and ``epmoe serve`` take as ``--dtype``: a compute dtype, or ``auto`` (``command_dtype``)."""


def command_dtype(dtype: str, device: str, spec: MoESpec) -> str:
    """A command's ``--dtype`` as the engine takes it: ``auto`` (the default) is ``float32`` on the CPU, where the
    reference check is exact, and on CUDA the checkpoint's own ``bfloat16`` or ``float16``
    (``MoESpec.checkpoint_dtype``), else ``bfloat16`` (a float32 checkpoint keeps its range; vLLM's ``--dtype auto``
    takes float16 there); any other value is returned as it is (the commands check it)."""
    if dtype != "auto":
        return dtype
    if device != "cuda":
        return "float32"
    named = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16"}.get(spec.checkpoint_dtype or "")
    return named or "bfloat16"


def default_expert_backend(device: str, dtype: str) -> str:
    """The commands' expert backend when none is named: ``triton`` on CUDA in bfloat16 or float16, ``reference``
    elsewhere (on CPU, and in float32 on CUDA, which the Triton kernels do not compute)."""
    return "triton" if device == "cuda" and dtype != "float32" else "reference"


def command_engine_config(source: object, model_dir: str, **fields: object) -> EngineConfig:
    """The ``EngineConfig`` of a command's options for ``model_dir``: every ``COMMAND_FIELDS`` name read from
    ``source`` (a RunConfig or a ServeConfig), with the commands' defaults applied: an ``expert_backend`` of
    ``None`` is ``triton`` on CUDA and ``reference`` on CPU, and steps run eagerly (``enforce_eager``) when asked,
    in float32, or on a backend CUDA graphs cannot replay. ``fields``: the other ``EngineConfig`` fields. A ``dtype``
    of ``auto`` is ``command_dtype``'s, and an ``expert_backend`` of ``None`` in float32 on CUDA is ``reference`` (the
    Triton kernels compute in bf16 or fp16).

    Raises:
        ValueError: a bad option (named by its field).
    """
    dtype = command_dtype(source.dtype, source.device, load_moe_spec(model_dir)) if is_checkpoint_dir(model_dir) \
        else source.dtype  # not a checkpoint: EngineConfig names it
    backend = source.expert_backend or default_expert_backend(source.device, dtype)
    eager = source.enforce_eager or dtype == "float32" or backend not in GRAPH_SAFE_BACKENDS
    given = {name: getattr(source, name) for name in COMMAND_FIELDS}
    return EngineConfig(model=model_dir, expert_backend=backend, enforce_eager=eager, **{**given, "dtype": dtype},
                        **fields)
