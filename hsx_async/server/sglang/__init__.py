"""The hook loaded into SGLang (``--forward-hooks``): glue between SGLang's scheduler and
:mod:`hsx_async.server.hook_core`, and the list of SGLang names it depends on."""
