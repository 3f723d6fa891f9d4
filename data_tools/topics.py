"""`crm-data topics`: cluster every criterion of a training file into K broad topics.

Fills `a_broad_criteria_topic` / `b_broad_criteria_topic` (one topic id per criterion: what `add`
noise needs to draw criteria unrelated to the losing side's) and writes the topic table beside the
output: `<OUT stem>.topics.json`, the input it was clustered from and each topic's id, name (its
top TF-IDF terms), size (criteria occurrences), distinct criteria and the most frequent examples.
Lines that are not training records (topic ids aside) go to `<OUT stem>.rejects.jsonl` (only
written when there are any).

Offline by default: TF-IDF of each distinct criterion (words and word pairs) and KMeans, which
scales to the 55k votes' hundreds of thousands of criteria (agglomerative clustering would need the
n x n distances). `embedder=DIR` clusters sentence-transformers embeddings of a model in a local
directory instead (the `embed` extra); topics are named by TF-IDF terms either way.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np

from crm.core.errors import ConfigError
from crm.core.files import refuse_foreign, write_json
from crm.core.records import parse_train, read_lines

EXAMPLES = 5
NAME_TERMS = 3
# The criteria are written as preferences ("Prefers a concise answer"): these words name no topic.
PREFERENCE_WORDS = ["prefer", "prefers", "preferred", "want", "wants", "like", "likes", "user",
                    "response", "responses", "answer", "answers"]


def _without_topics(obj):
    """A training record whose topic ids are still to come (or are about to be replaced)."""
    return parse_train(obj, with_topics=False)


def cluster(criteria: list[str], k: int, seed: int = 0, embed=None) -> tuple[np.ndarray, list[str]]:
    """A topic id per criterion (0..k'-1, k' = min(k, distinct criteria)) and each topic's name.

    `embed(texts) -> array` replaces TF-IDF as the space KMeans clusters in.
    """
    from sklearn.cluster import KMeans
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS, TfidfVectorizer

    k = min(k, len(criteria))
    tfidf = TfidfVectorizer(stop_words=sorted(ENGLISH_STOP_WORDS | set(PREFERENCE_WORDS)),
                            ngram_range=(1, 2), sublinear_tf=True)
    try:
        weights = tfidf.fit_transform(criteria)
    except ValueError:  # every criterion is made of stop words only: nothing to name topics by
        weights = None
    space = embed(criteria) if embed is not None else weights
    if space is None:
        return np.zeros(len(criteria), dtype=int), ["(no terms)"]
    k = min(k, _distinct_points(space))  # texts apart only by stop words are one point
    labels = KMeans(n_clusters=k, n_init=8, random_state=seed).fit_predict(space)
    terms = tfidf.get_feature_names_out() if weights is not None else []
    names = []
    for topic in range(k):
        rows = np.flatnonzero(labels == topic)
        if weights is None or not len(rows):
            names.append("(no terms)")
            continue
        mean = np.asarray(weights[rows].mean(axis=0)).ravel()
        top = [terms[i] for i in np.argsort(-mean)[:NAME_TERMS] if mean[i] > 0]
        names.append(", ".join(top) or "(no terms)")
    return labels, names


def _distinct_points(space) -> int:
    if hasattr(space, "tocsr"):
        rows = space.tocsr()
        return len({(r.indices.tobytes(), np.round(r.data, 6).tobytes()) for r in rows})
    return len(np.unique(np.round(np.asarray(space), 6), axis=0))


def sentence_embedder(model_dir: str | Path):
    """embed(texts) with a sentence-transformers model read from a local directory only."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError:
        raise ValueError("--embedder needs sentence-transformers: pip install -e '.[embed]'") from None
    if not Path(model_dir).is_dir():
        raise ValueError(f"--embedder {model_dir}: not a directory (models are read locally only)")
    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True,
                                trust_remote_code=False)
    return lambda texts: model.encode(texts, normalize_embeddings=True, convert_to_numpy=True)


