"""crm-data topics (data_tools/topics.py): criteria clustered into topics, ids filled per criterion,
the topic table beside the output, bad lines rejected, and the embedding path."""
from __future__ import annotations

import json

import numpy as np
import pytest

from crm.core.records import read_lines
from data_tools.cli import main
from data_tools.topics import cluster

# three topics, each criterion naming its topic's word among others
GROUPS = {
    "code": ["Wants working code examples", "Prefers code over prose", "Likes annotated code snippets",
             "Needs runnable code"],
    "tone": ["Prefers a friendly tone", "Wants a warm, casual tone", "Likes a playful tone",
             "Prefers an encouraging tone of voice"],
    "sources": ["Wants cited sources", "Prefers answers that name their sources",
                "Likes links to primary sources", "Asks for trustworthy sources"],
}
TOPIC_OF = {c: g for g, cs in GROUPS.items() for c in cs}


def record(i: int, a: list[str], b: list[str], **fields) -> dict:
    q = f"question {i}"
    return {"idx": str(i), "human_winner": "model_a",
            "model_a": [{"role": "user", "content": q}, {"role": "assistant", "content": "a"}],
            "model_b": [{"role": "user", "content": q}, {"role": "assistant", "content": "b"}],
            "a_criteria": a, "b_criteria": b, **fields}


