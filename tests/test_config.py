"""The config loader: TOML into frozen dataclasses; every rejection names its key."""

from __future__ import annotations

import copy
import dataclasses
import math
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsx_async.config import (
    LIVE_KEYS,
    Config,
    ShardConfig,
    config_from_dict,
    diff_config,
    flatten,
    load_config,
    parse_size,
    shard_from_env,
)
from hsx_async.errors import ConfigError
from hsx_async.protocol import BF16_STORAGE, FP8, Storage, valid_ns

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BASE = Path("/etc/hsx")
_SHARD_VARS = (
    "JOB_COMPLETION_INDEX",
    "HSX_SHARD_COUNT",
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_COUNT",
)

MINIMAL_TOML = """\
[server]
urls = ["http://127.0.0.1:30000"]   # one or more SGLang servers

[input]
path = "samples.jsonl"

[output]
dir = "/nvme/hsx-out"

[dump]
root = "/dev/shm/hsx"

[model]
hidden_size = 7168
aux_layers = [2, 30, 58]

[workers]
concurrency = 8
"""


def _raw() -> dict[str, Any]:
    """A valid configuration as tomllib returns it."""
    return {
        "server": {"urls": ["http://127.0.0.1:30000"]},
        "input": {"path": "samples.jsonl", "max_tokens": 64},
        "output": {"dir": "/nvme/out"},
        "dump": {"root": "/dev/shm/hsx", "shm_budget": "1GiB"},
        "model": {"hidden_size": 16, "aux_layers": [1, 2]},
    }


def _with(section: str, key: str, value: object) -> dict[str, Any]:
    raw = _raw()
    raw.setdefault(section, {})[key] = value
    return raw


def _error(raw: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw, base=BASE)
    return info.value


