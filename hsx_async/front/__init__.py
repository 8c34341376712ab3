"""Fronts: hsx as the capture side of trainers' own online pipelines (issue 41).

:mod:`.speculators` speaks the part of vLLM's API speculators' trainer calls and publishes
each sample to Mooncake Store (:mod:`.mooncake`) from hsx's extraction path (:mod:`.extract`).
"""
