rule benchmark:
    input:
        verified=f"{VARIANT}/verify.json",
        engine=f"{VARIANT}/engine",
        calib=f"{RESULTS}/calib-{PRECISION}",
        hf=f"{RESULTS}/hf",
        voice=codec_voice(),
        code=code("benchmark"),
    output:
        report(
            directory(f"{VARIANT}/benchmark"),
            patterns=["{name}.png"],
            caption="../report/plot.rst",
            category="benchmark",
        ),
    log:
        f"{VARIANT}/logs/benchmark.log",
    benchmark:
        f"{VARIANT}/benchmarks/benchmark.tsv"
    conda:
        "../envs/mossbuild.yaml"
    threads: threads_of("benchmark")
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
        "python -m workflow.benchmark --engine {input.engine} --ckpt {input.calib}/checkpoint --hf {input.hf} --params {params.p:q} --config-json {params.config:q} --out {output} > {log} 2> >(tee -a {log} >&2)"
