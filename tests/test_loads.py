"""ExpertLoadRecorder counts, windowing, cross-rank reduction (gloo), load files."""

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epmoe.loads import ExpertLoadRecorder, read_csv_loads, read_loads, save_loads
from epmoe.placement import ExpertPlacement

DATA = Path(__file__).resolve().parents[1] / "data" / "loads"


def test_record_equals_bincount():
    g = torch.Generator().manual_seed(0)
    rec = ExpertLoadRecorder(num_layers=3, num_slots=10, window=4)
    slots = [torch.randint(-1, 10, (37, 4), generator=g) for _ in range(3)]
    for layer, s in enumerate(slots):
        rec.record(layer, s)
    for layer, s in enumerate(slots):
        s = s.reshape(-1)
        assert torch.equal(rec.slot_counts()[layer], torch.bincount(s[s >= 0], minlength=10))


def test_window_drops_oldest_step():
    rec = ExpertLoadRecorder(num_layers=1, num_slots=4, window=2)
    rec.record(0, torch.tensor([[0, 1]]))
    rec.step()
    rec.record(0, torch.tensor([[2, 2]]))
    assert rec.slot_counts()[0].tolist() == [1, 1, 2, 0]
    rec.step()  # the first step falls out
    rec.record(0, torch.tensor([[3, -1]]))
    assert rec.slot_counts()[0].tolist() == [0, 0, 2, 1]
    rec.reset()
    assert rec.slot_counts().sum() == 0


def test_logical_load_sums_copies():
    placement = ExpertPlacement.from_phy2log(torch.tensor([[0, 1, 2, 0]]), ep_size=2, num_experts=3)
    rec = ExpertLoadRecorder(1, 4)
    rec.record(0, torch.tensor([[0, 3], [1, 3], [2, -1]]))
    assert rec.logical_load(placement).tolist() == [[3, 1, 1]]
    with pytest.raises(ValueError, match="recorder counts"):
        rec.logical_load(ExpertPlacement.trivial(2, 4, 2))
    with pytest.raises(ValueError, match="layer_index"):
        rec.record(1, torch.tensor([[0]]))


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    placement = ExpertPlacement.from_phy2log(torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0]]), ep_size=2, num_experts=4)
    rec = ExpertLoadRecorder(2, 4)
    rec.record(0, torch.tensor([[rank, 3]]))
    rec.record(1, torch.tensor([[0, 1 + rank], [2, -1]]))
    load = rec.logical_load(placement, group=dist.group.WORLD)
    if rank == 0:
        torch.save(load, out)
    dist.destroy_process_group()


@pytest.mark.multiprocess
def test_cross_rank_reduction_gloo(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "load.pt")
    mp.spawn(_worker, args=(port, out), nprocs=2, join=True)
    load = torch.load(out)
    # layer 0: rank 0 -> slots 0, 3; rank 1 -> slots 1, 3 (slot s holds expert s)
    # layer 1: rank 0 -> slots 0, 1, 2; rank 1 -> slots 0, 2, 2 (slot s holds expert 3 - s)
    assert load.tolist() == [[1, 1, 0, 2], [0, 3, 1, 2]]


