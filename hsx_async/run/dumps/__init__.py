"""A request's dump: reading it from shared memory, checking it, and copying it into a durable
file.
"""
