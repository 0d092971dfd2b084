"""Load dumps and placement files of SGLang and TensorRT-LLM, written the way those servers write them (torch.save,
JSON, safetensors, YAML, following sglang 0.5.23 and TensorRT-LLM's expert statistic / load-balancer code), read,
balanced and written back; bad input refused with the file and field named and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from epmoe.balance import balance_deepseek, balancedness
from epmoe.cli import LOAD_FORMAT_CHOICES, main
from epmoe.integrations import (
    LOAD_FORMATS,
    LayeredPlacement,
    load_placement_as,
    read_load_dump,
    save_placement_as,
)
from epmoe.placement import ExpertPlacement
from epmoe.spec import load_moe_spec

CONFIGS = Path(__file__).resolve().parents[2] / "data" / "configs"
V3 = CONFIGS / "deepseek-v3.config.json"
R1 = CONFIGS / "deepseek-r1.config.json"


def _yaml_load(text: str):
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _sglang_stat(path: Path, layers: int = 61, experts: int = 256, dense: int = 3, seed: int = 0) -> torch.Tensor:
    """An SGLang ``stat`` dump as ``_StatAccumulator.dump`` writes it: ``logical_count`` int32 [B, L_all, E]."""
    g = torch.Generator().manual_seed(seed)
    count = torch.randint(0, 500, (3, layers, experts), generator=g, dtype=torch.int32)
    count[:, :dense] = 0
    torch.save({"rank": 0, "logical_count": count, "average_utilization_rate_over_window": None}, str(path))
    return count


def test_sglang_stat_dump_of_deepseek_v3_balanced_and_exported(tmp_path):
    dump = tmp_path / "expert_distribution_recorder_1764590000.123.pt"
    count = _sglang_stat(dump)
    out = tmp_path / "init_expert_location.pt"
    assert main(["balance", "--loads", str(dump), "--config", str(V3), "--ep", "8", "--redundant", "32",
                 "--out", str(out)]) == 0
    doc = torch.load(str(out), weights_only=True)
    assert list(doc) == ["physical_to_logical_map"]  # SGLang passes every key to init_by_mapping
    full = doc["physical_to_logical_map"]
    assert full.dtype == torch.int64 and full.shape == (61, 288)
    assert torch.equal(full[:3], (torch.arange(288) % 256).expand(3, -1))  # dense rows trivial
    moe_load = count.sum(0)[3:].double()
    placement = ExpertPlacement.from_phy2log(full[3:], ep_size=8, num_experts=256)
    assert balancedness(moe_load, placement) >= balancedness(moe_load, balance_deepseek(moe_load, 8, 32))
    assert balancedness(moe_load, placement) > 0.99
    # read back (with the config: MoE rows only), and as JSON too
    back = load_placement_as(out, ep_size=8, spec=load_moe_spec(V3))
    assert back.placement == placement and back.layers == tuple(range(3, 61)) and back.num_decoder_layers == 61
    as_json = tmp_path / "init_expert_location.json"
    save_placement_as(back, as_json, "sglang")
    assert json.loads(as_json.read_text()) == {"physical_to_logical_map": full.tolist()}


def test_sglang_stat_json_and_without_config_the_counted_rows_are_kept(tmp_path):
    dump = tmp_path / "dump.json"
    count = torch.zeros(4, 8, dtype=torch.int64)
    count[1:] = torch.arange(1, 25).reshape(3, 8)
    dump.write_text(json.dumps({"logical_count": count.tolist()}))
    d = read_load_dump(dump)
    assert d.format == "sglang-stat" and d.layers == (1, 2, 3) and d.num_decoder_layers == 4
    assert torch.equal(d.load, count[1:].double())


def test_sglang_stat_negative_count_is_refused_not_its_layer_dropped(tmp_path):
    """A negative count in a row summing to zero or less dropped that layer from the balance (exit 0); counts near
    2**62 overflowed the row sums into "counts no token on any layer"."""
    dump = tmp_path / "dump.pt"
    torch.save({"logical_count": torch.tensor([[[1, -2], [3, 4], [5, 6]]], dtype=torch.int32)}, dump)
    with pytest.raises(ValueError, match=r"^loads '.*dump\.pt': logical_count\[0, 1\] = -2\.0 is negative; loads "
                                         r"count tokens$"):
        read_load_dump(dump)
    torch.save({"logical_count": torch.tensor([[[2**62, 2**62], [0, 0], [5, 6]]], dtype=torch.int64)}, dump)
    d = read_load_dump(dump)
    assert d.layers == (0, 2) and d.load.tolist() == [[2.0**62, 2.0**62], [5.0, 6.0]]
    # two batches of [B, L, E] summed: in int64 they wrapped to a "negative" count the file does not hold
    torch.save({"logical_count": torch.tensor([[[2**62, 1], [3, 4]], [[2**62, 1], [3, 4]]], dtype=torch.int64)}, dump)
    assert read_load_dump(dump).load.tolist() == [[2.0**63, 2.0], [6.0, 8.0]]


def test_sglang_per_pass_rank_files_mapped_back_through_their_map(tmp_path):
    phy2log = torch.tensor([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 3]])  # 2 layers, 4 experts, 6 slots
    expected = torch.zeros(2, 4, dtype=torch.float64)
    for rank in range(2):
        records = []
        for step in range(3):
            c = torch.arange(12, dtype=torch.int64).reshape(2, 6) * (rank + 1) + step
            records.append({"forward_pass_id": step, "rank": rank, "gatherer_key": "primary",
                            "global_physical_count": c})
            expected.scatter_add_(1, phy2log, c.double())
        torch.save({"records": records, "last_physical_to_logical_map": phy2log},
                   str(tmp_path / f"expert_distribution_recorder_17645.5_{rank}.pt"))
    d = read_load_dump(tmp_path)
    assert d.format == "sglang-per-pass" and torch.equal(d.load, expected) and d.layers == (0, 1)


def _trtllm_statistic(folder: Path, layers: range, experts: int, iters: range, ranks: int = 2) -> torch.Tensor:
    """TensorRT-LLM's ``ExpertStatistic`` output: meta_info.json and rank{r}.safetensors of int64 [E] bincounts."""
    folder.mkdir()
    (folder / "meta_info.json").write_text(json.dumps({"num_experts": experts, "num_experts_per_token": 8}))
    total = {}
    for r in range(ranks):
        g = torch.Generator().manual_seed(r)
        rec = {f"{i}_{layer}": torch.randint(0, 50, (experts,), generator=g, dtype=torch.int64)
               for i in iters for layer in layers}
        save_file(rec, str(folder / f"rank{r}.safetensors"))
        for k, v in rec.items():
            total[k] = total.get(k, 0) + v
    return total


