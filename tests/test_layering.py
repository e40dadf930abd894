"""The dependency rule between the top-level packages, checked statically.

Every .py file under pdserve, services, engine, libkv, kernels and tools is parsed with `ast` (nothing
is imported); each import statement, wherever it is in the file (module level, a function, a
TYPE_CHECKING block), is resolved to a module of this repository or to a third-party top-level name.
The rule (each is one test below):

- `tools` may import anything; nothing outside tools (and tests) imports `tools`;
- `services/*` imports only services, engine, libkv, protos and pdserve;
- services/common and services/worker import no role package (prefill, decode, gateway, bootstrap);
  role packages do not import each other; services/launch_server.py, the worker composition root,
  may import the worker roles;
- services/gateway and services/bootstrap import nothing that can pull torch (engine, libkv,
  kernels, services.worker), and nothing they reach through the repository's imports imports torch
  or transformers;
- engine imports only engine, libkv, kernels and pdserve, and never grpc;
- libkv imports only libkv, kernels and pdserve, and never grpc;
- pdserve, the core every process imports, imports only pdserve, and never torch or transformers.

Imports by name at run time (pdserve/cli.py's command table, importlib) are not imports here.
KNOWN lists the violations that other work in progress removes; each must still occur, so that it
is deleted from the list once it is gone.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("pdserve", "services", "engine", "libkv", "kernels", "tools")
RESOLVABLE = (*CHECKED, "protos")  # protos is generated code: a target, not checked itself
ROLES = ("services.prefill", "services.decode", "services.gateway", "services.bootstrap", "services.encoder")
WORKER_ROLES = ("services.prefill", "services.decode", "services.encoder")  # what launch-server starts
TORCH = ("torch", "transformers")

# (importing module, imported module) pairs that break the rule today and are being removed by
# work in progress elsewhere; delete an entry when its import is gone (test_known_exceptions_still_occur
# says which).
KNOWN: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One import statement of `module` (file `path`, line `line`): the repository module it
    reaches (`target`), or the third-party top-level name (`external`)."""

    module: str
    path: str
    line: int
    target: str | None
    external: str | None

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target or self.external}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    """Every repository module under RESOLVABLE, by dotted name."""
    found = {}
    for top in RESOLVABLE:
        for path in sorted((ROOT / top).rglob("*.py")) if (ROOT / top).is_dir() else ():
            found[_module_name(path)] = path
    return found


def _resolve(name: str) -> str | None:
    """The longest prefix of dotted `name` that is a repository module (None: third party)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules():
            return ".".join(parts[:end])
    return None


def _imported_names(module: str, path: Path, node: ast.AST) -> Iterable[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join([*package, *([base] if base else [])])
        # `from a import b` imports module a.b when there is one, else the name b of module a.
        yield from (f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names)


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    path = modules()[module]
    rel = path.relative_to(ROOT).as_posix()
    found: dict[tuple[int, str], Import] = {}  # `from a import b, c` is one import of module a
    for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
        for name in _imported_names(module, path, node):
            target = _resolve(name)
            external = None if target else name.split(".")[0]
            found.setdefault((node.lineno, target or external),
                             Import(module, rel, node.lineno, target, external))
    return tuple(found.values())


def checked_imports(*packages: str) -> list[Import]:
    """Every import of every checked module in `packages` (dotted prefixes)."""
    return [imp for module in sorted(modules())
            if module.split(".")[0] in CHECKED and _within(module, packages)
            for imp in imports_of(module)]


def _within(module: str | None, packages: Iterable[str]) -> bool:
    return module is not None and any(module == p or module.startswith(p + ".") for p in packages)


def _fail_on(violations: list[Import], rule: str) -> None:
    new = [v for v in violations if (v.module, v.target or v.external) not in KNOWN]
    assert not new, f"{rule}:\n  " + "\n  ".join(map(str, new))


def test_nothing_outside_tools_imports_tools() -> None:
    outside = [p for p in CHECKED if p != "tools"]
    _fail_on([imp for imp in checked_imports(*outside) if _within(imp.target, ["tools"])],
             "only tools and tests import tools")


def test_services_import_only_services_engine_libkv_protos_pdserve() -> None:
    allowed = ("services", "engine", "libkv", "protos", "pdserve")
    _fail_on([imp for imp in checked_imports("services") if imp.target and not _within(imp.target, allowed)],
             f"services may import only {', '.join(allowed)}")


def test_shared_service_code_imports_no_role() -> None:
    _fail_on([imp for imp in checked_imports("services.common", "services.worker")
              if _within(imp.target, ROLES)],
             "services/common and services/worker never import a role package (" + ", ".join(ROLES) + ")")


def test_roles_do_not_import_each_other() -> None:
    violations = []
    for role in ROLES:
        others = [r for r in ROLES if r != role]
        violations += [imp for imp in checked_imports(role) if _within(imp.target, others)]
    _fail_on(violations, "a role package never imports another")


def test_launch_server_composes_only_the_worker_roles() -> None:
    others = [r for r in ROLES if r not in WORKER_ROLES]
    _fail_on([imp for imp in checked_imports("services.launch_server") if _within(imp.target, others)],
             "services/launch_server.py may import the roles it starts (prefill, decode, encoder), "
             "no other role")


def test_gateway_and_bootstrap_import_nothing_that_pulls_torch() -> None:
    heavy = ("engine", "libkv", "kernels", "services.worker")
    _fail_on([imp for imp in checked_imports("services.gateway", "services.bootstrap")
              if _within(imp.target, heavy) or imp.external in TORCH],
             "services/gateway and services/bootstrap import none of " + ", ".join(heavy + TORCH))


def _with_packages(module: str) -> list[str]:
    """`module` and the packages Python imports first (a.b.c: a, a.b, a.b.c)."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1) if ".".join(parts[:end]) in modules()]


