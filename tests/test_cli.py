"""The ``epmoe`` command line: engine and sampling errors name the flags typed, and the README lists every flag
of ``run`` and ``serve``."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from epmoe.cli import build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def kimi(tiny_checkpoints):
    return tiny_checkpoints("kimi-k2.5")


@pytest.mark.parametrize("command, args, message", [
    ("run", ["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
    ("run", ["--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    ("run", ["--top-k", "-5"], "--top-k must be an integer >= -1"),
    ("run", ["--parallel", "tp", "--redundant", "2"],
     "--redundant places or moves whole experts (--parallel 'ep'); --parallel 'tp' slices"),
    ("serve", ["--parallel", "tp", "--eplb-interval", "3"],
     "--eplb-interval places or moves whole experts (--parallel 'ep'); --parallel 'tp' slices"),
    ("serve", ["--parallel", "tp", "--replica-policy", "random"], "--replica-policy places or moves whole experts"),
    ("serve", ["--speculative-algorithm", "draft"],
     "--speculative-algorithm 'draft' needs its draft: set --speculative-draft-model to the draft's directory"),
    ("serve", ["--speculative-num-tokens", "3"], "--speculative-num-tokens configures speculative decoding"),
    ("serve", ["--cuda-graph-max-tokens", "-1"], "--cuda-graph-max-tokens must be a non-negative integer, got -1"),
    ("run", ["--piecewise-cuda-graph-max-tokens", "-1"],
     "--piecewise-cuda-graph-max-tokens must be a non-negative integer, got -1"),
    ("serve", ["--piecewise-cuda-graph-max-tokens", "-1"],
     "--piecewise-cuda-graph-max-tokens must be a non-negative integer, got -1"),
    ("run", ["--max-num-seqs", "99999999999999999999", "--max-num-batched-tokens", "99999999999999999999"],
     "--max-num-seqs must be at most 65536, got 99999999999999999999"),
    ("serve", ["--max-num-seqs", "99999999999999999999", "--max-num-batched-tokens", "99999999999999999999"],
     "--max-num-seqs must be at most 65536, got 99999999999999999999"),
    ("run", ["--mem-fraction-static", "1.5"], "--mem-fraction-static must be in (0, 1), got 1.5"),
    ("run", ["--max-model-len", "0"], "--max-model-len must be a positive integer, got 0"),
    ("run", ["--max-model-len", "20"],
     "the longest prompt (48 tokens) plus --max-new-tokens (8) is 56 positions, past --max-model-len (20)"),
    ("serve", ["--block-size", "0"], "--block-size must be a positive integer, got 0"),
    ("serve", ["--max-moves", "3"], "--max-moves limits live rebalancing: give --eplb-interval with it"),
    ("serve", ["--seed", "-1"], "--seed must be an integer in [0, 2**63), got -1"),
    ("run", ["--seed", "-1"], "--seed must be an integer in [0, 2**63), got -1"),  # not "or None": no flag takes it
    ("serve", ["--placement", "p.json", "--layout", "round_robin"],
     "--layout ('round_robin') shapes the default placement; --placement ('p.json') is a file that fixes its own "
     "slots: leave it unset"),
    ("run", ["--prompt-lookup-min", "0"],
     "--prompt-lookup-min configures speculative decoding: give --speculative-algorithm (ngram | draft | eagle3) with "
     "it"),
    ("serve", ["--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
     "--prompt-lookup-min, --prompt-lookup-max configure speculative decoding"),
    ("serve", ["--speculative-algorithm", "ngram", "--speculative-draft-parallel", "replicated"],
     "--speculative-algorithm 'ngram' looks up the prompt and needs no draft model: leave --speculative-draft-model, "
     "--speculative-draft-placement and --speculative-draft-parallel unset"),
    ("serve", ["--max-model-len", "1"],
     "--max-model-len must be at least 2 (a prompt's token and one generated), got 1"),
    ("serve", ["--block-size", "2048"], "--block-size must be at most 1024 tokens"),
    ("serve", ["--drain-timeout", "inf"], "--drain-timeout must be a finite number of seconds >= 0, got inf"),
    ("serve", ["--allowed-origins", '[""]'], "--allowed-origins must be a list of non-empty strings, got ['']"),
    ("serve", ["--allowed-origins", '["http://ui.example/"]'], "--allowed-origins are scheme://host[:port], as "
     "browsers send them (no path, no trailing '/'), got ['http://ui.example/']"),
    ("serve", ["--ssl-keyfile", "key.pem"],
     "--ssl-keyfile needs --ssl-certfile too (HTTPS takes a private key and its certificate)"),
    ("serve", ["--ssl-keyfile", "/nowhere/key.pem", "--ssl-certfile", "/nowhere/cert.pem"],
     "--ssl-keyfile '/nowhere/key.pem' is not a file"),
    ("serve", ["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (the format the "
     "model's tool calls are read in: one of ['deepseek_v3', 'deepseek_v31', 'glm45', 'hermes', 'kimi_k2', "
     "'llama3_json', 'llama4_json', 'llama4_pythonic', 'mistral', 'openai', 'pythonic', 'qwen3_coder'])"),
    ("run", ["--max-num-batched-tokens", "100"],
     "--max-num-batched-tokens (100) must be at least --max-num-seqs (256): raise --max-num-batched-tokens or "
     "lower --max-num-seqs"),
])
def test_refused_options_name_their_flags(kimi, capsys, command, args, message):
    assert main([command, "--model", str(kimi), *args]) == 2
    err = capsys.readouterr().err
    assert f"epmoe {command}: error: {message}" in err


def test_tls_files_that_do_not_load_are_named(kimi, tmp_path, capsys):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    key.write_text("not a key")
    cert.write_text("not a certificate")
    assert main(["serve", "--model", str(kimi), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]) == 2
    assert f"epmoe serve: error: --ssl-certfile '{cert}' is not a PEM certificate" in capsys.readouterr().err
    cert.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\nnot base64\n-----END PRIVATE KEY-----\n")
    assert main(["serve", "--model", str(kimi), "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]) == 2
    assert (f"epmoe serve: error: --ssl-certfile '{cert}' and --ssl-keyfile '{key}' do not load as a certificate "
            f"and its private key (PEM): ") in capsys.readouterr().err


def test_cors_lists_are_json(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--allowed-headers", "*"])
    assert exc.value.code == 2
    assert ("epmoe serve: error: argument --allowed-headers: a JSON list of strings expected, e.g. '[\"*\"]', "
            "got '*'") in capsys.readouterr().err


def test_run_and_serve_take_the_same_engine_flags_into_the_engine(kimi):
    """Every engine option is a flag of both commands, and what is typed reaches the ``EngineConfig`` each builds
    (``--max-moves`` its ``eplb_max_moves``); the flags' defaults are ``EngineConfig``'s own."""
    import dataclasses

    from epmoe.cli import _engine_args
    from epmoe.engine import EngineConfig
    from epmoe.engine.config import COMMAND_FIELDS
    from epmoe.runtime.run import RunConfig
    from epmoe.server.config import ServeConfig

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    dests = {c: {a.dest for a in commands[c]._actions} for c in ("run", "serve")}
    assert set(COMMAND_FIELDS) <= dests["run"] & dests["serve"]
    typed = ["--model", str(kimi), "--ep", "2", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
             "--max-model-len", "100", "--mem-fraction-static", "0.5", "--num-kv-blocks", "40", "--block-size", "8",
             "--layout", "round_robin", "--redundant", "2", "--dispatcher", "all_to_all", "--eplb-interval", "5",
             "--max-moves", "3", "--replica-policy", "round_robin", "--cuda-graph-max-bs", "4",
             "--no-enable-prefix-caching", "--seed", "7", "--moe-routing-simulation", "uniform_random"]
    want = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 100, "mem_fraction_static": 0.5,
            "num_kv_blocks": 40, "block_size": 8, "layout": "round_robin", "redundant": 2,
            "dispatcher": "all_to_all", "eplb_interval": 5, "eplb_max_moves": 3, "replica_policy": "round_robin",
            "cuda_graph_max_bs": 4, "enable_prefix_caching": False, "seed": 7, "expert_backend": "reference",
            "enforce_eager": True, "moe_routing_simulation": "uniform_random"}
    run_args = build_parser().parse_args(["run", *typed])
    serve_args = build_parser().parse_args(["serve", *typed])
    built = [RunConfig(**_engine_args(run_args), seed=run_args.seed).engine_config(str(kimi)),
             ServeConfig(**_engine_args(serve_args), seed=serve_args.seed).engine_config(str(kimi))]
    for cfg in built:
        assert {k: getattr(cfg, k) for k in want} == want
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for command in ("run", "serve"):
        parsed = build_parser().parse_args([command])
        assert {k: getattr(parsed, k) for k in COMMAND_FIELDS} == {k: defaults[k] for k in COMMAND_FIELDS}, command


def test_prefix_caching_asked_for_with_a_draft_model_is_refused_naming_both_flags(kimi, capsys):
    for command in ("run", "serve"):
        assert main([command, "--model", str(kimi), "--speculative-algorithm", "draft", "--speculative-draft-model",
                     str(kimi), "--enable-prefix-caching"]) == 2
        assert (f"epmoe {command}: error: --enable-prefix-caching does not combine with --speculative-algorithm "
                "'draft': a draft model's own cache would miss the cached blocks; ngram, which has no cache, "
                "combines") in capsys.readouterr().err


def test_a_missing_model_directory_is_named_by_its_flag(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    for command in ("run", "serve"):
        assert main([command, "--model", str(missing)]) == 2
        assert f"epmoe {command}: error: --model '{missing}' is not a checkpoint directory" in capsys.readouterr().err


def test_dispatcher_choices_are_the_ones_accepted(capsys):
    """``run --help`` offers exactly the dispatchers eager steps take; argparse refuses the others naming the flag
    and the value, and ``RunConfig`` (the library's path) refuses them with the same list."""
    from epmoe.engine.config import EAGER_DISPATCHERS
    from epmoe.runtime.run import RunConfig

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    (action,) = [a for a in commands["run"]._actions if "--dispatcher" in a.option_strings]
    assert tuple(action.choices) == EAGER_DISPATCHERS == ("all_to_all", "local")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--dispatcher", "fixed_capacity"])
    assert exit_info.value.code == 2
    assert ("epmoe run: error: argument --dispatcher: invalid choice: 'fixed_capacity' (choose from 'all_to_all', "
            "'local')") in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^--dispatcher 'nccl_magic' is not one of \['all_to_all', 'local'\]$"):
        RunConfig(dispatcher="nccl_magic").validate()
    with pytest.raises(ValueError, match="^--dispatcher fixed_capacity is what the engine's CUDA-graph decode steps"):
        RunConfig(dispatcher="fixed_capacity").validate()


def test_readme_lists_every_run_and_serve_flag():
    readme = README.read_text()
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = []
    for command in ("run", "serve"):
        for action in commands[command]._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag != "--help" and not re.search(rf"{re.escape(flag)}(?![\w-])", readme):
                    missing.append(f"{command} {flag}")
    assert missing == []


def test_readme_builds_and_runs_the_quantized_tiny_checkpoints():
    """The README shows how to build every quantized tiny checkpoint (by a name ``build_tiny_checkpoint`` takes) and
    runs ``epmoe run --model`` on the directory it built."""
    from epmoe.models.tiny import QUANTIZED_FAMILIES

    readme = README.read_text()
    built = dict(re.findall(r"build_tiny_checkpoint\('([\w.-]+)', '([\w./-]+)'\)", readme))
    assert set(built) == set(QUANTIZED_FAMILIES) == {"kimi-k2.5-int4", "gpt-oss-mxfp4", "deepseek-v3-fp8"}
    for directory in built.values():
        assert f"\n  epmoe run --model {directory}\n" in readme
        assert f"\n  $ epmoe run --model {directory}\n" in readme  # and what it printed


# every subcommand with its required arguments and one it does not take
UNKNOWN_ARGUMENT = [
    ["run", "--bogus-flag"],
    ["serve", "--bogus-flag"],
    ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--bogus-flag"],
    ["balance", "--loads", "loads.json", "--ep", "2", "--out", "placement.json", "--bogus-flag"],
    ["plan", "--config", "config.json", "--gpus", "8", "--hardware", "h200-sxm", "--bogus-flag"],
    ["doctor", "--model", "ckpt", "--bogus-flag"],
    ["calibrate", "--out", "profile.json", "--bogus-flag"],
]


def test_every_subcommand_is_listed_for_the_unknown_argument_check():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert sorted(argv[0] for argv in UNKNOWN_ARGUMENT) == sorted(commands)


@pytest.mark.parametrize("argv", UNKNOWN_ARGUMENT, ids=lambda argv: argv[0])
def test_an_unknown_argument_is_refused_by_its_subcommand_with_its_usage(argv, capsys):
    """``epmoe run --bogus-flag``: ``run``'s usage and ``epmoe run: error:``, not the top-level parser's."""
    prog = "epmoe " + " ".join(argv[:2] if argv[0] == "bench" else argv[:1])
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} [-h] ") and err.endswith(
        f"\n{prog}: error: unrecognized arguments: --bogus-flag\n"), err
    with pytest.raises(SystemExit):  # a stray positional as well
        main([*argv[:-1], "extra"])
    assert capsys.readouterr().err.endswith(f"\n{prog}: error: unrecognized arguments: extra\n")


