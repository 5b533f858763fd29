rule calibrate:
    input:
        ckpt=f"{RESULTS}/ckpt-bf16",
        hf=f"{RESULTS}/hf",
        code=code("calibrate"),
    output:
        directory(f"{RESULTS}/calib-{PRECISION}"),
    log:
        f"{RESULTS}/logs/calibrate-{PRECISION}.log",
    benchmark:
        f"{RESULTS}/benchmarks/calibrate-{PRECISION}.tsv"
    conda:
        "../envs/mossbuild.yaml"
    threads: threads_of("calibrate")
    resources:
        **res("calibrate"),
    params:
        precision=PRECISION,
        # bf16 passes the checkpoint through: calibration settings must not rerun it
        p=as_json(config["calibration"] if PRECISION == "fp8" else {}),
    shell:
        "python -m workflow.calibrate --ckpt {input.ckpt} --hf {input.hf} --precision {params.precision} --params {params.p:q} --out {output} > {log} 2> >(tee -a {log} >&2)"
