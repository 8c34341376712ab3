"""Drift guard: the pinned SGLang source still has every class, method, attribute and string
the hook's glue patches or reads (``SGLANG_TARGETS``), and the checker names whatever moved.

SGLang is read as text, never imported here: from the real-SGLang tier's own environment
(``.venv-sglang``, built by ``bash .ci/sglang-env``; ``HSX_SGLANG_PYTHON`` names another),
or from the dev environment if a developer installed it there. Without either the tests
skip, except under CI, where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from hsx_async.server.sglang.drift import (
    HOOK_CAPTURE_TARGETS,
    SERVER_CAPTURE_TARGETS,
    SGLANG_TARGETS,
    Target,
    check_targets,
    forward_hooks_call_problems,
    launch_flags,
    release_problems,
    release_targets,
    release_version,
    server_arguments,
    sglang_source_root,
)
from hsx_async.server.sglang.hook import (
    SGLANG_RANGE,
    forward_hooks_arg,
    installed_sglang_version,
)
from hsx_async.server.sglang.releases import SERVER_CAPTURE_FLAGS
from tests.real_sglang.conftest import DEFAULT_PYTHON, ENV_PYTHON


def _tier_source() -> tuple[Path, str] | tuple[None, None]:
    """The sglang package directory and version of the real-SGLang tier's environment."""
    python = Path(os.environ.get(ENV_PYTHON) or DEFAULT_PYTHON)
    for site in sorted(python.parent.parent.glob("lib/python3*/site-packages")):
        dists = sorted(site.glob("sglang-*.dist-info"))
        if (site / "sglang").is_dir() and dists:
            return site / "sglang", dists[0].name.removeprefix("sglang-").removesuffix(".dist-info")
    return None, None


_DEV_ROOT = sglang_source_root()
ROOT, VERSION = (_DEV_ROOT, installed_sglang_version()) if _DEV_ROOT else _tier_source()
pytestmark = pytest.mark.skipif(
    ROOT is None and not os.environ.get("CI"),
    reason="no sglang source: build the real-SGLang environment with `bash .ci/sglang-env`",
)
DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "sglang"


def sglang_root() -> Path:
    assert ROOT is not None, "no sglang source (bash .ci/sglang-env builds .venv-sglang)"
    return ROOT


OLDEST = Path(__file__).resolve().parents[3] / ".venv-sglang-0.5.14"


@pytest.mark.skipif(
    not list(OLDEST.glob("lib/python3*/site-packages/sglang")),
    reason="no .venv-sglang-0.5.14 (bash .ci/sglang-oldest-env; .ci/engine-drift checks "
    "every release's wheel in CI)",
)
def test_the_oldest_release_installed_passes_its_own_targets() -> None:
    [root] = OLDEST.glob("lib/python3*/site-packages/sglang")
    assert release_version(root) == "0.5.14"
    assert release_problems(root) == []


def test_installed_sglang_is_in_the_range() -> None:
    assert VERSION is not None and SGLANG_RANGE.accepts(VERSION), (
        f"sglang {VERSION} is installed, the hook supports {SGLANG_RANGE.describe()}: run "
        ".ci/engine-drift on it, then add it to hsx_async/server/engine_versions.py"
    )


def test_every_target_is_in_the_installed_source() -> None:
    problems = release_problems(sglang_root())
    assert problems == [], "SGLang moved what the hsx hook relies on:\n" + "\n".join(problems)


def copy_of(tmp_path: Path, rel: str, edit: str | None = None, new: str = "") -> Path:
    """A fake sglang root holding one pinned file, with ``edit`` renamed to ``new``."""
    text = (sglang_root() / rel).read_text(encoding="utf-8")
    if edit is not None:
        pattern = rf"(?<!\w){re.escape(edit)}(?!\w)"
        assert re.search(pattern, text), f"{edit!r} not found in {rel}"
        text = re.sub(pattern, new, text)
    dest = tmp_path / "sglang" / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text, encoding="utf-8")
    return tmp_path / "sglang"


@pytest.mark.parametrize(
    "target",
    # The hook path's targets are in 0.5.23's source too (the tier's): each renamed there.
    [*SGLANG_TARGETS, *HOOK_CAPTURE_TARGETS],
    ids=lambda t: f"{t.label}@{t.path}:{t.kind}",
)
def test_a_renamed_target_is_named(tmp_path: Path, target: Target) -> None:
    moved = copy_of(tmp_path, target.path, target.name, target.name + "_moved")
    problems = check_targets(moved, [target])
    assert len(problems) == 1
    assert problems[0].startswith(f"{target.label} ({target.path}): ")
    assert target.why in problems[0]


def test_a_renamed_class_names_each_member(tmp_path: Path) -> None:
    rel = "srt/managers/utils.py"
    members = [t for t in SGLANG_TARGETS if t.owner == "GenerationBatchResult"]
    assert len(members) >= 2
    moved = copy_of(tmp_path, rel, "GenerationBatchResult", "BatchResult")
    problems = check_targets(moved, members)
    assert len(problems) == len(members)
    assert all("class GenerationBatchResult is gone or renamed" in p for p in problems)


