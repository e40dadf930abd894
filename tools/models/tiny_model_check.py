"""Check that a random-weight checkpoint is usable for exact-match tests.

`python -m tools.models.tiny_model_check DIR` greedy-decodes a few prompts with HF transformers and
prints, per prompt, how many distinct tokens 32 greedy steps produced (a flat random model repeats
one token) and the median / 10th percentile / minimum top-1 minus top-2 logit gap over all steps
(small gaps let fp32 rounding differences flip an argmax between two implementations).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass

import torch

PROMPTS = ("Hello, my name is", "The quick brown fox", "def compute(x):", "今日は天気", "In 1999, the server")


@dataclass(frozen=True)
class GreedyReport:
    """Greedy-decoding statistics of one checkpoint."""

    distinct_tokens: list[int]  # per prompt, among `steps` greedy tokens
    gap_median: float
    gap_p10: float
    gap_min: float


def check(model_dir: str, steps: int = 32) -> GreedyReport:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    distinct, gaps = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
        distinct.append(len(set(out.sequences[0, ids.shape[1]:].tolist())))
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
    gaps.sort()
    return GreedyReport(distinct, statistics.median(gaps), gaps[len(gaps) // 10], gaps[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    report = check(args.model_dir)
    print(f"distinct tokens in 32 greedy steps per prompt: {report.distinct_tokens}")
    print(f"top-1 minus top-2 logit gap: median {report.gap_median:.3f}, p10 {report.gap_p10:.3f}, "
          f"min {report.gap_min:.4f}")


if __name__ == "__main__":
    main()
