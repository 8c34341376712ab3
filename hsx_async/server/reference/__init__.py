"""``hsx reference-server``: PROTOCOL §2–3 with a real transformers model on the CPU,
batching and chunked prefill, so tests can compare a dataset with a direct forward pass."""
