"""HTML pages for `snakemake --report`: verify's metrics and the benchmark's table.

verify.json is flattened into one row per figure; benchmark.md (the page a person reads) is
rendered as it is, so the report shows exactly what the benchmark wrote.
"""

from __future__ import annotations

import argparse
import html
import json
from pathlib import Path

import markdown

from workflow.errors import InputError, run_main


def flatten(obj: object, prefix: str = "") -> list[tuple[str, object]]:
    """Nested dicts as (dotted.key, value) rows; lists and scalars are values."""
    if not isinstance(obj, dict):
        return [(prefix, obj)]
    return [row for k, v in obj.items() for row in flatten(v, f"{prefix}.{k}" if prefix else str(k))]


def verify_page(v: dict) -> str:
    title = f"verify: {v['backend']} / {v['precision']} on {v['device']}: {'passed' if v['passed'] else 'FAILED'}"
    rows = "\n".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(json.dumps(x))}</td></tr>" for k, x in flatten(v) if k != "passed"
    )
    return f"<h1>{html.escape(title)}</h1>\n<table>\n<tr><th>figure</th><th>value</th></tr>\n{rows}\n</table>\n"


def benchmark_page(md: str) -> str:
    return markdown.markdown(md, extensions=["tables"])


def page(body: str, title: str) -> str:
    style = "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}"
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head>\n<body>\n{body}</body></html>\n"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verify", type=Path, required=True, help="verify.json")
    ap.add_argument("--benchmark", type=Path, required=True, help="benchmark directory (benchmark.md)")
    ap.add_argument("--verify-html", type=Path, required=True)
    ap.add_argument("--benchmark-html", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        v = json.loads(args.verify.read_text())
        md = (args.benchmark / "benchmark.md").read_text()
    except FileNotFoundError as e:
        raise InputError(e.filename, "file is missing") from None
    except json.JSONDecodeError as e:
        raise InputError(args.verify, f"not valid JSON ({e.msg})") from None
    for path, body in ((args.verify_html, verify_page(v)), (args.benchmark_html, benchmark_page(md))):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(page(body, path.stem))
        print(f"wrote {path}")


if __name__ == "__main__":
    run_main(main)