def test_recorder_in_a_model_counts_the_slots_the_router_chose(tiny_checkpoints):
    """A real model under a permuted placement with redundant copies and round-robin replicas: the recorded slot
    counts are the slots of the router's choices (copy ``(t + k) mod logcnt``), and the logical loads its
    choices."""
    from epmoe.comm import Comm
    from epmoe.layer import MoELayerOptions
    from epmoe.models.hf import load_ep_model

    num_experts, hot = 16, torch.tensor([[3, 3, 11, 0], [5, 14, 14, 9]])
    g = torch.Generator().manual_seed(0)
    phy2log = torch.stack([torch.cat([torch.randperm(num_experts, generator=g), h]) for h in hot])
    placement = ExpertPlacement.from_phy2log(phy2log, ep_size=1, num_experts=num_experts)
    assert placement.logcnt.max() == 3
    rec = ExpertLoadRecorder(placement.num_layers, placement.num_slots)
    ep = load_ep_model(str(tiny_checkpoints("kimi-k2.5")), placement, Comm(None),
                       options=MoELayerOptions(dispatcher="local", replica_policy="round_robin", load_recorder=rec))
    chosen: dict[int, torch.Tensor] = {}

    def keep(index: int):
        def hook(module, args, out) -> None:
            chosen[index] = out[0]
        return hook

    for layer in ep.moe_layers:
        layer.gate.register_forward_hook(keep(layer.moe_index))
    with torch.no_grad():
        ep.model(torch.randint(0, 256, (1, 40), generator=g))
    assert sorted(chosen) == [0, 1]
    assert (rec.slot_counts()[:, num_experts:] > 0).all()  # the redundant copies served tokens
    for layer, topk_idx in chosen.items():
        t, k = topk_idx.shape
        copy = (torch.arange(t).unsqueeze(1) + torch.arange(k)) % placement.logcnt[layer][topk_idx]
        slots = placement.log2phy[layer][topk_idx, copy]
        assert torch.equal(placement.phy2log[layer][slots], topk_idx)
        assert torch.equal(rec.slot_counts()[layer], torch.bincount(slots.reshape(-1), minlength=placement.num_slots))
        assert torch.equal(rec.logical_load(placement)[layer],
                           torch.bincount(topk_idx.reshape(-1), minlength=num_experts))


@pytest.mark.parametrize("suffix", [".json", ".safetensors"])
def test_save_read_roundtrip(tmp_path, suffix):
    load = torch.tensor([[1.0, 2.0, 3.5], [0.0, 4.0, 1.0]], dtype=torch.float64)
    save_loads(tmp_path / f"l{suffix}", load)
    assert torch.equal(read_loads(tmp_path / f"l{suffix}"), load)
    assert not list(tmp_path.glob("*.tmp"))


def test_read_olmoe_csv():
    load, names = read_csv_loads(DATA / "olmoe_expert_counts.csv")
    assert load.shape == (15, 64)
    assert names[0] == "arxiv:0" and names[-1] == "wikipedia:15"
    assert torch.all(load.sum(1) == 1_671_168)
    assert torch.equal(read_loads(DATA / "olmoe_expert_counts.csv"), load)
    assert read_loads(DATA / "eplb_readme_example.json").shape == (2, 12)



def test_a_csv_dump_is_read_once_and_its_parse_and_sum_errors_name_the_file(tmp_path, monkeypatch):
    """``read_load_dump`` reads an OLMoE CSV once for its loads and layer names (it read it twice); a field the csv
    module cannot parse and a layer whose sum overflows float64 are ValueErrors naming the file, from the dump reader
    and the CSV reader alike."""
    import epmoe.loads
    from epmoe.integrations.dumps import read_load_dump

    reads = []
    read_text = epmoe.loads.read_text_file
    monkeypatch.setattr(epmoe.loads, "read_text_file", lambda path, *a: reads.append(path) or read_text(path, *a))
    csv_path = DATA / "olmoe_expert_counts.csv"
    dump = read_load_dump(csv_path)
    assert reads == [csv_path]
    assert dump.load.shape == (15, 64) and dump.names[0] == "arxiv:0" and dump.names[-1] == "wikipedia:15"
    assert torch.equal(dump.load, read_csv_loads(csv_path)[0])
    long_field = tmp_path / "long.csv"
    long_field.write_text("layer,expert,count\n0,0," + "1" * 200_000 + "\n")
    for read in (read_load_dump, read_loads, read_csv_loads):
        with pytest.raises(ValueError) as info:
            read(long_field)
        assert str(info.value) == (f"loads file {str(long_field)!r} could not be read: field larger than field limit "
                                   "(131072)")
    huge = tmp_path / "huge.csv"
    huge.write_text("layer,expert,count\n0,0,1e308\n0,1,1e308\n")
    for read in (read_load_dump, read_loads, read_csv_loads):
        with pytest.raises(ValueError) as info:
            read(huge)
        assert str(info.value) == (f"loads file {str(huge)!r}: load[0] is too large to balance: its entries (up to "
                                   "1e+308) overflow float64 when summed; loads count tokens")

