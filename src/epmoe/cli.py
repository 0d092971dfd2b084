"""The ``epmoe`` command: argument parsing only; each subcommand calls one library function."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Sequence


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="generate with an expert-parallel model across ranks and check it against transformers",
        description="Start EP ranks (or join torchrun's), start the engine on each (its experts from a Hugging "
        "Face checkpoint, a paged KV cache, CUDA graphs on GPUs), generate with continuous batching and compare "
        "with the unsharded transformers model. With no --model, a small checkpoint of the Kimi-K2.5 "
        "architecture is built once and cached.",
    )
    _add_engine_flags(p, ep_default=2)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable; default: built-in prompts)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="most tokens to generate per prompt (default 8)")
    p.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="prompts arrive at R per second on each rank (default: all at once)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (the same tokens on rerun)")
    p.add_argument("--no-reference", action="store_true", help="skip the unsharded transformers comparison")
    p.add_argument("--save-loads", metavar="FILE",
                   help="write the tokens routed per logical expert (all ranks, whole run) to FILE (.json or "
                        ".safetensors), the format 'epmoe balance --loads' reads")
    p.add_argument("--json", metavar="FILE", nargs="?", const="-", help="write the report as JSON (to stdout with no "
                                                                        "FILE)")
    p.set_defaults(func=_cmd_run)


def _add_engine_flags(p: argparse.ArgumentParser, ep_default: int) -> None:
    """The engine's flags, the same for ``run`` and ``serve`` (vLLM/SGLang names; each sets the ``EngineConfig``
    field ``engine.config.COMMAND_FLAGS`` names)."""
    p.add_argument("--model", metavar="DIR", help="local Hugging Face MoE checkpoint (default: built-in small "
                                                  "Kimi-K2.5)")
    p.add_argument("--ep", type=int, default=ep_default,
                   help=f"EP ranks to spawn (default {ep_default}; torchrun sets its own)")
    p.add_argument("--parallel", choices=("ep", "tp"), default="ep",
                   help="experts expert-parallel (ep, default) or tensor-parallel over the --ep ranks (tp: the "
                        "baseline; attention stays data-parallel)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="compute dtype; auto (default): float32 on cpu, on cuda the checkpoint's bfloat16 or "
                        "float16 (bfloat16 for a float32 one)")
    p.add_argument("--placement", metavar="FILE", help="expert placement file (JSON or safetensors)")
    p.add_argument("--redundant", type=int, default=0, help="redundant slots per layer for the default placement")
    p.add_argument("--layout", choices=("contiguous", "round_robin"), default="contiguous",
                   help="default placement layout")
    p.add_argument("--dispatcher", choices=("all_to_all", "local"), default=None,
                   help="dispatcher of eager steps: all_to_all (default on several ranks) or local (EP 1); "
                   "CUDA-graph decode steps choose their own (fixed_capacity on several ranks)")
    p.add_argument("--expert-backend", default=None,
                   help="triton (default on CUDA in bfloat16/float16; not float32 there), reference (default on CPU "
                        "and in float32) or grouped_mm")
    p.add_argument("--replica-policy", choices=("static", "round_robin", "random"), default="static",
                   help="how a token picks among an expert's copies: static (one fixed copy per rank, default), "
                        "round_robin or random")
    p.add_argument("--moe-routing-simulation", choices=("uniform_random",), default=None,
                   help="uniform_random: every MoE layer sends each token to experts drawn uniformly at random after "
                        "its router runs, for benchmarks of --load-format dummy weights, whose tokens of one prompt "
                        "come to route alike (vLLM's VLLM_MOE_ROUTING_SIMULATION_STRATEGY); the text is not the "
                        "model's (run skips its reference check)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run a tokenizer that ships as code with the checkpoint (Kimi-K2's tokenization_kimi.py)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once per rank")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="most tokens per step per rank; longer prompts are prefilled in chunks")
    p.add_argument("--max-model-len", type=int, default=None, help="longest sequence (default: the model's)")
    p.add_argument("--mem-fraction-static", type=float, default=0.9,
                   help="on CUDA, the fraction of GPU memory for weights and KV cache (default 0.9)")
    p.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                   help="KV cache blocks per layer (default: sized from memory)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=256,
                   help="largest decode batch replayed as one CUDA graph (default 256)")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=512, metavar="N",
                   help="prompts too replayed in CUDA graphs, one row per token next to the decodes, when each prompt "
                        "chunk ends within N tokens; graphs are captured up to N rows (default 512; 0: decode only)")
    p.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=8192, metavar="N",
                   help="steps with longer prompt chunks of up to N rows replay piecewise CUDA graphs: the forward "
                        "captured between the attention calls, attention eager (default 8192; 0: such steps eager)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each step's tokens back before planning the next (default: the next step is "
                        "planned and launched first)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of a prompt prefix computed before (vLLM's automatic prefix caching; "
                        "default on, off with a draft model)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights at the size of config.json (no reference check)")
    p.add_argument("--eplb-interval", type=int, default=0, metavar="STEPS",
                   help="rebalance experts live every STEPS engine steps from the recorded loads (default 0: never)")
    p.add_argument("--max-moves", dest="eplb_max_moves", type=int, default=None, metavar="M",
                   help="most expert copies one live rebalance may move")
    p.add_argument("--speculative-algorithm", choices=("ngram", "draft", "eagle3"), default=None,
                   help="speculative decoding: ngram (prompt lookup), draft (a small model of any family), eagle3 "
                        "(an EAGLE-3 head reading the target's hidden states); default off")
    p.add_argument("--speculative-draft-model", metavar="DIR",
                   help="the draft model (draft) or the EAGLE-3 head's directory (eagle3: config.json, weights "
                        "optional: random without)")
    p.add_argument("--speculative-num-tokens", type=int, default=None, metavar="K",
                   help="draft tokens verified per step, 1..16 (default 3)")
    p.add_argument("--speculative-draft-placement", metavar="FILE",
                   help="placement file of an MoE draft (its own; default: the trivial one of its experts)")
    p.add_argument("--speculative-draft-parallel", choices=("ep", "replicated"), default="ep",
                   help="an MoE draft's experts expert-parallel over the ranks (ep, default) or all on every rank "
                        "(replicated: no collectives)")
    p.add_argument("--prompt-lookup-min", type=int, default=1, help="ngram: shortest n-gram matched (default 1)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest n-gram matched (default 4)")


def _engine_args(args: argparse.Namespace) -> dict:
    """The engine's flags parsed (``_add_engine_flags``), by their ``RunConfig`` / ``ServeConfig`` field names."""
    from epmoe.engine.config import COMMAND_FLAGS

    return {name: getattr(args, name) for name in ("model", "ep", *COMMAND_FLAGS)}


