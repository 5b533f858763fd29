rule download:
    input:
        local=source_files(),
        code=code("download"),
    output:
        directory(f"{RESULTS}/hf"),
    log:
        f"{RESULTS}/logs/download.log",
    benchmark:
        f"{RESULTS}/benchmarks/download.tsv"
    conda:
        "../envs/mossbuild.yaml"
    threads: threads_of("download")
    resources:
        **res("download"),
    params:
        source=config["model"]["source"],
        seed=config["model"]["seed"],
        device=config["model"]["device"],
        finite="" if config["model"]["check_finite"] else "--no-finite-check",
    shell:
        "python -m workflow.download --source {params.source:q} --seed {params.seed} --device {params.device} {params.finite} --out {output} > {log} 2> >(tee -a {log} >&2)"