def test_read_bad_files(tmp_path):
    (tmp_path / "neg.json").write_text('{"load": [[1, -3]]}')
    with pytest.raises(ValueError, match=r"neg.json.*load\[0, 1\] = -3.0 is negative"):
        read_loads(tmp_path / "neg.json")
    (tmp_path / "ragged.json").write_text('{"load": [[1, 2], [3]]}')
    with pytest.raises(ValueError, match="equally long"):
        read_loads(tmp_path / "ragged.json")
    with pytest.raises(FileNotFoundError):
        read_loads(tmp_path / "missing.json")
    (tmp_path / "bad.csv").write_text("domain,layer,expert,count\na,0,0,5\na,0,2,1\n")
    with pytest.raises(ValueError, match=r"bad\.csv': layer a:0 has no count for 1 expert\(s\): 1 \(every layer needs "
                                         r"ids 0\.\.2, 2 being the largest id in the file\)$"):
        read_loads(tmp_path / "bad.csv")
    (tmp_path / "neg.csv").write_text("domain,layer,expert,count\na,0,0,5\na,0,-1,1\n")  # was "expected ids 0..0"
    with pytest.raises(ValueError, match=r"neg\.csv' line 3: expert -1 is no expert id \(ids count from 0, at most "
                                         r"1048576 experts a layer\)$"):
        read_loads(tmp_path / "neg.csv")
    (tmp_path / "huge.csv").write_text("domain,layer,expert,count\na,0,100000000,5\n")  # was a 10**8-entry table
    with pytest.raises(ValueError, match=r"huge\.csv' line 2: expert 100000000 is no expert id"):
        read_loads(tmp_path / "huge.csv")


