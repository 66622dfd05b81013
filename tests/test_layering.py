"""The house's import rules, checked on the source: an ast walk over every import of every module (imports inside
functions and `if TYPE_CHECKING:` blocks count, like those at the top; so does `importlib.import_module("literal")`),
plus Django's "app.Model" references. And
docs/ARCHITECTURE.md's room table, checked against what the code imports, so neither can drift from the other.

The rules (docs/ARCHITECTURE.md, "The gate"):
- the control plane's rooms import only downward, in CONTROL_PLANE's order: core is the ground floor and imports no
  room, controlplane is the roof that wires the rest and that no room imports;
- the control plane may use the SDK's shared modules (kcaas: node messages, sealing, the embedded broker), but never
  torch, triton, transformers, vllm, Hugging Face's kernels, kcaas_kernels or gpu_node — not even through a kcaas
  module it imports;
- the node side (gpu_node, kcaas_kernels, kcaas) never imports Django (or its family) nor a control-plane room;
- kcaas_kernels imports no room; the SDK (kcaas, connectors included) imports neither gpu_node nor kcaas_kernels;
  gpu_node imports only kcaas and kcaas_kernels; devtools (the dev PKI, the network store's processes) imports no
  room and no room imports it;
- no first-party module is importable as `kernels` (Hugging Face's package, which transformers needs, owns the name);
- no import cycle between rooms, nor between modules at import time.
Each failure names the file, the line and the rule broken. No database: this runs in `make lint` too.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"

# The control plane's rooms, ground floor first: each may import only the rooms before it.
CONTROL_PLANE = (
    "core",
    "audit",
    "tenants",
    "fleet",
    "caches",
    "routing",
    "billing",
    "privacy",
    "console",
    "controlplane",
)
NODE_SIDE = ("kcaas", "kcaas_kernels", "gpu_node")
ROOM_DIRS = {
    "core": "platform/core",
    "audit": "audit",
    "tenants": "tenants",
    "fleet": "platform/fleet",
    "caches": "platform/caches",
    "routing": "platform/routing",
    "billing": "platform/billing",
    "privacy": "platform/privacy",
    "console": "platform/console",
    "controlplane": "platform/controlplane",
    "kcaas": "kcaas",
    "kcaas_kernels": "kernels/kcaas_kernels",
    "gpu_node": "gpu_node",
    "devtools": "devtools",
}
# Folders that are source roots, not packages: a module's dotted name starts below them.
SOURCE_ROOTS = (ROOT / "platform", ROOT / "kernels")
ROOMS = tuple(ROOM_DIRS)

# The rooms each room may import. The control plane shares kcaas's plain modules with the node side.
ALLOWED = {
    **{room: {*CONTROL_PLANE[:i], "kcaas"} for i, room in enumerate(CONTROL_PLANE)},
    "kcaas": set(),
    "kcaas_kernels": set(),
    "gpu_node": {"kcaas", "kcaas_kernels"},
    "devtools": set(),  # the dev PKI and the network store's processes: for make up, make cluster and the tests
}
# What the node side never imports (the control-plane extra's web stack), and what the control plane never imports.
DJANGO_FAMILY = frozenset(
    {
        "django",
        "rest_framework",
        "drf_spectacular",
        "drf_spectacular_sidecar",
        "django_otp",
        "django_htmx",
        "dj_database_url",
        "whitenoise",
        "psycopg",
        "psycopg2",
    }
)
ML_FAMILY = frozenset({"torch", "triton", "transformers", "vllm", "kernels"})  # kernels: Hugging Face's
FORBIDDEN = {
    **{room: ML_FAMILY | {"kcaas_kernels", "gpu_node"} for room in CONTROL_PLANE},
    **{room: DJANGO_FAMILY | set(CONTROL_PLANE) for room in NODE_SIDE},
}
FORBIDDEN["kcaas"] |= {"gpu_node", "kcaas_kernels"}
FORBIDDEN["devtools"] = DJANGO_FAMILY | set(CONTROL_PLANE) | set(NODE_SIDE)
for room in (*CONTROL_PLANE, *NODE_SIDE):  # no server room imports the development helpers
    FORBIDDEN[room] = FORBIDDEN[room] | {"devtools"}

MODEL_FIELDS = {"ForeignKey", "OneToOneField", "ManyToManyField"}
DYNAMIC_IMPORTS = {"import_module", "__import__"}  # importlib.import_module("x.y") with a literal name is an import


@dataclass(frozen=True)
class Import:
    path: str  # the importing file, relative to the repository
    line: int
    module: str  # the importing module's dotted name
    target: str  # the imported module (the longest first-party module it names), or the top-level name
    kind: str = "import"  # "import" or "model reference"

    @property
    def top(self) -> str:
        return self.target.split(".")[0]

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_name(path: Path) -> str:
    """platform/ and kernels/ are source roots: platform/caches/services.py is `caches.services`."""
    rel = path.relative_to(next((root for root in SOURCE_ROOTS if path.is_relative_to(root)), ROOT))
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every first-party module of the rooms: dotted name -> file."""
    found = {}
    for folder in ROOM_DIRS.values():
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[module_name(path)] = path
    return found


