"""The commands' handlers, one module per command: each turns the parsed options into the
typed arguments of its domain functions, prints what they return and chooses the exit
code (STYLE 4b). A parser (``hsx_async.cli.<command>``) names its handler as
``"hsx_async.cli.handlers.<command>:<command>_command"``; the handler's module, and the
domain modules it imports, are loaded only when the command runs.
"""