def test_a_csv_layer_missing_experts_names_the_layer_and_the_ids(tmp_path):
    rows = ["domain,layer,expert,count"]
    rows += [f"{d},3,{e},7" for d in ("a", "b", "c") for e in range(20) if d == "a" or e % 2 == 0]
    (tmp_path / "gaps.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError) as info:
        read_loads(tmp_path / "gaps.csv")
    # b:3 and c:3 hold the even ids only: the first one's first 8 missing ids named, then how many in all
    assert str(info.value) == (f"loads file {str(tmp_path / 'gaps.csv')!r}: layer b:3 has no count for 10 expert(s): "
                               "1, 3, 5, 7, 9, 11, 13, 15, ... (every layer needs ids 0..19, 19 being the largest id "
                               "in the file); 1 more layer misses some too")
    rows = ["layer,expert,count", "0,0,1", "0,1,2", "1,0,3"]  # no domain column: the layer alone names it
    (tmp_path / "short.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=r"short\.csv': layer 1 has no count for 1 expert\(s\): 1 \(every layer "
                                         r"needs ids 0\.\.1, 1 being the largest id in the file\)$"):
        read_loads(tmp_path / "short.csv")


NEGATIVE, NOT_FINITE = "is negative; loads count tokens", "is not a finite number"


@pytest.mark.parametrize("count,what", [("-3", NEGATIVE), ("-0.5", NEGATIVE), ("nan", NOT_FINITE), ("inf", NOT_FINITE)])
def test_a_bad_csv_count_names_its_line_layer_expert_and_value(tmp_path, count, what):
    rows = ["domain,layer,expert,count"] + [f"web,{layer},{e},5" for layer in range(2) for e in range(4)]
    rows[7] = f"web,1,2,{count}"  # line 8 of the file
    (tmp_path / "bad.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError) as info:
        read_loads(tmp_path / "bad.csv")
    assert str(info.value) == (f"loads file {str(tmp_path / 'bad.csv')!r} line 8: layer web:1, expert 2: count "
                               f"{count!r} {what}")


def test_a_csv_header_repeating_a_column_is_refused(tmp_path):
    """``layer,layer,expert,count``: the csv module kept the last 'layer' column, the first one's values unread."""
    (tmp_path / "bad.csv").write_text("layer,layer,expert,count\n0,1,0,5\n0,1,1,5\n")
    with pytest.raises(ValueError) as info:
        read_loads(tmp_path / "bad.csv")
    assert str(info.value) == f"loads file {str(tmp_path / 'bad.csv')!r}: the header repeats column(s) ['layer']"


@pytest.mark.parametrize("row,msg", [
    ("web,1,1.5,3", "layer web:1: expert '1.5' is not an integer id"),  # was "invalid literal for int() ..."
    ("web,1,x,3", "layer web:1: expert 'x' is not an integer id"),
    ("web,1,2,", "layer web:1, expert 2: count '' is not a number"),  # was "could not convert string to float: ''"
    ("web,1,2,0x10", "layer web:1, expert 2: count '0x10' is not a number"),
    ("web,1 ,2,3", "layer '1 ' is empty or has spaces around it"),  # was a layer of its own, "web:1 "
    ("web,,2,3", "layer '' is empty or has spaces around it"),  # was a layer of its own, "web:"
    (",,2,3", "layer '' is empty or has spaces around it"),
    (" web,1,2,3", "domain ' web' is empty or has spaces around it"),
    ("web,1, 2,3", "layer web:1: expert ' 2' is not an integer id"),  # int() took these three as 2, 2 and 20
    ("web,1,\u0662,3", "layer web:1: expert '\u0662' is not an integer id"),
    ("web,1,2_0,3", "layer web:1: expert '2_0' is not an integer id"),
    ("web,1,2, 3", "layer web:1, expert 2: count ' 3' is not a number"),  # float() took these as 3 and 30
    ("web,1,2,3_0", "layer web:1, expert 2: count '3_0' is not a number"),
    ("web,1," + "9" * 5000 + ",3", "expert " + "9" * 40 + "... (5000 digits) is no expert id (ids count from 0, at "
                                   "most 1048576 experts a layer)"),  # was echoed whole
    ("web,1," + "x" * 5000 + ",3", "layer web:1: expert " + repr("x" * 40) + " (5000 characters) is not an integer "
                                   "id"),
    ("web,1,2," + "9" * 5000, "layer web:1, expert 2: count " + repr("9" * 40) + " (5000 characters) is not a finite "
                              "number"),
])
def test_a_bad_csv_value_names_its_column_and_value(tmp_path, row, msg):
    rows = ["domain,layer,expert,count"] + [f"web,{layer},{e},5" for layer in range(2) for e in range(4)]
    rows[7] = row  # line 8 of the file
    (tmp_path / "bad.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError) as info:
        read_loads(tmp_path / "bad.csv")
    assert str(info.value) == f"loads file {str(tmp_path / 'bad.csv')!r} line 8: {msg}" + (
        " (a layer is named by its 'domain' and 'layer' values as written)" if "spaces" in msg else "")


@pytest.mark.parametrize(
    "text,msg",
    [
        # DeepSeek's key ``weight``: messages name it, not ``load``
        ('{"weight": [[1, 2], [3]]}', "field 'weight' must be a list of equally long per-layer lists"),
        ('{"weight": [[1, -3]]}', r"weight[0, 1] = -3.0 is negative"),
        ('[[1, 2], [3, 4]]', "expected a JSON object with field 'load' (or 'weight'), got a JSON list"),
        ('{"loads": [[1]]}', "field 'load' (or 'weight') is missing; the object has ['loads']"),
        # was "is missing; the object has ['load', 'weight']"
        ('{"load": null, "weight": [[3, 4]]}', "field 'load' is null; it must be a list of per-layer lists of counts"),
        ('{"load": [["1", 2]]}', "field 'load' [layer 0, expert 0] = '1': loads must be numbers"),
        ('{"weight": [[1, true]]}', "field 'weight' [layer 0, expert 1] = True: loads must be numbers"),
    ],
)
def test_bad_json_loads_name_the_key(tmp_path, text, msg):
    (tmp_path / "l.json").write_text(text)
    with pytest.raises(ValueError) as info:
        read_loads(tmp_path / "l.json")
    assert msg in str(info.value) and "l.json" in str(info.value)


def test_directory_is_not_a_loads_file(tmp_path):
    with pytest.raises(ValueError, match=r"loads file '.*' is a directory, not a file"):
        read_loads(tmp_path)


def test_a_device_a_short_csv_row_and_booleans_are_refused(tmp_path):
    """``/dev/zero`` as the loads file was read until memory ran out (balance killed); a CSV row short of its
    ``count`` said "float() argument must be ... not 'NoneType'"; a boolean safetensors table was balanced as 1s
    and 0s (JSON's true is refused)."""
    from safetensors.torch import save_file

    from epmoe.integrations.dumps import read_load_dump

    with pytest.raises(ValueError, match=r"^loads file '/dev/zero' is not a regular file$"):
        read_load_dump("/dev/zero")
    short = tmp_path / "s.csv"
    short.write_text("hf_model,domain,layer,expert,count\n\nm,d,0,0,5\n\nm,d,0,1\n")  # blank lines count
    with pytest.raises(ValueError, match=r"s\.csv' line 5: no 'count' value \(the header has 5 columns\)$"):
        read_loads(short)
    short.write_text("\ufefflayer,expert,count\n0,0,5\n0,1,2,9\n")  # a byte-order mark is read past
    with pytest.raises(ValueError, match=r"s\.csv' line 3: more values than the header has columns \(the header "
                                         r"has 3 columns\)$"):
        read_loads(short)
    pipe = tmp_path / "f.pt"
    os.mkfifo(pipe)  # torch.load blocked on it
    with pytest.raises(ValueError, match=r"^loads file '.*f\.pt' is not a regular file$"):
        read_load_dump(pipe)
    (tmp_path / "trt").mkdir()
    os.symlink("/dev/zero", tmp_path / "trt" / "meta_info.json")  # was read until memory ran out
    with pytest.raises(ValueError, match=r"meta_info\.json' is not a regular file$"):
        read_load_dump(tmp_path / "trt", fmt="trtllm")
    st = tmp_path / "b.safetensors"
    save_file({"load": torch.tensor([[True, False]])}, str(st))
    with pytest.raises(ValueError, match=r"load must hold numbers \(tokens per expert\), got booleans"):
        read_loads(st)


def test_an_integer_past_float64_is_named(tmp_path):  # was "could not be read: int too large to convert to float"
    path = tmp_path / "l.json"
    path.write_text('{"load": [[1' + "0" * 400 + ', 2], [3, 4]]}')
    with pytest.raises(ValueError, match=r"^loads file '.*l\.json': field 'load' \[layer 0, expert 0\] is an integer "
                                         r"of 1329 bits, past a float64's range; loads count tokens$"):
        read_loads(path)
    # another format's file, or both keys (which one was read depended on the reader): were taken
    path.write_text('{"format": "bogus", "load": [[1, 2]]}')
    with pytest.raises(ValueError, match=r"field 'format' is \"bogus\"; this reader knows \"epmoe\.loads/1\"$"):
        read_loads(path)
    path.write_text('{"load": [[1, 2]], "weight": [[3, 4]]}')
    with pytest.raises(ValueError, match=r"fields 'load' and 'weight' are both given; a loads file holds one of them$"):
        read_loads(path)
    for doc in ('{"load": [[1, 2]]}', '{"format": null, "load": [[1, 2]]}'):  # no format given: read as epmoe's
        path.write_text(doc)
        assert read_loads(path).tolist() == [[1.0, 2.0]]


def test_load_file_errors_name_the_file_once(tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError) as info:
        read_loads(bad)
    assert str(info.value).count(str(bad)) == 1 and "missing column(s)" in str(info.value)
    st = tmp_path / "l.safetensors"
    save_file({"w": torch.ones(2, 4)}, str(st))
    with pytest.raises(ValueError, match=r"tensor 'load' is missing; the file holds \['w'\]"):
        read_loads(st)


def test_loads_of_another_model_are_named_without_a_field_the_file_lacks(tmp_path, capsys):
    """DeepSeek's README example keeps its loads under 'weight'; the mismatch with a config named a field 'load' the
    file does not have."""
    from epmoe.cli import main

    loads = DATA / "eplb_readme_example.json"
    assert main(["balance", "--loads", str(loads), "--ep", "8", "--redundant", "4", "--config",
                 str(DATA.parent / "configs" / "deepseek-v3.config.json"), "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "the loads cover 2 MoE layers x 12 experts, but config" in err and "'load'" not in err, err
    assert not (tmp_path / "p.json").exists()
