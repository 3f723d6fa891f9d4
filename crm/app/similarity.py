"""Selection by similarity: the benchmark queries closest to what a user says they use an LLM for.

The paper leaves open how to pick the queries a user cares about beyond ticking topics; here a
free-text description selects the k most similar queries by TF-IDF cosine (scikit-learn).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from crm.core.records import BenchRecord


class QueryIndex:
    """TF-IDF vectors of the benchmark's queries (each with its topic's name, so that "I cook a
    lot" finds the cooking questions that never say "cook")."""

    def __init__(self, records: Sequence[BenchRecord]):
        from sklearn.feature_extraction.text import TfidfVectorizer

        self.idx = [r.idx for r in records]
        self.vectorizer = TfidfVectorizer(stop_words="english", sublinear_tf=True)
        self.matrix = self.vectorizer.fit_transform([f"{r.topic}. {r.prompt}" for r in records])

    def nearest(self, text: str, k: int) -> list[tuple[str, float]]:
        """Up to k (idx, cosine) pairs, most similar first; queries sharing no word are left out."""
        # TfidfVectorizer L2-normalises its rows: a dot product is the cosine.
        scores = (self.matrix @ self.vectorizer.transform([text]).T).toarray().ravel()
        order = np.argsort(-scores, kind="stable")[:k]
        return [(self.idx[i], round(float(scores[i]), 4)) for i in order if scores[i] > 0]
