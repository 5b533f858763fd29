rule pages:
    input:
        verify=f"{VARIANT}/verify.json",
        benchmark=f"{VARIANT}/benchmark",
        code=code("pages"),
    output:
        verify=report(
            f"{VARIANT}/report/verify.html",
            caption="../report/verify.rst",
            category="verify",
        ),
        benchmark=report(
            f"{VARIANT}/report/benchmark.html",
            caption="../report/benchmark.rst",
            category="benchmark",
        ),
    log:
        f"{VARIANT}/logs/pages.log",
    benchmark:
        f"{VARIANT}/benchmarks/pages.tsv"
    conda:
        "../envs/mossbuild.yaml"
    threads: threads_of("pages")
    resources:
        **res("pages"),
    shell:
        "python -m workflow.pages --verify {input.verify} --benchmark {input.benchmark} --verify-html {output.verify} --benchmark-html {output.benchmark} > {log} 2> >(tee -a {log} >&2)"
