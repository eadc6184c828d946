"""Top host costs of a py-spy profile (`py-spy record -f raw`: collapsed stacks with counts).
usage: python -m benchmarks.profile_summary PROFILE.txt [N]
Prints the share of samples per leaf function (self) and per function anywhere on the stack
(inclusive, jaxllm and serve code only); idle samples (a thread waiting) count as they are."""
from __future__ import annotations

import collections
import sys


def summarize(path: str, n: int = 15) -> str:
    leaf, incl, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            c = int(count)
            total += c
            frames = stack.split(";")
            leaf[frames[-1]] += c
            for fr in set(frames):
                if "jaxllm/" in fr or "serve/" in fr:
                    incl[fr] += c
    out = [f"{total} samples", "self (leaf frames):"]
    out += [f"  {100 * c / total:5.1f}%  {fr}" for fr, c in leaf.most_common(n)]
    out.append("inclusive (jaxllm and serve frames):")
    out += [f"  {100 * c / total:5.1f}%  {fr}" for fr, c in incl.most_common(n)]
    return "\n".join(out)


if __name__ == "__main__":
    print(summarize(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 15))
