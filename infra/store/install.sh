#!/usr/bin/env bash
# System library of the remote tier's store (Mooncake Store): its wheel
# (mooncake-transfer-engine-non-cuda, a NexusKV dependency that pip installs) links libibverbs,
# which comes from Debian. Idempotent: installs only what is missing; needs root (or sudo) when
# something is. Run before `python -m pip install -e ".[dev]"` (the README's install command).
set -euo pipefail

packages=(libibverbs1)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "infra/store/install.sh: ${packages[*]} already installed"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "infra/store/install.sh: ${missing[*]} missing and no apt-get here; install them with the system's package manager" >&2
  exit 1
fi
sudo=()
[[ $(id -u) -eq 0 ]] || sudo=(sudo)
"${sudo[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "infra/store/install.sh: installed ${missing[*]}"
