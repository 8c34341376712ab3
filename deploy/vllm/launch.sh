#!/usr/bin/env bash
# Start vLLM with the hsx connector: every flag hsx needs, checked before vLLM starts.
#
#   HSX_AUX_LAYERS=2,30,58 deploy/vllm/launch.sh /models/Kimi-K2.5 [extra vLLM args...]
#
# HSX_AUX_LAYERS   aux layers in hsx numbering (the residual stream entering layer k), required
# HSX_DUMP_ROOT    where dumps go (default /dev/shm/hsx); the client's [dump].root
# HSX_PYTHON       the Python that has vLLM and hsx_async (default: python3)
# HSX_PORT         port (default 8000); HSX_HOST (default 127.0.0.1)
# HSX_TP_SIZE      tensor-parallel size (default 1)
set -euo pipefail
usage() { echo "usage: HSX_AUX_LAYERS=2,30,58 $0 MODEL_DIR [vLLM args...]" >&2; exit 2; }
[ $# -ge 1 ] || usage
model=$1; shift
[ -n "${HSX_AUX_LAYERS:-}" ] || { echo "$0: set HSX_AUX_LAYERS (e.g. 2,30,58)" >&2; exit 2; }
root=${HSX_DUMP_ROOT:-/dev/shm/hsx}
case "$root" in /*) ;; *) echo "$0: HSX_DUMP_ROOT=$root is relative; give an absolute path" >&2; exit 2;; esac
py=${HSX_PYTHON:-python3}
# The layer ids vLLM must capture: the aux layers, then n (the pre-norm final state).
capture=$("$py" - "$model" "$HSX_AUX_LAYERS" <<'PY'
import json, sys
from pathlib import Path
from hsx_async.layer_ids import num_layers_of
model, aux = sys.argv[1], sys.argv[2]
try:
    layers = [int(x) for x in aux.split(",")]
except ValueError:
    sys.exit(f"HSX_AUX_LAYERS={aux!r} is not a comma-separated list of integers")
if any(b <= a for a, b in zip(layers, layers[1:])) or min(layers) < 0:
    sys.exit(f"HSX_AUX_LAYERS={aux!r} is not strictly ascending and non-negative")
try:
    n = num_layers_of(json.loads((Path(model) / "config.json").read_text()))
except (OSError, ValueError) as exc:
    sys.exit(f"cannot read {model}/config.json: {exc}")
if n is None or max(layers) >= n:
    sys.exit(f"HSX_AUX_LAYERS={aux!r} does not fit a model with {n} layers")
print(json.dumps(layers + [n]))
PY
) || exit 2
export HSX_DUMP_ROOT=$root
exec "$py" -m vllm.entrypoints.openai.api_server \
  --model "$model" \
  --host "${HSX_HOST:-127.0.0.1}" --port "${HSX_PORT:-8000}" \
  --tensor-parallel-size "${HSX_TP_SIZE:-1}" \
  --no-enable-prefix-caching \
  --speculative-config "{\"method\":\"extract_hidden_states\",\"num_speculative_tokens\":1,\"draft_model_config\":{\"hf_config\":{\"eagle_aux_hidden_state_layer_ids\":$capture}}}" \
  --kv-transfer-config '{"kv_connector":"HsxHiddenStatesConnector","kv_connector_module_path":"hsx_async.server.vllm.connector","kv_role":"kv_producer"}' \
  "$@"
