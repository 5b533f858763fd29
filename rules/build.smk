rule build:
    input:
        calib=f"{RESULTS}/calib-{PRECISION}",
        code=code("build"),
    output:
        directory(f"{VARIANT}/engine"),
    log:
        f"{VARIANT}/logs/build.log",
    benchmark:
        f"{VARIANT}/benchmarks/build.tsv"
    conda:
        "../envs/mossbuild.yaml"
    threads: threads_of("build")
    resources:
        **res("build"),
    params:
        options=as_json(ENGINE.to_dict()),
    shell:
        "python -m workflow.build --ckpt {input.calib}/checkpoint --options-json {params.options:q} --out {output} > {log} 2> >(tee -a {log} >&2)"
