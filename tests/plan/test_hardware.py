"""Hardware profiles: every numeric field finite and in range, unknown keys refused, good profiles load."""

from __future__ import annotations

import json
import math
from importlib import resources

import pytest

from epmoe.cli import main
from epmoe.plan.hardware import hardware_names, load_hardware, parse_hardware


def _doc(name: str = "h200-sxm") -> dict:
    return json.loads(resources.files("epmoe.plan.hardware").joinpath(f"{name}.json").read_text())


def _set(doc: dict, field: str, value) -> None:
    *parents, last = field.split(".")
    for p in parents:
        doc = doc[p]
    doc[last] = value


def _write(tmp_path, doc: dict, name: str = "p.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(doc))  # json writes NaN / Infinity / -Infinity, which json.loads accepts
    return str(path)


POSITIVE = ["memory_bytes", "hbm_bytes_per_s", "matmul_flops_per_s.bf16", "matmul_flops_per_s.fp8",
            "links.intra_node.all_reduce_busbw_bytes_per_s", "links.intra_node.all_to_all_busbw_bytes_per_s",
            "links.inter_node.all_reduce_busbw_bytes_per_s", "links.inter_node.all_to_all_busbw_bytes_per_s"]
NON_NEGATIVE = ["moe_layer_fixed_us", "dispatch_layout_fixed_us", "links.intra_node.all_reduce_latency_us",
                "links.intra_node.all_to_all_latency_us",
                "links.inter_node.all_reduce_latency_us", "links.inter_node.all_to_all_latency_us"]


@pytest.mark.parametrize("field", POSITIVE + NON_NEGATIVE)
@pytest.mark.parametrize("value,shown", [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf"), (-1.0, "-1.0"),
                                         (True, "True"), ("5", "'5'"), (None, "None")])
def test_bad_number_refused_naming_file_field_and_value(tmp_path, field, value, shown):
    doc = _doc()
    _set(doc, field, value)
    path = _write(tmp_path, doc)
    bound = "> 0" if field in POSITIVE else ">= 0"
    with pytest.raises(ValueError) as exc:
        load_hardware(path)
    msg = str(exc.value)
    assert msg == f"{path}: field {field!r} must be a finite number {bound}, got {shown}"
    assert "\n" not in msg


@pytest.mark.parametrize("field", POSITIVE)
def test_zero_refused_where_positive_needed(field):
    doc = _doc()
    _set(doc, field, 0)
    with pytest.raises(ValueError, match=rf"bad\.json: field '{field}' must be a finite number > 0, got 0$"):
        parse_hardware(doc, "bad.json")


@pytest.mark.parametrize("field", NON_NEGATIVE)
def test_zero_accepted_for_latencies_and_fixed_cost(field):
    doc = _doc()
    _set(doc, field, 0)
    parse_hardware(doc, "ok.json")


def test_memory_bytes_nan_names_the_field():
    doc = _doc()
    doc["memory_bytes"] = math.nan
    with pytest.raises(ValueError, match=r"^x\.json: field 'memory_bytes' must be a finite number > 0, got nan$"):
        parse_hardware(doc, "x.json")


@pytest.mark.parametrize("field", ["hbm_bytes_per_s", "links.intra_node.all_to_all_latency_us", "memory_bytes"])
def test_missing_number_named(field):
    doc = _doc()
    *parents, last = field.split(".")
    d = doc
    for p in parents:
        d = d[p]
    del d[last]
    with pytest.raises(ValueError, match=rf"^x\.json: field '{field}' is missing$"):
        parse_hardware(doc, "x.json")


def test_moe_layer_fixed_us_absent_means_0():
    doc = _doc()
    del doc["moe_layer_fixed_us"]
    assert parse_hardware(doc).moe_layer_fixed_us == 0.0


@pytest.mark.parametrize("value", [math.inf, math.nan, -math.inf])
def test_overlap_not_finite_refused(value):
    doc = _doc()
    doc["moe_stream_matrix_overlap"] = value
    with pytest.raises(ValueError, match=r"field 'moe_stream_matrix_overlap' must be a number in \[0, 1\]"):
        parse_hardware(doc, "x.json")


@pytest.mark.parametrize("value", [0, -8, 8.0, math.nan, True, "8"])
def test_gpus_per_node_must_be_a_positive_integer(value):
    doc = _doc()
    doc["gpus_per_node"] = value
    with pytest.raises(ValueError, match=r"^x\.json: field 'gpus_per_node' must be a positive integer, got "
                                         rf"{value!r}$"):
        parse_hardware(doc, "x.json")


@pytest.mark.parametrize(
    "field,known",
    [
        ("moe_stream_matrix_overlaps", "format, name, description"),
        ("links.intra_node.all_reduce_latency", "kind, all_reduce_latency_us, all_reduce_busbw_bytes_per_s"),
        ("links.inter_node.kinds", "kind, all_reduce_latency_us"),
        ("links.inter-node", "intra_node, inter_node"),
        ("matmul_flops_per_s.fp16", "bf16, fp8"),
    ],
)
def test_unknown_key_refused_naming_it_and_the_known_ones(tmp_path, field, known):
    doc = _doc()
    _set(doc, field, 1.0)
    path = _write(tmp_path, doc)
    with pytest.raises(ValueError) as exc:
        load_hardware(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}: unknown field {field!r}") and known in msg and "\n" not in msg


def test_unknown_key_suggests_the_close_one():
    doc = _doc()
    doc["moe_stream_matrix_overlaps"] = 0.5
    with pytest.raises(ValueError, match=r"unknown field 'moe_stream_matrix_overlaps' \(did you mean "
                                         r"'moe_stream_matrix_overlap'\?\); known fields: format, "):
        parse_hardware(doc, "x.json")


@pytest.mark.parametrize("value", [["a"], "text", {"memory_bytes": 1}])
def test_sources_must_be_an_object_of_strings(value):
    doc = _doc()
    doc["sources"] = value
    with pytest.raises(ValueError, match=r"^x\.json: field 'sources' must be an object of strings"):
        parse_hardware(doc, "x.json")


def test_free_form_sources_and_optional_fields_still_load():
    doc = _doc()
    doc["sources"] = {"anything at all": "text", "links.intra_node": "nccl-tests"}
    doc["measurements"] = [{"bytes": 8, "all_reduce_ms": 0.1, "all_to_all_ms": 0.2}]
    del doc["links"]["inter_node"]
    del doc["matmul_flops_per_s"]["fp8"]
    hw = parse_hardware(doc, "x.json")
    assert hw.sources["anything at "
                      "all"] == "text" and hw.inter_node is None and hw.flops_per_s("fp8") == hw.flops_per_s("bf16")


@pytest.mark.parametrize("name", hardware_names())
def test_shipped_profiles_load(name, tmp_path):
    hw = load_hardware(name)
    assert hw.name == name and hw.memory_bytes > 0 and math.isfinite(hw.hbm_bytes_per_s)
    # and the same document from a path
    assert load_hardware(_write(tmp_path, _doc(name), f"{name}.json")).name == name


def test_plan_and_doctor_report_a_bad_profile(tmp_path, capsys):
    from ..conftest import CONFIGS

    doc = _doc()
    doc["hbm_bytes_per_s"] = math.inf
    path = _write(tmp_path, doc)
    want = f"{path}: field 'hbm_bytes_per_s' must be a finite number > 0, got inf"
    cfg = str(CONFIGS / "olmoe-1b-7b-0924.config.json")
    assert main(["plan", "--config", cfg, "--gpus", "8", "--hardware", path]) == 2
    err = capsys.readouterr().err
    assert want in err and err.count("\n") == 1 and "Traceback" not in err
    assert main(["doctor", "--config", cfg, "--hardware", path]) == 2  # a bad argument, as plan: before any check
    out = capsys.readouterr()
    assert want in out.err and out.out == "" and "Traceback" not in out.err


def test_a_profile_path_that_is_no_text_file_is_named(tmp_path, capsys, monkeypatch):
    """Random bytes as --hardware gave "'utf-8' codec can't decode byte ..." naming neither the flag nor the file;
    a directory was "not known"."""
    from ..conftest import CONFIGS

    cfg = str(CONFIGS / "olmoe-1b-7b-0924.config.json")
    binary = tmp_path / "bin.json"
    binary.write_bytes(b"{\x9d\xff}")
    for path, want in ((binary, f"hardware profile file '{binary}' is not UTF-8 text (byte 0x9d at position 1)"),
                       (tmp_path, f"hardware profile file '{tmp_path}' is a directory, not a file")):
        assert main(["plan", "--config", cfg, "--gpus", "8", "--hardware", str(path)]) == 2
        err = capsys.readouterr().err
        assert want in err and "Traceback" not in err
    # a directory named as a shipped profile does not hide it (only a file or a .json path is read as a profile)
    (tmp_path / "h200-sxm").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--config", cfg, "--gpus", "8", "--hardware", "h200-sxm"]) == 0


def test_doctor_names_every_missing_field_of_an_incomplete_profile(tmp_path, capsys):
    """An incomplete --hardware profile is a bad argument for doctor as for plan: exit 2, before any check, naming
    every field it lacks (doctor exited 1 with the first one as a finding)."""
    from ..conftest import CONFIGS

    doc = _doc()
    del doc["gpus_per_node"], doc["links"], doc["matmul_flops_per_s"]["bf16"]
    path = _write(tmp_path, doc)
    cfg = str(CONFIGS / "qwen3-30b-a3b.config.json")
    for cmd in (["doctor", "--config", cfg], ["plan", "--config", cfg, "--gpus", "8"]):
        assert main([*cmd, "--hardware", path]) == 2
        out = capsys.readouterr()
        assert out.out == ""
        assert out.err == (f"epmoe {cmd[0]}: error: {path}: fields 'gpus_per_node', 'links', "
                           f"'matmul_flops_per_s.bf16' are missing (an incomplete profile)\n")
    doc = _doc()
    del doc["links"]["intra_node"]["all_to_all_latency_us"], doc["links"]["inter_node"]["all_reduce_latency_us"]
    with pytest.raises(ValueError, match=r"^x\.json: fields 'links\.intra_node\.all_to_all_latency_us', "
                                         r"'links\.inter_node\.all_reduce_latency_us' are missing"):
        parse_hardware(doc, "x.json")


@pytest.mark.parametrize("curve,item", [
    ([[8, 0.01], [8, 0.02]], "item 1"),          # bytes not increasing
    ([[8, -0.01]], "item 0"),                    # negative time
    ([[0, 0.01]], "item 0"),                     # zero bytes
    ([[8, 0.01, 3]], "item 0"),                  # not a pair
    ([[8, math.nan]], "item 0"),                 # not finite
    ([[8, True]], "item 0"),                     # a bool is not a number
    ([[8, 0.02], [16, 0.01]], "item 1"),         # a larger message faster than a smaller one
    ([[8, 0.01], [10**400, 0.02]], "item 1"),    # an integer too large for a float
])
def test_bad_measured_curve_refused_naming_field_and_item(tmp_path, curve, item):
    doc = _doc()
    doc["links"]["intra_node"]["all_to_all_ms_by_bytes"] = curve
    with pytest.raises(ValueError, match=rf"links\.intra_node\.all_to_all_ms_by_bytes' {item}"):
        load_hardware(_write(tmp_path, doc))
    doc["links"]["intra_node"]["all_to_all_ms_by_bytes"] = "fast"
    with pytest.raises(ValueError, match="must be a list of \\[bytes, ms\\] pairs, got 'fast'"):
        load_hardware(_write(tmp_path, doc))


def test_measured_curve_loads_as_pairs(tmp_path):
    doc = _doc()
    doc["links"]["intra_node"]["all_reduce_ms_by_bytes"] = [[8, 0.009], [1024, 0.0095]]
    hw = load_hardware(_write(tmp_path, doc))
    assert hw.intra_node.all_reduce_ms_by_bytes == ((8.0, 0.009), (1024.0, 0.0095))
    assert hw.intra_node.all_to_all_ms_by_bytes == () and hw.dispatch_layout_fixed_us == 3.5