def _cmd_run(args: argparse.Namespace) -> int:
    from epmoe.files import check_output_path
    from epmoe.runtime.run import RunConfig, run_job

    if args.json not in (None, "-"):
        check_output_path("--json", args.json, "a JSON file path")
    if args.save_loads is not None:
        check_output_path("--save-loads", args.save_loads, "a loads file path (.json or .safetensors)")
        if args.json not in (None, "-") and Path(args.json).resolve() == Path(args.save_loads).resolve():
            raise ValueError(f"--json ({args.json!r}) and --save-loads ({args.save_loads!r}) name the same file")
    try:
        report = run_job(RunConfig(
            **_engine_args(args), prompts=tuple(args.prompt), max_new_tokens=args.max_new_tokens,
            reference=not args.no_reference, request_rate=args.request_rate, temperature=args.temperature,
            top_p=args.top_p, top_k=args.top_k, seed=args.seed, save_loads=args.save_loads,
        ))
    except (ValueError, TypeError) as exc:  # the engine's and the sampler's field names as the flags typed
        raise _flag_error(exc, _run_flags(), _typed_paths(args)) from exc
    if report is None:  # a non-zero torchrun rank: rank 0 prints
        return 0
    if args.json == "-":
        print(json.dumps(report.to_json(), indent=2))
    else:
        from epmoe.runtime.report import print_run_report

        print_run_report(report)
        if args.json:
            from epmoe.files import write_text_atomic

            write_text_atomic("--json", args.json, json.dumps(report.to_json(), indent=2))
    return 0 if report.matches_reference in (True, None) else 1


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API (completions, chat, streaming, metrics)",
        description="Spawn --ep ranks (or join torchrun's), load the engine on each, and serve /v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics, /eplb/loads and /eplb/rebalance. SIGTERM drains: running "
        "requests finish (up to --drain-timeout), then exit 0. With no --model, the built-in small checkpoint.",
    )
    _add_engine_flags(p, ep_default=1)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the dummy weights and of requests sampled without a seed of their own (default 0)")
    p.add_argument("--served-model-name", metavar="NAME", help="model id clients send (default: the directory name)")
    p.add_argument("--chat-template", metavar="TEMPLATE",
                   help="Jinja chat template, or a file holding one, instead of the tokenizer's")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults of requests that leave them out: 'auto' the checkpoint's "
                        "generation_config.json (default), 'vllm' the API's own, or a directory holding one")
    from epmoe.server.reasoning import REASONING_PARSERS
    from epmoe.server.tools import TOOL_CALL_PARSERS

    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let requests with tools leave the choice to the model (tool_choice 'auto'); needs "
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS),
                   help="the format the model writes its tool calls in (hermes: Qwen; kimi_k2: Kimi; deepseek_v3, "
                        "deepseek_v31: DeepSeek; glm45: GLM-4.5/4.6; qwen3_coder: Qwen3-Coder; openai: gpt-oss, with "
                        "--reasoning-parser openai_gptoss; mistral: Mixtral, Mistral; llama3_json, llama4_json, "
                        "llama4_pythonic, pythonic: Llama)")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                   help="split a thinking model's reasoning into reasoning_content (<think>: deepseek_r1, qwen3, "
                        "kimi_k2; gpt-oss's harmony analysis channel: openai_gptoss)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--api-key", metavar="KEY",
                   help="bearer token every /v1, /tokenize, /detokenize and /eplb request must carry (default: none)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds running requests get before they are aborted (default 30)")
    for what in ("origins", "methods", "headers"):
        p.add_argument(f"--allowed-{what}", type=_json_strings, default=["*"], metavar="JSON",
                       help=f"CORS: the {what} browsers may use, a JSON list (default [\"*\"]: any)")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)")
    p.add_argument("--ssl-keyfile", metavar="FILE", help="serve HTTPS with this PEM private key (with --ssl-certfile)")
    p.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS with this PEM certificate (with --ssl-keyfile)")
    from epmoe.server.config import UVICORN_LOG_LEVELS

    p.add_argument("--uvicorn-log-level", default="warning", choices=UVICORN_LOG_LEVELS,
                   help="uvicorn's own log level (default warning; epmoe's lines are not affected)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no line per HTTP request from uvicorn (its access log shows at --uvicorn-log-level info)")
    p.set_defaults(func=_cmd_serve)


