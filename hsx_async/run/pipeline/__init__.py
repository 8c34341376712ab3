"""The pipeline of one run: the worker half, the writer/commit half, and what bounds them."""
