"""One benchmark at two revisions of this repository, alternated in one run.

A refactor must leave the figures where they were, and two runs hours apart on a shared
machine differ by more than a refactor should. So each revision is checked out into a git
worktree of its own and the same `jaxllm bench ...` command runs there, before and after
alternating (before, after, before, after, ...), and the result keeps every run's figure,
the medians and their ratio."""
from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import write_result


def add_args(p):
    p.add_argument("--before", required=True, help="the base revision (anything git names)")
    p.add_argument("--after", default="HEAD", help="the revision measured against it")
    p.add_argument("--pairs", type=int, default=2, help="before/after runs, alternated")
    p.add_argument("--metric", default="jaxllm.output_tokens_per_s",
                   help="the result field compared, dotted; several: comma-separated (the "
                        "first is the headline)")
    p.add_argument("--results-dir", default="benchmarks/results")
    p.add_argument("--tag", default=None, help="name of the result file")
    p.add_argument("bench", nargs="+",
                   help="the benchmark and its arguments, after `--` (e.g. -- throughput --num-prompts 64)")


def _field(result: dict, dotted: str):
    for key in dotted.split("."):
        if not isinstance(result, dict) or key not in result:
            raise ValueError(f"--metric: the result has no field {dotted!r}")
        result = result[key]
    return float(result)


def _worktree(repo: str, rev: str, root: str, side: str) -> tuple[str, str]:
    sha = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", f"{rev}^{{commit}}"],
                         capture_output=True, text=True)
    if sha.returncode:
        raise ValueError(f"not a revision of {repo}: {rev!r}")
    sha = sha.stdout.strip()
    path = os.path.join(root, f"{side}-{sha[:12]}")
    subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", "-q", path, sha], check=True)
    return sha, path


def run(args):
    if args.pairs < 1:
        raise ValueError("--pairs must be at least 1")
    if args.bench[0] in ("revisions",):
        raise ValueError("bench: name the benchmark to compare, e.g. -- throughput ...")
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    root = tempfile.mkdtemp(prefix="jaxllm-revisions-")
    trees = {}
    try:
        for side, rev in (("before", args.before), ("after", args.after)):
            trees[side] = _worktree(repo, rev, root, side)
        metrics = args.metric.split(",")
        runs = {m: {"before": [], "after": []} for m in metrics}
        results: dict[str, list[dict]] = {"before": [], "after": []}
        for i in range(args.pairs):
            for side in ("before", "after"):
                sha, path = trees[side]
                out = os.path.join(root, "results")
                tag = f"{side}-{i}"
                cmd = [sys.executable, "-m", "jaxllm.cli", "bench", *args.bench,
                       "--results-dir", out, "--tag", tag]
                print(f"[{side} {sha[:12]} run {i + 1}/{args.pairs}] {shlex.join(cmd[3:])}", flush=True)
                env = {**os.environ, "PYTHONPATH": path + os.pathsep + os.environ.get("PYTHONPATH", "")}
                subprocess.run(cmd, cwd=path, env=env, check=True)
                with open(os.path.join(out, f"{tag}.json")) as f:
                    res = json.load(f)
                for m in metrics:
                    runs[m][side].append(_field(res, m))
                results[side].append(res)
        compared = []
        for m in metrics:
            medians = {side: statistics.median(v) for side, v in runs[m].items()}
            compared.append({
                "metric": m,
                "before": {"revision": trees["before"][0], "runs": runs[m]["before"],
                           "median": medians["before"]},
                "after": {"revision": trees["after"][0], "runs": runs[m]["after"],
                          "median": medians["after"]},
                "after_over_before": medians["after"] / medians["before"]})
            print(f"{m}: before {medians['before']:.4g}, after {medians['after']:.4g}, "
                  f"after/before {compared[-1]['after_over_before']:.3f}")
        # the first metric's comparison at the top, as with one metric
        result = {"benchmark": " ".join(["jaxllm", "bench", *map(shlex.quote, args.bench)]),
                  **compared[0], "results": results}
        if len(compared) > 1:
            result["compared"] = compared
        write_result(args, result, "revisions")
    finally:
        for _, path in trees.values():
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", path], check=False)
