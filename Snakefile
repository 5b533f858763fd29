# mossbuild: MOSS-Speech -> a verified (optionally FP8) engine -> an honest streaming benchmark.
# Each stage is one rule file in rules/ that calls one module of workflow/.

from snakemake.utils import min_version, validate

min_version("9.0")


configfile: workflow.source_path("config/config.yaml")


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
