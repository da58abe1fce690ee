"""Two servers' teacher-forced prefills compared prompt by prompt: the mean difference of their errors against
the fp32 reference, per adapter, with its standard error.

    python -m benchmarks.serving.paired SCORES.json A B [A B ...]

``SCORES.json`` is ``benchmarks.serving.reference --json``'s file; A and B name two of its runs (``fast``,
``default``, ...). The forced step sends the same prompts in the same order to every server
(``benchmarks/fast_lora/client.py forced``) and the reference lists each kind's errors in that order, so the
i-th error of a kind is the same tokens on both servers. The difference is then free of the prompts' own spread
(on the 16-layer model about 0.2 nats from prompt to prompt, the difference of two right paths about 0.08). A
difference of several standard errors on one adapter and not on the others is what a defect that touches one
rank looks like; two right bf16 paths differ by about one.
"""

from __future__ import annotations

import argparse
import json
import statistics


def paired(scores: dict, a: str, b: str) -> dict[str, tuple[float, float, int]]:
    """Per kind (adapter or ``base``): (mean of A - B, its standard error, prompts), A and B's forced errors."""
    first, second = scores[f"{a} forced"], scores[f"{b} forced"]
    out = {}
    for kind in sorted(set(first) & set(second), key=lambda k: (k != "base", k)):
        x, y = first[kind], second[kind]
        if len(x) != len(y):
            raise ValueError(f"{kind}: {len(x)} prompts in {a}, {len(y)} in {b}: not the same forced step")
        diff = [p - q for p, q in zip(x, y)]
        se = statistics.stdev(diff) / len(diff) ** 0.5 if len(diff) > 1 else float("nan")
        out[kind] = (statistics.mean(diff), se, len(diff))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scores")
    parser.add_argument("pairs", nargs="+", metavar="RUN", help="run names, two at a time: A B [A B ...]")
    args = parser.parse_args(argv)
    if len(args.pairs) % 2:
        parser.error("runs come in pairs: A B [A B ...]")
    with open(args.scores) as f:
        scores = json.load(f)
    for a, b in zip(args.pairs[::2], args.pairs[1::2]):
        by_kind = paired(scores, a, b)
        cells = [f"{kind} {mean:+.4f} ± {se:.4f}" for kind, (mean, se, _) in by_kind.items()]
        n = {count for _, _, count in by_kind.values()}
        print(f"{a} - {b} (nats, prompt by prompt, {'/'.join(map(str, sorted(n)))} prompts a kind): " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
