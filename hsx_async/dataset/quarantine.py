"""The quarantine: samples that could not be made, and the kinds of reason why.

``quarantine*.jsonl`` (PROTOCOL §4) holds one line per input line that did not become a
sample, with its reason. :func:`reason_kind` strips a reason of its particulars (ids,
numbers, paths, the server it happened on), so the same problem counts once however many
samples met it: the job report's bars, the Prometheus failure labels and ``hsx status``
use it.
"""

from __future__ import annotations

import re


def reason_kind(reason: str) -> str:
    """A quarantine reason without its particulars: what a bar in the chart is named."""
    text = re.sub(r"^\d+ attempts failed; last: ", "", reason)
    exhausted = text != reason
    text = re.sub(r"^https?://\S+?: ", "", text)  # the server a retried attempt went to
    text = re.split(r"[:(;]", text, maxsplit=1)[0]
    text = re.sub(r"'[^']*'|\"[^\"]*\"|/\S+", "…", text)
    # HTTP status codes stay (a handful of kinds, and the code is what to act on).
    text = re.sub(r"(HTTP \d{3}\b)|\d+", lambda m: m.group(1) or "N", text).strip() or "other"
    if len(text) > 60:
        text = text[:59] + "…"
    return f"retries exhausted: {text}" if exhausted else text