def _resolve(name: str) -> str:
    """The longest first-party module `name` names (`kcaas.wire.encode` -> `kcaas.wire`), else `name` itself."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules():
            return candidate
    return name


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _dynamic_import(node: ast.Call) -> str | None:
    """The module of an `importlib.import_module("literal")` or `__import__("literal")`."""
    if _call_name(node) in DYNAMIC_IMPORTS and node.args and isinstance(node.args[0], ast.Constant):
        return node.args[0].value if isinstance(node.args[0].value, str) else None
    return None


def _model_reference(node: ast.Call) -> str | None:
    """The app label of a `ForeignKey("app.Model", ...)`-style reference, if it names one."""
    if _call_name(node) not in MODEL_FIELDS:
        return None
    args = [node.args[0]] if node.args else [k.value for k in node.keywords if k.arg == "to"]
    if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str) and "." in args[0].value:
        return args[0].value.split(".")[0]
    return None


@cache
def imports_of(module: str) -> tuple[Import, ...]:
    """Every import in the module's source, wherever it sits in the tree."""
    path = modules()[module]
    rel = str(path.relative_to(ROOT))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
        if isinstance(node, ast.Import):
            found += [Import(rel, node.lineno, module, _resolve(alias.name)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".") if package else []
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base for alias in node.names]
            found += [Import(rel, node.lineno, module, _resolve(target)) for target in dict.fromkeys(targets)]
        elif isinstance(node, ast.Call) and (name := _dynamic_import(node)) is not None:
            found.append(Import(rel, node.lineno, module, _resolve(name)))
        elif isinstance(node, ast.Call) and (label := _model_reference(node)) is not None:
            found.append(Import(rel, node.lineno, module, label, kind="model reference"))
    return tuple(found)


def room_of(module: str) -> str:
    return module.split(".")[0]


def all_imports() -> list[Import]:
    return [imp for module in modules() for imp in imports_of(module)]


def rooms_imported(room: str) -> set[str]:
    """The other rooms a room's modules import (model references included)."""
    return {imp.top for imp in all_imports() if room_of(imp.module) == room and imp.top in ROOMS} - {room}


# ---- the rules --------------------------------------------------------------------------------------------------


def test_rooms_import_only_the_rooms_below_them():
    broken = []
    for imp in all_imports():
        room = room_of(imp.module)
        if imp.top in ROOMS and imp.top != room and imp.top not in ALLOWED[room]:
            if room in CONTROL_PLANE and imp.top in CONTROL_PLANE[CONTROL_PLANE.index(room) :]:
                rule = f"upward: {imp.top} sits above {room} (ground floor first: {' <- '.join(CONTROL_PLANE)})"
            else:
                rule = (
                    f"{room} may import only {', '.join(sorted(ALLOWED[room]))}"
                    if ALLOWED[room]
                    else f"{room} imports no room"
                )
            broken.append(f"{imp.where()}: {imp.kind} of {imp.target}: {rule}")
    assert not broken, "upward or sideways imports:\n" + "\n".join(broken)


