"""The layer order of the code base, written down once, and a checker of every module's imports (ast only).

A module may import from its own layer and from the layers it lists as below it; any other import of a project
module is an arrow the wrong way. Imports under `if TYPE_CHECKING:` and inside functions count too: they are
still dependencies a reader must follow, and a lazy import is how an upward arrow usually hides.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Layer name -> module prefixes (longest prefix wins when a module matches several).
LAYERS: dict[str, tuple[str, ...]] = {
    "proto": ("client.protogen", "client._gen", "client.checksums"),  # the wire contract (the generated code and
    # the checksum kinds a push names), under everything
    "ground": ("service", "service.config", "service.params", "service.tokenizer", "service.protogen",
               "service.netutil", "service.safetensors_io"),
    "models": ("service.models",),
    "backend": ("service.backend",),
    "engine": ("service.engine",),
    "vllm": ("service.vllm",),
    "api": ("service.api",),
    "buffer": ("service.buffer",),
    "demo": ("service.demo",),
    "drafter_trainer": ("drafter_trainer",),
    "app": ("service.app",),
    "cli": ("service.cli", "service.__main__"),
    "client": ("client",),
    "bench": ("bench",),
    "examples": ("examples",),
}

# What each layer may import besides itself: the layers below it. The seam is `backend`: the transport (api),
# the buffer and both engines sit on it side by side and never import each other.
BELOW: dict[str, frozenset[str]] = {
    "proto": frozenset(),
    "ground": frozenset(),
    "models": frozenset({"ground"}),
    "backend": frozenset({"ground", "models"}),
    "engine": frozenset({"ground", "models", "backend"}),
    "vllm": frozenset({"ground", "models", "backend"}),
    "api": frozenset({"ground", "backend"}),  # never models, engine, vllm: only the RolloutBackend interface
    "buffer": frozenset({"ground", "backend"}),
    "demo": frozenset({"ground", "models", "backend", "engine"}),
    "drafter_trainer": frozenset({"ground", "models", "backend", "engine", "buffer", "client"}),
    "app": frozenset({"ground", "models", "backend", "engine", "vllm", "api", "buffer", "demo", "drafter_trainer"}),
    "cli": frozenset({"ground", "models", "backend", "engine", "vllm", "api", "buffer", "demo", "drafter_trainer",
                      "app", "client"}),
    "client": frozenset(),  # the proto only (allowed everywhere): installable without the server
    "bench": frozenset({"ground", "models", "backend", "engine", "vllm", "api", "buffer", "demo", "drafter_trainer",
                        "app", "cli", "client", "examples"}),  # bench/e2e.py runs the GRPO example
    # a user's trainer: the client, plus (GRPO example) our decoder for the policy and the demo task
    "examples": frozenset({"client", "ground", "models", "demo"}),
}

# Finer rules inside a layer.
NEVER: tuple[tuple[str, str, str], ...] = (
    ("service.engine.drafters", "service.engine.llm_engine", "drafters get what they need, not the engine"),
    ("service.engine.scheduler", "torch", "the scheduler is torch-free"),
    *(("drafter_trainer", live, "the in-process trainer reaches the engine through RolloutBackend only")
      for live in ("service.engine.native", "service.engine.llm_engine", "service.engine.loop")),
    ("service.app", "service.engine.background_compile", "how its threads end is the backend's: must_exit_hard"),
)

ROOTS = ("service", "client", "drafter_trainer", "bench", "examples")


def layer_of(module: str) -> str | None:
    best, best_len = None, -1
    for layer, prefixes in LAYERS.items():
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = layer, len(p)
    return best


@dataclass(frozen=True, slots=True)
class Violation:
    path: str
    line: int
    module: str
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.module} imports {self.imported} ({self.why})"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:  # `from service import engine` imports the module service.engine
                yield node.lineno, f"{target}.{alias.name}"


def check_file(root: Path, path: Path) -> list[Violation]:
    module = module_name(root, path)
    layer = layer_of(module)
    if layer is None:
        return []
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = str(path.relative_to(root))
    found: dict[tuple[int, str], Violation] = {}
    for line, imported in imports_of(tree, module, path.name == "__init__.py"):
        for src, dst, why in NEVER:
            if (module == src or module.startswith(src + ".")) and (imported == dst or imported.startswith(dst + ".")):
                found[(line, dst)] = Violation(rel, line, module, dst, why)
        target = layer_of(imported)
        if target is None or target in (layer, "proto") or target in BELOW[layer]:
            continue
        if imported.rpartition(".")[0] and layer_of(imported.rpartition(".")[0]) in (layer, *BELOW[layer]) \
                and not _is_module(root, imported):
            continue  # `from pkg import name`: a name, not a module of another layer
        found.setdefault((line, target), Violation(rel, line, module, imported, f"{layer} -> {target}"))
    return list(found.values())


def _is_module(root: Path, dotted: str) -> bool:
    p = root.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def check_tree(root: Path) -> list[Violation]:
    out: list[Violation] = []
    for top in ROOTS:
        for path in sorted((root / top).rglob("*.py")):
            if "_gen" in path.parts or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            out.extend(check_file(root, path))
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of `package` -> the modules of `package` it imports (at run time, under TYPE_CHECKING or
    inside a function: every import a reader follows)."""
    base = root.joinpath(*package.split("."))
    paths = {module_name(root, p): p for p in sorted(base.rglob("*.py"))}

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in paths:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        found = {resolve(t) for _, t in imports_of(tree, module, path.name == "__init__.py")}
        graph[module] = {m for m in found if m is not None and m != module}
    return graph


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest path of imports (modules in order, the importer first); raises ValueError on a cycle."""
    memo: dict[str, list[str]] = {}
    stack: list[str] = []

    def chain(module: str) -> list[str]:
        if module in stack:
            raise ValueError("import cycle: " + " -> ".join([*stack[stack.index(module):], module]))
        if module not in memo:
            stack.append(module)
            memo[module] = [module, *max((chain(m) for m in sorted(graph[module])), key=len, default=[])]
            stack.pop()
        return memo[module]

    return max((chain(m) for m in sorted(graph)), key=len, default=[])