@pytest.mark.parametrize("argv, flag", [
    (["plan", "--config", "{missing}", "--gpus", "8", "--hardware", "h200-sxm"], "--config"),
    (["plan", "--config", "{qwen3}", "--gpus", "8", "--hardware", "h200-sxm", "--spec-tokens", "2", "--draft",
      "{missing}"], "--draft"),
    (["balance", "--loads", "{loads}", "--ep", "8", "--out", "{out}", "--config", "{missing}"], "--config"),
])
def test_a_missing_config_or_draft_is_named_by_its_flag(tmp_path, capsys, argv, flag):
    root = Path(__file__).resolve().parents[1] / "data"
    missing = tmp_path / "missing"
    paths = dict(missing=missing, qwen3=root / "configs" / "qwen3-30b-a3b.config.json",
                 loads=root / "loads" / "eplb_readme_example.json", out=tmp_path / "p.json")
    assert main([a.format(**paths) for a in argv]) == 2
    command = argv[0]
    assert (f"epmoe {command}: error: {flag} '{missing}' does not exist (expected a model directory holding "
            f"config.json, or a config file)\n") in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
    missing.mkdir()  # a directory without config.json: "config file '.../missing/config.json' does not exist"
    assert main([a.format(**paths) for a in argv]) == 2
    assert (f"epmoe {command}: error: {flag} '{missing}' is a directory without a config.json file (expected a "
            f"model directory holding config.json, or a config file)\n") in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()
    # a config that exists but does not parse: the error named the file alone ("config.json: not valid JSON")
    config = missing / "config.json"
    for text, what in (("", "is empty (expected a model directory holding config.json, or a config file)"),
                       ("{x", ": not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
                              "(char 1))"),
                       ("[1]", ": expected a JSON object, got list"),
                       # was Python's own advice: "Exceeds the limit (4300 digits) ... use sys.set_int_max_str_digits()"
                       ('{"a": ' + "9" * 5000 + "}", ": not valid JSON (a number of more than 4300 digits)")):
        config.write_text(text)
        assert main([a.format(**paths) for a in argv]) == 2
        sep = "" if what.startswith(":") else " "
        assert f"epmoe {command}: error: {flag} '{config}'{sep}{what}\n" in capsys.readouterr().err
        assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("command", ["run", "serve"])
