"""``epmoe bench serve``: load an OpenAI-compatible server and measure it (``vllm bench serve``'s counterpart).

Sends ``num_prompts`` streamed ``/v1/completions`` requests (random token-id prompts of ``input_len``, after a
random prefix of ``prefix_len`` shared by all (a system prompt: what prefix caching serves), with ``output_len``
tokens and ``ignore_eos``, or the prompts of a JSONL file) arriving as a Poisson
process at ``request_rate`` per second (``inf`` = all at once), at most ``max_concurrency`` in flight,
and reports TTFT, TPOT (time per output token after the first) and ITL (gap between streamed chunks):
mean, p50 and p99 in ms, with request and token throughput and the failures.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx
import numpy as np

from epmoe.checks import (
    MAX_DATA_TEXT_BYTES,
    MAX_POSITIONS,
    check_arrival_span,
    check_regular_file,
    read_text_file,
    valid_seed,
)
from epmoe.config_fields import json_text

MAX_BENCH_PROMPTS = 1_000_000
"""The most requests one ``bench serve`` run sends (its prompts are made before the first is sent)."""
MAX_BENCH_PROMPT_TOKENS = 1 << 26
"""The most random prompt tokens (all prompts, prefix included) one run makes before the first is sent: about 2 GiB of
Python token lists."""


@dataclass(frozen=True)
class BenchConfig:
    """Options of ``bench serve``.

    Attributes:
        base_url: the server, e.g. ``http://127.0.0.1:8000`` (``/v1`` is added).
        model: model id; ``None`` = the first of ``GET /v1/models``.
        num_prompts: requests to send.
        input_len, output_len: random prompts' tokens and the tokens asked of each (``ignore_eos``).
        prefix_len: random tokens before every random prompt, the same for all (vLLM's ``--random-prefix-len``).
        dataset: JSONL file, one ``{"prompt": str, "max_tokens": int (optional)}`` per line; ``None`` = random.
        request_rate: mean arrivals per second (Poisson); ``inf`` = all at once.
        max_concurrency: most requests in flight; ``None`` = no limit.
        api_key: bearer token.
        seed: seed of the prompts and the arrival times.
        timeout_s: per request.
    """

    base_url: str
    model: str | None = None
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 128
    prefix_len: int = 0
    dataset: str | None = None
    request_rate: float = math.inf
    max_concurrency: int | None = None
    api_key: str | None = None
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the first bad option."""
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        try:
            parts = urlsplit(self.base_url)
            host, _port = parts.hostname, parts.port  # a port past 65535 raises here
        except ValueError as exc:
            raise ValueError(f"base_url {self.base_url!r} is not a URL ({exc})") from None
        if not host:
            raise ValueError(f"base_url {self.base_url!r} names no host")
        for name in ("num_prompts", "input_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.prefix_len, bool) or not isinstance(self.prefix_len, int) or self.prefix_len < 0:
            raise ValueError(f"prefix_len must be an integer >= 0, got {self.prefix_len!r}")
        if self.num_prompts > MAX_BENCH_PROMPTS:
            raise ValueError(f"num_prompts must be at most {MAX_BENCH_PROMPTS:,}, got {self.num_prompts:,}")
        for name in ("input_len", "output_len", "prefix_len"):
            if getattr(self, name) > MAX_POSITIONS:
                raise ValueError(f"{name} must be at most {MAX_POSITIONS:,} tokens (past any model's context), "
                                 f"got {getattr(self, name):,}")
        tokens = self.num_prompts * (self.prefix_len + self.input_len)
        if self.dataset is None and tokens > MAX_BENCH_PROMPT_TOKENS:
            raise ValueError(f"num_prompts ({self.num_prompts:,}) random prompts of prefix_len + input_len "
                             f"({self.prefix_len + self.input_len:,}) tokens are {tokens:,} tokens, past the "
                             f"{MAX_BENCH_PROMPT_TOKENS:,} a run makes before it sends the first")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 requests per second (inf = all at once), "
                             f"got {self.request_rate!r}")
        check_arrival_span("request_rate", self.request_rate, self.num_prompts)
        if not valid_seed(self.seed):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")  # as run's and the server's
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency!r}")
        if self.dataset is not None:
            try:
                check_regular_file(self.dataset, "dataset")
            except FileNotFoundError as exc:  # a bad field, as the others: ValueError
                raise ValueError(str(exc)) from None


@dataclass
class RequestResult:
    """One request: ``ok``, its ``error``, output tokens, TTFT, inter-chunk gaps and latency (seconds)."""

    ok: bool
    error: str | None = None
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0


