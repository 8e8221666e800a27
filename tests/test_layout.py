"""The layout's promises, read from the import statements: the core never reaches up into the
periphery (serve/, measure/, and drafts/, which trains a draft and scores it with measure/),
and no two modules import each other, however indirectly; and the tests laid out like the
package."""
import ast
import re
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


# --- the reading order is the import order -----------------------------------------------------
README = ROOT / "README.md"


def resolve(name: str, folder: str, known: set) -> list:
    """A file or folder as the reading guide names it -> the modules it stands for. A bare name
    is in the folder named before it, else in minitransformer/ ("unless named"); a path is in
    minitransformer/ or at the top (quant/, sim/); a folder stands for every module in it."""
    path = name.removeprefix("../").removesuffix(".py").strip("/").replace("/", ".")
    tried = ([f"{folder}.{path}"] if folder and "/" not in name else []) + [path]
    for module in (f"{top}{m}" for m in tried for top in ("minitransformer.", "")):
        inside = sorted(m for m in known if m.startswith(module + "."))
        if module in known or (name.endswith("/") and inside):
            return [module] if module in known and not name.endswith("/") else inside
    raise AssertionError(f"the reading guide names {name!r}, which is no module of the project")


def named(text: str, known: set, pattern=r"`([^`]+)`") -> list:
    """The modules a passage names, in its order (scripts/ is no package: left out)."""
    modules, folder = [], ""
    for name in re.findall(pattern, text):
        if name.startswith("scripts/"):
            continue
        modules += resolve(name, folder, known)
        if "/" in name.strip("/"):                 # the folder of the bare names after it
            folder = name.removeprefix("../").rsplit("/", 1)[0].replace("/", ".")
    return modules


def readme_order(text: str, known: set) -> tuple:
    """README's reading order -> (the modules of its table, step by step, in order; the modules
    a first pass may skip)."""
    section = text.split("## Reading order", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| *\d+ *\| *([^|]+)\|", section, re.M)
    skip = section.split("A first pass may skip:", 1)[1].split("The same order is in", 1)[0]
    return [m for row in rows for m in named(row, known)], set(named(skip, known))


def forward_references(order: list, edges: dict, skipped: set) -> dict:
    """Module -> the project's modules it imports that the order has not come to yet (later in
    it, or nowhere in it and not to be skipped)."""
    found = {}
    for i, name in enumerate(order):
        ahead = sorted(t for t in edges[name] if t not in order[:i] and t not in skipped)
        if ahead:
            found[name] = ahead
    return found


def test_the_readme_reads_in_import_order():
    edges = graph()
    order, skipped = readme_order(README.read_text(), set(edges))
    assert order[:3] == ["minitransformer.config", "minitransformer.shape",
                         "minitransformer.model"] and "minitransformer.linear" in skipped
    assert len(order) == len(set(order)) and not set(order) & skipped
    assert forward_references(order, edges, skipped) == {}


def test_the_reading_guide_names_every_module():
    """Each module is a step of the reading order or one a first pass may skip (a package's
    __init__ aside): a module named nowhere would be read by nobody."""
    edges = graph()
    order, skipped = readme_order(README.read_text(), set(edges))
    packages = {m for m in edges if any(n.startswith(m + ".") for n in edges)}
    assert set(edges) - set(order) - skipped - packages == set()


def test_the_package_docstring_gives_the_readme_s_order():
    """Its list names the files in a column (indented 4, continued at 6), then says what they
    are after two spaces; its skip paragraph names them as plain words."""
    import minitransformer
    known = set(graph())
    steps, skip = minitransformer.__doc__.split("Reading order", 1)[1].split(
        "A first pass may skip:", 1)
    column = " ".join(re.findall(r"^ {4,6}(\S+(?: \S+)*)", steps.split("\n\n", 1)[1], re.M))
    files = r"((?:\.\./)?[\w/]+(?:\.py|/))"
    order, skipped = readme_order(README.read_text(), known)
    assert named(column, known, files) == order
    assert set(named(skip.split("\n\n", 1)[0], known, files)) == skipped


def test_a_forward_reference_is_found():
    edges = {"a": set(), "b": {"a", "skip"}, "c": {"d"}, "d": {"b"}, "skip": set()}
    assert forward_references(["a", "b", "d", "c"], edges, {"skip"}) == {}
    assert forward_references(["a", "b", "c", "d"], edges, {"skip"}) == {"c": ["d"]}
    assert forward_references(["a", "b"], edges, set()) == {"b": ["skip"]}  # named nowhere


def test_the_tests_are_laid_out_like_the_package():
    """Each folder of tests/ is a room of the package (a subpackage of minitransformer/, quant/,
    sim/ or scripts/), beside fixtures/; and no two test files share a name (pytest imports a
    test file by its name: there is no __init__.py)."""
    tests = ROOT / "tests"
    rooms = {p.name for p in (ROOT / "minitransformer").iterdir() if (p / "__init__.py").is_file()}
    rooms |= {"quant", "sim", "scripts", "fixtures"}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name[0] not in "._"}
    assert folders <= rooms, folders - rooms
    names = sorted(p.name for p in tests.rglob("*.py") if "__pycache__" not in p.parts)
    assert len(names) == len(set(names)), [n for n in set(names) if names.count(n) > 1]
    assert not list(tests.rglob("__init__.py"))
