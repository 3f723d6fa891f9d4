"""Synthetic README-format pairs of realistic length, for GPU throughput (LMArena's answers run to
hundreds of words: with answers of 300-700 words a pairwise row is about 1.1k tokens of a 32k BPE
trained on them). Seeded: the same arguments write the same file.

    python benchmarks/long_pairs.py OUT.jsonl N [--min-words 300] [--max-words 700] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pe", "da", "gu", "ze", "fo", "hi", "ba", "ko"]
CRITERIA = ["Prefers concise answers.", "Likes detailed step-by-step explanations.", "Wants examples.",
            "Prefers a warm tone.", "Likes vivid imagery.", "Wants caution about risks."]


def write_long_pairs(path: str | Path, n: int, *, min_words: int = 300, max_words: int = 700,
                     seed: int = 0) -> Path:
    """`n` records {idx, prompt, model_a, model_b, criteria, preference} of made-up words."""
    rng, text = _writer(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            query = text(rng.randint(20, 80))
            a, b = text(rng.randint(min_words, max_words)), text(rng.randint(min_words, max_words))
            f.write(json.dumps({
                "idx": i, "prompt": query,
                "model_a": [{"role": "user", "content": query}, {"role": "assistant", "content": a}],
                "model_b": [{"role": "user", "content": query}, {"role": "assistant", "content": b}],
                "criteria": rng.sample(CRITERIA, rng.randint(1, 3)),
                "preference": rng.choice(["model_a", "model_b"])}) + "\n")
    return path


def write_long_bench(path: str | Path, queries: int, models: int, *, min_words: int = 300,
                     max_words: int = 700, query_words: tuple[int, int] = (20, 80), seed: int = 0) -> Path:
    """A leaderboard bench of the same made-up words: `queries` lines {idx, topic, prompt, responses},
    each answered by `models` models named model-0 ... (model-0 is the baseline in the benchmarks)."""
    rng, text = _writer(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(queries):
            f.write(json.dumps({
                "idx": f"long-{i:05d}", "topic": f"topic-{i % 4}", "prompt": text(rng.randint(*query_words)),
                "responses": {f"model-{m}": text(rng.randint(min_words, max_words)) for m in range(models)},
            }) + "\n")
    return path


def _writer(seed: int):
    """A seeded generator and its text(k): k words of a 6,000-word made-up vocabulary."""
    rng = random.Random(seed)
    words = sorted({"".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(6000)})

    def text(k: int) -> str:
        return " ".join(rng.choice(words) for _ in range(k)) + "."

    return rng, text


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("n", type=int)
    p.add_argument("--min-words", type=int, default=300)
    p.add_argument("--max-words", type=int, default=700)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(write_long_pairs(a.out, a.n, min_words=a.min_words, max_words=a.max_words, seed=a.seed))
