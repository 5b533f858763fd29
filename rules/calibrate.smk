rule calibrate:
    input:
        ckpt=f"{RESULTS}/ckpt-bf16",
        code=code("calibrate"),
    output:
        directory(f"{RESULTS}/calib-{PRECISION}"),
    log:
        f"{RESULTS}/logs/calibrate-{PRECISION}.log",
    benchmark:
        f"{RESULTS}/benchmarks/calibrate-{PRECISION}.tsv"
    resources:
        **res("calibrate"),
    params:
        precision=PRECISION,
    shell:
        "{PY} -m workflow.calibrate --ckpt {input.ckpt} --precision {params.precision} --out {output} > {log} 2> >(tee -a {log} >&2)"
