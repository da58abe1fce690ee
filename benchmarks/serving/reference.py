"""Score a server's greedy tokens against a PyTorch reference of the same model and adapters.

    python -m benchmarks.serving.reference MODEL_DIR LORA_DIR RUN.json [RUN.json ...] [--device cuda] [--out VERDICT.txt]
        [--calibrate NAME] [--rotated] [--json SCORES.json]

The reference is transformers' own model class for the checkpoint (``Glm4MoeForCausalLM``,
``DeepseekV3ForCausalLM``, ``Qwen3MoeForCausalLM``) in fp32, each adapter merged into its weights as peft defines it:
``W + (lora_alpha / r) * B @ A`` for every routed expert it covers and, where it has them, the
shared expert. Teacher-forced on the server's own tokens: a position is *bad* when the reference's
best next token beats the server's token by more than 0.5 nats. A bf16 server of a correct model
has a bad position now and then (near-ties that bf16 flips, top-k routing included): 0-4 of 24 per
request in the H200 runs (benchmarks/results/shared_expert/); a request whose adapter is applied
wrongly has most of them bad: 14-24 of 24 there. On the 16-layer Qwen3-MoE of
benchmarks/fast_lora (32 positions): 0-6 right, 9-32 with each adapter request scored as another
adapter's (benchmarks/results/fast_lora/deep16/). A request counts as right with at most a quarter of
its positions bad (``MAX_BAD_SHARE``; 6 of 24, 8 of 32); the verdict prints both sides of that gap, so a run
whose counts come near it is seen at once.

That quarter is calibrated on bf16 servers. A block-fp8 (w8a8) server quantizes every GEMM's input to fp8 as
well, and its no-LoRA run has more bad positions (one of 16 requests past a quarter on the 16-layer Qwen3-MoE,
benchmarks/results/fast_lora/fp8-L16/): ``--calibrate NAME`` takes the share from that run instead (its worst
request's: the no-LoRA server right by construction), and ``--rotated`` adds the control at the same share,
each adapter run scored with every adapter request labelled as the next adapter (what a wrongly applied adapter
looks like). ``--json``: every request's count, for the record.

A run of teacher-forced prefills (``benchmarks/fast_lora/client.py forced``: the server's top-5 log-probabilities
at every position of given tokens, no decoding) is scored by how far those log-probabilities lie from the fp32
model's for the same tokens: the *error* of a position is the mean absolute difference over its five tokens, in
nats. No threshold: two servers' errors are compared adapter by adapter (the same tokens on every server), with
the no-LoRA server's as the floor of the base model's serving (bf16 logits, w8a8 where the model is fp8) and the
rotated control as what a wrongly applied adapter gives. A count of bad greedy positions moves in whole tokens
and only where a near-tie flips; this error moves with every logit, so a small defect shows in it first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from safetensors.torch import load_file

NATS = 0.5
MAX_BAD_SHARE = 0.25


def max_bad(positions: int, share: float = MAX_BAD_SHARE) -> int:
    return int(positions * share)


class Reference:
    def __init__(self, model_dir: str, lora_dir: str, device: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        self.lora_dir, self.device = lora_dir, device
        # Every weight an adapter may merge into (experts, shared expert, attention), restored before the next.
        self.pristine = {k: v.detach().clone() for k, v in self.model.state_dict().items() if ".layers." in k}
        self.adapter = None

    def use(self, adapter: str | None) -> None:
        """Load ``adapter`` merged into the weights (None: the base model)."""
        if adapter == self.adapter:
            return
        state = self.model.state_dict()
        with torch.no_grad():
            for name, value in self.pristine.items():
                state[name].copy_(value)
            if adapter is not None:
                self._merge(adapter, state)
        self.adapter = adapter

    def _merge(self, adapter: str, state: dict) -> None:
        with open(f"{self.lora_dir}/{adapter}/adapter_config.json") as f:
            cfg = json.load(f)
        # peft's scaling: lora_alpha / r, or lora_alpha / sqrt(r) for rsLoRA (use_rslora).
        scale = cfg["lora_alpha"] / (cfg["r"] ** 0.5 if cfg.get("use_rslora") else cfg["r"])
        lora = load_file(f"{self.lora_dir}/{adapter}/adapter_model.safetensors", device=self.device)
        inter = self.model.config.moe_intermediate_size
        for key in [k for k in lora if k.endswith("lora_A.weight")]:
            delta = scale * (lora[key.replace("lora_A", "lora_B")].float() @ lora[key].float())
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            prefix, proj = module.rsplit(".", 1)
            if ".experts." in prefix:  # transformers keeps each layer's experts as two stacked tensors
                experts, expert = prefix.rsplit(".", 1)
                e = int(expert)
                if proj == "down_proj":
                    state[f"{experts}.down_proj"][e] += delta
                else:
                    half = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    state[f"{experts}.gate_up_proj"][e, half] += delta
            else:
                state[f"{module}.weight"] += delta

    def _logprobs(self, ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(self.model(torch.tensor([ids], device=self.device)).logits[0].float(), dim=-1)

    @torch.no_grad()
    def score(self, prompt: list[int], output: list[int], top: list | None = None) -> dict:
        """The server's greedy ``output`` after ``prompt``: its bad positions, and with ``top`` (the server's top
        log-probabilities at each output position) their error as ``forced_error`` measures it."""
        rows = self._logprobs(prompt + output)[len(prompt) - 1 : len(prompt) - 1 + len(output)]
        chosen = rows[torch.arange(len(output)), torch.tensor(output, device=self.device)]
        gap = rows.max(dim=-1).values - chosen
        bad = (gap > NATS).nonzero().flatten().tolist()
        scored = {"bad": len(bad), "first_bad": bad[0] if bad else None, "gap_median": float(gap.median()),
                  "positions": len(output)}
        if top:
            scored["error"] = top_error(rows, top)["error"]
        return scored

    @torch.no_grad()
    def forced_error(self, prompt: list[int], top: list[list[list[float]]]) -> dict:
        """The served top log-probabilities ``top`` (per position of ``prompt``, ``[logprob, token]`` pairs)
        against this model's for the same tokens (``top_error``)."""
        return top_error(self._logprobs(prompt), top)


