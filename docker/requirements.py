"""Print the pip requirements of one pdserve image, taken from pyproject.toml's pins.

    python docker/requirements.py light    # bootstrap and gateway: no torch
    python docker/requirements.py worker   # prefill and decode: everything pyproject.toml lists

pyproject.toml stays the one place versions are pinned: build.sh downloads wheels for these lines
on the host, and the Dockerfile installs the same lines inside the image. Standard library only
(tomllib: Python 3.11+), so it runs in a bare base image before anything is installed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

# What bootstrap and the gateway import (checked in the built image: `pdserve launch-router
# --help` and `pdserve bootstrap --help` run there, and neither image has torch).
LIGHT = ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "uvloop",
         "prometheus-client", "fastapi", "uvicorn", "tokenizers", "jinja2", "httpx")

# Installed with --no-deps by scripts/setup.sh and the Dockerfile: its metadata pulls CUDA torch.
NO_DEPS = ("nixl-cu12==1.5.1",)


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def requirements(role: str, pyproject: Path) -> list[str]:
    pins = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    if role == "worker":
        return list(pins)
    if role == "light":
        chosen = [pin for pin in pins if _name(pin) in LIGHT]
        missing = set(LIGHT) - {_name(pin) for pin in chosen}
        if missing:
            raise SystemExit(f"requirements.py: pyproject.toml no longer lists {sorted(missing)}")
        return chosen
    if role == "no-deps":
        return list(NO_DEPS)
    raise SystemExit(f"usage: requirements.py light|worker|no-deps [PYPROJECT], got {role!r}")


def main() -> None:
    if len(sys.argv) not in (2, 3):
        raise SystemExit("usage: requirements.py light|worker|no-deps [PYPROJECT]")
    pyproject = (Path(sys.argv[2]) if len(sys.argv) == 3
                 else Path(__file__).resolve().parent.parent / "pyproject.toml")
    print("\n".join(requirements(sys.argv[1], pyproject)))


if __name__ == "__main__":
    main()