@dataclass
class BenchReport:
    """The result of ``run_bench``; latencies in ms, throughputs per second of the whole run.

    Attributes:
        completed, failed: requests that finished / failed; ``errors`` the first few failure messages.
        duration_s: from the first request sent to the last done.
        request_throughput, output_throughput, total_token_throughput: requests/s, output tokens/s,
            (prompt + output) tokens/s.
        ttft_ms, tpot_ms, itl_ms: ``{"mean", "p50", "p99"}`` (``None`` each where there is nothing to measure: no
            request completed, or for TPOT and ITL none wrote two tokens).
    """

    base_url: str
    model: str
    num_prompts: int
    request_rate: float
    max_concurrency: int | None
    completed: int
    failed: int
    errors: list[str]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]

    def to_json(self) -> dict:
        """A JSON-ready dict (``inf`` request rate as the string ``"inf"``)."""
        doc = asdict(self)
        doc["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        return doc

    def table(self):
        """A rich table of the results."""
        from rich.table import Table

        t = Table(title=f"bench serve: {self.model} at {self.base_url}")
        t.add_column("metric")
        t.add_column("value", justify="right")
        rows = [("completed / failed", f"{self.completed} / {self.failed}"), ("duration (s)", f"{self.duration_s:.2f}"),
                ("request throughput (req/s)", f"{self.request_throughput:.2f}"),
                ("output throughput (tok/s)", f"{self.output_throughput:.1f}"),
                ("total token throughput (tok/s)", f"{self.total_token_throughput:.1f}")]
        for name, stats in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("ITL", self.itl_ms)):
            rows.append((f"{name} mean / p50 / p99 (ms)",
                         " / ".join("-" if stats[k] is None else f"{stats[k]:.2f}" for k in ("mean", "p50", "p99"))))
        if self.errors:
            rows.append(("first failure", self.errors[0]))
        for row in rows:
            t.add_row(*row)
        return t


def _stats_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:  # nothing to measure (no request completed, or none wrote two tokens): not a zero latency
        return {"mean": None, "p50": None, "p99": None}
    a = np.asarray(values_s) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def load_requests(cfg: BenchConfig) -> list[tuple[str | list[int], int, int]]:
    """``(prompt, prompt tokens (estimated for text: its UTF-8 bytes), max_tokens)`` per request.

    Random prompts are token ids below 256 (valid in any vocabulary of 256 or more).

    Raises:
        ValueError: a dataset that is not UTF-8 text, or a line that is not JSON, has no string ``prompt`` (or an
            empty one) or a ``max_tokens`` that is not an integer >= 1 (line named).
    """
    rng = random.Random(cfg.seed)
    if cfg.dataset is None:
        prefix = [rng.randrange(256) for _ in range(cfg.prefix_len)]
        n = cfg.prefix_len + cfg.input_len
        return [(prefix + [rng.randrange(256) for _ in range(cfg.input_len)], n, cfg.output_len)
                for _ in range(cfg.num_prompts)]
    rows = []
    text = read_text_file(cfg.dataset, "dataset", MAX_DATA_TEXT_BYTES)
    for number, line in enumerate(text.split("\n"), start=1):  # JSON Lines' lines (splitlines also breaks on U+2028)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"dataset {cfg.dataset!r} line {number}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f"dataset {cfg.dataset!r} line {number}: needs a string 'prompt'")
        if not row["prompt"]:  # the server refuses an empty prompt: every request would fail
            raise ValueError(f"dataset {cfg.dataset!r} line {number}: field 'prompt' is empty")
        max_tokens = row.get("max_tokens", cfg.output_len)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"dataset {cfg.dataset!r} line {number}: field 'max_tokens' must be an integer >= 1, got "
                             f"{json_text(max_tokens)}")
        try:
            size = len(row["prompt"].encode())
        except UnicodeEncodeError as exc:  # a lone surrogate ("\udc80"): no text a server could take
            raise ValueError(f"dataset {cfg.dataset!r} line {number}: field 'prompt' is not text ({exc.reason} at "
                             f"position {exc.start})") from None
        rows.append((row["prompt"], size, max_tokens))
    if not rows:
        raise ValueError(f"dataset {cfg.dataset!r} has no prompts")
    return [rows[i % len(rows)] for i in range(cfg.num_prompts)]


async def _one(http: httpx.AsyncClient, url: str, model: str, prompt: str | list[int], max_tokens: int,
               headers: dict) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False)
    chunks = 0
    try:
        async with http.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "error")
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                # a chunk with a choice is a token, its text empty where the server has no tokenizer
                if event.get("choices") and event["choices"][0].get("text") is not None:
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency_s = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = True
    return result


