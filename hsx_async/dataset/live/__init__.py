"""The live dataset (PROTOCOL §6): training while ``hsx run`` extracts, on this node or
through ``hsx serve`` on another. One home for what spans run time and read time: the
registry of consumers, each consumer's ledger of leases and acknowledgements, the owners'
liveness, retirement (the bounded spool), the follower of the dataset's logs, the one view
of it all that the run's spool limit, ``hsx status``, serve's metrics and the report read,
the torch ``LiveDataset``, and ``hsx serve`` with its wire.

Light on purpose: ``hsx run`` imports the view and the ledger, never torch; the
``LiveDataset`` lives in :mod:`hsx_async.dataset.live.dataset`.
"""
