# Config, paths, code tracking, resources and small helpers shared by every rule file.
# Imports stay light (no torch): this file is read on every start, and by every SLURM job.

import ast
import json
import os
import sys
from pathlib import Path

import yaml
from jsonschema import ValidationError
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import validate

ROOT = Path(workflow.basedir).resolve()
sys.path.insert(0, str(ROOT))

from workflow.engines.options import (
    EngineOptions,
)  # noqa: E402  (pure Python, no torch)
from workflow.errors import InputError  # noqa: E402
from workflow.sources import parse_source  # noqa: E402


def typed(value):
    """Nested --config values arrive as strings ('64'): read each scalar as YAML would."""
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    if isinstance(value, list):
        return [typed(v) for v in value]
    if isinstance(value, str):
        parsed = yaml.safe_load(value) if value.strip() else value
        return parsed if isinstance(parsed, (int, float, bool, type(None))) else value
    return value


def schema_problem(error):
    """Snakemake's multi-line schema error as the one line every other config problem gets:
    `config: <key path>: <problem>`."""
    cause = error.__context__  # what snakemake's validate caught and wrapped
    if not isinstance(cause, ValidationError):
        return str(error)
    keys = [str(k) for k in cause.absolute_path]
    where = f"{'.'.join(keys)}: " if keys else ""
    # anyOf's own message names nothing: give its description
    if cause.validator == "anyOf":
        why = cause.schema.get("description")
        if why:
            return f"config: {where}{cause.instance!r}: {why}"
    return f"config: {where}{cause.message}"


config.update(typed(config))
try:
    validate(config, "../config/config.schema.yaml")
except WorkflowError as e:
    raise WorkflowError(schema_problem(e)) from None

try:
    SOURCE = parse_source(config["model"]["source"])
    ENGINE = EngineOptions.from_dict(config["engine"])
except InputError as e:
    raise WorkflowError(str(e)) from None

BACKEND, PRECISION = ENGINE.backend, ENGINE.precision
RESULTS = f"results/{SOURCE.tag}"
VARIANT = f"{RESULTS}/{BACKEND}-{PRECISION}"

# Each rule's shell runs `python -m workflow.<stage>` with this repository on PYTHONPATH. The
# python is the one running snakemake (its bin dir first on PATH, so an unactivated venv works),
# unless --sdm conda gives each rule its own environment (envs/mossbuild.yaml). It sends stdout
# to the rule's log, and stderr (progress bars, the one-line error) to the log and to the
# terminal: `> {log} 2> >(tee -a {log} >&2)`.
PYBIN = (
    ""
    if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method
    else str(Path(sys.executable).parent)
)
shell.prefix(
    "set -euo pipefail; export PYTHONPATH={ROOT:q}${{PYTHONPATH:+:$PYTHONPATH}}; "
    + ("export PATH={PYBIN:q}:$PATH; " if PYBIN else "")
)

# The device each rule computes on (from config). On cuda it asks for a GPU, on the CPU for none.
DEVICE = {
    "download": config["model"]["device"],
    "convert": "cpu",
    "calibrate": config["calibration"]["device"] if PRECISION == "fp8" else "cpu",
    "build": config["engine"]["device"],
    "verify": config["engine"]["device"],
    "benchmark": config["engine"]["device"],
    "pages": "cpu",
}


def code(module):
    """workflow/<module>.py and every workflow module it may run, transitively: inputs of the
    rule that runs it, so that editing any of them reruns that rule and what follows. A package
    loaded only as the parent of a submodule counts with what it imports when loaded, not with
    what its functions import (the rule never calls them)."""
    called = {}  # path -> whether the rule may call its functions
    todo = [(f"workflow.{module}", True)]
    while todo:
        name, calls = todo.pop()
        parts = name.split(".")
        path = ROOT.joinpath(*parts).with_suffix(".py")
        if not path.exists():
            path = ROOT.joinpath(*parts, "__init__.py")
        if not path.exists() or (path in called and (called[path] or not calls)):
            continue  # none, or seen already and this import adds nothing
        called[path] = calls
        todo += [(".".join(parts[:i]), False) for i in range(1, len(parts))]
        todo += [(target, True) for target in IMPORTS.of(path, calls)]
    IMPORTS.save()
    return sorted(str(p) for p in called)


