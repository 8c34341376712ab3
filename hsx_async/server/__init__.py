"""The server half of the protocol: the engine hooks (SGLang, vLLM), the fake server and the
reference server, on one set of rules and one dump path (``README.md`` in this package: the
modules, and the interface a hook for another engine implements).

Shares only :mod:`hsx_async.protocol` (and :mod:`hsx_async.errors`) with the client.
"""