@pytest.fixture(autouse=True)
def _no_shard_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A config without [shard] reads the job-array variables; a CI runner may set them."""
    for var in _SHARD_VARS:
        monkeypatch.delenv(var, raising=False)


# --- loading ----------------------------------------------------------------------------


def test_protocol_minimal_file_is_a_complete_config(tmp_path: Path) -> None:
    path = tmp_path / "hsx.toml"
    path.write_text(MINIMAL_TOML)
    c = load_config(path)
    assert c.server.urls == ("http://127.0.0.1:30000",)
    assert c.input.path == tmp_path.resolve() / "samples.jsonl"  # relative to the file
    assert c.output.dir == Path("/nvme/hsx-out")
    assert c.model.aux_layers == (2, 30, 58)
    assert c.model.row_bytes == 4 * 7168 * 2
    assert c.sample_bytes_per_token == c.model.row_bytes
    assert c.workers.concurrency == 8
    assert c.shard == ShardConfig(0, 1)
    assert c.path == path.resolve()
    assert c.writer.method == "auto"
    assert c.storage == BF16_STORAGE  # the default stays bit-exact bf16
    assert c.dataset_bytes_per_token == c.model.row_bytes
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.workers.concurrency = 9  # type: ignore[misc]


# Bytes per token at Kimi-K2.5's shape (H 7168, L 4): per quantized vector H values and a
# float32 scale, + 16 outliers (uint16 channel, bf16 value) in the outliers layout.
OUTLIERS16 = "per_token_slot_outliers16"


@pytest.mark.parametrize(
    ("quantize", "scales", "slots", "per_token"),
    [
        ("all", None, (0, 1, 2, 3), 4 * (7168 + 4 + 16 * 4)),
        ("aux", None, (0, 1, 2), 3 * (7168 + 4 + 16 * 4) + 7168 * 2),
        ("all", "per_token_slot", (0, 1, 2, 3), 4 * 7168 + 4 * 4),
        ("aux", "per_token_slot", (0, 1, 2), 3 * 7168 + 3 * 4 + 7168 * 2),
    ],
)
def test_fp8_output_names_the_slots_and_the_dataset_bytes(
    tmp_path: Path, quantize: str, scales: str | None, slots: tuple[int, ...], per_token: int
) -> None:
    """[output].dtype = FP8 quantizes every slot, or with quantize = "aux" the aux ones
    only (the final state, which sets the teacher's logits, stays bf16), in the layout
    [output].scales names (default: the outliers one). The dump budget keeps counting bf16
    rows: a server whose hook does not quantize dumps those."""
    path = tmp_path / "hsx.toml"
    extra = f'dtype = "float8_e4m3fn"\nquantize = "{quantize}"\n'
    if scales is not None:
        extra += f'scales = "{scales}"\n'
    path.write_text(
        MINIMAL_TOML.replace('dir = "/nvme/hsx-out"\n', f'dir = "/nvme/hsx-out"\n{extra}')
    )
    c = load_config(path)
    assert c.storage == Storage(FP8, slots, scales or OUTLIERS16)
    assert c.dataset_bytes_per_token == per_token
    assert c.sample_bytes_per_token == 4 * 7168 * 2


def test_an_outliers_layout_past_uint16_channels_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "hsx.toml"
    text = MINIMAL_TOML.replace('dir = "/nvme/hsx-out"\n', 'dir = "/nvme/hsx-out"\ndtype = '
                                '"float8_e4m3fn"\n').replace("7168", "70000").replace(
        'path = "samples.jsonl"', 'path = "samples.jsonl"\nmax_tokens = 1024')  # fmt: skip
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"output\.scales.*hidden_size 70000 needs scales"):
        load_config(path)
    path.write_text(
        text.replace('"float8_e4m3fn"\n', '"float8_e4m3fn"\nscales = "per_token_slot"\n')
    )
    assert load_config(path).storage.scales == "per_token_slot"


def test_unknown_output_dtype_is_one_line_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "hsx.toml"
    path.write_text(
        MINIMAL_TOML.replace('dir = "/nvme/hsx-out"\n', 'dir = "/nvme/hsx-out"\ndtype = "fp8"\n')
    )
    with pytest.raises(
        ConfigError, match=r"output\.dtype': 'fp8' is not one of 'bfloat16' \| 'float8_e4m3fn'"
    ):
        load_config(path)


def test_load_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_load_config_invalid_toml(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[server\nurls = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_env_vars_and_home_expand_in_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSX_TEST_OUT", "/data/out")
    monkeypatch.setenv("HOME", "/home/hsx")
    c = config_from_dict(
        {**_raw(), "output": {"dir": "$HSX_TEST_OUT/run1"}, "input": {"path": "~/in.jsonl"}},
        base=BASE,
    )
    assert c.output.dir == Path("/data/out/run1")
    assert c.input.path == Path("/home/hsx/in.jsonl")


def test_integer_for_a_float_key_becomes_a_float() -> None:
    c = config_from_dict(_with("server", "request_timeout", 10), base=BASE)
    assert c.server.request_timeout == 10.0
    assert isinstance(c.server.request_timeout, float)


# --- sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("16GiB", 16 << 30),
        ("16 gib", 16 << 30),
        (" 500 MB ", 500 * 10**6),
        ("1.5KiB", 1536),
        ("2TB", 2 * 10**12),
        ("7B", 7),
    ],
)
def test_parse_size(value: object, expected: int) -> None:
    assert parse_size(value, "dump.shm_budget") == expected


@pytest.mark.parametrize("value", [-1, True, 1.5, "", "GiB", "16 XB", "-5GiB", "1e9", None, [1]])
def test_parse_size_rejects_and_names_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match=r"'dump.shm_budget'.*not a size") as info:
        parse_size(value, "dump.shm_budget")
    assert info.value.key == "dump.shm_budget"


def test_parse_size_huge_number_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        parse_size("9" * 400 + "GiB", "dump.shm_budget")


# --- unknown keys, missing keys, wrong types --------------------------------------------


def test_unknown_key_suggests_the_nearest() -> None:
    err = _error(_with("workers", "concurency", 8))
    assert err.key == "workers.concurency"
    assert "did you mean 'concurrency'?" in str(err)


def test_unknown_key_without_a_near_one_lists_the_valid_ones() -> None:
    err = _error(_with("workers", "zzzzzz", 8))
    assert "valid keys: backoff_base, backoff_max, concurrency, max_attempts" in str(err)


def test_unknown_section_suggests_the_nearest() -> None:
    raw = {**_raw(), "worker": {"concurrency": 8}}
    err = _error(raw)
    assert err.key == "worker"
    assert "did you mean 'workers'?" in str(err)


@pytest.mark.parametrize("section", ["server", "input", "output", "model"])
def test_required_section(section: str) -> None:
    raw = _raw()
    del raw[section]
    err = _error(raw)
    assert err.key == section
    assert f"[{section}] is required" in str(err)


@pytest.mark.parametrize(
    ("section", "key"),
    [("server", "urls"), ("input", "path"), ("output", "dir"), ("model", "hidden_size")],
)
def test_required_key(section: str, key: str) -> None:
    raw = _raw()
    del raw[section][key]
    err = _error(raw)
    assert err.key == f"{section}.{key}"
    assert "is required" in str(err)


@pytest.mark.parametrize(
    ("section", "key", "value", "named", "says"),
    [
        ("workers", "concurrency", "8", "workers.concurrency", "not an integer"),
        ("workers", "concurrency", True, "workers.concurrency", "not an integer"),
        ("workers", "concurrency", 8.0, "workers.concurrency", "not an integer"),
        ("workers", "concurrency", "Auto", "workers.concurrency", "not an integer or 'auto'"),
        ("model", "hidden_size", 1.5, "model.hidden_size", "not an integer"),
        ("model", "aux_layers", "2,30", "model.aux_layers", "not a list"),
        ("model", "aux_layers", [2, "30"], "model.aux_layers[1]", "not an integer"),
        ("server", "urls", "http://a:1", "server.urls", "not a list"),
        ("server", "urls", [5], "server.urls[0]", "not a string"),
        ("server", "request_timeout", "10", "server.request_timeout", "not a number"),
        ("server", "request_timeout", False, "server.request_timeout", "not a number"),
        ("writer", "fsync", "yes", "writer.fsync", "not true or false"),
        ("writer", "fsync", 1, "writer.fsync", "not true or false"),
        ("writer", "method", "fast", "writer.method", "not one of 'auto' | 'direct' | 'sendfile'"),
        ("daemon", "log_level", "verbose", "daemon.log_level", "not one of"),
        ("input", "path", "", "input.path", "not a path"),
        ("output", "dir", 5, "output.dir", "not a path"),
        ("dump", "shm_budget", "lots", "dump.shm_budget", "not a size"),
        ("dump", "namespace_prefix", 5, "dump.namespace_prefix", "not a string"),
    ],
)
def test_wrong_type_names_the_key(
    section: str, key: str, value: object, named: str, says: str
) -> None:
    err = _error(_with(section, key, value))
    assert err.key == named
    assert named in str(err)
    assert says in str(err)


@pytest.mark.parametrize("value", [5, [1, 2], "x"])
def test_section_that_is_not_a_table(value: object) -> None:
    raw = _raw()
    raw["workers"] = value
    err = _error(raw)
    assert err.key == "workers"
    assert "must be a table" in str(err)


# --- cross-field validation -------------------------------------------------------------

_TIMEOUTS = [
    ("server", "request_timeout"),
    ("server", "health_interval"),
    ("server", "unreachable_timeout"),
    ("dump", "timeout"),
    ("daemon", "drain_timeout"),
    ("daemon", "progress_interval"),
]


@pytest.mark.parametrize(("section", "key"), _TIMEOUTS)
@pytest.mark.parametrize("value", [-1.0, 0, math.nan])
def test_timeouts_must_be_positive(section: str, key: str, value: float) -> None:
    err = _error(_with(section, key, value))
    assert err.key == f"{section}.{key}"
    assert "positive number of seconds" in str(err)


@pytest.mark.parametrize(
    ("section", "key", "value", "named"),
    [
        ("server", "urls", [], "server.urls"),
        ("server", "urls", ["localhost:30000"], "server.urls[0]"),
        ("server", "urls", ["http://a:1", "ftp://b"], "server.urls[1]"),
        ("server", "urls", ["http://a:1", "http://a:1"], "server.urls"),
        ("input", "max_tokens", 0, "input.max_tokens"),
        ("model", "hidden_size", 0, "model.hidden_size"),
        ("model", "aux_layers", [], "model.aux_layers"),
        ("model", "aux_layers", [2, -1], "model.aux_layers"),
        # Not ascending, or a layer twice: both production hooks refuse it (the one rule).
        ("model", "aux_layers", [30, 2, 58], "model.aux_layers"),
        ("model", "aux_layers", [2, 30, 30], "model.aux_layers"),
        ("dump", "namespace_prefix", "a/b", "dump.namespace_prefix"),
        ("dump", "namespace_prefix", "", "dump.namespace_prefix"),
        ("dump", "namespace_prefix", "x" * 62, "dump.namespace_prefix"),
        ("workers", "concurrency", 0, "workers.concurrency"),
        ("workers", "max_concurrency", 0, "workers.max_concurrency"),
        ("workers", "max_attempts", 0, "workers.max_attempts"),
        ("workers", "backoff_base", -0.5, "workers.backoff_base"),
        ("workers", "backoff_base", 60.0, "workers.backoff_base"),
        ("writer", "threads", 0, "writer.threads"),
        ("writer", "queue_depth", 0, "writer.queue_depth"),
        ("shard", "count", 0, "shard.count"),
        ("shard", "index", 2, "shard.index"),
        ("shard", "index", -1, "shard.index"),
        ("daemon", "metrics_listen", "9464", "daemon.metrics_listen"),
        ("daemon", "metrics_listen", "host:", "daemon.metrics_listen"),
        ("daemon", "metrics_listen", ":9464", "daemon.metrics_listen"),
        ("daemon", "metrics_listen", "host:65536", "daemon.metrics_listen"),
        ("daemon", "metrics_listen", "host:http", "daemon.metrics_listen"),
    ],
)
def test_validation_names_the_key(section: str, key: str, value: object, named: str) -> None:
    raw = _with(section, key, value)
    if section == "shard" and key == "index":
        raw["shard"]["count"] = 2
    err = _error(raw)
    assert err.key == named
    assert f"config key {named!r}" in str(err)


@pytest.mark.parametrize("listen", ["", "0.0.0.0:9464", "[::1]:9464", "localhost:0"])
def test_metrics_listen_accepts(listen: str) -> None:
    c = config_from_dict(_with("daemon", "metrics_listen", listen), base=BASE)
    assert c.daemon.metrics_listen == listen


def test_metrics_listen_superscript_port_is_a_config_error() -> None:
    assert _error(_with("daemon", "metrics_listen", "host:\u00b9")).key == "daemon.metrics_listen"


def test_unknown_user_home_is_a_config_error() -> None:
    value = f"~hsx-no-such-user-{uuid.uuid4().hex[:8]}/out"
    assert _error(_with("output", "dir", value)).key == "output.dir"


def test_namespace_prefix_leaves_room_for_shard_and_worker() -> None:
    raw = _with("dump", "namespace_prefix", "x" * 58)
    raw["shard"] = {"index": 99, "count": 100}
    raw["workers"] = {"concurrency": 16}
    try:
        c = config_from_dict(raw, base=BASE)
    except ConfigError as exc:
        assert exc.key == "dump.namespace_prefix"
        return
    prefix, shard = c.dump.namespace_prefix, c.shard.index
    assert valid_ns(f"{prefix}-s{shard}-w{c.workers.start_concurrency - 1}")


def test_concurrency_auto_starts_low_and_is_bounded_by_max_concurrency() -> None:
    raw = _raw()
    raw["workers"] = {"concurrency": "auto", "max_concurrency": 2}
    c = config_from_dict(raw, base=BASE)
    assert c.workers.auto and c.workers.concurrency == "auto"
    assert c.workers.start_concurrency == 2  # AUTO_START, capped by max_concurrency
    raw["workers"] = {"concurrency": 3}
    fixed = config_from_dict(raw, base=BASE).workers
    assert not fixed.auto and fixed.start_concurrency == 3


def test_shm_budget_must_hold_one_max_sample() -> None:
    raw = _raw()  # max_tokens 64 × row_bytes (3 × 16 × 2 = 96) = 6144 bytes
    raw["dump"]["shm_budget"] = 6143
    err = _error(raw)
    assert err.key == "dump.shm_budget"
    assert "64 tokens × 96 bytes = 6144" in str(err)
    raw["dump"]["shm_budget"] = 6144
    assert config_from_dict(raw, base=BASE).dump.shm_budget == 6144


# --- shards from the environment --------------------------------------------------------


def test_shard_from_env_default() -> None:
    assert shard_from_env({}) == ShardConfig(0, 1)


def test_shard_from_env_kubernetes_indexed_job() -> None:
    env = {"JOB_COMPLETION_INDEX": "3", "HSX_SHARD_COUNT": "8"}
    assert shard_from_env(env) == ShardConfig(3, 8)


def test_shard_from_env_slurm_array() -> None:
    env = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert shard_from_env(env) == ShardConfig(1, 4)
    # An explicit HSX_SHARD_COUNT wins over Slurm's own count.
    assert shard_from_env({**env, "HSX_SHARD_COUNT": "2"}) == ShardConfig(1, 2)


def test_shard_from_env_index_without_count() -> None:
    with pytest.raises(ConfigError, match="HSX_SHARD_COUNT is not") as info:
        shard_from_env({"JOB_COMPLETION_INDEX": "0"})
    assert info.value.key == "shard.count"


def test_shard_from_env_not_integers() -> None:
    with pytest.raises(ConfigError, match="not integers") as info:
        shard_from_env({"JOB_COMPLETION_INDEX": "x", "HSX_SHARD_COUNT": "2"})
    assert info.value.key == "shard"


def test_config_reads_shard_from_env_unless_the_file_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    monkeypatch.setenv("HSX_SHARD_COUNT", "3")
    assert config_from_dict(_raw(), base=BASE).shard == ShardConfig(2, 3)
    assert config_from_dict({**_raw(), "shard": {}}, base=BASE).shard == ShardConfig(0, 1)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "3")
    assert _error(_raw()).key == "shard.index"


# --- live reload ------------------------------------------------------------------------


def test_every_live_key_is_a_key() -> None:
    keys = set(flatten(config_from_dict(_raw(), base=BASE)))
    assert keys >= LIVE_KEYS
    assert "model.hidden_size" in keys
    assert "model.hidden_size" not in LIVE_KEYS


def test_diff_config_splits_live_and_restart_changes() -> None:
    old = config_from_dict(_raw(), base=BASE)
    assert diff_config(old, old) == diff_config(old, config_from_dict(_raw(), base=BASE))
    assert diff_config(old, old).live == {}
    assert diff_config(old, old).restart == {}
    raw = _raw()
    raw["workers"] = {"concurrency": 4}
    raw["dump"]["shm_budget"] = "2GiB"
    raw["model"]["hidden_size"] = 32
    raw["input"]["path"] = "other.jsonl"
    diff = diff_config(old, config_from_dict(raw, base=BASE))
    assert diff.live == {
        "workers.concurrency": (8, 4),
        "dump.shm_budget": (1 << 30, 2 << 30),
    }
    assert diff.restart == {
        "model.hidden_size": (16, 32),
        "input.path": (BASE / "samples.jsonl", BASE / "other.jsonl"),
    }


# --- property: anything in, a Config or a ConfigError out -------------------------------

# Known bugs with their own xfail tests above are kept out of the generated text: a leading
# '~' (expanduser RuntimeError) and non-decimal digits such as '¹' (metrics_listen).
_TEXT = st.text(
    alphabet=st.characters(exclude_categories=("Cs", "No"), exclude_characters="~"), max_size=12
)
_SCALARS = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    _TEXT,
    st.sampled_from(["http://h:1", "1GiB", "auto", "sendfile", "127.0.0.1:1", "/tmp/x", ""]),
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=4,
)


def _key_names() -> list[str]:
    # Runs at import, before the env fixture: an explicit [shard] keeps the env out.
    flat = flatten(config_from_dict({**_raw(), "shard": {}}, base=BASE))
    return sorted({k.split(".", 1)[1] for k in flat})


_KEY_NAMES = st.sampled_from(_key_names()) | _TEXT
_SECTION_NAMES = st.sampled_from(
    ["server", "input", "output", "dump", "model", "workers", "writer", "daemon", "shard"]
)


def _check_outcome(raw: dict[str, Any]) -> None:
    try:
        config = config_from_dict(raw, base=BASE)
    except ConfigError as exc:
        assert str(exc)
        if exc.key:
            assert repr(exc.key) in str(exc)
    else:
        assert isinstance(config, Config)


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        _SECTION_NAMES | _TEXT,
        st.dictionaries(_KEY_NAMES, _VALUES, max_size=4) | _SCALARS,
        max_size=6,
    )
)
def test_random_dicts_give_a_config_or_a_config_error(raw: dict[str, Any]) -> None:
    _check_outcome(raw)


@FAST
@given(st.lists(st.tuples(_SECTION_NAMES, _KEY_NAMES, _VALUES), min_size=1, max_size=4))
def test_mutated_valid_configs_give_a_config_or_a_config_error(
    changes: list[tuple[str, str, object]],
) -> None:
    raw = copy.deepcopy(_raw())
    for section, key, value in changes:
        raw.setdefault(section, {})[key] = value
    _check_outcome(raw)
