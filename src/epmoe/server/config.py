"""``ServeConfig``: every option of ``epmoe serve`` (the CLI parses into it), checked once."""

from __future__ import annotations

import ipaddress
import math
import numbers
import ssl
from dataclasses import dataclass
from pathlib import Path

from epmoe.engine import EngineConfig
from epmoe.engine.config import command_engine_config
from epmoe.spec import check_checkpoint_dir

MAX_N = 16  # most choices one request may ask for (``n``)
MAX_BODY_BYTES = 8 << 20  # a request body past this is refused with 413


def _int_at_least(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _check_tls(keyfile: str | None, certfile: str | None) -> None:
    """Both TLS files or neither, each PEM, the key not encrypted, and that they load as a key and its certificate
    (``ValueError`` naming them and what failed, before anything is loaded)."""
    if (keyfile is None) != (certfile is None):
        given, missing = ("ssl_keyfile", "ssl_certfile") if certfile is None else ("ssl_certfile", "ssl_keyfile")
        raise ValueError(f"{given} needs {missing} too (HTTPS takes a private key and its certificate)")
    if keyfile is None:
        return
    for name, path in (("ssl_keyfile", keyfile), ("ssl_certfile", certfile)):
        if not Path(path).is_file():
            raise ValueError(f"{name} {path!r} is not a file")
    for name, path, marker, what in (("ssl_certfile", certfile, "-----BEGIN CERTIFICATE-----", "certificate"),
                                     ("ssl_keyfile", keyfile, "PRIVATE KEY-----", "private key")):
        if marker not in Path(path).read_text(errors="replace"):
            raise ValueError(f"{name} {path!r} is not a PEM {what}")

    def no_passphrase() -> bytes:
        raise ValueError(f"ssl_keyfile {keyfile!r} is encrypted: give it without a passphrase")

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password=no_passphrase)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"ssl_certfile {certfile!r} and ssl_keyfile {keyfile!r} do not load as a certificate and "
                         f"its private key (PEM): {exc}") from None


