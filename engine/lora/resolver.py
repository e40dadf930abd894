"""On-demand adapters: a request's adapter name resolved to a folder of the worker's
--lora-resolver-dir (vLLM's filesystem LoRA resolver: the adapter named X is the folder X there).

The name comes from a client (a request's `model`), so it is checked before it touches the file
system: one path component of letters, digits and `._-`, not starting with a dot, at most 128
characters; and the folder it names, with every link resolved, must still lie directly in the
directory. Anything else is refused as not found, the answer for a name that has no adapter.
"""

from __future__ import annotations

import re
from pathlib import Path

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class AdapterNotFound(LookupError):
    """No adapter of that name in the resolver directory (or a name that cannot be one)."""


def resolve_adapter_folder(root: str | Path, name: str) -> Path:
    """The folder of adapter `name` under `root`; AdapterNotFound saying why not."""
    if not ADAPTER_NAME.match(name) or ".." in name:
        raise AdapterNotFound(f"{name!r} is not an adapter name (letters, digits and ._-, at most 128, "
                              "no leading dot)")
    base = Path(root).resolve()
    folder = (base / name).resolve()
    if folder.parent != base:
        raise AdapterNotFound(f"adapter {name!r} resolves outside the adapter directory")
    if not (folder / "adapter_config.json").is_file():
        raise AdapterNotFound(f"no adapter {name!r} in the adapter directory")
    return folder