def _json_strings(text: str) -> list[str]:
    """A JSON list of strings (vLLM's ``--allowed-origins`` form)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'a JSON list of strings expected, e.g. \'["*"]\', got {text!r}')
    return value


def _cmd_serve(args: argparse.Namespace) -> int:
    from epmoe.server.config import ServeConfig
    from epmoe.server.serve import serve

    try:
        cfg = ServeConfig(
            **_engine_args(args), seed=args.seed, host=args.host, port=args.port,
            served_model_name=args.served_model_name, api_key=args.api_key, drain_timeout_s=args.drain_timeout,
            chat_template=args.chat_template, generation_config=args.generation_config,
            enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser, allowed_origins=args.allowed_origins,
            allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
            allow_credentials=args.allow_credentials, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
            uvicorn_log_level=args.uvicorn_log_level, disable_uvicorn_access_log=args.disable_uvicorn_access_log,
        )
        return serve(cfg)
    except (ValueError, TypeError) as exc:
        raise _flag_error(exc, _serve_flags(), _typed_paths(args)) from exc


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks: 'bench serve' loads an OpenAI-compatible server")
    kinds = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    p = kinds.add_parser(
        "serve", help="send N streamed requests to an OpenAI-compatible server; TTFT, TPOT, ITL, throughput",
        description="vllm bench serve's counterpart: random token-id prompts (or a JSONL file of {\"prompt\"}) at a "
        "Poisson request rate or a max concurrency; prints TTFT / TPOT / ITL mean, p50, p99 and throughputs.",
    )
    p.add_argument("--base-url", required=True, help="server URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model id (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    p.add_argument("--random-input-len", type=int, default=None,
                   help="prompt tokens of random prompts (default 128; not with --dataset)")
    p.add_argument("--random-output-len", type=int, default=128,
                   help="tokens asked per request (default 128; with --dataset, for lines without max_tokens)")
    p.add_argument("--random-prefix-len", type=int, default=None,
                   help="random tokens before every random prompt, shared by all (default 0; not with --dataset)")
    p.add_argument("--dataset", metavar="JSONL", help='prompts, one {"prompt": ..., "max_tokens": ...} per line')
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (default inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--api-key", help="bearer token")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals")
    p.add_argument("--json", metavar="FILE", nargs="?", const="-", help="write the report as JSON (stdout: no FILE)")
    p.set_defaults(func=_cmd_bench_serve)


_BENCH_FLAGS = {"base_url": "--base-url", "num_prompts": "--num-prompts", "input_len": "--random-input-len",
                "output_len": "--random-output-len", "prefix_len": "--random-prefix-len",
                "request_rate": "--request-rate", "max_concurrency": "--max-concurrency", "dataset": "--dataset",
                "seed": "--seed"}


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from epmoe.server.bench import BenchConfig, run_bench

    if args.dataset is not None:
        given = [flag for flag, v in (("--random-input-len", args.random_input_len),
                                      ("--random-prefix-len", args.random_prefix_len)) if v is not None]
        if given:
            raise ValueError(f"{given[0]} shapes random prompts; with --dataset the prompts are the file's")
    try:
        cfg = BenchConfig(base_url=args.base_url, model=args.model, num_prompts=args.num_prompts,
                          input_len=128 if args.random_input_len is None else args.random_input_len,
                          output_len=args.random_output_len,
                          prefix_len=args.random_prefix_len or 0, dataset=args.dataset,
                          request_rate=args.request_rate, max_concurrency=args.max_concurrency, api_key=args.api_key,
                          seed=args.seed)
    except ValueError as exc:
        raise _flag_error(exc, _BENCH_FLAGS) from exc
    if args.json not in (None, "-"):
        from epmoe.files import check_output_path

        check_output_path("--json", args.json, "a JSON file path")
    import httpx

    try:
        report = run_bench(cfg, progress=args.json != "-")
    except ValueError as exc:
        raise _flag_error(exc, _BENCH_FLAGS) from exc
    except httpx.HTTPStatusError as exc:
        key = "" if exc.response.status_code != 401 else (
            " (is --api-key the server's key?)" if args.api_key else " (pass the server's key with --api-key)")
        raise ValueError(f"--base-url {args.base_url}: the server answered {exc.response.status_code} "
                         f"{exc.response.reason_phrase} to {exc.request.method} {exc.request.url}{key}") from None
    except httpx.HTTPError as exc:
        raise ValueError(f"--base-url {args.base_url}: {type(exc).__name__}: {exc}") from None
    if args.json == "-":
        print(json.dumps(report.to_json(), indent=2))
    else:
        Console().print(report.table())
        if args.json:
            from epmoe.files import write_text_atomic

            write_text_atomic("--json", args.json, json.dumps(report.to_json(), indent=2))
    return 0 if report.failed == 0 else 1


def _command_flags(*own: str) -> dict[str, str]:
    """``{field: flag}`` of the engine's flags and a command's ``own`` fields (each ``--`` and its name dashed)."""
    from epmoe.engine.config import COMMAND_FLAGS

    return {name: "--" + name.replace("_", "-") for name in ("model", "ep", *own)} | COMMAND_FLAGS


def _serve_flags() -> dict[str, str]:
    """``{field: flag}`` of ``serve`` (a function: the engine's flags import PyTorch, which the start waits for)."""
    return _command_flags("seed", "host", "port", "served_model_name", "api_key", "chat_template",
                          "generation_config", "allowed_origins", "allowed_methods", "allowed_headers", "ssl_keyfile",
                          "ssl_certfile") | {"drain_timeout_s": "--drain-timeout"}


def _run_flags() -> dict[str, str]:
    """``{field: flag}`` of ``run``."""
    return _command_flags("request_rate", "temperature", "top_p", "top_k", "seed", "max_new_tokens")


def _batches(text: str) -> tuple[int, ...]:
    """``--batch``: comma-separated sizes >= 1, each once, in ascending order."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated integers expected, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return tuple(sorted(set(values)))


def _typed_paths(args: argparse.Namespace) -> tuple[str, ...]:
    """The paths the user typed (every string option holding a ``/``), which ``_flag_error`` leaves as they are."""
    return tuple(v for v in vars(args).values() if isinstance(v, str) and "/" in v)


def _flag_error(exc: Exception, flags: dict[str, str], keep: Sequence[str] = ()) -> Exception:
    """``exc`` as the CLI reports it: the library's field names (``ep_size (7)``, ``gpus must``,
    ``speculative_draft_model to``, ``parallel 'tp'``) replaced by the flags the user typed (``--ep (7)``); a
    ``KeyError``'s message without the quotes its ``str()`` adds.

    A name with an underscore is an option wherever it stands; a plain word (``model``, ``parallel``) only where
    an option's sentence goes on (its value in parentheses or quotes, ``must``, ``is``, ... or a list of options
    that ``place(s) or move(s)``), so prose (``the model's``, ``expert-parallel``) stays as it is, and so does text
    in double quotes (another library's or the OS's own words) and the strings of ``keep`` (the paths the user
    typed: ``/data/my device``)."""
    import re

    msg = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    plain = r"(?=\s\(|\smust\b|\sneeds\b|\sis\b|\sexceeds\b|\s'|,\s|\splaces? or moves?\b)"
    # text in double quotes is another library's or the OS's own words ("No such device"): left as it is
    kept = "|".join(re.escape(k) for k in sorted(set(keep), key=len, reverse=True) if k)
    parts = re.split(f'("[^"]*"{"|" + kept if kept else ""})', msg)
    for name, flag in flags.items():
        ahead = r"(?![\w-]|\.\w)" if "_" in name else plain  # not a file's name (generation_config.json)
        parts = [p if i % 2 else re.sub(rf"(?<![\w'\"./-]){re.escape(name)}{ahead}", flag, p)
                 for i, p in enumerate(parts)]
    return (TypeError if isinstance(exc, TypeError) else ValueError)("".join(parts))


_PLAN_FLAGS = {"gpus": "--gpus", "nodes": "--nodes", "spec_tokens": "--spec-tokens", "redundant": "--redundant",
               "context": "--context", "batch": "--batch", "input_len": "--input-len", "weights": "--weights",
               "mem_fraction": "--mem-fraction",
               "balancedness": "--balancedness", "accept_length": "--accept-length"}


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="TP vs EP for a model, machine and batch: step time, collectives and memory per GPU",
        description="Estimate decode (or speculative verify) steps of every TP / EP strategy at each batch size: "
        "attention and dense compute, routed-expert compute, collectives (count, bytes, time) and per-GPU memory; "
        "with --input-len, one prompt's prefill (time to first token) too.",
    )
    p.add_argument("--config", required=True, metavar="CONFIG", help="Hugging Face config.json or checkpoint directory")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in total")
    p.add_argument("--hardware", required=True, metavar="NAME", help="h200-sxm, h100-sxm, rtx-pro-6000, or a profile "
                                                                     "JSON path")
    p.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default 1)")
    p.add_argument("--batch", type=_batches, default=(1, 8, 64, 256), help="batch sizes, e.g. 1,8,64,256")
    p.add_argument("--spec-tokens", type=int, default=0, help="draft tokens verified per step (default 0: plain "
                                                              "decode)")
    p.add_argument("--redundant", type=int, default=0, help="redundant expert slots per MoE layer (default 0)")
    p.add_argument("--context", type=int, help="KV-cache tokens per sequence (default: the model's "
                                                "max_position_embeddings, at most 4096)")
    p.add_argument("--input-len", type=_batches, default=(), metavar="N[,N]",
                   help="prompt lengths whose prefill alone (time to first token) is priced too, e.g. 1024,4096")
    p.add_argument("--weights", choices=("bf16", "fp8", "int4", "mxfp4"), help="routed expert storage (default: "
                                                                                 "the checkpoint's)")
    p.add_argument("--mem-fraction", type=float, default=0.9, help="share of GPU memory usable (default 0.9)")
    p.add_argument("--balancedness", type=float, default=0.8, help="expected mean/max load per EP rank (default 0.8)")
    p.add_argument("--accept-length", type=float, metavar="A",
                   help="with --spec-tokens: expected tokens per sequence per round (1 to S+1) for tokens/s; "
                        "default: only the break-even length")
    p.add_argument("--draft", metavar="DIR_OR_CONFIG", help="with --spec-tokens: the draft model (default: an "
                                                            "EAGLE-3 head of the target's sizes)")
    p.add_argument("--engine", choices=("sglang", "vllm"), help="also print the command that runs the recommended "
                                                                "strategy on this server")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE", help="write step time vs batch per strategy to this figure (format from "
                                                  "the suffix: .png, .pdf, .svg, ...; none: PNG)")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from epmoe.plan.draft import read_draft
    from epmoe.plan.hardware import load_hardware
    from epmoe.plan.report import report_plan
    from epmoe.plan.request import PlanRequest, default_context
    from epmoe.spec import check_config_path, load_moe_spec

    try:
        check_config_path(args.config, "--config", parse=True)  # named by its flag (the reader names the path)
        if args.draft is not None:
            check_config_path(args.draft, "--draft", parse=True)
        spec = load_moe_spec(args.config)
        context = args.context if args.context is not None else default_context(spec)
        req = PlanRequest(
            spec=spec, hardware=load_hardware(args.hardware), gpus=args.gpus, nodes=args.nodes,
            batches=args.batch, spec_tokens=args.spec_tokens, redundant=args.redundant, context=context,
            weights=args.weights, mem_fraction=args.mem_fraction, balancedness=args.balancedness,
            input_lens=args.input_len,
        )
        if req.context > req.spec.max_position_embeddings:
            print(f"epmoe plan: --context {req.context} is above the model's max_position_embeddings "
                  f"{req.spec.max_position_embeddings}: priced as asked, but its positions do not reach it",
                  file=sys.stderr)
        draft = read_draft(args.draft) if args.draft else None
        if draft is not None:
            from epmoe.doctor import draft_mismatches, is_eagle_head

            eagle = is_eagle_head(args.draft)
            bad = draft_mismatches(draft, eagle, req.spec)
            if bad:
                label, dv, tv = bad[0]
                raise ValueError(f"--draft {args.draft}: the draft has {label} {dv} but the target "
                                 f"{Path(args.config).name} has {label} {tv}"
                                 + (" (an EAGLE head reads the target's hidden states: it was trained for another "
                                    "target)" if eagle else ""))
        if (args.draft or args.accept_length is not None) and not args.spec_tokens:
            given = "--draft" if args.draft else "--accept-length"
            raise ValueError(f"{given} prices speculative decoding: it needs --spec-tokens of at least 1 (draft "
                             f"tokens verified per step), got {args.spec_tokens}")
        report_plan(req, as_json=args.json, plot_path=args.plot, draft=draft, accept_length=args.accept_length,
                    engine=args.engine, model=str(Path(args.config)) if Path(args.config).is_dir() else None,
                    draft_path=args.draft)
    except (ValueError, TypeError) as exc:
        raise _flag_error(exc, _PLAN_FLAGS) from exc
    return 0


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="measure all-reduce / all-to-all latency and bandwidth; write a hardware profile",
        description="Run under torchrun, or with --nprocs N to spawn N local processes (gloo on CPU, NCCL on GPUs).",
    )
    p.add_argument("--out", required=True, metavar="JSON", help="profile file to write (pass it to plan --hardware)")
    p.add_argument("--nprocs", type=int, help="spawn this many local processes (default: join torchrun's group)")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    p.add_argument("--max-bytes", type=int, help="largest buffer (default 256 MiB on GPU, 4 MiB on CPU; 1 MiB to 1 "
                                                 "GiB)")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per size (default 5)")
    p.add_argument("--name", default="calibrated", help="profile name (default calibrated)")
    p.add_argument("--base", metavar="NAME", help="profile supplying the link not measured and the fp8 figure")
    p.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from epmoe.runtime.calibrate import CalibrationConfig, calibrate

    try:
        doc = calibrate(CalibrationConfig(out=args.out, nprocs=args.nprocs, backend=args.backend,
                                          max_bytes=args.max_bytes, iters=args.iters, name=args.name, base=args.base))
    except (ValueError, TypeError) as exc:
        raise _flag_error(exc, {"out": "--out", "base": "--base", "nprocs": "--nprocs", "backend": "--backend",
                                "max_bytes": "--max-bytes", "iters": "--iters", "name": "--name"}) from exc
    if doc is not None:
        link = doc["links"]["intra_node" if "measured" in doc["links"]["intra_node"]["kind"] else "inter_node"]
        print(f"wrote {args.out}: all-reduce {link['all_reduce_latency_us']:.1f} us + "
              f"{link['all_reduce_busbw_bytes_per_s'] / 1e9:.2f} GB/s bus, all-to-all "
              f"{link['all_to_all_latency_us']:.1f} us + "
              f"{link['all_to_all_busbw_bytes_per_s'] / 1e9:.2f} GB/s bus")
    return 0


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor", help="check backends, GPUs, placements (target and draft) and memory before launch",
        description="One line per finding: what is wrong, why it matters, what to change. Exit code 1 when any "
                    "finding is an error (a missing or unreadable model, config or placement included), "
                    "2 on a bad flag value (an unknown, unreadable or incomplete --hardware profile included).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", metavar="DIR", help="target checkpoint directory")
    src.add_argument("--config", metavar="FILE", help="target config.json")
    p.add_argument("--placement", metavar="FILE", help="placement of the target: epmoe (JSON, safetensors), SGLang "
                                                       "(.json, .pt) or TensorRT-LLM (.yaml)")
    p.add_argument("--draft", metavar="DIR_OR_CONFIG", help="draft model for speculative decoding")
    p.add_argument("--draft-placement", metavar="FILE", help="placement of an MoE draft")
    p.add_argument("--ep", type=int, help="EP size (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes the EP ranks are spread over (default 1)")
    p.add_argument("--hardware", metavar="NAME", help="hardware profile for the memory check")
    p.add_argument("--batch", type=int, default=64, help="sequences per step for the memory check (default 64)")
    p.add_argument("--context", type=int, help="KV-cache tokens per sequence (default: the model's "
                                                "max_position_embeddings, at most 4096)")
    p.add_argument("--weights", choices=("bf16", "fp8", "int4", "mxfp4"), help="routed expert storage (default: "
                                                                                 "the checkpoint's)")
    p.set_defaults(func=_cmd_doctor)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from epmoe.doctor import DoctorConfig, run_doctor

    try:
        return run_doctor(DoctorConfig(
            model=args.model if args.model is not None else args.config, placement=args.placement, draft=args.draft,
            draft_placement=args.draft_placement, ep=args.ep, nodes=args.nodes, hardware=args.hardware,
            batch=args.batch, context=args.context, weights=args.weights,
        ))
    except (ValueError, TypeError) as exc:
        raise _flag_error(exc, {"ep": "--ep", "nodes": "--nodes", "batch": "--batch", "context": "--context",
                                "weights": "--weights", "hardware": "--hardware", "draft": "--draft",
                                "model": "--model" if args.model is not None else "--config"},
                          _typed_paths(args)) from exc


LOAD_FORMAT_CHOICES = ("auto", "epmoe", "olmoe-csv", "sglang-stat", "sglang-per-pass", "trtllm")


def _iters(text: str) -> tuple[int, int]:
    """``--iters A-B``: TensorRT-LLM's iteration range, ``A <= i < B``."""
    from epmoe.integrations.dumps import parse_iters

    try:
        return parse_iters(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("iters", "--iters", 1)) from None


def _add_balance(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "balance", help="balance expert loads (EPLB): write a placement, a per-layer table and a PNG",
        description="Reads loads (epmoe JSON/safetensors, the OLMoE CSV, SGLang's stat and per-pass dumps, "
                    "TensorRT-LLM statistic folders), writes the placement (epmoe, SGLang or TensorRT-LLM format) "
                    "atomically; nothing on error.",
    )
    p.add_argument("--loads", required=True, metavar="PATH", help="loads file or folder (format found by content)")
    p.add_argument("--loads-format", default="auto", choices=LOAD_FORMAT_CHOICES,
                   help="force the loads format (default auto)")
    p.add_argument("--config", metavar="CONFIG", help="the model's config.json or checkpoint directory: dense-layer "
                                                      "rows dropped, layer and expert counts checked")
    p.add_argument("--iters", type=_iters, metavar="A-B", help="TensorRT-LLM iterations A <= i < B (default all)")
    p.add_argument("--out-format", choices=("epmoe", "sglang", "trtllm"),
                   help="placement format (default from --out: .pt sglang, .yaml trtllm, else epmoe)")
    p.add_argument("--ep", type=int, required=True, help="EP size G")
    p.add_argument("--redundant", type=int, default=0, help="redundant slots per layer R (default 0)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (> 1: hierarchical, groups kept on one node)")
    p.add_argument("--groups", type=int, default=1, help="expert groups (default 1)")
    p.add_argument("--algorithm", default="epmoe", help="balancer: epmoe (default), deepseek, exact")
    p.add_argument("--from", dest="from_placement", metavar="PLACEMENT", help="current placement: move few copies")
    p.add_argument("--max-moves", type=int, help="most slots that may change (with --from)")
    p.add_argument("--out", required=True, metavar="PLACEMENT", help="placement file to write (.json, .safetensors, "
                                                                     ".pt or .yaml)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE", help="write per-rank loads before/after to this figure (format from the "
                                                  "suffix: .png, .pdf, .svg, ...; none: PNG)")
    p.set_defaults(func=_cmd_balance)


def _cmd_balance(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from epmoe.balance.report import balance_file
    from epmoe.spec import check_config_path

    try:
        if args.config is not None:
            check_config_path(args.config, "--config", parse=True)
        report = balance_file(
            args.loads, args.ep, args.redundant, args.out, num_nodes=args.nodes, num_groups=args.groups,
            algorithm=args.algorithm, from_placement=args.from_placement, max_moves=args.max_moves, plot=args.plot,
            loads_format=args.loads_format, config=args.config, iters=args.iters, out_format=args.out_format,
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise _flag_error(exc, {"ep_size": "--ep", "num_redundant": "--redundant", "num_nodes": "--nodes",
                                "num_groups": "--groups", "max_moves": "--max-moves", "from_placement": "--from",
                                "out": "--out", "plot": "--plot", "algorithm": "--algorithm", "iters": "--iters",
                                "out_format": "--out-format", "loads_format": "--loads-format",
                                "loads": "--loads"}) from exc
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        Console().print(report.table())
        if report.plot is not None:
            print(f"plot written to {report.plot}")  # as epmoe plan --plot says
    return 0


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not take is its own error, printed with its usage (``epmoe run:
    error: unrecognized arguments: --bogus``), not the top-level parser's. Its own subcommands' parsers are of this
    class too (``add_subparsers`` makes them of the parent parser's class)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def build_parser() -> argparse.ArgumentParser:
    """The full ``epmoe`` argument parser."""
    parser = argparse.ArgumentParser(prog="epmoe", description="Expert-parallel MoE inference for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser)
    # each ``_add_<name>`` adds its parser and sets ``func``: namespace -> process exit code
    for add in (_add_run, _add_serve, _add_bench, _add_balance, _add_plan, _add_doctor, _add_calibrate):
        add(sub)
    return parser


EXIT_INTERRUPTED = 130
"""The exit code of a command stopped by Ctrl-C (SIGINT), as a shell gives one: 128 + 2."""
EXIT_TERMINATED = 143
"""The exit code of a command stopped by SIGTERM (``timeout``, systemd, a batch scheduler), as a shell gives one:
128 + 15."""


class Terminated(BaseException):
    """SIGTERM, raised where the command is (as Ctrl-C raises ``KeyboardInterrupt``), so that the same ways out run:
    spawned ranks are stopped and their queue's semaphores released (``launch.spawn``)."""


_RETRY_S = 0.05
"""How soon a SIGTERM that came during an import is delivered again, seconds."""


def _importing(frame) -> bool:
    """Whether ``frame`` (where a signal found the main thread) is inside an import: an exception raised there would
    leave a library half-imported (numpy, scipy), or cross a C++ frame that aborts the process (pybind11)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


_TERM_GRACE_S = 2.0
"""How long the main thread has to take a SIGTERM (``_raise_terminated``) before ``_TermWatch`` exits the process,
seconds."""

_raised = threading.Event()
"""Set when ``_raise_terminated`` raised ``Terminated`` in the main thread (the command's own ways out run)."""


def _raise_terminated(signum, frame) -> None:
    """SIGTERM's handler: ``Terminated`` where the command is, or, inside an import, the same signal again in
    ``_RETRY_S`` (and so on until the import is over)."""
    if _importing(frame):
        timer = threading.Timer(_RETRY_S, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()
        return
    _raised.set()
    raise Terminated


class _TermWatch:
    """A SIGTERM the main thread cannot take: Python runs signal handlers only between the main thread's bytecodes,
    so a rank blocked in C++ (under torchrun, in a collective or a process-group setup waiting for a peer that
    failed) would sit there until torchrun's SIGKILL 30 s later. This daemon thread wakes on every signal through
    ``signal.set_wakeup_fd``; on SIGTERM, if ``_raise_terminated`` has not raised within ``_TERM_GRACE_S`` and is still
    SIGTERM's handler (``epmoe serve`` drains with its own once it listens), it prints the command's one line and
    exits the process with ``EXIT_TERMINATED``.

    Args:
        grace_s: seconds the main thread gets, ``_TERM_GRACE_S`` by default.

    Raises:
        ValueError: made outside the main thread (``signal.set_wakeup_fd`` works only there).
    """

    def __init__(self, grace_s: float = _TERM_GRACE_S) -> None:
        import socket

        self.grace_s = grace_s
        self._read, self._write = socket.socketpair()
        self._read.setblocking(True)
        self._write.setblocking(False)
        self._before = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="epmoe-sigterm", daemon=True).start()

    def _watch(self) -> None:
        while True:
            try:
                data = self._read.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data and not _raised.wait(self.grace_s) \
                    and signal.getsignal(signal.SIGTERM) is _raise_terminated:
                _leave_line()
                print("epmoe: terminated (SIGTERM)", file=sys.stderr, flush=True)
                os._exit(EXIT_TERMINATED)

    def close(self) -> None:
        """Give the previous wakeup fd back and stop the thread (from the main thread)."""
        signal.set_wakeup_fd(self._before)
        self._write.close()
        self._read.close()


def _leave_line() -> None:
    """On a terminal, clear the line a stopped rank's progress bar was drawn on and show the cursor again (rich hides
    it while it draws; a rank stopped by SIGTERM never gave it back, and the command's last line followed the bar on
    its line)."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\x1b[2K\x1b[?25h")
        sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``epmoe`` console script: the command's exit code; Ctrl-C prints one line and returns
    ``EXIT_INTERRUPTED``, SIGTERM one line and ``EXIT_TERMINATED`` (``epmoe serve`` drains on SIGTERM instead, once
    it listens; a main thread blocked in C++ that cannot take the SIGTERM, as a torchrun rank waiting for a failed
    peer, exits ``_TERM_GRACE_S`` after it with the same line and code: ``_TermWatch``). (Pressed while a library is
    being imported, in the first second or so, the interrupt may leave that library half-imported, and its own error
    can come first: Python gives no way to defer it there.)"""
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    _raised.clear()
    watch = _TermWatch() if main_thread else None
    try:
        return _main(argv)
    except KeyboardInterrupt:
        _leave_line()
        print("epmoe: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        _leave_line()
        print("epmoe: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)
            watch.close()


def _main(argv: Sequence[str] | None) -> int:
    from epmoe.runtime.launch import EXIT_BAD_INPUT, EXIT_RANK_ERROR, RankError, RankFailure

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RankFailure as exc:  # spawned ranks: every rank's first error, named by rank, the cause first
        # options the ranks' errors name by field, as flags (only names with an underscore: rank errors are prose)
        named = {"run": _run_flags, "serve": _serve_flags}.get(args.command, dict)()
        flags = {k: v for k, v in named.items() if "_" in k}
        print(f"epmoe {args.command}: error: {_flag_error(ValueError(str(exc)), flags, _typed_paths(args))}",
              file=sys.stderr)
        return exc.exit_code
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as exc:
        error = RankError.of(int(os.environ.get("RANK", "0")), exc)
        # under torchrun every rank says what stopped it, named by rank (torchrun shows every rank's stderr)
        torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
        message = error.line() if torchrun else (exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)
        print(f"epmoe {args.command}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT if error.bad_input else EXIT_RANK_ERROR


if __name__ == "__main__":
    sys.exit(main())