def test_eos_ids_and_an_eagle3_heads_sizes_are_refused_before_any_rank_starts(command, kimi, tmp_path, capsys):
    """An EAGLE-3 head of another hidden size, and an eos_token_id past the vocabulary, were found by the ranks after
    they started ("ranks 0 and 1 failed: ValueError: ..."); doctor and plan named them without loading anything."""
    import json
    import shutil

    from epmoe.engine.config import EngineConfig
    from epmoe.engine.group import check_group

    head = tmp_path / "eagle"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 7168,
                                                  "vocab_size": 163840, "num_hidden_layers": 1}))
    extra = ["--port", "0"] if command == "serve" else []
    assert main([command, "--model", str(kimi), "--speculative-algorithm", "eagle3", "--speculative-draft-model",
                 str(head), *extra]) == 2
    assert (f"epmoe {command}: error: --speculative-draft-model {head} has hidden_size 7168 but the target model "
            f"{kimi} has 64: an EAGLE-3 head reads the target's hidden states and token ids") in capsys.readouterr().err
    # a head whose fields sit under text_config, or whose size is not an integer, the ranks refused after the start
    for fields, message in (({"text_config": {"hidden_size": 64, "vocab_size": 259}}, "field 'hidden_size' of its "
                             "config.json must be an integer, got None"),
                            ({"hidden_size": 64.0, "vocab_size": 259}, "field 'hidden_size' of its config.json must "
                             "be an integer, got 64.0")):
        (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], **fields}))
        assert main([command, "--model", str(kimi), "--speculative-algorithm", "eagle3", "--speculative-draft-model",
                     str(head), *extra]) == 2
        assert f"--speculative-draft-model {head}: {message}" in capsys.readouterr().err
    model = tmp_path / "model"
    shutil.copytree(kimi, model)
    cfg = json.loads((model / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    cfg["eos_token_id"] = vocab + 10
    (model / "config.json").write_text(json.dumps(cfg))
    assert main([command, "--model", str(model), *extra]) == 2
    assert (f"epmoe {command}: error: '{model}/config.json': eos_token_id {vocab + 10} is outside the model's "
            f"vocabulary [0, {vocab}) (got {vocab + 10})") in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"eos_token_id"):
        check_group(EngineConfig(model=str(model)), 1)


def test_a_generation_config_directory_without_the_file_is_refused(kimi, tmp_path, capsys):
    """``--generation-config DIR`` with no generation_config.json in it started, logging that the API's defaults
    would serve: the file the user pointed at was silently not there. A path that is not a directory was refused."""
    from epmoe.engine.config import EngineConfig

    assert main(["serve", "--model", str(kimi), "--port", "0", "--generation-config", str(tmp_path)]) == 2
    assert (f"epmoe serve: error: --generation-config {str(tmp_path)!r} is a directory without a "
            f"generation_config.json file; give one that holds it, 'auto' (the checkpoint's) or 'vllm' (the API's "
            f"own defaults)") in capsys.readouterr().err
    assert main(["serve", "--model", str(kimi), "--port", "0", "--generation-config", ""]) == 2  # not the cwd's
    assert "--generation-config must not be empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"generation_config must be a directory holding a generation_config\.json"):
        EngineConfig(model=str(kimi), generation_config=str(tmp_path))
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.5}')
    assert EngineConfig(model=str(kimi), generation_config=str(tmp_path)).generation_config == str(tmp_path)


