"""The package's layout, read from its imports: the shared core flat in attn_cli/, one sub-package
per feature that only one command or extra enters (train/, parse/, serve/, interop/, decode/), and
imports that run one way, with no circle. A move that breaks the rule fails here, not in
review."""

from __future__ import annotations

import ast
from pathlib import Path

from .conftest import REPO

PACKAGE = REPO / "attn_cli"
FEATURES = {"train", "parse", "serve", "interop", "decode"}
# The imports between features: training validates a parser by F1 (EVALB, the tree constraint on
# the search), and a server is decoding behind HTTP.
ALLOWED_BETWEEN = {("train", "parse"), ("serve", "decode")}


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(absolute module imported, line, at module level) for every import of a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            if node.module is None:
                # `from . import a, b`: each name may be a module
                found += [(f"{module}.{alias.name}", node.lineno, id(node) in top_level)
                          for alias in node.names]
            else:
                found.append((module, node.lineno, id(node) in top_level))
    return found


def feature_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "attn_cli" and parts[1] in FEATURES else None


def test_the_features_are_sub_packages():
    for feature in FEATURES:
        assert (PACKAGE / feature / "__init__.py").is_file(), feature
    flat = {path.stem for path in PACKAGE.glob("*.py")}
    assert not flat & {"training", "train_report", "resume", "validation", "distributed",
                       "trees", "parsing", "tree_search", "evalb", "server", "request_queue",
                       "export", "hf", "translate", "controls", "prefix", "lexical",
                       "glossary", "shortlist", "compiled", "sentences", "markup"}, \
        "a feature's module is back in the flat core"


def test_the_core_never_imports_a_feature_and_cli_only_lazily():
    wrong = []
    for path in sorted(PACKAGE.glob("*.py")):
        for module, line, at_top in imports(path):
            if feature_of(module) is None:
                continue
            # cli.py enters each feature inside the command that needs it, so that `attn --help`
            # and every other command import none of it.
            if path.name != "cli.py" or at_top:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_features_import_the_core_and_themselves_only():
    wrong = []
    for feature in sorted(FEATURES):
        for path in sorted((PACKAGE / feature).rglob("*.py")):
            for module, line, _ in imports(path):
                other = feature_of(module)
                if other in (None, feature) or (feature, other) in ALLOWED_BETWEEN:
                    continue
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
            for module, line, _ in imports(path):
                if module == "attn_cli.cli":
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports the command line")
    assert not wrong, "\n".join(wrong)


def test_tests_import_no_benchmark_or_check():
    """Scripts may use test helpers (the toy parser's recipe, the HTTP client), never the
    other way: a test must not depend on a script a user runs by hand."""
    wrong = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for path in sorted((REPO / "tests").rglob("*.py"))
             for module, line, _ in imports(path)
             if module.split(".")[0] in ("benchmarks", "checks")]
    assert not wrong, "\n".join(wrong)


def test_the_rule_reader_sees_relative_imports():
    """The reader above resolves `from ..parse.trees import x` and `from . import y` as Python
    does; without this the two tests above could pass on a file they misread."""
    def modules(path: Path) -> set[str]:
        return {module for module, _, _ in imports(path)}

    assert {"attn_cli.parse.trees", "attn_cli.errors"} <= modules(PACKAGE / "train" /
                                                                  "validation.py")
    assert "attn_cli.train.start" in modules(PACKAGE / "train" / "loop.py")
    assert any(module.startswith("attn_cli.serve.") and not at_top
               for module, _, at_top in imports(PACKAGE / "cli.py"))


def module_graph() -> dict[str, set[str]]:
    """attn_cli's modules and the modules each imports, lazily or not (a lazy import ties two
    modules as much as one at the top: it only defers the cost), `from package import module`
    read as the module."""
    names = {".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"):
             path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        found = set()
        for module, _, _ in imports(path):
            found |= {module} & names.keys()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):  # `from ..decode import sentences`: the module sentences
            if isinstance(node, ast.ImportFrom) and node.module:
                base = imports_of_node(path, node)
                found |= {f"{base}.{alias.name}" for alias in node.names} & names.keys()
        graph[name] = found - {name}
    return graph


def imports_of_node(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom node names (as `imports` resolves it)."""
    if not node.level:
        return node.module
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    base = package.split(".")[:len(package.split(".")) - node.level + 1]
    return ".".join(base + [node.module])


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan): each is a circle of
    imports, and one of its imports runs from a lower module back up to a higher one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while True:
                member = stack.pop()
                part.append(member)
                if member == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_so_every_import_runs_down():
    """Modules stack in floors, each above all it imports: a circle (data → alignment →
    batching → data, once) has no such order, and one of its imports runs back up."""
    graph = module_graph()
    assert {"attn_cli.decode.translator", "attn_cli.decode.sentences"} <= \
        graph["attn_cli.decode.pipe"]  # the reader sees the package's modules
    assert "attn_cli.decode.sentences" in graph["attn_cli.serve.api"]  # `from ..decode import`
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles(graph) == []


def test_no_function_body_over_60_lines():
    """A function whose body (its docstring left out) passes 60 lines does more than one thing:
    the parts get names of their own."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:] or body
            lines = body[-1].end_lineno - body[0].lineno + 1
            if lines > 60:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines}")
    assert not long, "\n".join(long)


TORCH_FREE = ["formats", "config", "errors", "files", "stfile", "compound_bleu", "alignment",
              "tags", "decode.sentences", "decode.markup", "decode.glossary", "decode.controls",
              "parse.trees", "parse.parsing", "parse.evalb"]


def test_the_text_modules_import_without_torch():
    """What `attn --help`, completion, text scoring, `parse linearize` and a server's request
    reading stand on loads no torch (docs/layout.md lists these modules)."""
    import subprocess
    import sys

    code = ("import importlib, sys\n"
            f"for name in {TORCH_FREE!r}:\n"
            "    importlib.import_module('attn_cli.' + name)\n"
            "    assert 'torch' not in sys.modules, name\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_no_test_module_imports_another():
    """What several test files share lives in conftest.py, toys.py and serve/client.py: a test
    file imported by another would run its tests' module set-up for nothing, and hide where a
    helper is."""
    wrong = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for path in sorted((REPO / "tests").rglob("*.py"))
             for module, line, _ in imports(path)
             if module.split(".")[-1].startswith("test_")]
    assert not wrong, "\n".join(wrong)