def test_trtllm_statistic_of_deepseek_r1_to_yaml_and_back(tmp_path):
    stats = tmp_path / "expert_statistic"
    total = _trtllm_statistic(stats, range(3, 61), 256, range(100, 104))
    d = read_load_dump(stats, iters=(101, 103), spec=load_moe_spec(R1))
    assert d.format == "trtllm" and d.layers == tuple(range(3, 61))
    assert torch.equal(d.load[0], (total["101_3"] + total["102_3"]).double())
    out = tmp_path / "moe_load_balancer.yaml"
    assert main(["balance", "--loads", str(stats), "--iters", "101-103", "--config", str(R1), "--ep", "8",
                 "--redundant", "32", "--out", str(out)]) == 0
    doc = _yaml_load(out.read_text())
    assert doc["num_slots"] == 288 and doc["layer_updates_per_iter"] == 0
    assert sorted(doc["initial_global_assignments"]) == list(range(3, 61))
    assert all(sorted(set(r)) == list(range(256)) and len(r) == 288 for r in doc["initial_global_assignments"].values())
    back = load_placement_as(out, ep_size=8, spec=load_moe_spec(R1))
    assert back.layers == tuple(range(3, 61)) and back.placement.num_slots == 288
    assert balancedness(d.load, back.placement) >= balancedness(d.load, balance_deepseek(d.load, 8, 32))