def test_kv_pool_room_counts_only_this_hosts_torchrun_ranks(kimi, monkeypatch):
    """Under torchrun the ranks on this host (``LOCAL_WORLD_SIZE``) share its memory, not the whole group's: a group of
    four over two hosts was counted as four pools on each."""
    from epmoe.engine.capacity import check_kv_pool_room
    from epmoe.engine.config import EngineConfig
    from epmoe.engine.kv_cache import KVLayout
    from epmoe.memory import free_bytes
    from epmoe.models.hf import hf_config

    dtype = EngineConfig(model=str(kimi)).torch_dtype
    per_block = 16 * KVLayout.from_config(hf_config(str(kimi)).get_text_config()).bytes_per_token(dtype)
    blocks = int(0.4 * free_bytes("cpu") / per_block)  # a pool of 0.4 of the free memory a rank
    cfg = EngineConfig(model=str(kimi), num_kv_blocks=blocks, block_size=16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"the 4 CPU rank\(s\) share the host's"):
        check_kv_pool_room(cfg, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # left in the environment: spawned ranks still all share this host
    with pytest.raises(ValueError, match=r"the 4 CPU rank\(s\) share the host's"):
        check_kv_pool_room(cfg, 4)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    check_kv_pool_room(cfg, 4)  # under torchrun, two of the four here: 0.8 of the free memory
    for bad in ("0", "9", "two"):  # not a count within the group: all of them, as spawned ranks
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ValueError, match=r"the 4 CPU rank\(s\)"):
            check_kv_pool_room(cfg, 4)


