"""The server half of the protocol: SGLang hook, fake server, reference server.

Shares only :mod:`hsx_async.protocol` (and :mod:`hsx_async.errors`) with the client.
"""