class ImportIndex:
    """The workflow modules each module file imports, kept by file size and mtime in
    .snakemake/mossbuild/imports.json: every start (a no-op run, each SLURM job) needs them for
    every rule, and parsing every module again would be a sixth of a no-op run's time. The file
    is only a cache: unreadable, it is rebuilt; unwritable, the modules are parsed each start.
    """

    def __init__(self, path):
        self.path = Path(path)
        try:
            self.known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}
        self.changed = False
        # keys whose stamp this start has compared (each rule's code() meets most)
        self.checked = set()

    def of(self, module, in_functions):
        key = f"{module}:{int(in_functions)}"
        if key not in self.checked:
            stat = module.stat()
            stamp, hit = [stat.st_mtime_ns, stat.st_size], self.known.get(key)
            if not (isinstance(hit, list) and len(hit) == 2 and hit[0] == stamp):
                self.known[key] = [stamp, workflow_imports(module, in_functions)]
                self.changed = True
            self.checked.add(key)
        return self.known[key][1]

    def save(self):
        if not self.changed:
            return
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.known))
            os.replace(tmp, self.path)
            self.changed = False
        except OSError:
            tmp.unlink(missing_ok=True)


def workflow_imports(path, in_functions):
    """The workflow modules (and names from them) a module file imports."""
    found = []
    for node in imports(ast.parse(path.read_text()), in_functions):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("workflow")]
        elif (node.module or "").startswith("workflow"):
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return found


IMPORTS = ImportIndex(".snakemake/mossbuild/imports.json")


# where statements nest: the fields of a node that hold statement lists
STATEMENT_LISTS = ("body", "orelse", "finalbody", "handlers", "cases")


def imports(tree, in_functions):
    """The import statements of a module, those inside its functions only if in_functions;
    never those under `if TYPE_CHECKING:` (types only, nothing runs). Statements only are
    walked, not expressions (none is an import): every DAG build pays for this walk."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if (
            isinstance(node, ast.If)
            and getattr(node.test, "id", None) == "TYPE_CHECKING"
        ):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if in_functions or not isinstance(
            node, (ast.FunctionDef, ast.AsyncFunctionDef)
        ):
            todo += [n for field in STATEMENT_LISTS for n in getattr(node, field, ())]


def source_files():
    """A local checkpoint's files: inputs of download, so that a new checkpoint in that
    directory reruns download and everything after it."""
    if SOURCE.kind != "local":
        return []
    return sorted(str(p) for p in Path(SOURCE.value).rglob("*") if p.is_file())


def settings(rule):
    """`resources.<rule>` over `resources.default` from config."""
    return {**config["resources"]["default"], **config["resources"].get(rule, {})}


def threads_of(rule):
    return settings(rule)["threads"]


def res(rule):
    """The rule's SLURM/local resources: memory, runtime, GPUs (and partition, account, GPU
    model where config names them). `gpu` follows the rule's device unless config sets it;
    gpu 0 for a rule on cuda is refused (never a quiet fallback to the CPU)."""
    r = {k: v for k, v in settings(rule).items() if k != "threads"}
    r.setdefault("gpu", 1 if DEVICE[rule] == "cuda" else 0)
    if DEVICE[rule] == "cuda" and r["gpu"] < 1:
        raise WorkflowError(
            f"config: resources.{rule}.gpu is 0 but rule {rule} runs on cuda"
        )
    if r["gpu"] == 0:
        r.pop("gpu_model", None)
    return r


def as_json(obj):
    return json.dumps(obj, sort_keys=True)


def codec_voice():
    """The codec decoder's voice file where the config names one (benchmark.codec.voice): an input of
    the benchmark, so that a new file, not only a new path, reruns it."""
    voice = (config["benchmark"].get("codec") or {}).get("voice")
    return [voice] if voice else []