@pytest.mark.multiprocess
def test_a_ranks_error_names_the_flag_typed(kimi, capsys):
    """A KV pool past the memory is named by the flag typed, not by the engine's field: before any rank starts where
    the pool alone is past it (a rank found it, until the check before the start), and in a rank's own error (its
    pool against the memory the weights left) as the CLI reports it."""
    from epmoe.cli import _flag_error, _run_flags

    assert main(["run", "--model", str(kimi), "--ep", "1", "--no-reference", "--num-kv-blocks", "100000000"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"^epmoe run: error: --num-kv-blocks 100000000 of --block-size 16 is [\d.]+ GiB of KV cache a "
                     r"rank, and the 1 CPU rank\(s\) share the host's [\d.]+ GiB free$", err, re.M), err
    ranks = ValueError("rank 0 failed: ValueError: num_kv_blocks 100000000 needs 429.2 GiB of KV cache; 20.0 GiB are "
                       "free on cpu")
    assert str(_flag_error(ranks, _run_flags())) == ("rank 0 failed: ValueError: --num-kv-blocks 100000000 needs 429.2 "
                                                     "GiB of KV cache; 20.0 GiB are free on cpu")


def test_a_redundant_count_past_its_bound_is_named_by_its_flag(kimi, capsys):
    for command in ("run", "serve"):
        assert main([command, "--model", str(kimi), "--ep", "2", "--redundant", "100"]) == 2
        assert (f"epmoe {command}: error: --ep 2: --redundant (100) exceeds 16 (16 experts x 1): with that many "
                f"every rank already holds a copy of every expert") in capsys.readouterr().err


def test_a_draft_placement_that_does_not_fit_is_refused_before_any_rank_starts(tiny_checkpoints, tmp_path, capsys):
    """The draft's placement is checked with the target's, before a rank loads a weight (it was met only as the
    draft loaded inside the ranks); a dense draft given a placement likewise."""
    from epmoe.placement import ExpertPlacement

    target, draft = str(tiny_checkpoints("qwen3-moe")), str(tiny_checkpoints("mixtral"))
    wrong = tmp_path / "target-shaped.json"
    ExpertPlacement.trivial(2, 16, 2).save(wrong)  # 16 experts per layer over 2 ranks; the draft has 8
    for command in ("run", "serve"):
        assert main([command, "--model", target, "--ep", "2", "--speculative-algorithm", "draft",
                     "--speculative-draft-model", draft, "--speculative-draft-placement", str(wrong)]) == 2
        err = capsys.readouterr().err
        assert (f"epmoe {command}: error: --speculative-draft-placement {wrong} with --ep 2: draft model {draft} "
                f"(an MoE draft, 2 MoE layers x 8 experts) cannot be placed on 2 rank(s): ") in err, err
        assert f"placement holds 16 logical experts per layer but draft model {draft} has 8" in err, err
        assert "rank 0 failed" not in err
    for path, what in ((tmp_path, "is a directory, not a file"), (tmp_path / "none.json", "does not exist")):
        assert main(["serve", "--model", target, "--ep", "2", "--speculative-algorithm", "draft",
                     "--speculative-draft-model", draft, "--speculative-draft-placement", str(path)]) == 2
        assert (f"--speculative-draft-placement {path} with --ep 2: placement file '{path}' {what}"
                in capsys.readouterr().err)
    from epmoe.models.tiny import build_tiny_dense_checkpoint

    dense = str(build_tiny_dense_checkpoint(tmp_path / "dense", seed=7))
    assert main(["run", "--model", target, "--ep", "1", "--speculative-algorithm", "draft",
                 "--speculative-draft-model", dense, "--speculative-draft-placement", str(wrong)]) == 2
    assert (f"epmoe run: error: --speculative-draft-placement {wrong} with --ep 1: draft model {dense} is dense: it "
            f"has no experts to place; leave --speculative-draft-placement unset") in capsys.readouterr().err


def test_a_parser_of_text_on_a_checkpoint_without_a_tokenizer_is_refused_before_start(kimi, tmp_path, capsys):
    import shutil

    shutil.copy(kimi / "config.json", tmp_path / "config.json")  # a bare config.json: dummy weights, no tokenizer
    assert main(["serve", "--model", str(tmp_path), "--load-format", "dummy", "--port", "0",
                 "--reasoning-parser", "deepseek_r1"]) == 2
    assert (f"epmoe serve: error: --reasoning-parser reads the model's text, and the checkpoint {tmp_path} has no "
            f"tokenizer") in capsys.readouterr().err


REMOTE_TOKENIZER = '''from transformers import PreTrainedTokenizerFast


class TinyRemoteTokenizer(PreTrainedTokenizerFast):
    """A byte-level tokenizer that ships as code with its checkpoint, as Kimi-K2's TikTokenTokenizer does."""
'''


@pytest.fixture(scope="module")
def remote_tokenizer_checkpoint(kimi, tmp_path_factory):
    """The built-in checkpoint with its tokenizer saved by transformers as a class shipped in the checkpoint
    (``tokenization_tiny_remote.py``, ``auto_map`` in ``tokenizer_config.json``)."""
    import importlib
    import shutil
    import sys

    from transformers import AutoTokenizer

    src, out = tmp_path_factory.mktemp("remote-src"), tmp_path_factory.mktemp("remote-ckpt")
    (src / "tokenization_tiny_remote.py").write_text(REMOTE_TOKENIZER)
    sys.path.insert(0, str(src))
    try:
        module = importlib.import_module("tokenization_tiny_remote")
    finally:
        sys.path.remove(str(src))
    base = AutoTokenizer.from_pretrained(kimi)
    tok = module.TinyRemoteTokenizer(tokenizer_object=base.backend_tokenizer, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>")
    module.TinyRemoteTokenizer.register_for_auto_class("AutoTokenizer")
    for path in kimi.iterdir():
        if not path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, out / path.name)
    tok.save_pretrained(out)
    assert (out / "tokenization_tiny_remote.py").is_file()
    return out


def test_a_tokenizer_shipped_as_code_runs_only_with_trust_remote_code(remote_tokenizer_checkpoint, capsys):
    ckpt = remote_tokenizer_checkpoint
    for command, extra in (("run", "--no-reference"), ("serve", "--port=0")):  # refused before any rank starts
        assert main([command, "--model", str(ckpt), "--ep", "1", extra]) == 2
        err = capsys.readouterr().err
        assert (f"epmoe {command}: error: the tokenizer of '{ckpt}' is code shipped with the checkpoint "
                f"(tokenization_tiny_remote.py): set --trust-remote-code to run it") in err, err
    assert main(["run", "--model", str(ckpt), "--ep", "1", "--no-reference", "--trust-remote-code",
                 "--max-new-tokens", "3", "--prompt", "hello"]) == 0
    out = capsys.readouterr().out
    assert "hello" in out


@pytest.mark.parametrize("entry, message", [
    ([None, None], "auto_map AutoTokenizer must name the tokenizer class as 'module.Class'"),
    (5, "auto_map AutoTokenizer must name the tokenizer class as 'module.Class'"),
    ("nodot", "auto_map AutoTokenizer must name the tokenizer class as 'module.Class'"),
    (["tokenization_missing.XTok", None], "auto_map AutoTokenizer 'tokenization_missing.XTok' names "
                                          "tokenization_missing.py, which the checkpoint does not hold"),
    (["org/repo--tokenization_x.XTok", None], "names code of another repository (org/repo), which epmoe does not "
                                              "fetch"),
])
def test_a_broken_tokenizer_auto_map_is_named_with_its_file(remote_tokenizer_checkpoint, tmp_path, entry, message):
    import json
    import shutil

    from epmoe.engine.tokenizer import load_tokenizer

    ckpt = tmp_path / "ckpt"
    shutil.copytree(remote_tokenizer_checkpoint, ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "auto_map": {"AutoTokenizer": entry}}))
    for trust in (False, True):
        with pytest.raises(ValueError, match=re.escape(f"{ckpt / 'tokenizer_config.json'}: ") + ".*"
                           + re.escape(message)):
            load_tokenizer(str(ckpt), trust_remote_code=trust)


