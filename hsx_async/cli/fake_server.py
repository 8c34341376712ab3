"""``hsx fake-server``: the SGLang stand-in with deterministic rows and injected faults.

Its defaults are :class:`hsx_async.server.fake.options.FakeOptions`'s, restated here so
that ``--help`` imports no server module (``tests/server/fake/test_fake.py`` holds them
equal); the fault names are ``ALL_FAULTS``'s, in order (``tests/test_cli_help.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hsx_async.cli.help import RawEpilogHelpFormatter

# What each injected fault does (``--faults``); the keys are exactly ALL_FAULTS, in order.
FAULT_HELP: dict[str, str] = {
    "http_500": "answer 500 at once, nothing written",
    "drop_before": "close the connection without a response, nothing written",
    "drop_after": "write the full dump with meta.json, then close the connection",
    "abort_dump": "write the parts but no meta.json, answer 200",
    "late_meta": "answer 200 first, write meta.json --late-meta-s later (benign)",
    "truncated_part": "the last part file is shorter than its name says",
    "oversized_part": "the last part file is one row longer than its name says",
    "gap_parts": "the last part is named one row later: a gap",
    "overlap_parts": "an extra part [T-1, T) is written and listed: an overlap",
    "wrong_num_tokens": "meta.json num_tokens is T + 1",
    "wrong_hidden_size": "meta.json hidden_size is H + 1",
    "wrong_layers": "meta.json aux_layers differ from the server's",
    "cached_tokens": "the response's meta_info.cached_tokens is > 0",
    "wrong_prompt_tokens": "the response's meta_info.prompt_tokens is T + 1",
    "wrong_rid": "the response's meta_info.id is not the request's rid",
    "hang": "never answer (the connection closes when the server stops)",
}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _fault_list(text: str) -> tuple[str, ...]:
    if text.strip() == "all":
        return tuple(FAULT_HELP)
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in FAULT_HELP]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault {unknown[0]!r}; known: all, {', '.join(FAULT_HELP)}"
        )
    return names


def _fault_epilog() -> str:
    width = max(len(k) for k in FAULT_HELP)
    rows = [f"  {kind:<{width}}  {text}" for kind, text in FAULT_HELP.items()]
    return "fault kinds (--faults; each hsx request meets one with --fault-rate):\n" + "\n".join(
        rows
    )


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "fake-server",
        help="run a fake SGLang server (no GPU) that dumps deterministic hidden states",
        description=(
            "An SGLang stand-in that speaks PROTOCOL §2–3 with deterministic numbers: it "
            "batches and chunks prefill like SGLang, can model GPU latency and injects "
            "faults on demand. Listens on 127.0.0.1 unless --host says otherwise."
        ),
        epilog=_fault_epilog(),
        formatter_class=RawEpilogHelpFormatter,  # the fault list keeps its lines
    )
    add = p.add_argument
    add("--host", default="127.0.0.1", help="listen address")
    add("--port", type=int, default=30000, help="listen port (0: any free port)")
    add("--hidden-size", type=int, default=64, help="hidden size H of every row")
    add(
        "--aux-layers",
        type=_int_list,
        default="1,3,5",
        help="captured layers, ascending, comma-separated (as [model].aux_layers)",
    )
    add("--dump-root", type=Path, default=Path("/dev/shm/hsx"), help="the servers' HSX_DUMP_ROOT")
    add("--model", default="hsx-fake", help='"model" reported in meta.json and /get_model_info')
    add(
        "--chunk-size",
        type=int,
        default=0,
        help="most rows of one request per forward pass (chunked prefill; 0: no limit)",
    )
    add("--random-chunks", action="store_true", help="also split prompts at random points")
    add(
        "--max-batch-tokens",
        type=int,
        default=16384,
        help="token budget of one simulated forward pass, shared by the waiting requests",
    )
    add(
        "--latency-base-ms",
        type=float,
        default=0.0,
        help="modelled cost of a forward pass, fixed part (ms)",
    )
    add(
        "--latency-per-token-us",
        type=float,
        default=0.0,
        help="modelled cost of a forward pass per row (µs)",
    )
    add(
        "--fault-rate",
        type=float,
        default=0.0,
        help="probability that an hsx request meets one fault",
    )
    add(
        "--faults",
        type=_fault_list,
        default="all",
        help="fault kinds to draw from, comma-separated, or 'all' (listed below)",
    )
    add(
        "--late-meta-s",
        type=float,
        default=0.5,
        help="delay of meta.json for the late_meta fault (s)",
    )
    add("--seed", type=int, default=0, help="seed of the fault and chunking draws")
    add(
        "--writer-threads",
        type=int,
        default=0,
        help="threads writing parts (0: auto, half the cores, 1 to 4)",
    )
    p.set_defaults(handler="hsx_async.server.fake.server:fake_server_command")
