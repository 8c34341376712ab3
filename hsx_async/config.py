"""The configuration file: TOML into frozen dataclasses, validated once.

Every section is a frozen dataclass whose fields are the keys; a key's default is the
field's default, and a field without a default is required. Unknown keys are rejected with
the nearest valid name, mistyped values with the expected type, so a typo never silently
becomes a default in a 70-hour job. Relative paths are relative to the config file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import re
import tomllib
import types
import typing
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from hsx_async.engines import DEFAULT_ENGINE, ENGINES, EngineName
from hsx_async.errors import ConfigError
from hsx_async.net import listen_ok
from hsx_async.protocol import (
    BF16,
    BF16_STORAGE,
    DEFAULT_DUMP_ROOT,
    FP8,
    NS_PATTERN,
    OUTLIER_NONE,
    Storage,
    check_aux_layers,
    num_layers,
    row_bytes,
    valid_ns,
)

Size = typing.NewType("Size", int)  # bytes; TOML gives an integer or a string like "16GiB"

_SIZE_RE = re.compile(r"\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(value: object, key: str) -> int:
    """Bytes from an integer or a string such as ``"16GiB"`` or ``"500 MB"``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m:  # Decimal: exact, and no float overflow for absurd values
            return int(Decimal(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])
    raise ConfigError(key, f'{value!r} is not a size; write bytes or a string like "16GiB"')


@dataclass(frozen=True)
class OneOf:
    """A key's value is a name of a registry (``Annotated[str, OneOf(table)]``), read when
    a file is loaded: whatever the table holds then (a registered engine) is valid."""

    table: Mapping[str, object]


# An engine's name, one of the registry's (hsx_async.engines).
EngineChoice = Annotated[EngineName, OneOf(ENGINES)]


@dataclass(frozen=True)
class ServerConfig:
    urls: tuple[str, ...]
    request_timeout: float = 600.0
    health_interval: float = 5.0
    unreachable_timeout: float = 1800.0
    engine: EngineChoice = DEFAULT_ENGINE  # what every server runs (hsx_async.engines)
    engines: tuple[EngineChoice, ...] = ()  # one per URL, where replicas differ

    def engine_of(self, url: str) -> EngineName:
        """The engine of one of :attr:`urls` (``engines`` wins over ``engine``)."""
        if self.engines:
            return self.engines[self.urls.index(url)]
        return self.engine


@dataclass(frozen=True)
class InputConfig:
    path: Path
    max_tokens: int = 32768


@dataclass(frozen=True)
class OutputConfig:
    dir: Path
    disk_reserve: Size = Size(20 << 30)
    # How hidden states are stored (PROTOCOL §4): bfloat16, bit-exact; or float8_e4m3fn with
    # a float32 scale per (token, layer) for the slots `quantize` names: "all" (about half
    # the bytes) or "aux" (the final state, which sets the teacher's logits, stays bf16).
    # `scales`, the FP8 layout (§3): each vector's 16 largest values kept exactly beside it
    # (massive activations of attention-sink tokens starve nothing), or version 3's one
    # scale per vector alone (what speculators' FP8 loader reads unchanged).
    dtype: Literal["bfloat16", "float8_e4m3fn"] = "bfloat16"
    quantize: Literal["all", "aux"] = "all"
    scales: Literal["per_token_slot_outliers16", "per_token_slot"] = "per_token_slot_outliers16"
    # Training while extracting (PROTOCOL §6): "keep" every sample file, or delete each
    # once every consumer named in `consumers` acknowledged it ("acked"); with
    # spool_limit > 0 intake pauses while the files held plus those in flight would pass it.
    retention: Literal["keep", "acked"] = "keep"
    spool_limit: Size = Size(0)
    consumers: tuple[str, ...] = ()


@dataclass(frozen=True)
class DumpConfig:
    root: Path = Path(DEFAULT_DUMP_ROOT)
    timeout: float = 120.0
    shm_budget: Size = Size(8 << 30)
    namespace_prefix: str = "hsx"


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    aux_layers: tuple[int, ...]
    # The model every server must serve: its reported model path, or the model its dumps
    # name. "" : the first server admitted pins it (run/servers/admission.py).
    name: str = ""

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.hidden_size, self.aux_layers)


