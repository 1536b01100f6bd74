"""Make benchmarks/data/json_schemas.jsonl: a seeded, stratified, deduplicated sample of JSONSchemaBench.

JSONSchemaBench (guidance-ai/jsonschemabench, data/; the same schemas as the Hugging Face dataset
epfl-dlab/JSONSchemaBench, MIT licence on its card; arXiv 2501.10868) holds ~10k real-world JSON schemas in ten
categories by source and difficulty: Glaiveai2K (function-call signatures), Kubernetes, Snowplow, WashingtonPost
(API payloads), JsonSchemaStore (tool configs), Github_trivial/easy/medium/hard/ultra (schemas found on GitHub,
graded by size and features). The GitHub repository carries no licence file of its own. Each schema keeps the
licence of the project it was collected from (as those projects state, not re-checked offline here: Kubernetes,
SchemaStore and Snowplow's Iglu Central Apache-2.0, Glaive's function-calling set Apache-2.0; GitHub files their
repositories' own).

Policy of the sample (what benchmarks/schema_coverage.py measures depends on it, so it is explicit):
- every category gets the same number of schemas (`--per-category`, default 30: 300 in all), drawn uniformly with
  `random.Random(seed)` from that category's files in path order;
- a schema is a candidate if its minified JSON is at most `--max-bytes` (default 24000: keeps the file under ~2 MB;
  it drops the largest Github_ultra, Kubernetes, JsonSchemaStore and WashingtonPost schemas, whose share is
  printed) and jsonschema's own meta-schema check accepts it (the benchmark's oracle must be able to validate);
- duplicates (the same canonical JSON, keys sorted) are candidates once, in the first category (sorted order) and
  path that holds them.
No schema feature is filtered out: which features compile is what the benchmark measures.

    python -m benchmarks.data.make_json_schemas --repo /work/.mirror/guidance-ai+jsonschemabench/repo
    # (a git directory of github:guidance-ai/jsonschemabench; the `fetch` tool of the sessions brings one)

Read at commit ba103c73756198dd9b149ddc7db7867da7a077f6 for the committed file (seed 0, 30 per category).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).resolve().parent / "json_schemas.jsonl"


def read_tree(repo: Path, commit: str) -> dict[str, list[tuple[str, bytes]]]:
    """category -> [(path, file bytes)] of data/<category>/*.json at `commit` (files the snapshot lacks skipped)."""
    listing = subprocess.check_output(["git", "-C", str(repo), "ls-tree", "-r", commit, "data"], text=True)
    entries = []
    for line in listing.splitlines():
        meta, path = line.split("\t", 1)
        if path.endswith(".json") and path.count("/") == 2:
            entries.append((path, meta.split()[2]))
    entries.sort()
    batch = subprocess.run(["git", "-C", str(repo), "cat-file", "--batch"], check=True, capture_output=True,
                           input="".join(f"{sha}\n" for _, sha in entries).encode())
    out, pos, skipped = defaultdict(list), 0, 0
    data = batch.stdout
    for path, _ in entries:
        end = data.index(b"\n", pos)
        header = data[pos:end].split()
        pos = end + 1
        if header[-1] == b"missing":
            skipped += 1
            continue
        size = int(header[2])
        out[path.split("/")[1]].append((path, data[pos:pos + size]))
        pos += size + 1
    if skipped:
        print(f"{skipped} file(s) absent from the snapshot, skipped", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, required=True, help="git directory of guidance-ai/jsonschemabench")
    ap.add_argument("--commit", default="ba103c73756198dd9b149ddc7db7867da7a077f6")
    ap.add_argument("--per-category", type=int, default=30)
    ap.add_argument("--max-bytes", type=int, default=24000, help="largest minified schema kept")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    from jsonschema.validators import validator_for

    tree = read_tree(args.repo, args.commit)
    seen: set[str] = set()
    rows = []
    rng = random.Random(args.seed)
    for category in sorted(tree):
        candidates, too_big, bad = [], 0, 0
        for path, raw in tree[category]:
            schema = json.loads(raw)
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
            if len(text.encode()) > args.max_bytes:
                too_big += 1
                continue
            try:
                validator_for(schema).check_schema(schema)
            except Exception:  # any failure of the meta-schema check: not usable as an oracle
                bad += 1
                continue
            key = hashlib.sha256(json.dumps(schema, sort_keys=True).encode()).hexdigest()
            if key not in seen:
                seen.add(key)
                candidates.append((path, schema, key))
        picked = rng.sample(candidates, min(args.per_category, len(candidates)))
        for path, schema, _ in sorted(picked, key=lambda c: c[0]):
            rows.append({"source": f"jsonschemabench:{path}@{args.commit[:8]}", "category": category,
                         "schema": schema})
        print(f"{category}: {len(tree[category])} files, {too_big} over {args.max_bytes} bytes, {bad} failing the "
              f"meta-schema check, {len(candidates)} candidates, {len(picked)} taken", file=sys.stderr)
    text = "".join(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in rows)
    args.out.write_text(text, encoding="utf-8")
    print(f"{len(rows)} schemas, {len(text.encode()) / 1e6:.2f} MB -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
