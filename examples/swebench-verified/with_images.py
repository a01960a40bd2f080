"""Write SWE-bench rows (a Hub id or a local file) as Parquet with each row's official image.

The Hub's SWE-bench Verified names no image; legorl's tasks then run in the base image, which
holds no repository. SWE-bench publishes one image per instance, its repository at ``/testbed``:
``docker.io/swebench/sweb.eval.x86_64.<instance id, "__" as "_1776_", lower case>:latest``.
Rows that already name an ``image`` keep it.

    python with_images.py princeton-nlp/SWE-bench_Verified OUT.parquet [--split test]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from legorl.tasks.importer import read_source

REGISTRY = "docker.io/swebench"


def official_image(instance_id: str) -> str:
    return f"{REGISTRY}/sweb.eval.x86_64.{instance_id.replace('__', '_1776_').lower()}:latest"


def main() -> None:
    parser = argparse.ArgumentParser(description="Write SWE-bench rows as Parquet with each row's official image.")
    parser.add_argument("source", help="A Hugging Face dataset id, or a local .parquet/.jsonl/.json file.")
    parser.add_argument("out", type=Path, help="The Parquet file to write.")
    parser.add_argument("--split", default="test", help="Dataset split (Hub datasets only).")
    args = parser.parse_args()
    rows, _ = read_source(args.source, args.split)
    for row in rows:
        if not isinstance(row.get("image"), str) or not row["image"]:  # absent, None or NaN
            row["image"] = official_image(str(row["instance_id"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    pd.DataFrame(rows).to_parquet(tmp, index=False)
    tmp.replace(args.out)
    print(f"wrote {len(rows)} row(s) with images to {args.out}")


if __name__ == "__main__":
    main()
