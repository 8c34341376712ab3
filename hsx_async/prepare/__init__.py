"""From conversations to samples: ``hsx prepare`` (chat template + assistant loss mask) and
``hsx regenerate`` (the target model's own answers, through the servers of ``hsx run``).

Modules: :mod:`.records` (ShareGPT/OpenAI records), :mod:`.template` (rendering and the
mask), :mod:`.encode` (one record → one sample line, per worker process), :mod:`.summary`
(counts and the extraction's size), :mod:`.command` (``hsx prepare``), :mod:`.regenerate`
(``hsx regenerate``).
"""
