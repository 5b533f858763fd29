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
        e=config["engine"],
        flags=build_flags(config["engine"]),
    shell:
        "python -m workflow.build --ckpt {input.calib}/checkpoint --backend {params.e[backend]} --precision {params.e[precision]}"
        " --device {params.e[device]} --dtype {params.e[dtype]} --max-batch {params.e[max_batch]} --max-seq-len {params.e[max_seq_len]} {params.flags}"
        " --out {output} > {log} 2> >(tee -a {log} >&2)"
