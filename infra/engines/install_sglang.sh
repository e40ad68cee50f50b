#!/usr/bin/env bash
# Install SGLang 0.5.23's own code into the current Python environment, next to NexusKV, and the
# KV-event publisher code of the older SGLang releases the event bridge supports.
#
#   bash infra/engines/install_sglang.sh          # after: python -m pip install -e ".[dev]"
#
# What NexusKV runs of SGLang (tests/connectors/sglang_real/): its KV-event publisher and event
# structs (srt/disaggregation/kv_events.py), its radix caches' event recorders, its HiCache storage
# factory (srt/mem_cache/storage/backend_factory.py), its cache controllers and host/device pools.
# None of that needs a GPU or SGLang's CUDA kernels, so this script does not `pip install sglang`
# (which pins torch==2.14.1 and pulls ~5 GB of CUDA wheels): it installs the sglang wheel with
# --no-deps and then only the packages those modules import, with torch held at the version
# already installed (torch 2.13.0 from NexusKV's install; torchvision comes in the build for it).
# The versions below are the ones the tests were run with; a package that is already installed
# (for instance by infra/engines/install_vllm.sh) is left as it is.
#
# click: transformers -> huggingface_hub>=1.31 requires click>=8.4.2 while faust-streaming 0.15.3
# declares click<8.4. huggingface_hub gets its click; faust runs on it (NexusKV uses faust as a
# library, never its click command line; the test suite runs every Faust app with it). `pip check`
# then reports that conflict and sglang's own undeclared requirements (it was installed with
# --no-deps); this script fails if it reports anything else about a package it installed.
#
# Older publishers: the kv_events.py of SGLang 0.5.10.post1, 0.5.15, 0.5.18, 0.5.20 and 0.5.22,
# extracted from their wheels (about 100 MB downloaded once, a few seconds) into
# $NEXUSKV_SGLANG_PUBLISHERS (default ~/.cache/nexuskv/sglang-publishers/<version>/kv_events.py);
# the wheels themselves are not kept.
#
# SGLang computes its page hashes with a C++ extension it compiles on first use (ninja, a C++
# compiler and the OpenSSL headers: g++ and libssl-dev on Debian); this script compiles it once
# (about 25 s, cached under ~/.cache/torch_extensions), so a missing toolchain fails the install.
#
# Idempotent: when everything is in place it checks package metadata and files (about a second)
# and exits. Cold on a machine with NexusKV installed: about a minute and a half, ~600 MB.
# Environment: PYTHON (default: python), NEXUSKV_SGLANG_PUBLISHERS.
set -euo pipefail

SGLANG_VERSION=0.5.23
OLD_PUBLISHERS="0.5.10.post1 0.5.15 0.5.18 0.5.20 0.5.22"
PYTHON=${PYTHON:-python}
PUBLISHERS=${NEXUSKV_SGLANG_PUBLISHERS:-$HOME/.cache/nexuskv/sglang-publishers}
# The modules SGLang's HiCache and KV-event code import, at the versions they were verified with.
REQUIREMENTS=(
  "orjson==3.13.0" "psutil==7.2.2" "pybase64==1.5.1" "starlette==1.10.0" "ipython==9.18.1"
  "transformers==5.19.0" "torchvision" "dill==0.4.1" "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.3"
  "compressed-tensors==0.20.1" "gguf==0.19.0" "openai==3.57.0" "partial-json-parser==0.2.1.1.post7" "ninja"
)

