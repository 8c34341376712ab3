"""The lifecycle of a job: start-up and resume, the feed, stop and drain, reload, what the
operator sees.
"""
