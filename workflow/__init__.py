"""mossbuild: the package the Snakemake rules call.

Each rule runs one stage module (`python -m workflow.<stage>`, its `main`); every other module
is library, shared by the stages. A stage never imports another stage.
"""

STAGES = ("download", "convert", "calibrate", "build", "verify", "benchmark", "pages")