def write_records(path, n: int = 24) -> list[dict]:
    names = list(TOPIC_OF)
    records = [record(i, [names[i % 12], names[(i + 5) % 12]], [names[(i + 7) % 12]]) for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return records


def test_cluster_recovers_topics_that_share_words():
    criteria = list(TOPIC_OF)
    labels, names = cluster(criteria, k=3, seed=0)
    groups = {}
    for c, label in zip(criteria, labels):
        groups.setdefault(int(label), set()).add(TOPIC_OF[c])
    assert sorted(groups) == [0, 1, 2] and all(len(g) == 1 for g in groups.values())
    for label, (word,) in groups.items():
        assert names[label].split(", ")[0] == word  # named by its top term
    again, _ = cluster(criteria, k=3, seed=0)
    assert (again == labels).all()


def test_k_is_capped_by_the_distinct_criteria():
    labels, names = cluster(["Prefers code", "prefers CODE!", "Wants a friendly tone"], k=20)
    # the first two differ in stop words and case only
    assert len(names) == 2 and labels[0] == labels[1] != labels[2]
    labels, names = cluster(["Prefers it", "Wants that"], k=5)  # stop words only: one unnamed topic
    assert list(labels) == [0, 0] and names == ["(no terms)"]


def test_an_embedding_space_replaces_tfidf():
    criteria = list(TOPIC_OF)
    # a toy embedder that sees only the group: clusters follow it even where no word is shared
    basis = {g: np.eye(3)[i] for i, g in enumerate(GROUPS)}
    labels, names = cluster(criteria, k=3, embed=lambda texts: np.stack([basis[TOPIC_OF[t]] for t in texts]))
    assert len({(TOPIC_OF[c], int(label)) for c, label in zip(criteria, labels)}) == 3
    assert sorted(n.split(", ")[0] for n in names) == sorted(GROUPS)  # still named by TF-IDF terms


def test_topics_fills_every_criterion_and_writes_the_table(tmp_path, capsys):
    src, out = tmp_path / "train.jsonl", tmp_path / "with_topics.jsonl"
    records = write_records(src)
    # a bad line and one with stale topic ids (they are replaced)
    with open(src, "a", encoding="utf-8") as f:
        f.write('{"human_winner": "model_a"}\n')
        f.write(json.dumps(record(99, ["Needs runnable code"], ["Likes a playful tone"],
                                  a_broad_criteria_topic=[7], b_broad_criteria_topic=[7])) + "\n")
    assert main(["topics", str(src), str(out), "--k", "3"]) == 0
    stdout = capsys.readouterr().out
    assert f"26 read = 25 written to {out} + 1 rejected" in stdout
    lines = list(read_lines(out, "train"))
    assert len(lines) == 25 and all(ln.error is None for ln in lines)
    topic_of = {}
    for ln in lines:
        r = ln.record
        for crits, tops in ((r.a_criteria, r.a_topics), (r.b_criteria, r.b_topics)):
            assert len(crits) == len(tops)
            for c, t in zip(crits, tops):
                assert topic_of.setdefault(c, t) == t  # one topic per criterion text
    assert {frozenset(c for c in topic_of if topic_of[c] == t) for t in set(topic_of.values())} == \
        {frozenset(cs) for cs in GROUPS.values()}
    # everything else of a record is kept as it was
    assert json.loads(out.read_text().splitlines()[0])["idx"] == records[0]["idx"]
    doc = json.loads((tmp_path / "with_topics.topics.json").read_text())
    assert doc["input"] == str(src.resolve())
    table = doc["topics"]
    assert [t["id"] for t in table] == [0, 1, 2]
    assert sum(t["size"] for t in table) == 24 * 3 + 2 and sum(t["distinct"] for t in table) == 12
    for t in table:
        assert t["examples"] and all(topic_of[c] == t["id"] for c in t["examples"])
        assert t["name"].split(", ")[0] in GROUPS
    (reject,) = [json.loads(x) for x in (tmp_path / "with_topics.rejects.jsonl").read_text().splitlines()]
    assert (reject["line"], reject["field"]) == (25, "model_a")


def refusal(capsys, argv: list[str]) -> list[str]:
    """crm-data's exit 2 for `argv`, and the lines it wrote to stderr."""
    capsys.readouterr()
    assert main(argv) == 2
    return capsys.readouterr().err.strip().splitlines()


def test_topics_in_place_and_clear_errors(tmp_path, capsys):
    src = tmp_path / "train.jsonl"
    write_records(src)
    assert main(["topics", str(src), str(src), "--k", "2"]) == 0
    assert all(ln.error is None for ln in read_lines(src, "train"))
    assert not (tmp_path / "train.rejects.jsonl").exists()  # none to write
    # `topics A B` meant as two inputs: B, the user's data, is not replaced without --overwrite
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text("mine\n")
    assert refusal(capsys, ["topics", str(src), str(theirs), "--k", "2"]) == [
        f"crm-data topics: {theirs} exists and is not an output of crm-data topics (no "
        f"{tmp_path / 'theirs.topics.json'}): give a new OUT.jsonl (or IN.jsonl itself, to fill "
        "its topic ids in place), or --overwrite to replace it"]
    assert theirs.read_text() == "mine\n"
    assert main(["topics", str(src), str(theirs), "--k", "2", "--overwrite"]) == 0
    assert (tmp_path / "theirs.topics.json").is_file()  # its own output now: a re-run replaces it
    # A re-run of the same input replaces its own output; another input's (`topics C B` over
    # `topics A B`'s B) is refused as well
    assert main(["topics", str(src), str(theirs), "--k", "2"]) == 0
    other = tmp_path / "other.jsonl"
    write_records(other)
    made = theirs.read_bytes(), (tmp_path / "theirs.topics.json").read_bytes()
    assert refusal(capsys, ["topics", str(other), str(theirs), "--k", "2"]) == [
        f"crm-data topics: {theirs} is crm-data topics' output of {src.resolve()} "
        f"({tmp_path / 'theirs.topics.json'}), not of {other}: give a new OUT.jsonl, or "
        "--overwrite to replace it"]
    assert (theirs.read_bytes(), (tmp_path / "theirs.topics.json").read_bytes()) == made
    # a table that is no topics' table: named, not a traceback (topics and shard read it alike)
    shape = 'not {"input": ..., "topics": [{"id": ..., "name": ...}, ...]}'
    for damaged, why in (("not json", "not JSON: Expecting value: line 1 column 1 (char 0)"),
                         ('{"input": "x"}', shape), ('[{"id": 0}]', shape)):
        (tmp_path / "theirs.topics.json").write_text(damaged)
        for argv in (["topics", str(other), str(theirs)], ["shard", str(theirs), str(tmp_path / "sh")]):
            (line,) = refusal(capsys, argv)
            assert line.endswith(f"{tmp_path / 'theirs.topics.json'}: not a topic table of crm-data "
                                 f"topics ({why}); remove it or run crm-data topics again"), line
    assert theirs.read_bytes() == made[0] and not (tmp_path / "sh").exists()
    # votes without criteria: crm-data criteria named, as crm-data shard names it
    votes = tmp_path / "votes.jsonl"
    turn = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    votes.write_text(json.dumps({"prompt": "q", "chosen": turn, "rejected": turn}) + "\n")
    capsys.readouterr()
    assert main(["topics", str(votes), str(tmp_path / "v.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(
        f"crm-data topics: {votes}:1: votes (chosen-rejected format), not training records: "
        f"`crm-data criteria {votes} OUT_DIR --base-url URL --model NAME` writes the criteria")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("{}\n")
    capsys.readouterr()
    assert main(["topics", str(empty), str(tmp_path / "o.jsonl")]) == 2
    assert "no valid training record to take criteria from" in capsys.readouterr().err
    assert main(["topics", str(src), str(src), "--embedder", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "sentence-transformers" in err or "not a directory" in err


def test_sentence_transformers_model_from_a_local_directory(tmp_path):
    st = pytest.importorskip("sentence_transformers")  # the `embed` extra
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from data_tools.topics import sentence_embedder

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted({w.lower().strip(",") for c in TOPIC_OF
                                                                    for w in c.split()})]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab))
    model_dir = tmp_path / "tiny-st"
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(model_dir / "bert")
    BertTokenizerFast(str(tmp_path / "vocab.txt")).save_pretrained(model_dir / "bert")
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    st.SentenceTransformer(modules=[Transformer(str(model_dir / "bert")), Pooling(16)]).save(str(model_dir))
    embed = sentence_embedder(model_dir)
    vectors = embed(list(TOPIC_OF))
    assert vectors.shape == (12, 16) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    labels, names = cluster(list(TOPIC_OF), k=3, embed=embed)
    assert len(names) == 3 and set(labels.tolist()) <= {0, 1, 2}
