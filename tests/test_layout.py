"""The layout's promises, read from the import statements: the core never reaches up into the
periphery (serve/, measure/, and drafts/, which trains a draft and scores it with measure/),
and no two modules import each other, however indirectly."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("minitransformer", "quant", "sim")
PERIPHERY = ("minitransformer.serve", "minitransformer.measure", "minitransformer.drafts")
ENTRY_POINTS = ("minitransformer.__main__",)  # the command line serves: it may import serve/


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set) -> set:
    """The project's modules that a file imports, anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:  # "from package import module" or "from module import name"
                module = f"{node.module}.{alias.name}"
                found.add(module if module in known else node.module)
    return found & known


def graph() -> dict:
    """Module -> the project's modules it imports. A module's own packages are left out: Python
    runs a package's __init__ before any module in it, whoever imports what."""
    files = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    return {name: {t for t in imports(path, set(files)) if not (name + ".").startswith(t + ".")}
            for name, path in files.items()}


def in_periphery(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in PERIPHERY)


def test_the_core_imports_nothing_from_serve_or_measure():
    edges = graph()
    core = [name for name in edges if name.startswith("minitransformer")
            and not in_periphery(name) and name not in ENTRY_POINTS]
    assert "minitransformer.model" in core and "minitransformer.speculative" in core
    upward = {name: sorted(t for t in edges[name] if in_periphery(t)) for name in core}
    assert {name: up for name, up in upward.items() if up} == {}


def cycle(edges: dict):
    """One import circle as a list of modules, or None (depth-first search, three colours)."""
    state, stack = {}, []

    def visit(name):
        state[name] = "open"
        stack.append(name)
        for target in sorted(edges.get(name, ())):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[name] = "done"
        stack.pop()
        return None

    for name in sorted(edges):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_no_import_circle():
    edges = graph()
    assert "minitransformer.formats.gguf" in edges["minitransformer.loader"]  # it does see
    assert cycle(edges) is None


def test_the_circle_finder_finds_one():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None
