"""What one ``hsx regenerate`` did: the counts as it goes, and the summary it prints (a
person's, or ``--json``) and keeps in ``<stem>.summary.json``; its servers' spells out of
rotation are the job report's (:class:`hsx_async.run.report.numbers.ServerSpells`, noted by the
run's recorder)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from hsx_async.prepare.summary import reason_rows, row


@dataclass
class RegenStats:
    done: int = 0
    skipped: int = 0  # already in the output or quarantine (resume)
    quarantined: int = 0
    abandoned: int = 0  # begun, then left for a resume (a stop while it waited)
    turns: int = 0
    length_capped: int = 0
    tokens: int = 0  # generated, over the turns kept
    bytes: int = 0  # output lines written
    read: int = 0  # conversations read from the input
    seen: dict[str, int] = field(default_factory=dict)  # id → first line
    reasons: collections.Counter[str] = field(default_factory=collections.Counter)
    failed: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class RegenSummary:
    """What ``hsx regenerate`` prints (and writes to ``<stem>.summary.json``)."""

    done: int
    skipped: int
    quarantined: int
    turns: int
    length_capped: int
    tokens: int
    seconds: float
    stopped: bool  # by a signal
    unfinished: int  # read, but neither written nor quarantined (a resume does them)
    input_done: bool  # the whole input was read (False: stopped before its end)
    quarantine_reasons: dict[str, int]
    failed_attempts: dict[str, int]  # by fault kind
    servers: dict[str, int]  # requests sent, by server
    servers_out: list[dict[str, Any]]  # each time a server left rotation, and why
    files: dict[str, str]
    next_step: str = ""  # the command that follows (hsx prepare)
    # The job's server identity, pinned by the first server admitted (None: none was).
    identity: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "done": self.done,
            "skipped": self.skipped,
            "quarantined": self.quarantined,
            "turns": self.turns,
            "length_capped": self.length_capped,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "stopped": self.stopped,
            "unfinished": self.unfinished,
            "input_done": self.input_done,
            "quarantine_reasons": self.quarantine_reasons,
            "failed_attempts": self.failed_attempts,
            "servers": self.servers,
            "servers_out": self.servers_out,
            "files": self.files,
            "identity": self.identity,
        }

    def lines(self) -> list[str]:
        """The summary a person reads (laid out as ``hsx prepare``'s)."""
        rate = self.tokens / self.seconds if self.seconds else 0.0
        out = [
            f"hsx regenerate: {self.done:,} conversations regenerated, {self.quarantined:,} "
            f"quarantined, {self.skipped:,} already done → {self.files['output']}",
            row(
                "turns",
                f"{self.turns:,} ({self.length_capped:,} cut at max_new_tokens), "
                f"{self.tokens:,} tokens in {self.seconds:.1f} s ({rate:,.0f} tokens/s)",
            ),
        ]
        if self.quarantined:
            out.append(row("quarantined", f"{self.quarantined:,} → {self.files['quarantine']}"))
            out += reason_rows(self.quarantine_reasons)
        if self.failed_attempts:
            kinds = ", ".join(f"{n:,} {kind}" for kind, n in self.failed_attempts.items())
            out.append(row("retried", f"{kinds} (not charged unless the conversation's own)"))
        for spell in self.servers_out:
            state = "came back" if spell["back"] else "still out"
            where = f"{spell['server']} ({spell['kind']}, {state})"
            out.append(row("server out", f"{where}: {spell['reason']}"))
        out += [row("settings", self.files["meta"]), row("summary", self.files["summary"])]
        if self.unfinished or not self.input_done:
            left = f"{self.unfinished:,} conversations" if self.unfinished else "the input"
            rest = "" if self.input_done else " (and the input was not read to its end)"
            out.append(
                f"hsx: {left} not finished{rest}: run the same command again to finish (it resumes)"
            )
        elif self.next_step:
            out.append(f"hsx: next: {self.next_step}")
        return out
