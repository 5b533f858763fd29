rule convert:
    input:
        hf=f"{RESULTS}/hf",
        code=code("convert"),
    output:
        directory(f"{RESULTS}/ckpt-bf16"),
    log:
        f"{RESULTS}/logs/convert.log",
    benchmark:
        f"{RESULTS}/benchmarks/convert.tsv"
    conda:
        "../envs/mossbuild.yaml"
    threads: threads_of("convert")
    resources:
        **res("convert"),
    shell:
        "python -m workflow.convert --hf {input.hf} --out {output} > {log} 2> >(tee -a {log} >&2)"
