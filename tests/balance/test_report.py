"""``epmoe balance``: writes the placement and the PNG, reports per layer, writes nothing on bad input."""

import json
import re
from pathlib import Path

import pytest

from epmoe.cli import main
from epmoe.placement import ExpertPlacement

DATA = Path(__file__).resolve().parents[2] / "data" / "loads"
CSV = str(DATA / "olmoe_expert_counts.csv")


def test_balance_writes_placement_and_png(tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    args = ["balance", "--loads", CSV, "--ep", "8", "--redundant", "8", "--out", str(out), "--plot", str(png), "--json"]
    assert main(args) == 0
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
        (["--ep", "7", "--redundant", "8"], "error: num_slots (72 = 64 experts + 8 redundant) must be divisible by "
                                            "--ep (7)\n"),
        # the CLI names the flags the user typed, not the library's field names
        (["--ep", "128"], "error: --ep (128) is larger than the number of slots (64"),
        (["--ep", "8", "--nodes", "2", "--groups", "3"], "num_experts (64) must be divisible by --groups (3)"),
        (["--ep", "8", "--nodes", "4", "--groups", "2"], "--groups (2) must be divisible by --nodes (4)"),
        (["--ep", "8", "--redundant", "-1"], "--redundant must be an integer >= 0, got -1"),
        (["--ep", "8", "--max-moves", "3"], "--max-moves (3) needs --from (the current placement)"),
        # the library's rebalance_with_moves also takes None; the flag cannot be given as None
        (["--ep", "8", "--max-moves", "-1"], "error: --max-moves must be an integer >= 0, got -1\n"),
        # KeyError's str() would add quotes around the whole message
        (["--ep", "8", "--algorithm", "magic"], "error: unknown balancer 'magic'; supported: deepseek, epmoe, exact\n"),
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


EPLB = str(DATA / "eplb_readme_example.json")


def test_bad_plot_path_writes_nothing(tmp_path, capsys):
    out = tmp_path / "ok.json"
    assert main(["balance", "--loads", EPLB, "--ep", "8", "--redundant", "4", "--out", str(out),
                 "--plot", "/nonexistent/x.png"]) == 2
    assert ("epmoe balance: error: --plot ('/nonexistent/x.png') cannot be written: directory '/nonexistent' "
            "does not exist") in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []



def test_a_plot_whose_write_fails_is_named_and_no_file_is_left(tmp_path, capsys, monkeypatch):
    """A figure the up-front check passes but the file system refuses (a full one) fails the command naming
    ``--plot``, the path given (not its temporary name) and the system's reason; the placement staged before it is
    removed too."""
    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    out, png = tmp_path / "ok.json", tmp_path / "x.png"
    assert main(["balance", "--loads", EPLB, "--ep", "8", "--redundant", "4", "--out", str(out),
                 "--plot", str(png)]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"epmoe balance: error: --plot ({str(png)!r}) cannot be written: No space left on "
                        "device\n"), err
    assert list(tmp_path.iterdir()) == []

def test_plot_suffix_matplotlib_cannot_write_is_refused_and_others_picked(tmp_path, capsys):
    from epmoe.plan.plot import plot_formats

    out = tmp_path / "ok.json"
    args = ["balance", "--loads", EPLB, "--ep", "8", "--redundant", "4", "--out", str(out)]
    assert main([*args, "--plot", str(tmp_path / "x.txt")]) == 2
    known = ", ".join(f".{s}" for s in plot_formats())
    assert capsys.readouterr().err.endswith(
        f"epmoe balance: error: --plot ({str(tmp_path / 'x.txt')!r}): matplotlib writes no '.txt' files; "
        f"supported: {known} (no suffix: PNG)\n")
    assert list(tmp_path.iterdir()) == []
    assert main([*args, "--plot", str(tmp_path / "loads.pdf")]) == 0
    assert (tmp_path / "loads.pdf").read_bytes()[:5] == b"%PDF-" and out.exists()
    assert capsys.readouterr().out.endswith(f"plot written to {tmp_path / 'loads.pdf'}\n")


def test_a_csv_missing_experts_or_with_a_negative_count_names_layer_expert_and_value(tmp_path, capsys):
    rows = ["domain,layer,expert,count"] + [f"web,{layer},{e},5" for layer in range(2) for e in range(8)
                                            if (layer, e) not in ((1, 2), (1, 5))]
    csv = tmp_path / "loads.csv"
    csv.write_text("\n".join(rows) + "\n")
    args = ["balance", "--loads", str(csv), "--ep", "2", "--out", str(tmp_path / "p.json")]
    assert main(args) == 2
    assert capsys.readouterr().err.endswith(
        f"epmoe balance: error: loads file {str(csv)!r}: layer web:1 has no count for 2 expert(s): 2, 5 (every layer "
        "needs ids 0..7, 7 being the largest id in the file)\n")
    csv.write_text("\n".join(rows[:12] + ["web,1,2,-3", "web,1,5,1"] + rows[12:]) + "\n")
    assert main(args) == 2
    assert capsys.readouterr().err.endswith(
        f"epmoe balance: error: loads file {str(csv)!r} line 13: layer web:1, expert 2: count '-3' is negative; loads "
        "count tokens\n")
    assert list(tmp_path.iterdir()) == [csv]


def test_an_all_zero_layer_is_balanced_by_both_columns(tmp_path, capsys):
    rows = ["domain,layer,expert,count"]
    rows += [f"web,{layer},{e},{(e + 1) * 10 if layer == 0 else 0}" for layer in range(2) for e in range(4)]
    csv = tmp_path / "loads.csv"
    csv.write_text("\n".join(rows) + "\n")
    assert main(["balance", "--loads", str(csv), "--ep", "2", "--out", str(tmp_path / "p.json"), "--json"]) == 0
    layers = json.loads(capsys.readouterr().out)["rows"]
    # layer 0: ranks carry 10+20 and 30+40 tokens (mean 50, max 70); layer 1: every rank idle
    assert [r["layer"] for r in layers] == ["web:0", "web:1"]
    assert layers[0]["balancedness_before"] == pytest.approx(50 / 70) and layers[0]["max_over_mean_before"] == 1.4
    zero = layers[1]
    assert (zero["balancedness_before"], zero["balancedness_after"]) == (1.0, 1.0)
    assert (zero["max_over_mean_before"], zero["max_over_mean_after"]) == (1.0, 1.0)
    assert main(["balance", "--loads", str(csv), "--ep", "2", "--out", str(tmp_path / "q.json")]) == 0
    table = capsys.readouterr().out
    assert re.search(r"web:1 +│ +1\.0000 +│ +1\.0000 +│ +1\.000 +│ +1\.000 +│ +0 +│", table), table


def test_out_that_is_a_directory_or_in_a_missing_one(tmp_path, capsys):
    somedir = tmp_path / "somedir"
    somedir.mkdir()
    assert main(["balance", "--loads", EPLB, "--ep", "8", "--redundant", "4", "--out", str(somedir)]) == 2
    err = capsys.readouterr().err
    assert f"epmoe balance: error: --out ({str(somedir)!r}) is a directory; expected a placement file path" in err
    assert main(["balance", "--loads", EPLB, "--ep", "8", "--out", ""]) == 2  # was "('') is a directory"
    assert "epmoe balance: error: --out is empty; expected a placement file path" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["somedir"] and list(somedir.iterdir()) == []
    missing = tmp_path / "missing" / "p.json"
    assert main(["balance", "--loads", EPLB, "--ep", "8", "--redundant", "4", "--out", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"--out ({str(missing)!r}) cannot be written: directory {str(missing.parent)!r} does not exist" in err
    assert ".tmp" not in err
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    under = a_file / "p.json"  # was "directory ... does not exist": it exists, as a file
    assert main(["balance", "--loads", EPLB, "--ep", "8", "--out", str(under)]) == 2
    assert (f"epmoe balance: error: --out ({str(under)!r}) cannot be written: {str(a_file)!r} is not a directory"
            in capsys.readouterr().err)
    assert main(["balance", "--loads", "", "--ep", "8", "--out", str(tmp_path / "p.json")]) == 2
    # was "loads folder '.' holds neither TensorRT-LLM's meta_info.json nor SGLang's per-pass .pt files"
    assert capsys.readouterr().err.endswith("epmoe balance: error: --loads is empty; expected a loads file or folder\n")


def test_outputs_written_together_without_temporary_files(tmp_path, capsys):
    out, png = tmp_path / "p.safetensors", tmp_path / "loads.png"
    args = ["balance", "--loads", EPLB, "--ep", "8", "--redundant", "4", "--out", str(out), "--plot", str(png)]
    assert main(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loads.png", "p.safetensors"]
    assert ExpertPlacement.load(out).ep_size == 8 and png.read_bytes()[:4] == b"\x89PNG"
    # files of the user's beside the targets under the names the writes once staged in are left alone
    for name in ("loads.png.tmp", ".p.safetensors.epmoe-partial.safetensors"):
        (tmp_path / name).write_text("mine")
    assert main(args) == 0
    assert all((tmp_path / name).read_text() == "mine" for name in ("loads.png.tmp",
                                                                   ".p.safetensors.epmoe-partial.safetensors"))
    assert len(list(tmp_path.iterdir())) == 4


def test_loads_directory_and_weight_key_messages(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["balance", "--loads", str(tmp_path), "--ep", "2", "--out", str(out)]) == 2
    assert (f"error: loads folder {str(tmp_path)!r} holds neither TensorRT-LLM's meta_info.json nor SGLang's "
            "per-pass .pt files") in capsys.readouterr().err
    bad = tmp_path / "w.json"
    bad.write_text('{"weight": [[1, 2], [3]]}')
    assert main(["balance", "--loads", str(bad), "--ep", "2", "--out", str(out)]) == 2
    assert "field 'weight' must be a list of equally long per-layer lists" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.json"]


def test_out_must_not_overwrite_the_loads(tmp_path, capsys):
    loads = tmp_path / "loads.json"
    loads.write_text((DATA / "eplb_readme_example.json").read_text())
    before = loads.read_bytes()
    assert main(["balance", "--loads", str(loads), "--ep", "8", "--redundant", "4", "--out", str(loads)]) == 2
    assert "--out" in capsys.readouterr().err and loads.read_bytes() == before


def test_absurd_redundant_and_overflowing_loads_are_refused(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["balance", "--loads", str(DATA / "eplb_readme_example.json"), "--ep", "8", "--redundant",
                 "999999996", "--out", str(out)]) == 2
    assert "exceeds 84 (12 experts x 7)" in capsys.readouterr().err and not out.exists()
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"weight": [[1e308, 1e308, 1, 1]]}))
    assert main(["balance", "--loads", str(big), "--ep", "2", "--out", str(out)]) == 2
    assert "overflow float64" in capsys.readouterr().err and not out.exists()


def test_out_suffix_names_the_format(tmp_path, capsys):
    out = tmp_path / "p.txt"
    assert main(["balance", "--loads", str(DATA / "eplb_readme_example.json"), "--ep", "8", "--out", str(out)]) == 2
    assert "must end in .json or .safetensors" in capsys.readouterr().err and not out.exists()
    st = tmp_path / "p.safetensors"
    assert main(["balance", "--loads", str(DATA / "eplb_readme_example.json"), "--ep", "8", "--redundant", "4",
                 "--out", str(st)]) == 0
    assert st.stat().st_mode & 0o777 == 0o644


def test_a_from_placement_with_ep_size_0_names_the_field(tmp_path, capsys):
    bad = tmp_path / "from.json"
    bad.write_text(json.dumps({"phy2log": [[0, 1, 2, 3]], "ep_size": 0}))
    out = tmp_path / "p.json"
    assert main(["balance", "--loads", CSV, "--ep", "8", "--from", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"placement file '{bad}': field 'ep_size' must be a positive integer, got 0\n" in err
    assert "EP size 0" not in err and not out.exists()


def test_an_empty_csv_and_a_csv_under_another_suffix_say_what_is_read(tmp_path, capsys):
    """Loads files are read by their suffix: a CSV named ``.txt`` is read as JSON, and the error says which suffix
    reads what; an empty ``.csv`` is called empty (it was "missing column(s)")."""
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "loads.txt").write_text("layer,expert,count\n0,0,1\n0,1,2\n")
    out = str(tmp_path / "p.json")
    assert main(["balance", "--loads", str(tmp_path / "empty.csv"), "--ep", "2", "--out", out]) == 2
    assert f"loads file {str(tmp_path / 'empty.csv')!r} is empty: the OLMoE CSV has a header" in capsys.readouterr().err
    assert main(["balance", "--loads", str(tmp_path / "loads.txt"), "--ep", "2", "--out", out]) == 2
    err = capsys.readouterr().err
    assert f"loads file {str(tmp_path / 'loads.txt')!r} is not JSON: " in err
    assert "(a loads file is read by its suffix: '.csv' the OLMoE routing CSV" in err
    assert not (tmp_path / "p.json").exists()