@pytest.mark.parametrize("after_s", [1.0, 6.0])
def test_ctrl_c_at_any_moment_is_one_line_and_no_traceback(after_s):
    """Ctrl-C (SIGINT) during the first imports printed a traceback (``import epmoe`` imported PyTorch before
    ``main`` ran), and ``bench serve`` alone caught it later. Now at 1 s (PyTorch's import, inside ``main``) and 6 s
    (requests waiting on a server that accepts and never answers) the command prints one line and exits.
    (Pressed during a dependency's import, one Ctrl-C may be swallowed by a bare ``except`` there: the test presses
    again. Before ``main``, while Python imports the few standard modules ``epmoe.cli`` needs, Ctrl-C still stops
    the interpreter with its own traceback.)"""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as listener:  # accepts connections into its backlog, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        proc = subprocess.Popen([sys.executable, "-m", "epmoe.cli", "bench", "serve", "--base-url", url,
                                 "--num-prompts", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                # a shell's background job ignores SIGINT, and its children inherit that
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=after_s)
            out = err = None
            for _ in range(3):  # as a user presses again: a library's bare except may swallow one during its import
                proc.send_signal(signal.SIGINT)
                try:
                    out, err = proc.communicate(timeout=20)
                    break
                except subprocess.TimeoutExpired:
                    continue
        finally:
            proc.kill()
    assert err is not None, "still running after three Ctrl-C"
    # 130, or killed by the SIGINT itself where asyncio's Ctrl-C handling ends the run (both read as Ctrl-C to a shell)
    assert proc.returncode in (130, -signal.SIGINT), (out, err)
    assert err.strip().splitlines()[-1] == "epmoe: interrupted" and "Traceback" not in err, err


