"""ExpertPlacement: constructors, derived tables, per-rank views, files, validation messages."""

from __future__ import annotations

import json
import os

import pytest
import torch

from epmoe.placement import ExpertPlacement


def test_contiguous_and_round_robin_layouts():
    c = ExpertPlacement.trivial(2, 8, 4)
    assert c.phy2log[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert c.local_experts(1).tolist() == [[2, 3], [2, 3]]
    rr = ExpertPlacement.trivial(1, 8, 4, layout="round_robin")
    assert rr.phy2log[0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert rr.local_slots(2) == range(4, 6)


def test_redundant_tables():
    p = ExpertPlacement.trivial(1, 6, 4, num_redundant=2, layout="round_robin")
    assert p.phy2log[0].tolist() == [0, 4, 1, 5, 2, 0, 3, 1]
    assert p.logcnt[0].tolist() == [2, 2, 1, 1, 1, 1]
    assert p.log2phy[0].tolist() == [[0, 5], [2, 7], [4, -1], [6, -1], [1, -1], [3, -1]]
    assert (p.num_slots, p.num_redundant, p.slots_per_rank) == (8, 2, 2)


def test_dispatch_table_prefers_local_copy_then_spreads():
    p = ExpertPlacement.trivial(1, 6, 4, num_redundant=2, layout="round_robin")
    # rank 0 holds slots 0,1 (experts 0,4); expert 1 lives at slots 2 and 7 -> rank 0 takes copy 0 % 2.
    assert p.dispatch_table(0)[0].tolist() == [0, 2, 4, 6, 1, 3]
    # rank 1 holds slots 2,3 (experts 1,5): local copy of expert 1; expert 0 -> copy 1 % 2 = slot 5.
    assert p.dispatch_table(1)[0].tolist() == [5, 2, 4, 6, 1, 3]
    # every entry of every table holds the right expert
    for r in range(4):
        assert torch.equal(p.phy2log[0][p.dispatch_table(r)[0]], torch.arange(6))


@pytest.mark.parametrize("suffix", [".json", ".safetensors"])
def test_save_load_roundtrip(tmp_path, suffix):
    p = ExpertPlacement.from_phy2log(torch.tensor([[3, 0, 1, 2, 3, 3], [0, 1, 2, 3, 0, 1]]), ep_size=3)
    path = tmp_path / f"pl{suffix}"
    p.save(path)
    q = ExpertPlacement.load(path)
    assert q == p and q.ep_size == 3 and q.num_experts == 4
    assert not list(tmp_path.glob("*.tmp"))


def test_sglang_key_and_ep_size_argument(tmp_path):
    path = tmp_path / "sgl.json"
    path.write_text(json.dumps({"physical_to_logical_map": [[1, 0, 1, 0]]}))
    p = ExpertPlacement.load(path, ep_size=2)
    assert p.phy2log.tolist() == [[1, 0, 1, 0]] and p.ep_size == 2
    with pytest.raises(ValueError, match="field 'ep_size' is missing and no EP size was given"):
        ExpertPlacement.load(path)


@pytest.mark.parametrize(
    "phy2log, ep, experts, message",
    [
        ([[0, 1, 1, 1]], 2, 3, r"layer 0: logical expert 2 has no physical slot"),
        ([[0, 1, 2, 3, 4]], 2, 5, r"num_slots \(5\) must be divisible by the EP group size \(2\)"),
        ([[0, 1]], 4, 2, r"EP size \(4\) is larger than the number of slots \(2\)"),
        ([[0, 1, 2, 9]], 2, 4, r"phy2log\[0, 3\] = 9 is not a logical expert id in \[0, 4\)"),
        ([[0, 1, 2, 3], [0, 1, 2, 2]], 2, 4, r"layer 1: logical expert 3 has no physical slot"),
    ],
)
def test_validation_messages(phy2log, ep, experts, message):
    with pytest.raises(ValueError, match=message):
        ExpertPlacement(torch.tensor(phy2log), num_experts=experts, ep_size=ep)


def test_type_errors_and_model_check():
    with pytest.raises(TypeError, match="integer tensor"):
        ExpertPlacement(torch.zeros(1, 4), num_experts=4, ep_size=1)
    p = ExpertPlacement.trivial(3, 8, 2)
    with pytest.raises(ValueError, match="placement covers 3 MoE layers but the model has 4"):
        p.check_model(4, 8)
    with pytest.raises(ValueError, match="placement holds 8 logical experts per layer but the model has 16"):
        p.check_model(3, 16)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"ep_size": 2, "phy2log": [[0, 1], [0]]}, r"phy2log layer 1 has 1 slots but layer 0 has 2"),
        ({"ep_size": 2}, r"field 'phy2log' is missing"),
        ({"ep_size": 2, "phy2log": None}, r"field 'phy2log' is null; it must be a list of per-layer lists$"),
        ({"ep_size": 2, "num_experts": 4, "phy2log": [[0, 1, 2, 2]]}, r"layer 0: logical expert 3 has no physical "
                                                                      r"slot"),
        ({"ep_size": 2, "phy2log": [[0, 1.5]]}, r"integers only, got phy2log\[0, 1\] = 1\.5$"),
        ({"ep_size": 2, "phy2log": [[0, 1], [1, "a"]]}, r"integers only, got phy2log\[1, 1\] = 'a'$"),
        # no slots at all: named as such (it was torch's 'cannot reshape tensor of 0 elements')
        ({"ep_size": 2, "phy2log": []}, r"/bad\.json': field 'phy2log' holds no slots, got \[\]: it needs one list"),
        ({"ep_size": 2, "phy2log": [[], []]}, r"/bad\.json': field 'phy2log' holds no slots, got \[\[\], \[\]\]"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, doc, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message) as info:
        ExpertPlacement.load(path)
    assert "bad.json" in str(info.value)