@dataclass(frozen=True)
class WorkersConfig:
    # "auto": tuned at run time (run/pipeline/autotune.py), from AUTO_START up to max_concurrency.
    concurrency: int | Literal["auto"] = 8
    max_concurrency: int = 64
    max_attempts: int = 5
    backoff_base: float = 0.5
    backoff_max: float = 30.0

    @property
    def auto(self) -> bool:
        return self.concurrency == "auto"

    @property
    def start_concurrency(self) -> int:
        """The workers a run starts with."""
        if isinstance(self.concurrency, int):
            return self.concurrency
        return min(AUTO_START, self.max_concurrency)


AUTO_START = 4  # workers.concurrency = "auto" starts here


@dataclass(frozen=True)
class WriterConfig:
    threads: int = 2
    queue_depth: int = 16
    method: Literal["auto", "direct", "sendfile"] = "auto"
    fsync: bool = True


@dataclass(frozen=True)
class DaemonConfig:
    drain_timeout: float = 120.0
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    metrics_listen: str = "127.0.0.1:9464"
    progress_interval: float = 30.0


@dataclass(frozen=True)
class ShardConfig:
    index: int = 0
    count: int = 1


@dataclass(frozen=True)
class RegenerateConfig:
    """``hsx regenerate``: how the target model answers (SGLang sampling parameters)."""

    tokenizer: str = ""  # the target's tokenizer directory; "" : pass --tokenizer
    chat_template: str = ""  # a Jinja file; "": the tokenizer's own template
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's EOS

    def __post_init__(self) -> None:
        _check(0.0 <= self.temperature <= 100.0, "regenerate.temperature", "must be in [0, 100]")
        _check(0.0 < self.top_p <= 1.0, "regenerate.top_p", "must be in (0, 1]")
        _check(self.max_new_tokens >= 1, "regenerate.max_new_tokens", "must be at least 1")
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "regenerate.stop_token_ids",
            "token ids are ≥ 0",
        )


