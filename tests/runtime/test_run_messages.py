"""``epmoe run``'s messages for bad prompts and tokenizers, the float32 judge of bf16 runs, and saved loads."""

from __future__ import annotations

import shutil

import pytest

from epmoe.cli import main


@pytest.fixture(scope="module")
def kimi(tiny_checkpoints):
    return tiny_checkpoints("kimi-k2.5")


def test_a_prompt_that_is_not_utf8_is_named(kimi, capsys):
    prompt = b"caf\xc3\xa9 \xe9t\xe9".decode("utf-8", "surrogateescape")  # how Python hands over non-UTF-8 argv
    assert main(["run", "--model", str(kimi), "--prompt", "fine", "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert ("epmoe run: error: --prompt b'caf\\xc3\\xa9 \\xe9t\\xe9' is not valid UTF-8 text (byte 0xe9 at "
            "position 6); pass prompts in UTF-8") in err
    # a long one is shown by its first 40 bytes (3000 bytes filled the terminal)
    long = (b"x" * 100 + b"\xff" * 2900).decode("utf-8", "surrogateescape")
    assert main(["run", "--model", str(kimi), "--prompt", long]) == 2
    err = capsys.readouterr().err
    assert (f"epmoe run: error: --prompt {b'x' * 40!r}... (3000 bytes) is not valid UTF-8 text (byte 0xff at "
            "position 100); pass prompts in UTF-8") in err and len(err) < 300


def test_encoding_text_that_is_not_unicode_names_it(kimi):
    from epmoe.engine.tokenizer import encode_text, load_tokenizer

    with pytest.raises(ValueError, match=r"prompt 'ab\\udce9' is not valid UTF-8 text \(position 2\)"):
        encode_text(load_tokenizer(str(kimi)), 512, "ab\udce9")
    with pytest.raises(ValueError, match=r"prompt 'ab\\udce9' is not valid UTF-8 text \(position 2\)"):
        encode_text(None, 512, "ab\udce9")


def test_a_corrupt_tokenizer_file_is_named(kimi, tmp_path, capsys):
    broken = tmp_path / "ckpt"
    shutil.copytree(kimi, broken)
    (broken / "tokenizer.json").write_text("")
    assert main(["run", "--model", str(broken), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert (f"epmoe run: error: tokenizer file '{broken}/tokenizer.json' cannot be read: Expecting value: line 1 "
            "column 1 (char 0)") in err


def test_a_missing_vocabulary_file_is_named(kimi, tmp_path, capsys):
    # was transformers' advice to install sentencepiece or tiktoken
    broken = tmp_path / "ckpt"
    shutil.copytree(kimi, broken)
    (broken / "tokenizer.json").unlink()
    assert main(["run", "--model", str(broken), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert (f"the tokenizer of '{broken}' cannot be loaded: the directory holds tokenizer_config.json but no "
            "vocabulary file (tokenizer.json, a .model or .tiktoken file, vocab.json or vocab.txt, merges.txt)") in err


def _copy_with(kimi, dst, config=None, generation=None):
    """A copy of the checkpoint with ``config`` merged into its config.json and ``generation`` written as its
    generation_config.json."""
    import json

    shutil.copytree(kimi, dst)
    if config:
        (dst / "config.json").write_text(json.dumps({**json.loads((dst / "config.json").read_text()), **config}))
    if generation is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation))
    return dst


@pytest.mark.parametrize("edit, message", [
    ({"rms_norm_eps": -1}, "config.json: field 'rms_norm_eps' must be a positive number, got -1"),
    ({"max_position_embeddings": 0},
     "config.json: field 'max_position_embeddings' must be an integer in [1, 16777216], got 0"),
    ({"tie_word_embeddings": "yes"},
     'config.json: field \'tie_word_embeddings\' must be true or false, got "yes" (a string)'),
    ({"use_cache": "yes"}, "config.json: transformers cannot build the model's config from it: "
                           "StrictDataclassFieldValidationError: Validation error for field 'use_cache': TypeError: "
                           "Field 'use_cache' expected bool, got str (value: 'yes')"),
])
def test_a_config_error_is_named_as_itself_not_as_the_tokenizers(kimi, tmp_path, capsys, edit, message):
    """Fields transformers' config class refuses made the tokenizer fail first ("the tokenizer ... cannot be
    loaded"): config.json is checked before, by epmoe and by transformers, and its error names the field."""
    bad = _copy_with(kimi, tmp_path / "ckpt", config=edit)
    assert main(["run", "--model", str(bad), "--ep", "1", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert f"epmoe run: error: {bad}/{message}" in err
    assert "tokenizer" not in err


def test_a_bad_generation_config_is_named_with_its_file_not_taken_for_a_flag(kimi, tmp_path, capsys):
    """transformers' reference reads generation_config.json: a field it refuses is named with the file before any rank
    starts (it was reported as the --max-new-tokens flag, after the whole run)."""
    bad = _copy_with(kimi, tmp_path / "ckpt", generation={"temperature": -3, "max_new_tokens": 0})
    assert main(["run", "--model", str(bad), "--ep", "1", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert (f"epmoe run: error: {bad / 'generation_config.json'}: transformers' GenerationConfig refuses field "
            "'max_new_tokens' (0): 'max_new_tokens' must be greater than 0, but is 0.") in err
    assert "--max-new-tokens" not in err


@pytest.mark.parametrize("generation", [{"num_beams": 0}, {"num_beams": "2"}, {"stop_strings": ["\n\n"]},
                                        {"num_beams": 2, "repetition_penalty": 1.5}])
def test_the_reference_is_plain_greedy_whatever_generation_config_asks(kimi, tmp_path, capsys, generation):
    """The reference's generate took the file's beams, stop strings and penalties: num_beams 0 ended in a
    ZeroDivisionError traceback, "2" in an error naming no file, stop_strings in "could not locate a tokenizer", and
    beams or a penalty made it another search than the engine's greedy one. doctor and serve accept these files;
    run now does too, and its greedy tokens match the reference's."""
    good = _copy_with(kimi, tmp_path / "ckpt", generation=generation)
    assert main(["run", "--model", str(good), "--ep", "1", "--max-new-tokens", "3"]) == 0, capsys.readouterr().err
    assert "Traceback" not in capsys.readouterr().err


def test_a_generation_config_that_is_no_json_object_is_named_before_any_rank_starts(kimi, tmp_path, capsys):
    """Without the reference too: the engine's ranks read the file (its EOS ids), so it is read once before them."""
    bad = _copy_with(kimi, tmp_path / "ckpt")
    (bad / "generation_config.json").write_text('{"eos_token_id": 257, ')
    assert main(["run", "--model", str(bad), "--ep", "2", "--max-new-tokens", "2", "--no-reference"]) == 2
    err = capsys.readouterr().err
    assert f"'{bad / 'generation_config.json'}' cannot be read" in err and "rank" not in err, err


@pytest.mark.multiprocess
def test_saved_loads_feed_balance_and_survive_live_rebalancing(kimi, tmp_path):
    import json

    import torch

    from epmoe.loads import read_loads

    prompts = ["hello there", "expert parallel", "abc"]
    common = ["run", "--model", str(kimi), "--ep", "2", "--redundant", "2", "--max-new-tokens", "5",
              "--no-reference", *[a for p in prompts for a in ("--prompt", p)]]
    # the same tokens with the experts moving every 2 steps: the loads per logical expert are the same
    assert main([*common, "--save-loads", str(tmp_path / "still.json")]) == 0
    assert main([*common, "--eplb-interval", "2", "--save-loads", str(tmp_path / "moved.safetensors"),
                 "--json", str(tmp_path / "moved.json")]) == 0
    still, moved = read_loads(tmp_path / "still.json"), read_loads(tmp_path / "moved.safetensors")
    report = json.loads((tmp_path / "moved.json").read_text())
    assert any(e["committed"] for e in report["ranks"][0]["rebalances"])
    assert torch.equal(still, moved) and still.shape == (2, 16)
    # every token fed (prompt, then all but the last generated one) routes to top-4 experts in both MoE layers
    generated = {i: len(t) for r in report["ranks"] for i, t in zip(r["prompts"], r["tokens"])}
    fed = sum(len(p.encode()) + generated[i] - 1 for i, p in enumerate(prompts))  # byte-level tokenizer
    assert still.sum(1).tolist() == [4.0 * fed] * 2
    per_rank = torch.tensor([r["rank_counts"] for r in report["ranks"]]).sum((0, 2))
    assert per_rank.tolist() == [4 * fed] * 2
    assert main(["balance", "--loads", str(tmp_path / "still.json"), "--ep", "2", "--redundant", "2",
                 "--out", str(tmp_path / "placement.json")]) == 0


def test_save_loads_refusals(kimi, tmp_path, capsys):
    assert main(["run", "--model", str(kimi), "--parallel", "tp", "--save-loads", str(tmp_path / "l.json")]) == 2
    assert "--save-loads records expert loads of --parallel ep" in capsys.readouterr().err
    assert main(["run", "--model", str(kimi), "--save-loads", str(tmp_path / "l.csv")]) == 2
    assert "loads are written as .json or .safetensors, not '.csv'" in capsys.readouterr().err
    assert main(["run", "--model", str(kimi), "--save-loads", str(tmp_path / "l.txt")]) == 2  # not written as JSON
    assert "loads are written as .json or .safetensors, not '.txt'" in capsys.readouterr().err
    assert main(["run", "--model", str(kimi), "--save-loads", str(tmp_path / "no" / "l.json")]) == 2
    err = capsys.readouterr().err
    assert f"--save-loads ('{tmp_path / 'no' / 'l.json'}') cannot be written: directory" in err
    assert "does not exist" in err


def test_replica_policy_reaches_the_layers(kimi, capsys):
    """``--replica-policy``: with two copies of experts 0 and 1 (slots 16 and 17), static keeps to one copy,
    round_robin uses both; the same tokens either way."""
    import torch

    from epmoe.engine import Engine, EngineConfig, SamplingParams

    prompt = "Expert parallelism places whole experts on ranks; copies share the load."
    slots, tokens = {}, {}
    for policy in ("static", "round_robin"):
        engine = Engine(EngineConfig(model=str(kimi), redundant=2, replica_policy=policy))
        tokens[policy] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=2))[0].token_ids
        slots[policy] = engine.loads.slot_totals.cpu()
    assert tokens["static"] == tokens["round_robin"]
    static, rr = slots["static"], slots["round_robin"]
    assert static[:, 16:].sum() == 0 and static[:, :2].sum() > 0
    assert torch.equal(static[:, :2], rr[:, :2] + rr[:, 16:])  # the same tokens per expert, split over its copies
    used = [(layer, e) for layer in range(2) for e in range(2) if static[layer, e] >= 4]
    assert used and all(rr[layer, e] > 0 and rr[layer, 16 + e] > 0 for layer, e in used)
    assert main(["run", "--model", str(kimi), "--parallel", "tp", "--replica-policy", "random"]) == 2
    assert "replica-policy places or moves whole experts" in capsys.readouterr().err



def test_the_reference_run_shows_progress(kimi, monkeypatch, capsys):
    from epmoe.runtime.run import RunConfig, _reference

    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich draws its live progress as on a terminal
    out, not_finite = _reference(RunConfig(model=str(kimi), max_new_tokens=2), str(kimi), [[72, 105], [66]], [],
                                 "float32")
    assert [len(t) for t in out] == [2, 2] and not_finite == []
    err = capsys.readouterr().err
    assert "loading the unsharded transformers reference (float32)" in err
    assert "transformers reference (float32, prompts)" in err


def test_routing_simulation_reaches_every_router_and_is_checked(kimi):
    """``--moe-routing-simulation uniform_random``: every MoE layer's router simulates (set before any step), the
    engine generates; an unknown name is refused by name before anything loads."""
    import torch

    from epmoe.engine import Engine, EngineConfig, SamplingParams
    from epmoe.engine.loading import simulation_seed

    engine = Engine(EngineConfig(model=str(kimi), moe_routing_simulation="uniform_random", seed=5))
    assert [layer.gate.simulation for layer in engine.ep_model.moe_layers] == ["uniform_random"] * len(
        engine.ep_model.moe_layers) and engine.ep_model.moe_layers
    out = engine.generate(["Expert parallelism places whole experts on ranks."],
                          SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.token_ids) == 3
    assert engine.loads.slot_totals.sum() > 0
    # the one rank of seed 5 seeded its default generators with 5 * 2**16 + 0 when the model loaded (before the
    # steps' draws); another rank of the same seed draws from another seed
    assert simulation_seed(5, 0) == 327680 != simulation_seed(5, 1)
    torch.manual_seed(0)
    again = Engine(EngineConfig(model=str(kimi), moe_routing_simulation="uniform_random", seed=5))
    assert torch.initial_seed() == 327680 and again.ep_model.moe_layers[0].gate.simulation == "uniform_random"
    with pytest.raises(ValueError, match=r"moe_routing_simulation must be one of \['uniform_random'\] or left unset "
                                         r"\(None\), got 'zipf'"):
        EngineConfig(model=str(kimi), moe_routing_simulation="zipf")
    # through run_job: the flag's name, before any rank starts
    from epmoe.runtime.run import RunConfig, run_job

    with pytest.raises(ValueError, match=r"--moe-routing-simulation must be one of \['uniform_random'\] or left "
                                         r"unset \(None\), got 'zipf'"):
        run_job(RunConfig(model=str(kimi), moe_routing_simulation="zipf"))
    with pytest.raises(ValueError, match=r"routing simulation must be None or one of \['uniform_random'\], got 'x'"):
        engine.ep_model.set_routing_simulation("x")
    assert engine.ep_model.moe_layers[0].gate.simulation == "uniform_random"


def test_run_with_simulated_routing_says_so_and_repeats(kimi, tmp_path, capsys):
    """``epmoe run --moe-routing-simulation uniform_random``: the summary and the JSON say the routing was simulated and
    why the reference was not checked; the same seed gives the same text (each rank's draws seeded)."""
    import json

    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        assert main(["run", "--model", str(kimi), "--ep", "1", "--max-new-tokens", "4", "--seed", "2",
                     "--moe-routing-simulation", "uniform_random", "--json", str(out)]) == 0
        outs.append(json.loads(out.read_text()))
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())  # the summary's cells wrap
    assert "simulated, uniform_random (--moe-routing-simulation): not the model's text" in text
    assert "not checked (--moe-routing-simulation uniform_random)" in text  # the one reason that applied
    assert outs[0]["moe_routing_simulation"] == "uniform_random" and outs[0]["load_format"] == "auto"
    assert outs[0]["reference_not_asked"] == "--moe-routing-simulation uniform_random"
    assert outs[0]["matches_reference"] is None and outs[0]["outputs"] == outs[1]["outputs"]


@pytest.mark.parametrize("reference", [True, False])
def test_the_checkpoint_headers_are_read_once_before_the_ranks_start(kimi, monkeypatch, reference):
    """With the reference check asked for, the headers read to ask whether transformers can load the checkpoint are
    the ones checked before the start (they were read twice); without it the check reads them once as before."""
    import epmoe.runtime.run as run
    from epmoe.models.checkpoint import CheckpointReader

    opened = []
    init = CheckpointReader.__init__
    monkeypatch.setattr(CheckpointReader, "__init__", lambda self, directory: opened.append(str(directory)) or
                        init(self, directory))

    class Started(Exception):
        pass

    def spawn(fn, world_size, args):
        raise Started(world_size)

    monkeypatch.setattr(run, "spawn", spawn)
    with pytest.raises(Started):
        run.run_job(run.RunConfig(model=str(kimi), max_new_tokens=2, prompts=("hi",), reference=reference))
    assert opened == [str(kimi)]
