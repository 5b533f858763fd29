# Paths, code tracking and small helpers shared by every rule file.

import ast
import json
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(workflow.basedir).resolve()
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
)

from workflow.engines import check_engine_config  # noqa: E402  (pure Python, no torch)
from workflow.errors import InputError  # noqa: E402
from workflow.sources import parse_source  # noqa: E402

try:
    SOURCE = parse_source(config["model"]["source"])
    check_engine_config(
        config["engine"]["backend"],
        config["engine"]["precision"],
        config["engine"]["device"],
    )
except InputError as e:
    raise WorkflowError(str(e)) from None

BACKEND, PRECISION = config["engine"]["backend"], config["engine"]["precision"]
RESULTS = f"results/{SOURCE.tag}"
VARIANT = f"{RESULTS}/{BACKEND}-{PRECISION}"
PY = shlex.quote(sys.executable)
# Each rule's shell sends stdout to its log, and stderr (progress bars, the one-line error) to
# the log and to the terminal: `> {log} 2> >(tee -a {log} >&2)`.


def code(module):
    """workflow/<module>.py and every workflow module it imports, transitively: inputs of the
    rule that runs it, so that editing any of them reruns that rule and what follows.
    Imports under `if TYPE_CHECKING:` are types only and are not followed."""
    seen, todo = set(), [f"workflow.{module}"]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        path = ROOT.joinpath(*parts).with_suffix(".py")
        if not path.exists():
            path = ROOT.joinpath(*parts, "__init__.py")
        if not path.exists() or path in seen:
            continue
        seen.add(path)
        for i in range(1, len(parts)):
            todo.append(".".join(parts[:i]))
        todo += _imports(ast.parse(path.read_text()))
    return sorted(str(p) for p in seen)


def _imports(tree):
    """Names of workflow modules imported anywhere in tree, type-only blocks excepted."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if (
            isinstance(node, ast.If)
            and getattr(node.test, "id", None) == "TYPE_CHECKING"
        ):
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("workflow")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "workflow"
        ):
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        out += _imports(node)
    return out


def res(rule):
    """The rule's resources from config (`resources.<rule>` over `resources.default`)."""
    return {**config["resources"]["default"], **config["resources"].get(rule, {})}


def as_json(obj):
    return json.dumps(obj, sort_keys=True)
