"""``epmoe balance``: writes the placement and the PNG, reports per layer, writes nothing on bad input."""

import json
from pathlib import Path

import pytest

from epmoe.cli import main
from epmoe.placement import ExpertPlacement

DATA = Path(__file__).resolve().parents[1] / "data" / "loads"
CSV = str(DATA / "olmoe_expert_counts.csv")


def test_balance_writes_placement_and_png(tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    assert main(["balance", "--loads", CSV, "--ep", "8", "--redundant", "8", "--out", str(out), "--plot", str(png), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    placement = ExpertPlacement.load(out)
    assert (placement.num_layers, placement.num_slots, placement.ep_size) == (15, 72, 8)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(report["rows"]) == 15 and report["rows"][0]["layer"] == "arxiv:0"
    assert report["balancedness_after"] > 0.999 > report["balancedness_before"]
    # rebalance from it with a budget
    out2 = tmp_path / "p2.safetensors"
    assert main(["balance", "--loads", CSV, "--ep", "8", "--redundant", "8", "--from", str(out), "--max-moves", "5",
                 "--out", str(out2)]) == 0
    assert "mean" in capsys.readouterr().out
    assert ExpertPlacement.load(out2) == placement  # already balanced: nothing to move


def test_deepseek_hierarchical_cli(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["balance", "--loads", str(DATA / "eplb_readme_example.json"), "--ep", "8", "--redundant", "4",
                 "--nodes", "2", "--groups", "4", "--algorithm", "deepseek", "--out", str(out)]) == 0
    golden = json.loads((DATA / "eplb_readme_example.json").read_text())["expected_phy2log_hierarchical"]
    assert ExpertPlacement.load(out).phy2log.tolist() == golden


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--ep", "7", "--redundant", "8"], "num_slots (72 = 64 experts + 8 redundant) must be divisible by the EP group size (7)"),
        (["--ep", "128"], "ep_size (128) is larger than the number of slots (64"),
        (["--ep", "8", "--nodes", "2", "--groups", "3"], "num_experts (64) must be divisible by num_groups (3)"),
        (["--ep", "8", "--nodes", "4", "--groups", "2"], "num_groups (2) must be divisible by num_nodes (4)"),
        (["--ep", "8", "--algorithm", "magic"], "supported: deepseek, epmoe, exact"),
    ],
)
def test_bad_input_writes_nothing(tmp_path, capsys, args, msg):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    assert main(["balance", "--loads", CSV, *args, "--out", str(out), "--plot", str(png)]) == 2
    assert msg in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bad_loads_file_writes_nothing(tmp_path, capsys):
    bad = tmp_path / "in" / "neg.json"
    bad.parent.mkdir()
    bad.write_text('{"load": [[1, 2, float], [1, 2, 3]]}'.replace("float", "-1"))
    out = tmp_path / "p.json"
    assert main(["balance", "--loads", str(bad), "--ep", "3", "--out", str(out)]) == 2
    assert "load[0, 2] = -1.0 is negative" in capsys.readouterr().err
    assert not out.exists()
    bad.write_text('{"load": [[1, NaN, 2]]}')
    assert main(["balance", "--loads", str(bad), "--ep", "3", "--out", str(out)]) == 2
    assert "is not a finite number" in capsys.readouterr().err
    assert not out.exists()
