"""The house's rules, checked on the source: stages apart from library, and no module-level
state written after import (settings travel as objects; the engine owns what it tunes)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from workflow import STAGES

ROOT = Path(__file__).resolve().parents[1]
MUTATORS = {"update", "clear", "append", "extend", "insert", "pop", "popitem", "remove", "setdefault", "add", "discard"}


def stage_imports(source: str) -> set[str]:
    """The workflow stage modules a module's source imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n.split(".")[1] for n in names if n.startswith("workflow.") and n.split(".")[1] in STAGES}
    return found


def module_state_writes(source: str) -> list[str]:
    """Where a module writes module-level state after import: a `global` statement, or, inside
    a function, a store into, a `del` of or a mutating call on a module-level name or an
    attribute of an imported module (`BLOCKS[k] = v`, `BLOCKS.update(...)`, `gemv.X = y`,
    `setattr(gemv, ...)`), unless the function binds that name itself."""
    tree = ast.parse(source)
    top = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        top |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            top |= {(a.asname or a.name).split(".")[0] for a in node.names}
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        local |= {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        shared = top - local
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found.append(f"line {node.lineno}: global {', '.join(node.names)}")
            elif isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
                if root_in(node, shared):
                    found.append(f"line {node.lineno}: {ast.unparse(node)} written")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in MUTATORS and root_in(node.func.value, shared):
                    found.append(f"line {node.lineno}: {ast.unparse(node.func)}()")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "delattr"):
                found += [f"line {node.lineno}: {ast.unparse(node)}"] if node.args and root_in(node.args[0], shared) else []
    return found


def root_in(node: ast.AST, names: set[str]) -> bool:
    """Whether an attribute or subscript chain starts at one of these names."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return isinstance(node, ast.Name) and node.id in names


def workflow_sources() -> list[Path]:
    return sorted((ROOT / "workflow").rglob("*.py"))


def test_every_rule_runs_a_stage_and_every_stage_has_a_rule():
    ran = set()
    for rule in (ROOT / "rules").glob("*.smk"):
        ran |= set(re.findall(r"python -m workflow\.(\w+)", rule.read_text()))
    assert ran == set(STAGES)
    assert all((ROOT / "workflow" / f"{stage}.py").exists() for stage in STAGES)


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_imports_no_other_stage(stage):
    assert stage_imports((ROOT / "workflow" / f"{stage}.py").read_text()) <= {stage}


def test_library_modules_import_no_stage():
    stage_files = {ROOT / "workflow" / f"{s}.py" for s in STAGES}
    for path in workflow_sources():
        if path not in stage_files:
            assert not stage_imports(path.read_text()), path


def test_no_module_level_state_is_written_after_import():
    problems = {str(p.relative_to(ROOT)): module_state_writes(p.read_text()) for p in workflow_sources()}
    assert {p: found for p, found in problems.items() if found} == {}


def test_the_checks_see_what_they_look_for():
    """Each kind of write the state check looks for, and a stage import, in a module of its own."""
    seeded = """
from workflow import build
from workflow.engines import gemv
BLOCKS = {}
COUNT = 0
def tune(found):
    BLOCKS.update(found)
def store(key, value):
    BLOCKS[key] = value
def reset():
    gemv.BLOCKS.clear()
def patch():
    gemv.MAX_M = 8
    setattr(gemv, "MAX_M", 8)
def count():
    global COUNT
    COUNT += 1
def fine(BLOCKS):
    BLOCKS.update({})
    local = {}
    local["k"] = 1
"""
    found = module_state_writes(seeded)
    assert [line.split(":")[0] for line in found] == [f"line {n}" for n in (7, 9, 11, 13, 14, 16)]
    assert stage_imports(seeded) == {"build"}
