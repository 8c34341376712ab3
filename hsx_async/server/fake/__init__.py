"""``hsx fake-server``: PROTOCOL §2–3 with deterministic rows, a GPU-like latency model and
injected faults, for tests and benchmarks."""
