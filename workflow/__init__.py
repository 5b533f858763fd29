"""mossbuild: the library the Snakemake rules call (one module per stage)."""