def top_error(logprobs: torch.Tensor, top: list[list[list[float]]]) -> dict:
    """Served ``[logprob, token]`` pairs (per row of ``logprobs``, the reference's log-probabilities at the same
    positions) against the reference's for those tokens: the mean absolute difference at each position, as its
    mean and worst, and the share of positions whose served best token is the reference's."""
    tokens = torch.tensor([[int(tok) for _, tok in row] for row in top], device=logprobs.device)
    served = torch.tensor([[lp for lp, _ in row] for row in top], device=logprobs.device)
    error = (served - logprobs.gather(1, tokens)).abs().mean(dim=1)
    agree = tokens[:, 0] == logprobs.argmax(dim=-1)
    return {"error": float(error.mean()), "worst": float(error.max()), "agree": float(agree.float().mean())}


def rotated(run: dict, key: str = "requests") -> dict:
    """``run`` with every adapter request (of ``run[key]``) labelled as the next of the run's adapters by name (the
    last as the first): the wrong side. Base requests stay."""
    names = sorted({r["adapter"] for r in run[key] if r["adapter"]})
    following = dict(zip(names, names[1:] + names[:1]))
    return {**run, "name": f"{run['name']} rotated",
            key: [{**r, "adapter": following.get(r["adapter"], r["adapter"])} for r in run[key]]}


def forced_verdict(ref: Reference, runs: list[tuple[str, dict]], with_rotated: bool = False,
                   scores: dict | None = None) -> str:
    """The teacher-forced runs' errors: one row per run, one column per adapter (and the base model), each the
    mean error over that kind's requests and positions, with the worst request's mean and the share of positions
    whose best token is the reference's."""
    if with_rotated:
        runs = runs + [(path, rotated(run, "forced")) for path, run in runs if any(r["adapter"] for r in run["forced"])]
    table: dict[str, dict[str, list[dict]]] = {}
    for _, run in runs:
        rows = table.setdefault(run["name"], {})
        for request in sorted(run["forced"], key=lambda r: r["adapter"] or ""):
            ref.use(request["adapter"])
            rows.setdefault(request["adapter"] or "base", []).append(ref.forced_error(request["prompt"], request["top"]))
    kinds = sorted({kind for rows in table.values() for kind in rows}, key=lambda k: (k != "base", k))
    lines = ["", "Teacher-forced prefills: the served top-5 log-probabilities at every position against the fp32 "
             "model's for the same tokens, mean absolute difference (nats); per kind: the mean over its requests, "
             "[the worst request's], (the share of positions whose best token is the reference's).",
             "   run".ljust(22) + "".join(f"{kind:>26}" for kind in kinds)]
    for name, rows in table.items():
        cells = []
        for kind in kinds:
            got = rows.get(kind)
            cells.append(f"{statistics.mean(r['error'] for r in got):.4f} [{max(r['error'] for r in got):.4f}] "
                         f"({statistics.mean(r['agree'] for r in got):.3f})" if got else "-")
        lines.append(f"   {name:<19}" + "".join(f"{c:>26}" for c in cells))
        if scores is not None:
            scores[f"{name} forced"] = {kind: [round(r["error"], 5) for r in got] for kind, got in rows.items()}
    return "\n".join(lines)


