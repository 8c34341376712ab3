"""``hsx regenerate`` whose only server never passes admission stops after
``server.unreachable_timeout`` with :class:`NoServerError` (exit 3), however many
conversations wait: the wait for a server is the job runner's, one for every kind of job.

(Before, issue 38: with 4 conversations it stopped; with 40, more than its workers, the
reader — cut off while the intake was full — waited for room to put its end marker that
no worker would ever take, and the run never exited.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hsx_async.config import config_from_dict
from hsx_async.errors import NoServerError
from hsx_async.prepare.regenerate import regenerate
from tests.e2e import config_raw
from tests.prepare.conftest import WriteLines, tiny_conversation
from tests.prepare.regenerate.decode_servers import hostile_server

DEADLINE_S = 30.0  # the run must end well before: unreachable_timeout is 1 s


@pytest.mark.timeout(60)
@pytest.mark.parametrize("conversations", [4, 40])
async def test_a_refused_server_ends_the_run_whatever_the_input(
    tmp_path: Path, tiny_model_dir: Path, write_jsonl: WriteLines, conversations: int
) -> None:
    src = write_jsonl(
        tmp_path / "conversations.jsonl", [tiny_conversation(i) for i in range(conversations)]
    )
    async with hostile_server(lambda body: [10**9]) as bad:  # an id past any vocabulary
        raw = config_raw(
            tmp_path,
            src,
            [bad.url],
            tmp_path / "unused-dump-root",
            regenerate={"tokenizer": str(tiny_model_dir), "max_new_tokens": 4},
            workers={"concurrency": 3, "max_attempts": 3},
        )
        raw["server"].update(unreachable_timeout=1.0, health_interval=0.1)
        config = config_from_dict(raw, base=tmp_path)
        with pytest.raises(NoServerError, match="no server in rotation"):
            async with asyncio.timeout(DEADLINE_S):
                await regenerate(config, src, tmp_path / "regen.jsonl")
    # Every request it got was an admission probe (one token): no turn was sent.
    assert bad.requests and all(r["sampling_params"]["max_new_tokens"] == 1 for r in bad.requests)
