#!/usr/bin/env bash
# Start SGLang (0.5.14 to 0.5.23) with the hsx hidden-state dump hook. See README.md next to
# this file.
#
#   HSX_AUX_LAYERS=2,30,58 deploy/sglang/launch.sh MODEL_PATH [extra sglang flags...]
#
# Environment (read here and by the hook in every scheduler process):
#   HSX_AUX_LAYERS            required: ascending, comma-separated; layer k is the residual
#                             stream entering decoder layer k (HF hidden_states[k]); the same
#                             list as the client's [model].aux_layers
#   HSX_DUMP_ROOT             dump root, the client's [dump].root (default /dev/shm/hsx)
#   HSX_MODEL_NAME            "model" in meta.json (default: SGLang's served model name)
# Launch settings:
#   HSX_TP_SIZE               tensor-parallel size (default 1)
#   HSX_HOST, HSX_PORT        listen address (default 127.0.0.1, 30000)
#   HSX_CHUNKED_PREFILL_SIZE  tokens per prefill pass, i.e. the most rows in one part
#                             (default: SGLang's choice for the GPU)
#   HSX_PYTHON                the Python of the SGLang environment (default python3)
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: HSX_AUX_LAYERS=2,30,58 $0 MODEL_PATH [extra sglang flags...]" >&2
    exit 2
fi
model_path=$1
shift

: "${HSX_AUX_LAYERS:?set HSX_AUX_LAYERS, e.g. 2,30,58 (as [model].aux_layers of the client)}"
export HSX_AUX_LAYERS
export HSX_DUMP_ROOT="${HSX_DUMP_ROOT:-/dev/shm/hsx}"
if [[ -n "${HSX_MODEL_NAME:-}" ]]; then
    export HSX_MODEL_NAME
fi
python=${HSX_PYTHON:-python3}

# Fail now, not after a long model load: the hook must import in SGLang's Python and the
# HSX_* settings must be valid. Prints the exact --forward-hooks value.
# Line 1: the --forward-hooks value; line 2: the aux-capture flags of the installed release
# (0.5.23 on: SGLang's capture-only aux mode; before: none, the hook captures itself).
hook_args=$("$python" - <<'PY'
import os
import sys

from hsx_async.errors import HsxError
from hsx_async.server.hook_core import HookConfig
from hsx_async.server.sglang.hook import (
    forward_hooks_arg,
    installed_sglang_version,
    launch_capture_flags,
)

try:
    HookConfig.from_env(os.environ, server="launch.sh")
except HsxError as exc:
    sys.exit(f"launch.sh: {exc}")
print(forward_hooks_arg())
print(" ".join(launch_capture_flags(installed_sglang_version())))
PY
)
forward_hooks=$(sed -n 1p <<<"$hook_args")
read -r -a capture <<<"$(sed -n 2p <<<"$hook_args")"

optional=()
if [[ -n "${HSX_CHUNKED_PREFILL_SIZE:-}" ]]; then
    optional+=(--chunked-prefill-size "$HSX_CHUNKED_PREFILL_SIZE")
fi

exec "$python" -m sglang.launch_server \
    --model-path "$model_path" \
    --tp-size "${HSX_TP_SIZE:-1}" \
    --host "${HSX_HOST:-127.0.0.1}" \
    --port "${HSX_PORT:-30000}" \
    --disable-radix-cache \
    "${capture[@]}" \
    --disable-prefill-cuda-graph \
    --forward-hooks "$forward_hooks" \
    "${optional[@]}" \
    "$@"