@dataclass(frozen=True)
class Config:
    server: ServerConfig
    input: InputConfig
    output: OutputConfig
    model: ModelConfig
    dump: DumpConfig = field(default_factory=DumpConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    writer: WriterConfig = field(default_factory=WriterConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    shard: ShardConfig = field(default_factory=ShardConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    path: Path | None = None  # the file it came from; not a key

    @property
    def sample_bytes_per_token(self) -> int:
        """Bytes per token of a dump in /dev/shm: bfloat16, the most a server may dump (a
        hook that does not quantize dumps bf16 and the client quantizes)."""
        return self.model.row_bytes

    @property
    def storage(self) -> Storage:
        """How the dataset stores hidden states ([output].dtype, .quantize, .scales)."""
        if self.output.dtype == BF16:
            return BF16_STORAGE
        layers = num_layers(self.model.aux_layers)
        slots = range(layers) if self.output.quantize == "all" else range(layers - 1)
        return Storage(FP8, tuple(slots), self.output.scales)

    @property
    def dataset_bytes_per_token(self) -> int:
        """Bytes per token of a dataset file's hidden states, in its storage."""
        return self.storage.row_bytes(num_layers(self.model.aux_layers), self.model.hidden_size)


# --- generic loading -------------------------------------------------------------------

_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _hint_words(hint: Any) -> str:
    if get_origin(hint) is Literal:
        return " or ".join(repr(c) for c in get_args(hint))
    return _TYPE_WORDS.get(hint, str(hint))


def _nearest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(sorted(valid))}"


def _convert(value: Any, hint: Any, key: str, base: Path) -> Any:
    origin = get_origin(hint)
    if origin is Annotated:
        return _one_of(value, hint, key, base)
    if hint is Size:
        return Size(parse_size(value, key))
    if hint is Path:
        return _path(value, key, base)
    if origin in (typing.Union, types.UnionType):  # int | Literal["auto"]: the first arm that fits
        for arm in get_args(hint):
            with contextlib.suppress(ConfigError):
                return _convert(value, arm, key, base)
        words = " or ".join(_hint_words(arm) for arm in get_args(hint))
        raise ConfigError(key, f"{value!r} is not {words}")
    if origin is Literal:
        if value not in get_args(hint):
            choices = " | ".join(repr(c) for c in get_args(hint))
            raise ConfigError(key, f"{value!r} is not one of {choices}")
        return value
    if origin is tuple:
        item = get_args(hint)[0]
        if not isinstance(value, list):
            raise ConfigError(key, f"{value!r} is not a list; write [ ... ]")
        return tuple(_convert(v, item, f"{key}[{i}]", base) for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not hint:
        raise ConfigError(key, f"{value!r} is not {_TYPE_WORDS.get(hint, str(hint))}")
    return value


def _path(value: Any, key: str, base: Path) -> Path:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, f"{value!r} is not a path; write a non-empty string")
    try:
        path = Path(os.path.expandvars(value)).expanduser()
    except RuntimeError:  # ~user of a user that does not exist
        raise ConfigError(key, f"{value!r}: cannot expand '~'; write an absolute path") from None
    return path if path.is_absolute() else base / path


def _one_of(value: Any, hint: Any, key: str, base: Path) -> Any:
    """A value of ``Annotated[T, OneOf(table)]``: one of the table's names as it is now."""
    inner, *marks = get_args(hint)
    for mark in marks:
        if isinstance(mark, OneOf) and not (isinstance(value, str) and value in mark.table):
            choices = " | ".join(repr(c) for c in mark.table)
            raise ConfigError(key, f"{value!r} is not one of {choices}")
    return _convert(value, inner, key, base)


def _section(cls: type[Any], raw: Any, name: str, base: Path) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(name, f"must be a table ([{name}]), got {raw!r}")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(f"{name}.{key}", f"unknown key; {_nearest(key, list(fields))}")
    values = {}
    for fname, f in fields.items():
        if fname in raw:
            values[fname] = _convert(raw[fname], hints[fname], f"{name}.{fname}", base)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{name}.{fname}", "is required; add it to the file")
    return cls(**values)


_SECTIONS: dict[str, type[Any]] = {
    "server": ServerConfig,
    "input": InputConfig,
    "output": OutputConfig,
    "model": ModelConfig,
    "dump": DumpConfig,
    "workers": WorkersConfig,
    "writer": WriterConfig,
    "daemon": DaemonConfig,
    "shard": ShardConfig,
    "regenerate": RegenerateConfig,
}
_REQUIRED = ("server", "input", "output", "model")


def config_from_dict(raw: dict[str, Any], *, base: Path, path: Path | None = None) -> Config:
    for name in raw:
        if name not in _SECTIONS:
            raise ConfigError(name, f"unknown section; {_nearest(name, list(_SECTIONS))}")
    for name in _REQUIRED:
        if name not in raw:
            raise ConfigError(name, f"section [{name}] is required; add it to the file")
    sections = {
        name: _section(cls, raw[name], name, base) for name, cls in _SECTIONS.items() if name in raw
    }
    if "shard" not in raw:
        sections["shard"] = shard_from_env(os.environ)
    config = Config(**sections, path=path)
    validate(config)
    return config


def load_config(path: Path) -> Config:
    """Read, check and freeze a config file. Raises :class:`ConfigError` naming the key."""
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("", f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{path} is not valid TOML: {exc}") from None
    return config_from_dict(raw, base=path.resolve().parent, path=path.resolve())


def shard_from_env(env: typing.Mapping[str, str]) -> ShardConfig:
    """The shard of an Indexed Job (k8s) or array job (Slurm) when ``[shard]`` is absent."""
    for index_var, count_vars in (
        ("JOB_COMPLETION_INDEX", ("HSX_SHARD_COUNT",)),
        ("SLURM_ARRAY_TASK_ID", ("HSX_SHARD_COUNT", "SLURM_ARRAY_TASK_COUNT")),
    ):
        if index_var not in env:
            continue
        count_var = next((v for v in count_vars if v in env), None)
        if count_var is None:
            raise ConfigError(
                "shard.count",
                f"{index_var} is set but {count_vars[0]} is not; "
                "set it to the number of shards or add [shard] to the file",
            )
        try:
            shard = ShardConfig(index=int(env[index_var]), count=int(env[count_var]))
        except ValueError:
            raise ConfigError("shard", f"{index_var}/{count_var} are not integers") from None
        return shard
    return ShardConfig()


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def validate(c: Config) -> None:
    """Cross-field checks; each failure names the key and what to change."""
    _check(bool(c.server.urls), "server.urls", "list at least one server URL")
    for i, url in enumerate(c.server.urls):
        _check(_url_ok(url), f"server.urls[{i}]", f"{url!r} must be http(s)://HOST[:PORT]")
    _check(len(set(c.server.urls)) == len(c.server.urls), "server.urls", "lists a URL twice")
    _check(
        not c.server.engines or len(c.server.engines) == len(c.server.urls),
        "server.engines",
        f"lists {len(c.server.engines)} engines for {len(c.server.urls)} server.urls; give "
        "one per URL, or drop it and set server.engine for all",
    )
    for key, value in (
        ("server.request_timeout", c.server.request_timeout),
        ("server.health_interval", c.server.health_interval),
        ("server.unreachable_timeout", c.server.unreachable_timeout),
        ("dump.timeout", c.dump.timeout),
        ("daemon.drain_timeout", c.daemon.drain_timeout),
        ("daemon.progress_interval", c.daemon.progress_interval),
    ):
        _check(value > 0, key, f"must be a positive number of seconds, got {value}")
    _check(c.input.max_tokens >= 1, "input.max_tokens", "must be at least 1")
    _check(c.model.hidden_size >= 1, "model.hidden_size", "must be at least 1")
    _check(
        c.output.dtype == BF16 or c.storage.outliers == 0 or c.model.hidden_size < OUTLIER_NONE,
        "output.scales",
        f"{c.output.scales!r} indexes channels in 16 bits: hidden_size "
        f'{c.model.hidden_size} needs scales = "per_token_slot"',
    )
    # The one aux-layer rule of every hook and server: the client refuses what they refuse.
    check_aux_layers(c.model.aux_layers, key="model.aux_layers")
    _check(
        len(c.dump.namespace_prefix) <= 40 and valid_ns(c.dump.namespace_prefix + "-s99999-w99999"),
        "dump.namespace_prefix",
        f"must make names matching {NS_PATTERN} (letters, digits, '._-', ≤ 40 chars)",
    )
    _check(
        c.workers.auto or c.workers.start_concurrency >= 1,
        "workers.concurrency",
        'must be at least 1, or "auto"',
    )
    _check(c.workers.max_concurrency >= 1, "workers.max_concurrency", "must be at least 1")
    _check(c.workers.max_attempts >= 1, "workers.max_attempts", "must be at least 1")
    _check(
        0 <= c.workers.backoff_base <= c.workers.backoff_max,
        "workers.backoff_base",
        "must be ≥ 0 and ≤ workers.backoff_max",
    )
    _check(c.writer.threads >= 1, "writer.threads", "must be at least 1")
    _check(c.writer.queue_depth >= 1, "writer.queue_depth", "must be at least 1")
    _check(c.shard.count >= 1, "shard.count", "must be at least 1")
    _check(
        0 <= c.shard.index < c.shard.count,
        "shard.index",
        f"must be in [0, shard.count) = [0, {c.shard.count}), got {c.shard.index}",
    )
    one_sample = c.input.max_tokens * c.model.row_bytes
    _check(
        c.dump.shm_budget >= one_sample,
        "dump.shm_budget",
        f"{c.dump.shm_budget} bytes cannot hold one sample of input.max_tokens "
        f"({c.input.max_tokens} tokens × {c.model.row_bytes} bytes = {one_sample}); "
        "raise dump.shm_budget or lower input.max_tokens",
    )
    _check_spool(c)
    _check(
        listen_ok(c.daemon.metrics_listen),
        "daemon.metrics_listen",
        f'{c.daemon.metrics_listen!r} is not HOST:PORT (or "" to disable)',
    )


def _check_spool(c: Config) -> None:
    out = c.output
    for i, name in enumerate(out.consumers):
        why = f"{name!r} must match {NS_PATTERN} (letters, digits, '._-', ≤ 64 chars)"
        _check(valid_ns(name), f"output.consumers[{i}]", why)
    _check(len(set(out.consumers)) == len(out.consumers), "output.consumers", "lists a name twice")
    _check(
        out.retention == "keep" or bool(out.consumers),
        "output.consumers",
        'retention = "acked" deletes a sample once every consumer listed here acknowledged '
        'it: name at least one (e.g. ["drafter"])',
    )
    _check(
        not out.spool_limit or out.retention == "acked",
        "output.spool_limit",
        'needs retention = "acked" (with "keep" the spool never shrinks: intake would pause '
        "for good); set it, or drop spool_limit",
    )
    one_file = spool_bytes_bound(c, c.input.max_tokens)
    _check(
        not out.spool_limit or out.spool_limit >= one_file,
        "output.spool_limit",
        f"{out.spool_limit} bytes cannot hold one sample file of input.max_tokens "
        f"({c.input.max_tokens} tokens: up to {one_file} bytes); raise it or lower "
        "input.max_tokens",
    )


SAMPLE_FILE_OVERHEAD = 8192  # a sample file's header and its alignment padding, at most


def spool_bytes_bound(c: Config, tokens: int) -> int:
    """At most the bytes of one sample file of ``tokens`` tokens (hidden states in the
    dataset's storage, int64 ids, the uint8 mask, the padded header)."""
    return tokens * (c.dataset_bytes_per_token + 9) + SAMPLE_FILE_OVERHEAD


def _url_ok(url: str) -> bool:
    """An http(s) URL with a host, a valid port if any, and nothing that cannot be sent:
    urlsplit raises on ``http://[::1`` and ``.port`` on ``:99999``, so both are asked here
    rather than first in a worker."""
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        return False
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def redact_url(url: str) -> str:
    """A URL fit for logs, status and provenance: any password replaced by ``***``."""
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port
    except ValueError:
        return (
            "<invalid URL>"  # only before validation: never shown in full, it may hold a password
        )
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


# --- live reload ------------------------------------------------------------------------

# Keys a SIGHUP may change while running; everything else needs a restart.
LIVE_KEYS = frozenset(
    {
        "server.urls",
        "server.engines",  # so a reload can add a URL with its engine
        "server.request_timeout",
        "server.health_interval",
        "server.unreachable_timeout",
        "dump.timeout",
        "dump.shm_budget",
        "workers.concurrency",
        "workers.max_concurrency",
        "workers.max_attempts",
        "workers.backoff_base",
        "workers.backoff_max",
        "daemon.log_level",
        "daemon.progress_interval",
        "daemon.drain_timeout",
        "output.disk_reserve",
    }
)


def flatten(config: Config) -> dict[str, Any]:
    """``{"section.key": value}`` for every key (the config file's own path excluded)."""
    out: dict[str, Any] = {}
    for name in _SECTIONS:
        section = getattr(config, name)
        for f in dataclasses.fields(section):
            out[f"{name}.{f.name}"] = getattr(section, f.name)
    return out


def flatten_public(config: Config) -> dict[str, Any]:
    """:func:`flatten` with credentials masked: what may be logged or recorded."""
    out = flatten(config)
    out["server.urls"] = tuple(redact_url(u) for u in config.server.urls)
    return out


@dataclass(frozen=True)
class ConfigDiff:
    live: dict[str, tuple[Any, Any]]
    restart: dict[str, tuple[Any, Any]]


def diff_config(old: Config, new: Config) -> ConfigDiff:
    a, b = flatten(old), flatten(new)
    changed = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    return ConfigDiff(
        live={k: v for k, v in changed.items() if k in LIVE_KEYS},
        restart={k: v for k, v in changed.items() if k not in LIVE_KEYS},
    )