def test_sigterm_during_an_import_waits_for_the_import(tmp_path, monkeypatch):
    """A SIGTERM that came while a library was importing raised inside it: numpy or scipy were left half-imported
    (AttributeError, a recursion error), or the exception crossed pybind11's C++ frames and aborted the process. It
    is now delivered again once the import is over, and stops the command there."""
    import importlib
    import signal
    import time

    from epmoe.cli import Terminated, _raise_terminated

    (tmp_path / "slow_module_under_sigterm.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.3)  # the handler runs here, inside the import\n"
        "FINISHED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        module = importlib.import_module("slow_module_under_sigterm")
        assert module.FINISHED  # the import ran to its end
        with pytest.raises(Terminated):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)  # the signal again, out of the import: raised here
    finally:
        signal.signal(signal.SIGTERM, before)


def test_run_json_and_save_loads_naming_one_file_are_refused_before_the_run(tmp_path, capsys):
    """``--json F --save-loads F``: the report silently overwrote the loads (which ``balance`` then refused)."""
    both = tmp_path / "both.json"
    assert main(["run", "--json", str(both), "--save-loads", str(both)]) == 2
    assert capsys.readouterr().err.endswith(f"epmoe run: error: --json ({str(both)!r}) and --save-loads "
                                            f"({str(both)!r}) name the same file\n")
    assert not both.exists()


