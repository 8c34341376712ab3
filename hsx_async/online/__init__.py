"""Serving a live dataset to trainers on other nodes: ``hsx serve`` (PROTOCOL §6.4)."""
