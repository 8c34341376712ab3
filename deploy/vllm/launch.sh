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
py=${HSX_PYTHON:-python3}
# The dump root and the layer ids vLLM must capture (the aux layers, then n: the pre-norm
# final state), by the rules the connector itself applies: the same HSX_DUMP_ROOT read and
# the one aux-layer rule, with the model's layer count.
settings=$("$py" - "$model" <<'PY'
import json, os, sys
from pathlib import Path
from hsx_async.errors import HsxError
from hsx_async.layer_ids import num_layers_of
from hsx_async.protocol import parse_aux_layers
from hsx_async.server.hook_core import ENV_AUX_LAYERS, dump_root_from_env
model = sys.argv[1]
try:
    n = num_layers_of(json.loads((Path(model) / "config.json").read_text()))
except (OSError, ValueError) as exc:
    sys.exit(f"cannot read {model}/config.json: {exc}")
if n is None:
    sys.exit(f"{model}/config.json names no layer count (num_hidden_layers)")
try:
    root = dump_root_from_env(os.environ)
    layers = parse_aux_layers(os.environ[ENV_AUX_LAYERS], key=ENV_AUX_LAYERS, num_layers=n)
except HsxError as exc:
    sys.exit(f"launch.sh: {exc}")
print(json.dumps([*layers, n]), root, sep="\t")
PY
) || exit 2
capture=${settings%%$'\t'*}
export HSX_DUMP_ROOT=${settings#*$'\t'}
exec "$py" -m vllm.entrypoints.openai.api_server \
  --model "$model" \
  --host "${HSX_HOST:-127.0.0.1}" --port "${HSX_PORT:-8000}" \
  --tensor-parallel-size "${HSX_TP_SIZE:-1}" \
  --no-enable-prefix-caching \
  --speculative-config "{\"method\":\"extract_hidden_states\",\"num_speculative_tokens\":1,\"draft_model_config\":{\"hf_config\":{\"eagle_aux_hidden_state_layer_ids\":$capture}}}" \
  --kv-transfer-config '{"kv_connector":"HsxHiddenStatesConnector","kv_connector_module_path":"hsx_async.server.vllm.connector","kv_role":"kv_producer"}' \
  "$@"