def test_an_output_name_longer_than_the_file_system_takes_is_named(tmp_path, capsys):
    """A 300-byte name was "[Errno 36] File name too long" after the work, naming no flag; a 240-byte one, which
    the file system takes, failed too, from the longer temporary name the write staged it under."""
    loads = tmp_path / "loads.json"
    loads.write_text('{"format": "epmoe.loads/1", "load": [[4, 3, 2, 1]]}')
    long = tmp_path / ("p" * 295 + ".json")
    assert main(["balance", "--loads", str(loads), "--ep", "2", "--out", str(long)]) == 2
    assert capsys.readouterr().err.endswith(f"epmoe balance: error: --out ({str(long)!r}) cannot be written: its "
                                            f"name is 300 bytes, longer than the 255 its file system takes\n")
    fits = tmp_path / ("p" * 235 + ".json")
    assert main(["balance", "--loads", str(loads), "--ep", "2", "--out", str(fits)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["loads.json", fits.name])


def test_the_last_line_on_a_terminal_clears_a_stopped_bar_and_shows_the_cursor(monkeypatch):
    """A rank's progress bar stopped by SIGTERM left the cursor hidden and the command's line glued to the bar
    ("... 20% 0:00:08epmoe: terminated (SIGTERM)"); on a terminal the line is now cleared and the cursor shown first.
    Not on a pipe: the line alone."""
    import io

    from epmoe import cli

    class Tty(io.StringIO):
        def isatty(self):
            return True

    def stopped(argv):
        sys.stderr.write("\x1b[?25l generating 20% 0:00:08")  # a bar being drawn, cursor hidden
        raise cli.Terminated

    monkeypatch.setattr(cli, "_main", stopped)
    for stream, want in ((Tty(), "\r\x1b[2K\x1b[?25hepmoe: terminated (SIGTERM)\n"),
                         (io.StringIO(), "0:00:08epmoe: terminated (SIGTERM)\n")):
        monkeypatch.setattr(sys, "stderr", stream)
        assert cli.main([]) == cli.EXIT_TERMINATED
        assert stream.getvalue().endswith(want), repr(stream.getvalue())


def test_sigterm_reaches_a_main_thread_blocked_in_cpp(tmp_path):
    """A main thread blocked in C++ (here a store read of a key nobody writes, as a torchrun rank waits in the
    process-group setup for a peer that failed) runs no Python signal handler: SIGTERM waited for the SIGKILL that
    follows it. The command now prints its line and exits 143 once the grace is over."""
    import signal
    import subprocess

    script = tmp_path / "blocked.py"
    script.write_text(
        "import sys\n"
        "from datetime import timedelta\n"
        "import torch.distributed as dist\n"
        "from epmoe import cli\n"
        "def blocked(args):\n"
        "    store = dist.TCPStore('127.0.0.1', 0, 1, True, timeout=timedelta(seconds=120))\n"
        "    print('blocked', flush=True)\n"
        "    store.get('a key nobody sets')\n"
        "cli._main = blocked\n"
        "sys.exit(cli.main([]))\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "blocked\n"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == ["epmoe: terminated (SIGTERM)"], err


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the ranks through Linux's /proc")
def test_sigterm_stops_a_run_with_one_line_and_its_ranks(kimi):
    """SIGTERM (as ``timeout``, systemd or a batch scheduler send it) to ``epmoe run``'s own process: it ended with
    exit -15 and only multiprocessing's warning of two leaked semaphores; now one line, 143 (128 + 15, as a shell
    reports it), and the spawned ranks stopped."""
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-m", "epmoe.cli", "run", "--model", str(kimi), "--ep", "2",
                             "--max-new-tokens", "64", "--no-reference", "--request-rate", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = set()
    try:
        deadline = time.monotonic() + 120
        while len(children) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)  # the ranks, once spawned (the rendezvous store's own process may come too)
            children = {int(c) for t in os.listdir(f"/proc/{proc.pid}/task")
                        for c in open(f"/proc/{proc.pid}/task/{t}/children").read().split()}
        assert len(children) >= 2, "the ranks did not start"
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, (out, err)
    assert err.strip().splitlines()[-1] == "epmoe: terminated (SIGTERM)", err
    assert "Traceback" not in err and "leaked" not in err, err
    time.sleep(1)
    assert not [c for c in children if os.path.exists(f"/proc/{c}") and
                open(f"/proc/{c}/stat").read().split(")")[-1].split()[0] != "Z"], "a rank outlived the run"