def test_round_trips_between_the_three_formats(tmp_path):
    spec = load_moe_spec(V3)
    p = ExpertPlacement.trivial(58, 256, 8, 32, layout="round_robin")
    lp = LayeredPlacement(p, spec.moe_layers, 61, "epmoe")
    for name in ("p.json", "p.safetensors", "s.json", "s.pt", "t.yaml"):
        fmt = "sglang" if name.startswith("s") else "trtllm" if name.startswith("t") else "epmoe"
        save_placement_as(lp, tmp_path / name, fmt)
        back = load_placement_as(tmp_path / name, ep_size=8, spec=spec)
        assert back.placement == p and back.layers == spec.moe_layers and back.format == fmt


def test_movement_aware_rebalance_of_a_running_sglang_placement(tmp_path):
    lite = CONFIGS / "deepseek-v2-lite.config.json"  # 27 decoder layers, the first dense, 64 experts
    dump = tmp_path / "dump.pt"
    _sglang_stat(dump, layers=27, experts=64, dense=1, seed=1)
    first, second = tmp_path / "first.pt", tmp_path / "second.json"
    base = ["--config", str(lite), "--ep", "8", "--redundant", "8"]
    assert main(["balance", "--loads", str(dump), *base, "--out", str(first)]) == 0
    _sglang_stat(dump, layers=27, experts=64, dense=1, seed=2)
    assert main(["balance", "--loads", str(dump), *base, "--from", str(first), "--max-moves", "60",
                 "--out", str(second), "--out-format", "sglang", "--json"]) == 0
    a = load_placement_as(first, ep_size=8, spec=load_moe_spec(lite)).placement
    b = load_placement_as(second, ep_size=8, spec=load_moe_spec(lite)).placement
    assert 0 < int((a.phy2log != b.phy2log).sum()) <= 60


