"""``hsx run`` and the jobs that share its runner, by concern (each folder imports only the
ones below it; ``tests/test_layering.py`` holds the order):

- ``daemon/``: a job's lifecycle — the one runner (``job``), ``hsx run``'s extraction
  (``daemon``), start-up and resume, the feed, stop and drain, reload, ``/metrics`` and
  ``/status``, the spool's admission limit;
- ``check/`` and ``report/``: ``hsx check`` before a job, the report after it;
- ``pipeline/``: one run's two halves (workers → writers and the committer), wired by
  ``pipeline``, and what bounds them (the /dev/shm budget, the disk guard, autotune);
- ``servers/``: the pool and its rotation, the HTTP client, the one examination of a
  server (``admission`` with a pluggable ``probe``), identity, claims, whose fault a
  failure is and what it costs;
- ``dumps/``: a request's dump, read, checked and copied into a durable file;
- ``source`` (the input samples) and ``notify`` (systemd's protocol) at the bottom.
"""