@pytest.mark.parametrize(
    "doc, message",
    [
        # an id outside the 8 experts: named with its position, before the counts it breaks
        ({"ep_size": 2, "num_experts": 8, "phy2log": [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 9]]},
         r"/p\.json': phy2log\[1, 7\] = 9 is not a logical expert id in \[0, 8\)$"),
        ({"ep_size": 3, "num_experts": 8, "phy2log": [[0, 1, -1, 3, 4, 5, 6, 7]]},
         r"/p\.json': phy2log\[0, 2\] = -1 is not a logical expert id in \[0, 8\)$"),
        # no num_experts: 8 is the largest id, so 9 experts are assumed and expert 7 lacks a slot; the id comes first
        ({"ep_size": 2, "phy2log": [[0, 1, 2, 3, 4, 5, 6, 8]]},
         r"/p\.json': phy2log\[0, 7\] = 8 is the largest id and num_experts is not given, so 9 experts were "
         r"assumed; is 8 out of range\? Then layer 0: logical expert 7 has no physical slot"),
        # keys that are not ours are refused by name, not ignored
        ({"ep_size": 2, "num_experts": 8, "num_ranks": 2, "phy2log": [[0, 1, 2, 3, 4, 5, 6, 7]]},
         r"/p\.json': unknown field\(s\) 'num_ranks'; a placement file holds 'format', 'num_experts', 'ep_size', "
         r"'phy2log', 'physical_to_logical_map'$"),
    ],
)
def test_placement_file_ids_and_keys(tmp_path, doc, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        ExpertPlacement.load(path)


def test_file_ep_size_0_is_an_invalid_field_even_when_an_ep_size_is_asked_for(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"phy2log": [[0, 1, 2, 3]], "ep_size": 0}))
    with pytest.raises(ValueError, match=r"^placement file '.*p\.json': field 'ep_size' must be a positive "
                                         r"integer, got 0$"):
        ExpertPlacement.load(path, ep_size=2)


def test_file_ep_disagreement(tmp_path):
    path = tmp_path / "p.json"
    ExpertPlacement.trivial(1, 4, 2).save(path)
    with pytest.raises(ValueError, match="the file is for EP size 2 but EP size 4 was asked for"):
        ExpertPlacement.load(path, ep_size=4)


