"""``hsx regenerate``: every assistant turn replaced by the target model's own answer.

Turn by turn: the prompt of assistant turn *k* is the conversation up to it, with turns
before it already regenerated, rendered with the chat template's generation prompt, sent as
token ids to a server of ``[server]`` in its engine's wire (:mod:`hsx_async.engines`:
SGLang's ``/generate``, vLLM's ``/v1/completions``), seeded per conversation and turn.

It is a client of the run pipeline's parts, not a second pipeline:

- the servers: :class:`~hsx_async.run.servers.pool.ServerPool` (least loaded server in rotation;
  out of rotation with its reason) and :mod:`.serving` (admitted only
  after a decode probe passes; a wrong ``[server].engine`` stops the run, exit 2; no server
  for ``server.unreachable_timeout``, exit 3);
- every failed attempt gets its cause (:mod:`hsx_async.run.servers.faults`), and the attempts of a
  turn are kept by :class:`~hsx_async.run.servers.retry.Attempts`: only the conversation's own
  faults charge ``workers.max_attempts`` and quarantine it; a server's never do;
- every answer is checked against the tokenizer and the request
  (:mod:`.answer`) before a word of it is kept;
- the output and the quarantine are made durable by the run's group commit
  (:class:`~hsx_async.run.pipeline.writers.Committer`): one fsynced line per finished conversation,
  so a run killed at any instant and started again skips the conversations written and
  ends with each exactly once; one regenerate per output at a time (a lock beside it);
- signals as in ``hsx run`` (:class:`~hsx_async.run.daemon.signals.Stopper`): the first stops
  intake and lets the conversations in flight finish within ``daemon.drain_timeout``, a
  second exits at once; the events log and the summary as ``hsx run``'s
  (:class:`~hsx_async.run.report.numbers.RunRecorder`).

Output (OpenAI ``messages`` form, the record's id kept or derived as ``hsx prepare`` does):
``{"id", "messages", "hsx_regenerate": {"turns": [...], "length_capped": bool}}``; an
answer cut by ``max_new_tokens`` carries ``"hsx_length_capped": true`` in its message.
Beside it the files of :mod:`.files`; logs say ``input_line``, 1-based, as ``hsx run``'s.

Modules: :mod:`.run` (the life cycle), :mod:`.turns` (the reader, the
workers, one turn's attempts), :mod:`.answer` (a turn's answer, checked), :mod:`.serving`
(which servers take turns), :mod:`.files`, :mod:`.summary`.
"""

from __future__ import annotations

from hsx_async.prepare.regenerate.files import RegenPaths
from hsx_async.prepare.regenerate.run import Regenerator, regenerate
from hsx_async.prepare.regenerate.summary import RegenSummary

__all__ = ["RegenPaths", "RegenSummary", "Regenerator", "regenerate"]
