"""The library reads in small pieces: no function over 80 lines, none with more than 8
parameters (the anchors' longest: nano-vllm's model runner 257 lines in all, llama2.c's
``forward`` 132; what a function needs beyond 8 values travels in a config or state
dataclass, as ``EngineConfig`` or ``SamplingSettings``). The one exception is the stable public
API the package exports (``minitransformer.__all__``): its signatures are documented and kept,
so its width is not counted (its length is)."""
import ast
import inspect
from pathlib import Path

import minitransformer

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("minitransformer", "quant", "sim")
MAX_LINES, MAX_PARAMETERS = 80, 8


def measure(tree) -> list:
    """(line, name, lines, parameters) of every function and method in a module's tree, nested
    ones too; lines from the first decorator to the last line, docstring included; parameters
    every name it takes (*args and **kwargs one each), a method's self or cls not counted."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
            names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
            if names[:1] in (["self"], ["cls"]):
                names = names[1:]
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found.append((node.lineno, node.name, node.end_lineno - first + 1, len(names)))
    return found


def public_api() -> set:
    """(file relative to the root, name) of each function the package exports."""
    found = set()
    for name in minitransformer.__all__:
        obj = getattr(minitransformer, name)
        if inspect.isfunction(obj):
            file = Path(inspect.getsourcefile(obj)).resolve()
            found.add((file.relative_to(ROOT), obj.__name__))
    return found


def offenders(root=ROOT, exempt=frozenset()) -> list:
    """'file:line name: N lines' or '...: N parameters' for each function of the library past
    a limit."""
    out = []
    for package in LIBRARY:
        for file in sorted((root / package).rglob("*.py")):
            tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
            for line, name, lines, parameters in measure(tree):
                where = f"{file.relative_to(root)}:{line} {name}"
                if lines > MAX_LINES:
                    out.append(f"{where}: {lines} lines (at most {MAX_LINES})")
                if parameters > MAX_PARAMETERS and (file.relative_to(root), name) not in exempt:
                    out.append(f"{where}: {parameters} parameters (at most {MAX_PARAMETERS})")
    return out


def test_no_library_function_is_too_long_or_too_wide():
    found = offenders(exempt=public_api())
    assert not found, "split these, or pass a dataclass:\n" + "\n".join(found)


def test_the_measure_counts_lines_and_parameters_as_it_says(tmp_path):
    """The scan itself: a long function and a wide one are found, self is not a parameter,
    decorators count as lines, nested functions are measured on their own."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 1))
    wide = ", ".join(f"a{i}" for i in range(MAX_PARAMETERS))
    source = (f"def long():\n{body}\n\n"                        # MAX_LINES lines: fine
              f"@staticmethod\ndef longer():\n{body}\n\n"       # + a decorator: one too many
              f"class C:\n    def method(self, {wide}):\n        def inner(*args, **kw): pass\n"
              f"def wider({wide}, *rest): pass\n")
    measured = {name: (lines, parameters)
                for _, name, lines, parameters in measure(ast.parse(source))}
    assert measured == {"long": (MAX_LINES, 0), "longer": (MAX_LINES + 1, 0),
                        "method": (2, MAX_PARAMETERS), "inner": (1, 2),
                        "wider": (1, MAX_PARAMETERS + 1)}
    package = tmp_path / "sim"
    package.mkdir()
    (package / "m.py").write_text(source)
    for other in ("minitransformer", "quant"):
        (tmp_path / other).mkdir()
    assert offenders(tmp_path) == [
        f"sim/m.py:{MAX_LINES + 3} longer: {MAX_LINES + 1} lines (at most {MAX_LINES})",
        f"sim/m.py:{2 * MAX_LINES + 7} wider: {MAX_PARAMETERS + 1} parameters "
        f"(at most {MAX_PARAMETERS})"]


def test_only_the_exported_functions_are_exempt_from_the_width():
    assert public_api() == {(Path("minitransformer/generate.py"), "generate"),
                            (Path("minitransformer/generate.py"), "stream"),
                            (Path("minitransformer/generate.py"), "logits"),
                            (Path("minitransformer/loader.py"), "load")}