def _check_context(cfg: BenchConfig, model: str, max_model_len,
                   requests: list[tuple[str | list[int], int, int]]) -> None:
    """Refuse requests the served model's context cannot hold (the server would answer them 400); ``max_model_len``
    as ``/v1/models`` lists it (vLLM's field), unchecked where it is not an integer. A dataset's prompts are text,
    their tokens unknown here: its requests are refused only where their ``max_tokens`` alone leaves no room for a
    prompt; the server judges the rest.

    Raises:
        ValueError: random requests of ``prefix_len + input_len + output_len`` past ``max_model_len``, each named; a
            dataset request asking ``max_model_len`` tokens or more.
    """
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int):
        return
    if cfg.dataset is not None:
        asked = max(m for _, _, m in requests)
        if asked >= max_model_len:
            raise ValueError(f"dataset {cfg.dataset!r} asks {asked} tokens of a request (a line's max_tokens, or "
                             f"output_len where a line has none), which leaves no room for its prompt in the "
                             f"max_model_len ({max_model_len}) of model {model!r} at {cfg.base_url}")
        return
    need = cfg.prefix_len + cfg.input_len + cfg.output_len
    if need > max_model_len:
        raise ValueError(f"prefix_len ({cfg.prefix_len}) + input_len ({cfg.input_len}) + output_len "
                         f"({cfg.output_len}) is {need} tokens a request, past the max_model_len ({max_model_len}) of "
                         f"model {model!r} at {cfg.base_url}: the server would refuse every request")


async def _run(cfg: BenchConfig, progress: bool) -> BenchReport:
    from rich.progress import Progress

    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    base = cfg.base_url.rstrip("/")
    rng = random.Random(cfg.seed + 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=cfg.timeout_s, limits=limits) as http:
        # asked first, also with a model given: a server that is not there (or refuses the key) is one error, before
        # any prompt is made, not a run of failed requests
        r = await http.get(f"{base}/v1/models", headers=headers)
        r.raise_for_status()
        listed = r.json()["data"]
        served = [m["id"] for m in listed]
        if cfg.model is not None and cfg.model not in served:
            raise ValueError(f"model {cfg.model!r} is not served at {cfg.base_url}: its /v1/models lists {served}")
        model = cfg.model if cfg.model is not None else served[0]
        requests = load_requests(cfg)
        _check_context(cfg, model, listed[served.index(model)].get("max_model_len"), requests)
        gate = asyncio.Semaphore(cfg.max_concurrency or len(requests))
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("requests", total=len(requests))

            async def send(prompt, max_tokens: int, delay: float) -> RequestResult:
                await asyncio.sleep(delay)
                async with gate:
                    out = await _one(http, f"{base}/v1/completions", model, prompt, max_tokens, headers)
                bar.advance(task)
                return out

            delays, t = [], 0.0
            for _ in requests:
                delays.append(t)
                t += 0.0 if math.isinf(cfg.request_rate) else rng.expovariate(cfg.request_rate)
            start = time.perf_counter()
            results = await asyncio.gather(*(send(p, m, d) for (p, _, m), d in zip(requests, delays)))
            duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(n for (_, n, _), r in zip(requests, results) if r.ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return BenchReport(
        base_url=cfg.base_url, model=model, num_prompts=len(requests), request_rate=cfg.request_rate,
        max_concurrency=cfg.max_concurrency, completed=len(ok), failed=len(results) - len(ok),
        errors=[r.error for r in results if not r.ok][:5], duration_s=duration, total_input_tokens=in_tokens,
        total_output_tokens=out_tokens, request_throughput=len(ok) / duration,
        output_throughput=out_tokens / duration, total_token_throughput=(in_tokens + out_tokens) / duration,
        ttft_ms=_stats_ms([r.ttft_s for r in ok]), tpot_ms=_stats_ms(tpot),
        itl_ms=_stats_ms([g for r in ok for g in r.itl_s]),
    )


def run_bench(cfg: BenchConfig, progress: bool = True) -> BenchReport:
    """Run the benchmark (see the module docstring).

    Raises:
        ValueError: a bad dataset line, a ``model`` the server does not list, random requests longer than its
            ``max_model_len`` (``_check_context``); httpx.HTTPError: ``/v1/models``
            unreachable or refused (asked before any prompt is made, with or without ``model``).
    """
    return asyncio.run(_run(cfg, progress))