@pytest.mark.parametrize("doc,msg", [
    ({"ep_size": "2", "phy2log": [[0, 1, 2, 3]]}, "field 'ep_size' must be an integer, got '2'"),
    ({"ep_size": 2.0, "phy2log": [[0, 1, 2, 3]]}, "field 'ep_size' must be an integer, got 2.0"),
    ({"ep_size": 2, "num_experts": True, "phy2log": [[0, 1, 2, 3]]}, "field 'num_experts' must be an integer"),
    ({"format": "foo/9", "ep_size": 2, "phy2log": [[0, 1, 2, 3]]}, "field 'format' is 'foo/9'"),
    # an invalid value is named as such, not as an EP size the file is "for"
    ({"ep_size": 0, "phy2log": [[0, 1, 2, 3]]}, "field 'ep_size' must be a positive integer, got 0$"),
    ({"ep_size": -2, "phy2log": [[0, 1, 2, 3]]}, "field 'ep_size' must be a positive integer, got -2$"),
    ({"ep_size": 2, "num_experts": 0, "phy2log": [[0, 1, 2, 3]]},
     "field 'num_experts' must be a positive integer, got 0$"),
    # was "Overflow when unpacking long long"
    ({"ep_size": 2, "phy2log": [[0, 2 ** 70, 2, 3]]}, r"phy2log\[0, 1\] = 1180591620717411303424 is no expert id "
                                                       r"\(at most 1048576 experts a layer\)$"),
    # was an allocation of 64 GiB, then "could not be read: [enforce fail at alloc_cpu.cpp...]"
    ({"ep_size": 2, "phy2log": [[0, 2 ** 33, 2, 3]]}, r"phy2log\[0, 1\] = 8589934592 is no expert id"),
    ({"ep_size": 2, "num_experts": 2 ** 40, "phy2log": [[0, 1, 2, 3]]},
     r"field 'num_experts' must be a positive integer up to 1048576, got 1099511627776$"),
])
def test_placement_file_fields_are_typed(tmp_path, doc, msg):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=msg):
        ExpertPlacement.load(path)


def test_safetensors_metadata_fields_named(tmp_path):  # was "invalid literal for int() with base 10: 'x'"
    from safetensors.torch import save_file

    path = tmp_path / "p.safetensors"
    save_file({"phy2log": torch.tensor([[0, 1, 2, 3]])}, str(path), metadata={"ep_size": "x"})
    with pytest.raises(ValueError, match=r"metadata field 'ep_size' must be an integer, got 'x'$"):
        ExpertPlacement.load(path)


def test_redundant_slots_bounded():
    with pytest.raises(ValueError, match=r"num_redundant \(1000000000000\) exceeds 8 \(8 experts x 1\)"):
        ExpertPlacement.trivial(num_layers=2, num_experts=8, ep_size=2, num_redundant=10**12)
    assert ExpertPlacement.trivial(num_layers=1, num_experts=4, ep_size=2, num_redundant=4).num_slots == 8


def test_a_missing_placement_file_and_a_directory_are_told_apart(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"placement file '.*nowhere\.json' does not exist$"):
        ExpertPlacement.load(tmp_path / "nowhere.json")
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(FileNotFoundError, match=r"placement file '.*dir\.json' is a directory, not a file$"):
        ExpertPlacement.load(tmp_path / "dir.json")


def test_a_pipe_or_non_utf8_placement_file_is_named(tmp_path):
    """A pipe was said to "not exist" (and read, had it existed, would block); a binary JSON file gave a codec
    error; a YAML (TensorRT-LLM) one the same."""
    from epmoe.integrations.placements import load_placement_as

    pipe = tmp_path / "p.json"
    os.mkfifo(pipe)
    with pytest.raises(ValueError, match=r"^placement file '.*p\.json' is not a regular file$"):
        ExpertPlacement.load(pipe)
    with pytest.raises(ValueError, match=r"^placement file '.*p\.json' is not a regular file$"):
        load_placement_as(pipe)
    for name in ("b.json", "b.yaml"):
        (tmp_path / name).write_bytes(b'{"phy2log": [[0, 1]], "ep_size": 1}\xff')
        with pytest.raises(ValueError, match=rf"^placement file '.*{name}' is not UTF-8 text \(byte 0xff at "
                                             r"position 35\)$"):
            load_placement_as(tmp_path / name)
    with pytest.raises(ValueError, match=r"^placement file '.*b\.json' is not UTF-8 text"):
        ExpertPlacement.load(tmp_path / "b.json")
    (tmp_path / "ok.json").write_text('{"phy2log": [[0, 1]], "ep_size": 1}\r\n')
    assert ExpertPlacement.load(tmp_path / "ok.json").phy2log.tolist() == [[0, 1]]