# Prints the requirements that are not installed (any installed version counts) and the old
# publishers that are missing; exits 0 when nothing is missing.
missing() {
  "$PYTHON" - "$SGLANG_VERSION" "$PUBLISHERS" "$OLD_PUBLISHERS" "${REQUIREMENTS[@]}" <<'PY'
import sys
from importlib import metadata
from pathlib import Path

version, publishers, old, *reqs = sys.argv[1:]
out = []
try:
    have = metadata.version("sglang")
    if have != version:
        out.append(f"sglang=={version} (installed {have})")
except metadata.PackageNotFoundError:
    out.append(f"sglang=={version}")
for req in reqs:
    name = req.split("==")[0]
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        out.append(req)
for v in old.split():
    if not (Path(publishers) / v / "kv_events.py").is_file():
        out.append(f"publisher:{v}")
import os
ext = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
if not any(ext.glob("*/hicache_hash_cpp/hicache_hash_cpp*.so")):
    out.append("build:sglang-native-page-hash")
print("\n".join(out))
sys.exit(1 if out else 0)
PY
}

if todo=$(missing); then
  echo "install_sglang: sglang $SGLANG_VERSION, its imports and the old publishers are installed; nothing to do"
  exit 0
fi
start=$(date +%s)
prefix=$("$PYTHON" -c 'import sys; print(sys.prefix)')
torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')
echo "install_sglang: installing into $prefix (torch $torch_version held):"
echo "$todo" | sed 's/^/  /'

if echo "$todo" | grep -q '^sglang=='; then
  "$PYTHON" -m pip install --no-deps "sglang==$SGLANG_VERSION"
fi
pkgs=$(echo "$todo" | grep -v -e '^sglang==' -e '^publisher:' -e '^build:' || true)
installed_names=""
if [[ -n "$pkgs" ]]; then
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  echo "torch==$torch_version" >"$constraints"
  # shellcheck disable=SC2086
  "$PYTHON" -m pip install -c "$constraints" $pkgs
  installed_names=$(echo "$pkgs" | sed 's/==.*//')
fi

for v in $(echo "$todo" | sed -n 's/^publisher://p'); do
  tmp=$(mktemp -d)
  "$PYTHON" -m pip download --quiet --no-deps "sglang==$v" -d "$tmp"
  "$PYTHON" - "$tmp" "$PUBLISHERS/$v" <<'PY'
import sys, zipfile
from pathlib import Path

wheel = next(Path(sys.argv[1]).glob("sglang-*.whl"))
dest = Path(sys.argv[2])
dest.mkdir(parents=True, exist_ok=True)
with zipfile.ZipFile(wheel) as z:
    data = z.read("sglang/srt/disaggregation/kv_events.py")
(dest / "kv_events.py.tmp").write_bytes(data)
(dest / "kv_events.py.tmp").replace(dest / "kv_events.py")
(dest / "SOURCE").write_text(f"{wheel.name}: sglang/srt/disaggregation/kv_events.py\n")
PY
  rm -rf "$tmp"
  echo "install_sglang: publisher code of SGLang $v in $PUBLISHERS/$v"
done

# The conflicts this script accepts (see the header); one about a package it installed fails it.
report=$("$PYTHON" -m pip check 2>&1 || true)
unexpected=$(echo "$report" | grep -v -E '^(sglang |faust-streaming [^ ]+ (has requirement|requires) click)' \
  | grep -v -E '^No broken requirements' || true)
for name in $installed_names; do
  if echo "$unexpected" | grep -i -q -E "^${name//-/[-_]} "; then
    echo "install_sglang: pip check reports a conflict of a package this script installed:" >&2
    echo "$unexpected" >&2
    exit 1
  fi
done
"$PYTHON" - <<'PY'
import sglang
from sglang.srt.disaggregation import kv_events  # noqa: F401
from sglang.srt.managers import cache_controller  # noqa: F401
from sglang.srt.mem_cache import hicache_storage, radix_cache, unified_radix_cache  # noqa: F401
from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller  # noqa: F401
from sglang.srt.mem_cache.storage import backend_factory  # noqa: F401
from sglang.srt.mem_cache.utils import get_hash_str
import torch
assert len(get_hash_str([1, 2, 3, 4], None, page_size=2)) == 2  # builds SGLang's native page hash once
print(f"install_sglang: sglang {sglang.__version__} imports on torch {torch.__version__}; its page hash is built")
PY
echo "install_sglang: done in $(( $(date +%s) - start )) s"
