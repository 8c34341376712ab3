"""The pure protocol rules (PROTOCOL §2–3): names, part tiling, meta.json, response checks."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hsx_async.errors import ConfigError, DumpError, HsxRequestError
from hsx_async.protocol import (
    CUSTOM_PARAM_NS,
    FP8,
    NS_PATTERN,
    PER_TOKEN_SLOT_OUTLIERS16,
    RID_PATTERN,
    DumpMeta,
    SectionCheck,
    Storage,
    check_aux_layers,
    check_hsx_request,
    check_meta,
    check_part_sizes,
    check_response,
    check_tiling,
    check_unit,
    generate_body,
    marked_ns,
    num_layers,
    parse_aux_layers,
    parse_meta,
    parse_part_name,
    part_name,
    request_dir,
    row_bytes,
    section_check,
    shown,
    valid_ns,
    valid_rid,
)

FAST = settings(max_examples=120, deadline=None)
_SAFE_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _meta(**changes: Any) -> DumpMeta:
    fields: dict[str, Any] = {
        "rid": "r1",
        "num_tokens": 10,
        "hidden_size": 8,
        "aux_layers": (2, 5),
        "parts": ((0, 4), (4, 10)),
        "model": "m",
        "server": "fake",
    }
    fields.update(changes)
    return DumpMeta(**fields)


def _meta_json(**changes: Any) -> bytes:
    raw: dict[str, Any] = orjson.loads(_meta().to_json())
    raw.update(changes)
    return orjson.dumps(raw)


# --- names ------------------------------------------------------------------------------


@pytest.mark.parametrize("ns", ["a", "hsx-w0", "A.b_c-9", "x" * 64])
def test_valid_ns_accepts(ns: str) -> None:
    assert valid_ns(ns)


@pytest.mark.parametrize(
    "ns", ["", ".", "..", ".hidden", "-a", "_a", "a/b", "a\n", "a b", "x" * 65, "é", "a\x00"]
)
def test_valid_ns_rejects(ns: str) -> None:
    assert not valid_ns(ns)


@pytest.mark.parametrize("value", [None, 5, b"abc", ["a"]])
def test_valid_names_reject_non_strings(value: object) -> None:
    assert not valid_ns(value)
    assert not valid_rid(value)


def test_rid_length_limit() -> None:
    assert valid_rid("r" * 128)
    assert not valid_rid("r" * 129)
    assert not valid_rid("abc\n")  # '$' alone would let a trailing newline through


@FAST
@given(st.from_regex(RID_PATTERN, fullmatch=True))
def test_every_pattern_match_is_a_valid_rid(rid: str) -> None:
    assert valid_rid(rid)
    assert valid_ns(rid) == (len(rid) <= 64)


@FAST
@given(st.text(max_size=140))
def test_valid_names_never_leave_the_root(text: str) -> None:
    for ok, limit in ((valid_ns(text), 64), (valid_rid(text), 128)):
        if ok:
            assert set(text) <= _SAFE_CHARS
            assert 1 <= len(text) <= limit
            assert text[0] not in "._-"


def test_request_dir_joins_valid_names(tmp_path: Path) -> None:
    assert request_dir(tmp_path, "ns", "rid-1") == tmp_path / "ns" / "rid-1"


@pytest.mark.parametrize(("ns", "rid", "named"), [("../x", "r", "namespace"), ("ns", "a/b", "rid")])
def test_request_dir_refuses_escaping_names(tmp_path: Path, ns: str, rid: str, named: str) -> None:
    with pytest.raises(DumpError, match=named) as info:
        request_dir(tmp_path, ns, rid)
    assert (NS_PATTERN if named == "namespace" else RID_PATTERN) in str(info.value)


# --- parts ------------------------------------------------------------------------------


def test_part_name_format() -> None:
    assert part_name(0, 4096) == "part-0000000000-0000004096.bin"


@FAST
@given(st.integers(0, 10**10 - 1), st.integers(0, 10**10 - 1))
def test_part_name_round_trips(start: int, end: int) -> None:
    assert parse_part_name(part_name(start, end)) == (start, end)


@pytest.mark.parametrize(
    "name",
    [
        "meta.json",
        "part-1-2.bin",
        ".part-0000000000-0000000004.bin.tmp",
        "part-0000000000-0000000004.bin.tmp",
        "part-0000000000-0000000004.bin\n",
        "part-0000000000-00000000004.bin",
    ],
)
def test_parse_part_name_rejects(name: str) -> None:
    assert parse_part_name(name) is None


def test_parse_part_name_accepts_only_ascii_digits() -> None:
    arabic = "part-" + "\u0660" * 10 + "-" + "\u0660" * 9 + "\u0664" + ".bin"
    assert parse_part_name(arabic) is None


def test_num_layers_and_row_bytes() -> None:
    assert num_layers([2, 30, 58]) == 4
    assert row_bytes(7168, [2, 30, 58]) == 4 * 7168 * 2


# --- tiling -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parts", "n"), [([(0, 1)], 1), ([(0, 4096), (4096, 4710)], 4710), ([(0, 1), (1, 2)], 2)]
)
def test_check_tiling_accepts(parts: list[tuple[int, int]], n: int) -> None:
    check_tiling(parts, n)


@pytest.mark.parametrize(
    ("parts", "n", "match"),
    [
        ([(0, 4), (5, 10)], 10, "gap at row 4"),
        ([(0, 5), (4, 10)], 10, "overlap at row 5"),
        ([(1, 10)], 10, "gap at row 0"),
        ([(0, 4)], 10, r"cover \[0, 4\) but num_tokens is 10"),
        ([(0, 10), (10, 12)], 10, r"cover \[0, 12\)"),
        ([(0, 0), (0, 10)], 10, "empty or reversed"),
        ([(0, 5), (5, 3)], 10, "empty or reversed"),
        ([], 10, "no parts"),
        ([(0, 1)], 0, "num_tokens is 0"),
    ],
)
def test_check_tiling_rejects(parts: list[tuple[int, int]], n: int, match: str) -> None:
    with pytest.raises(DumpError, match=match):
        check_tiling(parts, n)


@st.composite
def _tilings(draw: st.DrawFn) -> tuple[list[tuple[int, int]], int]:
    n = draw(st.integers(1, 5000))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=8)) if n > 1 else set())
    bounds = [0, *cuts, n]
    return list(itertools.pairwise(bounds)), n


@FAST
@given(_tilings(), st.data())
def test_check_tiling_accepts_every_exact_tiling_and_rejects_any_change(
    tiling: tuple[list[tuple[int, int]], int], data: st.DataObject
) -> None:
    parts, n = tiling
    check_tiling(parts, n)
    i = data.draw(st.integers(0, len(parts) - 1))
    start, end = parts[i]
    delta = data.draw(st.sampled_from([-1, 1]))
    which = data.draw(st.sampled_from(["start", "end", "drop", "n"]))
    if which == "start":
        broken, m = [*parts[:i], (start + delta, end), *parts[i + 1 :]], n
    elif which == "end":
        broken, m = [*parts[:i], (start, end + delta), *parts[i + 1 :]], n
    elif which == "drop":
        broken, m = parts[:i] + parts[i + 1 :], n
    else:
        broken, m = parts, n + delta
    with pytest.raises(DumpError):
        check_tiling(broken, m)


# --- meta.json --------------------------------------------------------------------------


@FAST
@given(
    rid=st.from_regex(RID_PATTERN, fullmatch=True),
    tiling=_tilings(),
    hidden=st.integers(1, 1 << 16),
    layers=st.lists(st.integers(0, 200), min_size=1, max_size=6),
    model=st.text(max_size=20),
)
def test_meta_json_round_trips(
    rid: str, tiling: tuple[list[tuple[int, int]], int], hidden: int, layers: list[int], model: str
) -> None:
    parts, n = tiling
    meta = DumpMeta(rid, n, hidden, tuple(layers), tuple(parts), model, "srv")
    raw = orjson.loads(meta.to_json())
    assert raw["protocol"] == 4
    assert raw["dtype"] == "bfloat16"
    assert parse_meta(meta.to_json()) == meta
    check_meta(meta, rid=rid, num_tokens=n, hidden_size=hidden, aux_layers=layers)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"{", "not valid JSON"),
        (b"[1, 2]", "not a JSON object"),
        (_meta_json(protocol=5), "protocol is 5"),
        (_meta_json(final_state="prenorm"), "final_state is 'prenorm'"),
        (_meta_json(final_state=1), "final_state is 1"),
        (_meta_json(protocol=None), "protocol is None"),
        (_meta_json(dtype="float16"), "dtype is 'float16'"),
        (_meta_json(aux_layers=[2, "5"]), "aux_layers"),
        (_meta_json(aux_layers=3), "aux_layers"),
        (_meta_json(parts={"0": 4}), "parts is not a list"),
        (_meta_json(parts=[[0, 4, 5]]), r"part \[0, 4, 5\] is not \[start, end\]"),
        (_meta_json(parts=[[0, 4.0]]), "is not"),
        (_meta_json(parts=[[0, True]]), "is not"),
        (_meta_json(rid=7), "rid is missing"),
        (_meta_json(num_tokens="10"), "'num_tokens'"),
        (_meta_json(num_tokens=True), "'num_tokens'"),
        (_meta_json(hidden_size=8.0), "'hidden_size'"),
    ],
)
def test_parse_meta_rejects(data: bytes, match: str) -> None:
    with pytest.raises(DumpError, match=match):
        parse_meta(data)


def test_version_1_meta_means_post_norm_and_pre_norm_is_kept() -> None:
    raw = orjson.loads(_meta().to_json())
    raw["protocol"] = 1
    del raw["final_state"]
    assert parse_meta(orjson.dumps(raw)).final_state == "post_norm"
    raw.update(protocol=2, final_state="pre_norm")
    assert parse_meta(orjson.dumps(raw)).final_state == "pre_norm"


def test_parse_meta_defaults_model_and_server() -> None:
    raw = orjson.loads(_meta().to_json())
    del raw["model"], raw["server"]
    meta = parse_meta(orjson.dumps(raw))
    assert (meta.model, meta.server) == ("", "")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rid": "r2"}, "rid is 'r1', expected 'r2'"),
        ({"num_tokens": 11}, "num_tokens is 10, the request had 11"),
        ({"hidden_size": 16}, r"hidden_size is 8, config \[model\].hidden_size is 16"),
        ({"aux_layers": (2, 6)}, r"aux_layers is \[2, 5\], config \[model\].aux_layers"),
        ({"aux_layers": (5, 2)}, "aux_layers"),
    ],
)
def test_check_meta_names_the_mismatch(kwargs: dict[str, Any], match: str) -> None:
    expected: dict[str, Any] = {"rid": "r1", "num_tokens": 10, "hidden_size": 8}
    expected["aux_layers"] = (2, 5)
    expected.update(kwargs)
    with pytest.raises(DumpError, match=match):
        check_meta(_meta(), **expected)


def test_check_meta_checks_tiling() -> None:
    with pytest.raises(DumpError, match="gap"):
        check_meta(
            _meta(parts=((0, 4), (5, 10))),
            rid="r1",
            num_tokens=10,
            hidden_size=8,
            aux_layers=(2, 5),
        )


def test_check_part_sizes() -> None:
    meta, per_row = _meta(), 48
    good = {(0, 4): 4 * per_row, (4, 10): 6 * per_row}
    check_part_sizes(meta, good, per_row)
    with pytest.raises(DumpError, match=r"part-0000000004-0000000010.bin is listed .* missing"):
        check_part_sizes(meta, {(0, 4): 4 * per_row}, per_row)
    with pytest.raises(DumpError, match=r"has 100 bytes, expected 192 \(4 rows × 48 bytes\)"):
        check_part_sizes(meta, {**good, (0, 4): 100}, per_row)
    with pytest.raises(DumpError, match=r"part-0000000010-0000000012\.bin is not listed"):
        check_part_sizes(meta, {**good, (10, 12): 2 * per_row}, per_row)


# --- request and response ---------------------------------------------------------------


def test_generate_body_is_prefill_only_and_names_the_namespace() -> None:
    body = generate_body("rid-1", "hsx-w0", [1, 2, 3])
    assert body == {
        "rid": "rid-1",
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 0, "custom_params": {CUSTOM_PARAM_NS: "hsx-w0"}},
        "stream": False,
    }
    assert CUSTOM_PARAM_NS == "hsx_ns"


@pytest.mark.parametrize("cached", [0, None, "absent"])
def test_check_response_accepts(cached: object) -> None:
    meta: dict[str, Any] = {"id": "r", "prompt_tokens": 3}
    if cached != "absent":
        meta["cached_tokens"] = cached
    check_response({"meta_info": meta, "text": ""}, rid="r", num_tokens=3)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ([], "not a JSON object"),
        ({}, "no meta_info"),
        ({"meta_info": []}, "no meta_info"),
        ({"meta_info": {"id": "x", "prompt_tokens": 3}}, "id is 'x', expected 'r'"),
        ({"meta_info": {"id": "r", "prompt_tokens": 2}}, "prompt_tokens is 2"),
        ({"meta_info": {"id": "r"}}, "prompt_tokens is None"),
        (
            {"meta_info": {"id": "r", "prompt_tokens": 3, "cached_tokens": 2}},
            "--disable-radix-cache",
        ),
    ],
)
def test_check_response_rejects(body: object, match: str) -> None:
    with pytest.raises(DumpError, match=match):
        check_response(body, rid="r", num_tokens=3)


# --- the FP8 scale rule (§3): what the copy refuses -------------------------------------

_VALID_SCALE_BITS = [0x00800000, 0x3F800000, 0x7F7FFFFF]  # 2^-126, 1.0, float32's largest
_INVALID_SCALE_BITS = [
    0x00000000,  # zero
    0x00000001,  # the smallest subnormal
    0x007FFFFF,  # the largest subnormal
    0x7F800000,  # +Inf
    0x7FC00000,  # NaN
    0x80000000,  # -0
    0x80800000,  # -2^-126
    0xBF800000,  # -1.0
    0xFF800000,  # -Inf
    0xFFFFFFFF,  # a negative NaN
]


def _scale_bytes(*bits: int) -> bytes:
    return struct.pack(f"<{len(bits)}I", *bits)


def test_only_the_fp8_scale_section_is_checked() -> None:
    names = {s.name: section_check(s) for s in Storage(FP8, (0, 1)).sections(3, 8)}
    assert names["hidden_states"] is None and names["hidden_states_unquantized"] is None
    assert names["hidden_states_scales"] is not None
    assert all(section_check(s) is None for s in Storage().sections(3, 8))


def _outlier_checks(hidden: int = 64) -> tuple[SectionCheck, SectionCheck]:
    sections = {
        s.name: s for s in Storage(FP8, (0, 1), PER_TOKEN_SLOT_OUTLIERS16).sections(3, hidden)
    }
    assert section_check(sections["hidden_states"], hidden) is None
    assert check_unit(sections["hidden_states_outlier_index"]) == 32
    assert check_unit(sections["hidden_states_scales"]) == 4
    index = section_check(sections["hidden_states_outlier_index"], hidden)
    values = section_check(sections["hidden_states_outlier_values"], hidden)
    assert index is not None and values is not None
    return index, values


def _index_bytes(*vectors: list[int]) -> bytes:
    return b"".join(struct.pack("<16H", *(v + [0xFFFF] * (16 - len(v)))) for v in vectors)


def test_outlier_channels_the_rule_does_not_make_are_refused() -> None:
    """Per vector: used channels strictly ascending and below H, the unused (65535) last."""
    index, _ = _outlier_checks()
    assert index(_index_bytes([0, 5, 63], [], list(range(16)))) is None
    for bad in ([5, 3], [3, 3], [64], [1, 0xFFFF, 7]):  # the last: a used one after unused
        problem = index(_index_bytes([1, 2], bad))
        assert problem is not None and problem.startswith("1 FP8 vectors' outlier channels")
    gap = struct.pack("<16H", *([4, 0xFFFF, 9] + [0xFFFF] * 13))  # a used one after unused
    assert index(gap) is not None


def test_non_finite_outlier_values_are_refused() -> None:
    _, values = _outlier_checks()
    finite = torch.tensor([1.0, -3e38, 0.0, -0.0] * 4, dtype=torch.bfloat16)
    assert values(finite.view(torch.int16).numpy().tobytes()) is None
    for x in (float("nan"), float("inf"), float("-inf")):
        bad = finite.clone()
        bad[5] = x
        problem = values(bad.view(torch.int16).numpy().tobytes())
        assert problem is not None and problem.startswith("1 FP8 outlier values are not finite")


@pytest.mark.parametrize("bits", _INVALID_SCALE_BITS, ids=hex)
def test_a_scale_no_quantizer_makes_is_refused(bits: int) -> None:
    (scales,) = (s for s in Storage(FP8, (0,)).sections(2, 8) if s.name == "hidden_states_scales")
    check = section_check(scales)
    assert check is not None
    assert check(_scale_bytes(*_VALID_SCALE_BITS)) is None
    problem = check(_scale_bytes(*_VALID_SCALE_BITS, bits, bits))
    assert problem is not None and problem.startswith("2 FP8 scales are negative, zero, sub")


# --------------------------------------------------------------------------------------
# The one aux-layer rule and the one request rule (every hook and server calls them:
# tests/server/test_rules.py)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "n", "fragment"),
    [
        ([], None, "names no layer; list at least one, e.g. [2, 30, 58]"),
        ([], 6, "names no layer; list at least one, e.g. [0, 1, 2]"),
        ([2, True], None, "is not a list of integer layer ids"),
        ([2, "3"], None, "is not a list of integer layer ids"),
        ([-1, 3], None, "names a negative layer"),
        (
            [30, 2, 58],
            None,
            "[30, 2, 58] is not strictly ascending; list each layer once, "
            "lowest first: [2, 30, 58]",
        ),
        ([2, 2], None, "lowest first: [2]"),
        ([2, 30, 61], 61, "does not fit a model with 61 layers: name layers 0..60"),
    ],
)
def test_check_aux_layers_says_what_to_change(
    layers: list[Any], n: int | None, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        check_aux_layers(layers, key="model.aux_layers", num_layers=n)
    assert info.value.key == "model.aux_layers" and fragment in str(info.value)


def test_check_aux_layers_accepts_ascending_ids_in_range() -> None:
    assert check_aux_layers([2, 30, 58], key="k", num_layers=61) == (2, 30, 58)
    assert check_aux_layers((0,), key="k") == (0,)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "names no layer"),
        (" ", "names no layer"),
        ("1,x", "not a comma-separated"),
        ("2,,3", "not a comma-separated"),
        ("5,1", "not strictly ascending"),
    ],
)
def test_parse_aux_layers(text: str, fragment: str) -> None:
    assert parse_aux_layers(" 2, 30 ,58 ", key="k") == (2, 30, 58)
    with pytest.raises(ConfigError, match=fragment):
        parse_aux_layers(text, key="k")


def test_marked_ns() -> None:
    assert marked_ns(None) is None
    assert marked_ns({}) is None
    assert marked_ns({"other": 1}) is None
    assert marked_ns({"hsx_ns": "w0"}) == "w0"
    assert marked_ns({"hsx_ns": 7}) == 7  # marked, and refused by check_hsx_request
    assert marked_ns(["hsx_ns"]) is None


@pytest.mark.parametrize(
    ("ns", "rid", "max_new", "fragment"),
    [
        ("../x", "r", 0, "hsx_ns '../x' does not match"),
        (7, "r", 0, "hsx_ns 7 does not match"),
        ("w0", "a/b", 0, "rid 'a/b' does not match"),
        ("w0", None, 0, "rid None does not match"),
        ("w0", "r", 1, "max_new_tokens is 1; an hsx request must be prefill-only"),
        ("w0", "r", None, "max_new_tokens is None"),
        ("w0", "r", False, "max_new_tokens is False"),  # a JSON boolean is not 0
    ],
)
def test_check_hsx_request(ns: object, rid: object, max_new: object, fragment: str) -> None:
    assert check_hsx_request("w0", "r-1", max_new_tokens=0) == ("w0", "r-1")
    assert check_hsx_request("w0", "r-1") == ("w0", "r-1")  # the vLLM form
    with pytest.raises(HsxRequestError) as info:
        check_hsx_request(ns, rid, max_new_tokens=max_new)
    assert fragment in str(info.value)


def test_shown_names_are_short() -> None:
    assert shown("r") == "'r'"
    assert len(shown("x" * 500)) == 80 and shown("x" * 500).endswith("...")
