"""``hsx run``: the pipeline from samples to durable files (source → workers → client →
dump → writer → commit) and its operation (daemon lifecycle, budget, disk guard, retries,
resume, metrics, progress, systemd notify, preflight checks, the demo)."""