def test_no_first_party_module_is_importable_as_kernels():
    """`kernels` is Hugging Face's (transformers >= 5.25 imports it): a module of ours by that name shadows it from
    the repository root, or is shadowed by it elsewhere."""
    source_roots = [ROOT, *SOURCE_ROOTS]
    shadowing = [
        str(root / "kernels" / "__init__.py") for root in source_roots if (root / "kernels" / "__init__.py").exists()
    ]
    shadowing += [str(root / "kernels.py") for root in source_roots if (root / "kernels.py").exists()]
    shadowing += [name for name in modules() if name.split(".")[0] == "kernels"]
    assert not shadowing, f"importable as `kernels`: {shadowing}"


def test_forbidden_imports():
    broken = []
    for imp in all_imports():
        room = room_of(imp.module)
        if imp.top in FORBIDDEN[room]:
            side = "the control plane" if room in CONTROL_PLANE else f"the node side ({room})"
            broken.append(f"{imp.where()}: {imp.kind} of {imp.target}: {side} never imports {imp.top}")
    assert not broken, "forbidden imports:\n" + "\n".join(broken)


def _reach(module: str, stop: frozenset[str]) -> dict[str, list[Import]]:
    """The modules `module` reaches through first-party imports (importing a submodule imports its packages too),
    each with the chain of imports that first reaches it; nothing is followed past a module whose top level is in
    `stop`."""
    chains: dict[str, list[Import]] = {module: []}
    todo = [module]
    while todo:
        current = todo.pop(0)
        for imp in imports_of(current):
            parts = imp.target.split(".")
            for step in [".".join(parts[:end]) for end in range(1, len(parts))] + [imp.target]:
                if step not in chains:
                    chains[step] = chains[current] + [imp]
                    if step in modules() and parts[0] not in stop:
                        todo.append(step)
    return chains


def test_the_control_plane_reaches_no_ml_stack_through_kcaas():
    forbidden = frozenset(FORBIDDEN["core"])
    broken = []
    for imp in all_imports():
        if room_of(imp.module) in CONTROL_PLANE and imp.top == "kcaas" and imp.target in modules():
            reached = {}
            for name, chain in _reach(imp.target, forbidden).items():
                reached.setdefault(name.split(".")[0], chain)  # the first chain to each forbidden top level
            for top, chain in sorted(reached.items()):
                if top in forbidden:
                    via = " -> ".join(f"{step.target} ({step.where()})" for step in chain)
                    broken.append(
                        f"{imp.where()}: import of {imp.target} reaches {top}: the control plane never imports {top}, "
                        f"not through kcaas either (via {via})"
                    )
    assert not broken, "the control plane reaches the ML stack:\n" + "\n".join(broken)


