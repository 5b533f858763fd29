rule benchmark:
    input:
        verified=f"{VARIANT}/verify.json",
        engine=f"{VARIANT}/engine",
        calib=f"{RESULTS}/calib-{PRECISION}",
        hf=f"{RESULTS}/hf",
        code=code("benchmark"),
    output:
        directory(f"{VARIANT}/benchmark"),
    log:
        f"{VARIANT}/logs/benchmark.log",
    benchmark:
        f"{VARIANT}/benchmarks/benchmark.tsv"
    resources:
        **res("benchmark"),
    params:
        p=as_json(config["benchmark"]),
        # what shapes the figures, recorded in benchmark.json (not verify's thresholds, say)
        config=as_json(
            {k: config[k] for k in ("model", "engine", "benchmark")}
            | ({"calibration": config["calibration"]} if PRECISION == "fp8" else {})
        ),
    shell:
        "{PY} -m workflow.benchmark --engine {input.engine} --ckpt {input.calib}/checkpoint --hf {input.hf} --params {params.p:q} --config-json {params.config:q} --out {output} > {log} 2> >(tee -a {log} >&2)"