def test_changed_parameters_are_named(tmp_path: Path) -> None:
    [target] = [t for t in SGLANG_TARGETS if t.name == "process_batch_result_prefill"]
    source = (sglang_root() / target.path).read_text(encoding="utf-8")
    edited = source.replace(
        "def process_batch_result_prefill(\n        self,\n        batch: ScheduleBatch,",
        "def process_batch_result_prefill(\n        self,\n        schedule_batch: ScheduleBatch,",
    )
    assert edited != source
    dest = tmp_path / "sglang" / target.path
    dest.parent.mkdir(parents=True)
    dest.write_text(edited, encoding="utf-8")
    [problem] = check_targets(tmp_path / "sglang", [target])
    assert "its parameters are now (self, schedule_batch, result)" in problem


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    [problem] = check_targets(tmp_path, SGLANG_TARGETS[:1])
    assert "the file is gone" in problem


def test_every_launch_flag_is_a_sglang_argument() -> None:
    flags = launch_flags((DEPLOY / "launch.sh").read_text(encoding="utf-8"))
    assert "disable_radix_cache" in flags and "forward_hooks" in flags
    unknown = sorted(set(flags) - server_arguments(sglang_root()))
    assert unknown == [], f"launch.sh passes flags sglang {VERSION} does not have: {unknown}"


def test_readme_shows_the_launch_command() -> None:
    readme = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert f"--forward-hooks '{forward_hooks_arg()}'" in readme
    block = readme.split("python3 -m sglang.launch_server", 1)[1].split("```", 1)[0]
    script = (DEPLOY / "launch.sh").read_text(encoding="utf-8")
    optional = {"chunked_prefill_size"}
    capture = set(launch_flags(" ".join(SERVER_CAPTURE_FLAGS)))  # (0.5.23's: the README's)
    assert set(launch_flags(block)) == (set(launch_flags(script)) | capture) - optional


def fields_only(tmp_path: Path, version: str) -> Path:
    """A fake sglang root: the installed release's server arguments, as ``version``."""
    fields = Path("srt") / "arg_groups" / "fields"
    shutil.copytree(sglang_root() / fields, tmp_path / "sglang" / fields)
    (tmp_path / "sglang" / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    exec_ = tmp_path / "sglang" / fields / "exec_.py"
    text = exec_.read_text(encoding="utf-8")
    exec_.write_text(text.replace("enable_return_aux_hidden_states:", "moved:"), encoding="utf-8")
    return tmp_path / "sglang"


def test_a_launch_flag_the_release_lacks_is_named(tmp_path: Path) -> None:
    """A release of the server capture path without --enable-return-aux-hidden-states:
    .ci/engine-drift names it (launch.sh passes it there)."""
    flags = [p for p in release_problems(fields_only(tmp_path, "0.5.23")) if p.startswith("--")]
    assert flags == [
        "--enable-return-aux-hidden-states: no such server argument; deploy/sglang/launch.sh "
        "passes it on sglang 0.5.23"
    ]


def test_a_release_before_the_server_capture_needs_no_capture_flag(tmp_path: Path) -> None:
    """0.5.14-0.5.22: launch.sh passes no capture flag there (the hook captures itself)."""
    problems = release_problems(fields_only(tmp_path, "0.5.22"))
    assert not [p for p in problems if p.startswith("--")]


def test_each_release_is_checked_for_its_own_capture_path(tmp_path: Path) -> None:
    root = fields_only(tmp_path, "0.5.14")
    assert release_version(root) == "0.5.14"
    old, new = release_targets(root, "0.5.14"), release_targets(root, "0.5.23")
    assert set(HOOK_CAPTURE_TARGETS) <= set(old) and not set(SERVER_CAPTURE_TARGETS) & set(old)
    assert set(SERVER_CAPTURE_TARGETS) <= set(new) and not set(HOOK_CAPTURE_TARGETS) & set(new)


def test_a_source_without_a_version_is_named(tmp_path: Path) -> None:
    (tmp_path / "sglang").mkdir()
    assert release_version(tmp_path / "sglang") is None
    [problem] = release_problems(tmp_path / "sglang")
    assert "sglang/_version.py: no __version__" in problem


def test_server_arguments_before_0_5_20_are_server_args_fields(tmp_path: Path) -> None:
    root = tmp_path / "sglang"
    (root / "srt").mkdir(parents=True)
    (root / "srt" / "server_args.py").write_text(
        "class ServerArgs:\n    model_path: str\n    disable_radix_cache: bool = False\n"
        "class Other:\n    not_an_argument: int = 0\n"
    )
    assert server_arguments(root) == {"model_path", "disable_radix_cache"}


@pytest.mark.parametrize(
    ("rel", "text", "found"),
    [
        ("srt/model_executor/model_runner.py",
         "def f(m):\n    register_forward_hooks(m, s)\n", True),
        ("srt/model_executor/model_runner_components/cuda_graph_setup.py",
         "def f(r):\n    hm.register_forward_hooks(r.model, s)\n", True),
        ("srt/model_executor/model_runner.py", "from x import register_forward_hooks\n", False),
    ],
)  # fmt: skip
def test_the_call_that_loads_the_hook_is_found_where_it_moved(
    tmp_path: Path, rel: str, text: str, found: bool
) -> None:
    dest = tmp_path / "sglang" / rel
    dest.parent.mkdir(parents=True)
    dest.write_text(text)
    problems = forward_hooks_call_problems(tmp_path / "sglang")
    assert (problems == []) is found
    if not found:
        assert "register_forward_hooks" in problems[0] and "no call left" in problems[0]