def torch_reached_from(starts: list[str]) -> list[str]:
    """Each import of torch or transformers by a module that `starts` import, directly or through
    other repository modules, with the chain of imports that reaches it."""
    via: dict[str, str | None] = {m: None for m in starts}  # module -> the module that imported it
    queue, found = list(starts), []
    while queue:
        module = queue.pop()
        for imp in imports_of(module):
            if imp.external in TORCH:
                chain = [module]
                while via[chain[-1]] is not None:
                    chain.append(via[chain[-1]])
                found.append(f"{imp} (reached by {' <- '.join(chain)})")
            for reached in _with_packages(imp.target) if imp.target else ():
                if reached not in via:
                    via[reached] = module
                    queue.append(reached)
    return found


def test_gateway_and_bootstrap_never_reach_torch() -> None:
    """Through the repository's own imports, transitively: no module the gateway or the registry
    imports (directly or not) imports torch or transformers."""
    starts = [m for m in sorted(modules()) if _within(m, ("services.gateway", "services.bootstrap"))]
    found = torch_reached_from(starts)
    assert not found, "the gateway and the registry must never import torch:\n  " + "\n  ".join(found)


def test_engine_imports_only_engine_libkv_kernels_pdserve() -> None:
    allowed = ("engine", "libkv", "kernels", "pdserve")
    _fail_on([imp for imp in checked_imports("engine")
              if (imp.target and not _within(imp.target, allowed)) or imp.external == "grpc"],
             f"engine may import only {', '.join(allowed)}, and never grpc")


def test_libkv_imports_only_libkv_kernels_pdserve() -> None:
    allowed = ("libkv", "kernels", "pdserve")
    _fail_on([imp for imp in checked_imports("libkv")
              if (imp.target and not _within(imp.target, allowed)) or imp.external == "grpc"],
             f"libkv may import only {', '.join(allowed)}, and never grpc")


def test_pdserve_is_a_torch_free_core() -> None:
    _fail_on([imp for imp in checked_imports("pdserve")
              if (imp.target and not _within(imp.target, ["pdserve"])) or imp.external in TORCH],
             "pdserve imports only pdserve, and never " + " or ".join(TORCH))


def test_known_exceptions_still_occur() -> None:
    occurring = {(imp.module, imp.target or imp.external) for imp in checked_imports(*CHECKED)}
    gone = sorted(pair for pair in KNOWN if pair not in occurring)
    assert not gone, f"these imports are gone: delete them from KNOWN in {Path(__file__).name}: {gone}"


def test_the_checker_sees_the_repository() -> None:
    """Guards the checker itself: it finds modules and resolves imports of each kind."""
    assert {"pdserve.cli", "services.launch_server", "engine.engine", "libkv.pool"} <= set(modules())
    targets = {imp.target for imp in imports_of("services.launch_server")}
    assert {"services.worker.runtime", "pdserve.config_flags", "protos.v1.worker_pb2"} <= targets
    assert "services.prefill.servicer" in targets  # a function-level import
    assert any(imp.external == "torch" for imp in imports_of("libkv.pool"))
    # services.worker.wire -> libkv.layout, which imports torch.
    assert any("libkv/layout.py" in line and "services.worker.wire" in line
               for line in torch_reached_from(["services.worker.wire"]))