def _cycles(edges: dict[str, dict[str, Import]]) -> list[str]:
    """Tarjan's strongly connected components of a graph whose edges carry the import that makes them: each
    component of more than one node is a cycle, described by the imports inside it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, {})):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted({*edges, *(target for targets in edges.values() for target in targets)}):
        if node not in index:
            visit(node)
    return [
        f"cycle between {', '.join(component)}:\n"
        + "\n".join(
            f"  {source} -> {target}: {edges[source][target].where()}"
            for source in component
            for target in sorted(edges.get(source, {}))
            if target in component
        )
        for component in components
    ]


def test_no_import_cycles_between_rooms():
    """Implied by the rules above for the rooms they order; checked on its own so that a new room cannot add one."""
    edges: dict[str, dict[str, Import]] = defaultdict(dict)
    for imp in all_imports():
        room = room_of(imp.module)
        if imp.top in ROOMS and imp.top != room:
            edges[room].setdefault(imp.top, imp)
    cycles = _cycles(edges)
    assert not cycles, "import cycles between rooms:\n" + "\n".join(cycles)


def _import_time_lines(tree: ast.Module) -> set[int]:
    """The lines of the imports that run when the module is imported: its top level, inside top-level if/try/with
    blocks too, not inside functions or classes."""
    lines: set[int] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.add(node.lineno)
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody"):
                todo += [child for child in getattr(node, field, []) if isinstance(child, ast.stmt)]
            for handler in getattr(node, "handlers", []):
                todo += handler.body
    return lines


def test_no_import_time_cycles_between_modules():
    """A module-level import cycle makes import order matter (a name missing in a half-initialized module)."""
    edges: dict[str, dict[str, Import]] = defaultdict(dict)
    for module, path in modules().items():
        lines = _import_time_lines(ast.parse(path.read_text()))
        for imp in imports_of(module):
            if imp.kind == "import" and imp.line in lines and imp.target in modules() and imp.target != module:
                edges[module].setdefault(imp.target, imp)
    cycles = _cycles(edges)
    assert not cycles, "import-time cycles between modules:\n" + "\n".join(cycles)


def test_no_import_cycles_between_modules_lazy_imports_included():
    """A late import inside a function that closes a cycle is the cycle hidden, not removed: the two modules still
    need each other (the one core.errors <-> core.transient had is gone: node_answers holds what needed both)."""
    edges: dict[str, dict[str, Import]] = defaultdict(dict)
    for module in modules():
        for imp in imports_of(module):
            if imp.kind == "import" and imp.target in modules() and imp.target != module:
                edges[module].setdefault(imp.target, imp)
    cycles = _cycles(edges)
    assert not cycles, "import cycles between modules (lazy imports included):\n" + "\n".join(cycles)


# ---- docs/ARCHITECTURE.md ---------------------------------------------------------------------------------------


def _room_rows() -> dict[str, tuple[int, str]]:
    """The room table's rows whose first cell is a whole room (`platform/caches/`, `audit/`, `kcaas/`):
    room -> (line number, imports cell)."""
    rows = {}
    dirs = {f"`{folder}/`": room for room, folder in ROOM_DIRS.items()}
    for number, line in enumerate(ARCHITECTURE.read_text().splitlines(), 1):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 3 and cells[0] in dirs:
            rows[dirs[cells[0]]] = (number, cells[2])
    return rows


def _rooms_named(cell: str) -> set[str]:
    """The rooms an imports cell names: its comma-separated words that are room names (a word in parentheses is a
    remark, not a name)."""
    cell = re.sub(r"\([^)]*\)", "", cell)
    words = {word.strip().strip("`") for word in re.split(r"[,;]", cell)}
    return words & set(ROOMS)


def test_architecture_room_table_lists_what_each_room_imports():
    rows = _room_rows()
    problems = [
        f"docs/ARCHITECTURE.md: no row for `{ROOM_DIRS[room]}/` in the room table" for room in ROOMS if room not in rows
    ]
    for room, (number, cell) in rows.items():
        named, actual = _rooms_named(cell), rooms_imported(room)
        if named != actual:
            problems.append(
                f"docs/ARCHITECTURE.md:{number}: the `{ROOM_DIRS[room]}/` row says it imports "
                f"{sorted(named) or 'no room'}, the code imports {sorted(actual) or 'no room'}"
                + (f" (missing from the row: {sorted(actual - named)})" if actual - named else "")
                + (f" (not imported: {sorted(named - actual)})" if named - actual else "")
            )
    assert not problems, "\n".join(problems)


def test_architecture_states_the_order_this_test_enforces():
    order = " <- ".join(f"`{room}`" for room in CONTROL_PLANE)
    assert order in ARCHITECTURE.read_text(), f"docs/ARCHITECTURE.md must state the control plane's order: {order}"
