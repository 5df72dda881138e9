"""The house's shape: no room too large, and no import that runs back up.

Rooms of a few hundred lines hold one idea each (STYLE.md): no file under lmsrt/ over 600 lines,
no class over 400. And lmsrt's modules import one another without a circle, so each can be read
(and tested) from the bottom up."""
import ast
import pathlib

import pytest

LMSRT = pathlib.Path(__file__).resolve().parents[1] / "lmsrt"
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 400


def _modules():
    for path in sorted(LMSRT.rglob("*.py")):
        if "bootstrap" in path.parts:          # put on torchrun's PYTHONPATH, never imported
            continue
        parts = path.relative_to(LMSRT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


MODULES = dict(_modules())


def _top_level(tree):
    """Import statements that run when the module is imported (not those inside functions, nor
    under ``if TYPE_CHECKING:``)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)


def _imports(name, path):
    """The lmsrt modules that ``name`` imports at import time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _top_level(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                base = base + node.module.split(".") if node.module else base
            else:
                base = node.module.split(".")
            base = ".".join(base)
            # ``from . import arena`` imports a module; ``from .x import y`` the module x.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        found.update(t for t in targets if t in MODULES and t != name)
    return found


def test_no_file_under_lmsrt_is_over_600_lines():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"split these rooms: {long}"


def test_no_class_under_lmsrt_is_over_400_lines():
    long = {}
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_CLASS_LINES:
                long[f"{name}.{node.name}"] = lines
    assert not long, f"split these classes along what changes together: {long}"


def test_the_import_graph_of_lmsrt_has_no_circle():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert graph["lmsrt.lms"] >= {"lmsrt.engine", "lmsrt.device"}     # the graph is read
    done, path = set(), []

    def visit(name):
        if name in path:
            circle = path[path.index(name):] + [name]
            pytest.fail("lmsrt imports in a circle: " + " -> ".join(circle))
        if name in done:
            return
        path.append(name)
        for child in sorted(graph[name]):
            visit(child)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_engine_asks_the_policy_questions_and_never_its_kind():
    """The engine and the diagnostics ask a ``Policy`` questions; which kind it is, and its
    numbers, are the policy's own (lmsrt/policy/)."""
    asking = sorted((LMSRT / "engine").glob("*.py")) + [LMSRT / "diagnostics.py"]
    for path in asking:
        text = path.read_text()
        for kind_test in ("policy.auto", "AutoPolicy", "FixedPolicy", "lms_frac ==", "keeps_small"):
            assert kind_test not in text, f"{path.name} asks the policy's kind: {kind_test}"


def test_both_policies_answer_every_question_of_the_protocol():
    from lmsrt.policy import AutoPolicy, FixedPolicy, Policy
    asked = [name for name in dir(Policy) if not name.startswith("_")]
    asked += list(Policy.__annotations__)
    for policy in (FixedPolicy(0.5, 1 << 30, 1 << 20), AutoPolicy(1 << 30, 1 << 20)):
        missing = [name for name in asked if not hasattr(policy, name)]
        assert not missing, f"{type(policy).__name__} does not answer {missing}"
