# mossbuild: MOSS-Speech -> a verified (optionally FP8) engine -> an honest streaming benchmark.
# Each stage is one rule file in rules/ that calls one module of workflow/.

import yaml
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: workflow.source_path("config/config.yaml")


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


config.update(typed(config))


validate(config, "config/config.schema.yaml")


include: "rules/common.smk"
include: "rules/download.smk"
include: "rules/convert.smk"
include: "rules/calibrate.smk"
include: "rules/build.smk"
include: "rules/verify.smk"
include: "rules/benchmark.smk"


rule all:
    default_target: True
    input:
        f"{VARIANT}/verify.json",
        f"{VARIANT}/benchmark",