def score_run(ref: Reference, run: dict) -> dict[str, list[dict]]:
    scored: dict[str, list[dict]] = {}
    for request in sorted(run["requests"], key=lambda r: r["adapter"] or ""):
        ref.use(request["adapter"])
        scored.setdefault(request["adapter"] or "base", []).append(
            ref.score(request["prompt"], request["output"], request.get("top")))
    return scored


def load_runs(paths: list[str]) -> list[tuple[str, dict]]:
    """Each run file with its path."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append((path, json.load(f)))
    return runs


def verdict(ref: Reference, runs: list[tuple[str, dict]], calibrate: str | None = None, with_rotated: bool = False,
            scores: dict | None = None) -> str:
    """The greedy runs' verdict (``runs``: ``load_runs``')."""
    loaded = list(runs)
    if with_rotated:
        loaded += [(path, rotated(run)) for path, run in list(loaded) if any(r["adapter"] for r in run["requests"])]
    scored_runs = [(path, run, score_run(ref, run)) for path, run in loaded]
    share = MAX_BAD_SHARE
    if calibrate is not None:
        calibration = [r for _, run, scored in scored_runs if run["name"] == calibrate for rows in scored.values()
                       for r in rows]
        assert calibration, f"no run named {calibrate} to calibrate on"
        share = max(r["bad"] / r["positions"] for r in calibration)
    lengths = sorted({len(r["output"]) for _, run in loaded for r in run["requests"]})
    lines = [f"Teacher-forced against transformers' fp32 model with each adapter merged; a position is bad when "
             f"the reference's best token beats the server's by > {NATS} nats; a request is right with at most "
             + ("a quarter of its positions bad" if calibrate is None else
                f"the share of bad positions of the {calibrate} run's worst request ({share:.3f})")
             + f" ({', '.join(f'{max_bad(n, share)} of {n}' for n in lengths)})."]
    for path, run, scored in scored_runs:
        if scores is not None:
            scores[run["name"]] = {adapter: [r["bad"] for r in rows] for adapter, rows in scored.items()}
        lines += ["", f"== {run['name']} ({path}): {len(run['requests'])} requests, {run.get('failed', 0)} failed",
                  "   adapter  requests  right  bad positions  first bad token (median)  median gap (nats)"
                  "  top-5 error (nats)"]
        for adapter, rows in scored.items():
            right = sum(r["bad"] <= max_bad(r["positions"], share) for r in rows)
            first = [r["first_bad"] for r in rows if r["bad"] > max_bad(r["positions"], share)]
            positions = sum(r["positions"] for r in rows)
            median_first = statistics.median(first) if first else "-"
            median_gap = statistics.median(r["gap_median"] for r in rows)
            errors = [r["error"] for r in rows if "error" in r]
            error = f"{statistics.mean(errors):.4f}" if errors else "-"
            lines.append(f"   {adapter:<8} {len(rows):>8}  {right:>5}  {sum(r['bad'] for r in rows):>5}/{positions:<7}"
                         f"  {median_first:>24}  {median_gap:>17.3f}  {error:>18}")
        counts = [(r["bad"], r["positions"]) for rows in scored.values() for r in rows]
        right = [c for c, n in counts if c <= max_bad(n, share)]
        wrong = [c for c, n in counts if c > max_bad(n, share)]
        spread = (f"bad positions per request: right {min(right)}-{max(right)}" if right else "no request right") + (
            f", wrong {min(wrong)}-{max(wrong)}" if wrong else "")
        lines.append(f"   VERDICT {run['name']}: {len(right)}/{len(counts)} right ({spread})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("lora")
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out")
    parser.add_argument("--calibrate", metavar="NAME", help="the run (by name) whose worst request sets the share")
    parser.add_argument("--rotated", action="store_true", help="also score each adapter run with adapters rotated")
    parser.add_argument("--json", metavar="SCORES.json", help="every request's bad positions, by run and adapter")
    args = parser.parse_args(argv)
    scores: dict = {}
    ref = Reference(args.model, args.lora, args.device)
    loaded = load_runs(args.runs)
    greedy = [(path, run) for path, run in loaded if "requests" in run]
    forced = [(path, run) for path, run in loaded if "forced" in run]
    text = verdict(ref, greedy, args.calibrate, args.rotated, scores) if greedy else ""
    if forced:
        text += forced_verdict(ref, forced, args.rotated, scores)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(scores, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
