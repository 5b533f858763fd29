# mossbuild: MOSS-Speech -> a verified (optionally FP8) engine -> an honest streaming benchmark.
# Each stage is one rule file in rules/ that calls one module of workflow/.

from snakemake.utils import min_version

min_version("9.0")


configfile: workflow.source_path("config/config.yaml")


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/download.smk"
include: "rules/convert.smk"
include: "rules/calibrate.smk"
include: "rules/build.smk"
include: "rules/verify.smk"
include: "rules/benchmark.smk"
include: "rules/pages.smk"


localrules:
    all,
    pages,


rule all:
    default_target: True
    input:
        f"{VARIANT}/verify.json",
        f"{VARIANT}/benchmark",
        f"{VARIANT}/report/verify.html",
        f"{VARIANT}/report/benchmark.html",