def read_topic_table(path: str | Path) -> tuple[str | None, list[dict]]:
    """(the input it was clustered from, its topics) of a `<stem>.topics.json`; a table written
    before the input was recorded (a bare list) has none. A file of another shape is a ValueError
    naming it."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # not JSON, not UTF-8
        doc, why = None, f"not JSON: {exc}"
    else:
        why = 'not {"input": ..., "topics": [{"id": ..., "name": ...}, ...]}'
    topics = doc.get("topics") if isinstance(doc, dict) else doc
    if not isinstance(topics, list) or not all(isinstance(t, dict) and {"id", "name"} <= t.keys()
                                               for t in topics):
        raise ValueError(f"{path}: not a topic table of crm-data topics ({why}); remove it or "
                         "run crm-data topics again")
    return (doc.get("input") if isinstance(doc, dict) else None), topics


def topics(in_path: str | Path, out_path: str | Path, *, k: int = 20, seed: int = 0,
           embedder: str | Path | None = None, overwrite: bool = False) -> dict:
    """Cluster the criteria of `in_path` and write `out_path` (may be the same file) with topic
    ids, its rejects (`<OUT stem>.rejects.jsonl`) and topic table. Returns a summary. An existing
    `out_path` other than `in_path` is replaced only when it is an earlier output of topics (its
    table beside it) or with `overwrite`: `topics A B` meant as two inputs must not erase B."""
    if k < 1:
        raise ValueError(f"k={k}: expected at least 1 topic")
    in_path, out_path = Path(in_path), Path(out_path)
    table_path = out_path.with_name(out_path.stem + ".topics.json")
    if not overwrite and out_path.resolve() != in_path.resolve():
        refuse_foreign(out_path, table_path, "crm-data topics",
                       "give a new OUT.jsonl (or IN.jsonl itself, to fill its topic ids in place), "
                       "or --overwrite to replace it")
        earlier, _ = read_topic_table(table_path) if table_path.is_file() else (None, [])
        if earlier is not None and earlier != str(in_path.resolve()):  # `topics C B` over A's B
            raise ConfigError(f"{out_path} is crm-data topics' output of {earlier} ({table_path}), "
                              f"not of {in_path}: give a new OUT.jsonl, or --overwrite to replace it")
    uses: Counter = Counter()  # criterion -> occurrences, in first-seen order
    good = bad = 0
    for line in read_lines(in_path, "train", parser=_without_topics):
        if line.error:
            bad += 1
            continue
        good += 1
        uses.update(line.record.a_criteria + line.record.b_criteria)
    criteria = list(uses)
    if not criteria:
        raise ValueError(f"{in_path}: no valid training record to take criteria from")
    labels, names = cluster(criteria, k, seed, sentence_embedder(embedder) if embedder else None)
    topic_of = dict(zip(criteria, labels.tolist()))

    rejects_path = out_path.with_name(out_path.stem + ".rejects.jsonl")
    rejects_path.unlink(missing_ok=True)  # an earlier run's rejects are not this run's
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as out, open(rejects_path, "a", encoding="utf-8") as rejects:
        # The parser keeps the decoded object beside its record: the line is decoded once.
        for line in read_lines(in_path, "train", parser=lambda o: (o, _without_topics(o))):
            if line.error:
                rejects.write(json.dumps({**line.error.as_dict(), "raw": line.text},
                                         ensure_ascii=False) + "\n")
                continue
            obj, record = line.record
            obj["a_broad_criteria_topic"] = [topic_of[c] for c in record.a_criteria]
            obj["b_broad_criteria_topic"] = [topic_of[c] for c in record.b_criteria]
            out.write(json.dumps(obj, ensure_ascii=False) + "\n")
    tmp.replace(out_path)
    if not bad:
        rejects_path.unlink()

    table = []
    for topic, name in enumerate(names):
        members = [c for c in criteria if topic_of[c] == topic]
        members.sort(key=lambda c: -uses[c])  # stable: ties keep first-seen order
        table.append({"id": topic, "name": name, "size": sum(uses[c] for c in members),
                      "distinct": len(members), "examples": members[:EXAMPLES]})
    write_json(table_path, {"input": str(in_path.resolve()), "topics": table})
    return {"read": good + bad, "written": good, "rejected": bad, "criteria": sum(uses.values()),
            "distinct_criteria": len(criteria), "topics": len(names), "table": str(table_path),
            "rejects": str(rejects_path) if bad else None}
