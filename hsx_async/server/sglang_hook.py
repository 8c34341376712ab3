"""The stable name SGLang loads: ``--forward-hooks`` and the deploy files name
``hsx_async.server.sglang_hook:hsx_hook_factory``. The glue lives in
:mod:`hsx_async.server.sglang.hook`; this module only keeps that path working."""

from hsx_async.server.sglang.hook import forward_hooks_arg, hsx_hook_factory

__all__ = ["forward_hooks_arg", "hsx_hook_factory"]