def test_bad_input_names_file_and_field_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out.pt"
    qwen = CONFIGS / "qwen3-30b-a3b.config.json"
    dump = tmp_path / "dump.pt"
    _sglang_stat(dump)

    def refused(*args: str) -> str:
        assert main(["balance", *args, "--ep", "8", "--out", str(out)]) == 2
        assert not out.exists() and not list(tmp_path.glob(".out*"))
        return capsys.readouterr().err

    err = refused("--loads", str(dump), "--config", str(qwen))
    assert f"loads {str(dump)!r}: field 'logical_count' covers 61 decoder layers x 256 experts" in err
    assert "48 decoder layers x 128 experts (a dump of another model?)" in err

    wrong_dense = tmp_path / "wrong_dense.pt"
    count = torch.ones(61, 256, dtype=torch.int32)
    torch.save({"logical_count": count}, str(wrong_dense))
    assert "field 'logical_count' counts tokens on decoder layer 0, which config" in refused(
        "--loads", str(wrong_dense), "--config", str(V3))

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(dump.read_bytes()[:2000])
    err = refused("--loads", str(truncated), "--config", str(V3))
    assert f"loads file {str(truncated)!r} could not be read by torch.load with weights_only=True (truncated" in err

    stats = tmp_path / "stats"
    _trtllm_statistic(stats, range(3, 61), 256, range(0, 2))
    yaml_path = tmp_path / "lb.yaml"
    p = ExpertPlacement.trivial(58, 256, 8, 0)
    save_placement_as(LayeredPlacement(p, tuple(range(3, 61)), None, "trtllm"), yaml_path)
    doc = _yaml_load(yaml_path.read_text())
    del doc["initial_global_assignments"][17]
    yaml_path.write_text(yaml.dump(doc, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper)))
    err = refused("--loads", str(stats), "--config", str(R1), "--from", str(yaml_path))
    assert f"placement file {str(yaml_path)!r}: field 'initial_global_assignments' has no layer 17" in err

    rejected = tmp_path / "rejected.json"  # SGLang would stop with a TypeError on the extra key
    full = (torch.arange(256) % 256).expand(61, -1)
    rejected.write_text(json.dumps({"physical_to_logical_map": full.tolist(), "ep_size": 8}))
    err = refused("--loads", str(dump), "--config", str(V3), "--from", str(rejected))
    assert f"placement file {str(rejected)!r}: field 'ep_size' is not accepted by SGLang's --init-expert" in err

    short = tmp_path / "short.json"  # a map without the dense rows: SGLang needs every decoder layer
    short.write_text(json.dumps({"physical_to_logical_map": full[3:].tolist()}))
    err = refused("--loads", str(dump), "--config", str(V3), "--from", str(short))
    assert "field 'physical_to_logical_map' has 58 rows, but config" in err and "61 decoder layers" in err

    epmoe_loads = tmp_path / "loads.json"
    epmoe_loads.write_text(json.dumps({"load": [[1, 2, 3, 4]] * 2}))
    assert main(["balance", "--loads", str(epmoe_loads), "--ep", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "SGLang's physical_to_logical_map covers every decoder layer" in err and "pass --config" in err


def test_load_format_choices_match_the_readers():
    assert LOAD_FORMAT_CHOICES == LOAD_FORMATS
    with pytest.raises(ValueError, match="iters applies to TensorRT-LLM statistic folders"):
        read_load_dump(Path(__file__).resolve().parents[2] / "data" / "loads" / "eplb_readme_example.json",
                       iters=(0, 1))


def test_doctor_reads_the_three_formats(tmp_path, capsys):
    spec = load_moe_spec(V3)
    lp = LayeredPlacement(ExpertPlacement.trivial(58, 256, 8, 32), spec.moe_layers, 61, "epmoe")
    for name in ("p.json", "s.pt", "t.yaml"):
        save_placement_as(lp, tmp_path / name)
        assert main(["doctor", "--config", str(V3), "--placement", str(tmp_path / name), "--ep", "8"]) == 0
        assert f"placement {name} covers all 58 MoE layers (288 slots, 32 redundant)" in capsys.readouterr().out
    doc = _yaml_load((tmp_path / "t.yaml").read_text())
    doc["initial_global_assignments"][30] = doc["initial_global_assignments"][30][:-1]
    (tmp_path / "t.yaml").write_text(yaml.dump(doc, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper)))
    assert main(["doctor", "--config", str(V3), "--placement", str(tmp_path / "t.yaml"), "--ep", "8"]) == 1
    assert "field 'initial_global_assignments.30' has 287 entries, but num_slots is 288" in capsys.readouterr().out


@pytest.mark.parametrize("name, fmt", [("p.pt", "sglang"), ("p.json", "sglang"), ("p.yaml", "trtllm")])
def test_the_engine_takes_the_placement_files_doctor_takes(tiny_checkpoints, tmp_path, name, fmt):
    """``epmoe run/serve --placement`` take SGLang's and TensorRT-LLM's files as doctor does (run read every file as
    epmoe's JSON: a .pt failed on its bytes, a .yaml as 'Expecting value', while doctor said 'ok'); their decoder
    layers are cut to the model's MoE layers (the first layer of the Kimi checkpoint is dense)."""
    from epmoe.doctor import check_placement
    from epmoe.engine import EngineConfig
    from epmoe.engine.group import trivial_or_file_placement
    from epmoe.integrations.placements import LayeredPlacement, save_placement_as

    model = str(tiny_checkpoints("kimi-k2.5"))
    spec = load_moe_spec(model)
    assert spec.moe_layers[0] > 0  # a dense layer first: the SGLang map has a row more than the placement
    p = ExpertPlacement.trivial(spec.num_moe_layers, spec.num_experts, 2, 2, "round_robin")
    save_placement_as(LayeredPlacement(p, spec.moe_layers, spec.num_layers, fmt), tmp_path / name, fmt)
    assert check_placement(spec, str(tmp_path / name), 2, "the target model")[1][0].severity == "ok"
    got = trivial_or_file_placement(EngineConfig(model=model, placement=str(tmp_path / name)), spec.num_moe_layers,
                                    spec.num_experts, 2)
    assert torch.equal(got.phy2log, p.phy2log) and got.ep_size == 2 and got.num_redundant == 2
