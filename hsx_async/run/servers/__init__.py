"""The servers of a job: the pool, the HTTP client, their examination, identity and faults."""
