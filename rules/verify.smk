rule verify:
    input:
        engine=f"{VARIANT}/engine",
        calib=f"{RESULTS}/calib-{PRECISION}",
        hf=f"{RESULTS}/hf",
        code=code("verify"),
    output:
        f"{VARIANT}/verify.json",
    log:
        f"{VARIANT}/logs/verify.log",
    benchmark:
        f"{VARIANT}/benchmarks/verify.tsv"
    conda:
        "../envs/mossbuild.yaml"
    threads: threads_of("verify")
    resources:
        **res("verify"),
    params:
        p=as_json(config["verify"]),
    shell:
        "python -m workflow.verify --engine {input.engine} --ckpt {input.calib}/checkpoint --hf {input.hf} --calib-data {input.calib}/dataset --params {params.p:q} --out {output} > {log} 2> >(tee -a {log} >&2)"