@dataclass(frozen=True)
class ServeConfig:
    """Options of the server; the engine's keep vLLM/SGLang names.

    Attributes:
        model: checkpoint directory; ``None`` = the built-in small Kimi-K2.5-architecture checkpoint.
        ep: ranks to spawn (one process each; rank 0 is the engine core; HTTP is served by the parent process).
        parallel: ``ep`` (experts expert-parallel) or ``tp`` (experts tensor-parallel over the same ranks; the
            baseline); attention is data-parallel either way.
        device, dtype, placement, redundant, layout, dispatcher, load_format, max_num_seqs, max_num_batched_tokens,
            max_model_len, block_size, mem_fraction_static, num_kv_blocks, cuda_graph_max_bs, cuda_graph_max_tokens,
            piecewise_cuda_graph_max_tokens, enforce_eager, disable_overlap_schedule, enable_prefix_caching,
            eplb_interval, eplb_max_moves, replica_policy, moe_routing_simulation, trust_remote_code: the
            engine's options
            (``EngineConfig``).
        dtype: as ``EngineConfig``, or ``auto`` (the default; ``engine.config.command_dtype``: float32 on CPU, on
            CUDA the checkpoint's bf16/fp16), which ``serve`` resolves first.
        seed: seed of the dummy weights and of requests sampled without a seed of their own (``EngineConfig``).
        expert_backend: ``None`` = ``triton`` on CUDA in bf16/fp16, ``reference`` on CPU and in float32.
        host: address to listen on.
        port: TCP port (0 = any free one, logged).
        served_model_name: the model id clients send; ``None`` = the checkpoint directory's name.
        api_key: bearer token every request but ``/health``, ``/ping``, ``/version`` and ``/metrics`` must
            carry; ``None`` = no check.
        drain_timeout_s: on SIGTERM, seconds the running requests get to finish before they are aborted.
        max_body_bytes: largest request body, bytes (413 past it).
        cache_dir: where the built-in checkpoint is cached.
        speculative_algorithm, speculative_draft_model, speculative_num_tokens, speculative_draft_placement,
            speculative_draft_parallel, prompt_lookup_min, prompt_lookup_max: speculative decoding
            (``EngineConfig``'s fields).
        chat_template: a Jinja chat template, or the path of a file holding one, used instead of the tokenizer's
            (vLLM's ``--chat-template``); ``None`` = the tokenizer's (or the plain default).
        generation_config: where requests take the sampling fields they leave out (``temperature``, ``top_p``,
            ``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as a chat's ``max_tokens`` cap):
            ``auto`` = the checkpoint's ``generation_config.json``, ``vllm`` = the API's own defaults, or a
            directory holding a ``generation_config.json`` (vLLM's ``--generation-config``).
        enable_auto_tool_choice, tool_call_parser, reasoning_parser: how chat outputs are read (vLLM's flags;
            ``chat_output.ChatParsers`` checks them as the server starts).
        allowed_origins, allowed_methods, allowed_headers, allow_credentials: the CORS answers browsers get
            (vLLM's flags and defaults: every origin, method and header, no credentials); ``"*"`` = any.
        ssl_keyfile, ssl_certfile: serve HTTPS with this PEM private key and certificate chain (both or neither;
            vLLM's flags); ``None`` = plain HTTP.
        uvicorn_log_level: uvicorn's own log level (``critical``, ``error``, ``warning``, ``info``, ``debug``,
            ``trace``); epmoe's log lines are not affected.
        disable_uvicorn_access_log: no line per HTTP request from uvicorn (its access log, written at ``info``;
            vLLM's ``--disable-uvicorn-access-log``).
    """

    model: str | None = None
    ep: int = 1
    parallel: str = "ep"
    device: str = "cpu"
    dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    mem_fraction_static: float = 0.9
    cuda_graph_max_bs: int = 256
    cuda_graph_max_tokens: int = 512
    piecewise_cuda_graph_max_tokens: int = 8192
    enforce_eager: bool = False
    disable_overlap_schedule: bool = False
    enable_prefix_caching: bool | None = None
    load_format: str = "auto"
    eplb_interval: int = 0
    eplb_max_moves: int | None = None
    placement: str | None = None
    redundant: int = 0
    layout: str = "contiguous"
    dispatcher: str | None = None
    replica_policy: str = "static"
    moe_routing_simulation: str | None = None
    trust_remote_code: bool = False
    expert_backend: str | None = None
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    block_size: int = 16
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    drain_timeout_s: float = 30.0
    max_body_bytes: int = MAX_BODY_BYTES
    cache_dir: str | None = None
    speculative_algorithm: str | None = None
    speculative_draft_model: str | None = None
    speculative_num_tokens: int | None = None
    speculative_draft_placement: str | None = None
    speculative_draft_parallel: str = "ep"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    chat_template: str | None = None
    generation_config: str = "auto"
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    uvicorn_log_level: str = "warning"
    disable_uvicorn_access_log: bool = False

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the first bad option (the engine checks its own on each rank)."""
        _int_at_least("ep", self.ep, 1)
        _int_at_least("port", self.port, 0)
        if self.port > 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            if self.host != "localhost":
                raise ValueError(f"host must be an IP address or 'localhost', got {self.host!r}") from None
        if self.model is not None:
            check_checkpoint_dir(self.model, "model")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError(f"served_model_name must not be empty, got {self.served_model_name!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it out to serve without one)")
        if not isinstance(self.drain_timeout_s, numbers.Real) or not 0 <= self.drain_timeout_s < math.inf:
            raise ValueError(f"drain_timeout_s must be a finite number of seconds >= 0, got {self.drain_timeout_s!r}")
        _int_at_least("max_body_bytes", self.max_body_bytes, 1024)
        if not self.generation_config:  # Path("") is the working directory
            raise ValueError("generation_config must not be empty: give 'auto', 'vllm' or a directory holding a "
                             "generation_config.json")
        if self.generation_config not in ("auto", "vllm"):
            directory = Path(self.generation_config)
            if not directory.is_dir():
                raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory holding a "
                                 f"generation_config.json, got {self.generation_config!r}")
            if not (directory / "generation_config.json").is_file():
                raise ValueError(f"generation_config {self.generation_config!r} is a directory without a "
                                 f"generation_config.json file; give one that holds it, 'auto' (the checkpoint's) "
                                 f"or 'vllm' (the API's own defaults)")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
                raise ValueError(f"{name} must be a list of non-empty strings, got {value!r}")
            # browsers send methods in capitals and match them as sent
            object.__setattr__(self, name, tuple(v.upper() if name == "allowed_methods" else v for v in value))
        pathed = [o for o in self.allowed_origins if o != "*" and "/" in o.partition("://")[2]]
        if pathed:
            raise ValueError(f"allowed_origins are scheme://host[:port], as browsers send them (no path, no trailing "
                             f"'/'), got {pathed}")
        if self.chat_template is not None and not self.chat_template.strip():
            raise ValueError("chat_template must not be empty (leave it out for the tokenizer's)")
        _check_tls(self.ssl_keyfile, self.ssl_certfile)
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"uvicorn_log_level must be one of {', '.join(UVICORN_LOG_LEVELS)}, got "
                             f"{self.uvicorn_log_level!r}")

    @property
    def scheme(self) -> str:
        """``https`` with a key and certificate, else ``http``."""
        return "https" if self.ssl_certfile is not None else "http"

    @property
    def cors(self) -> dict:
        """The CORS options as Starlette's ``CORSMiddleware`` takes them."""
        return {"allow_origins": list(self.allowed_origins), "allow_methods": list(self.allowed_methods),
                "allow_headers": list(self.allowed_headers), "allow_credentials": self.allow_credentials}

    def engine_config(self, model_dir: str) -> EngineConfig:
        """The engine's options for ``model_dir`` (``command_engine_config``).

        Raises:
            ValueError: a bad engine option (named).
        """
        return command_engine_config(
            self, model_dir, seed=self.seed,
            generation_config=None if self.generation_config in ("auto", "vllm") else self.generation_config)
