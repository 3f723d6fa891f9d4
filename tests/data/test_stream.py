"""crm.data: shards -> ranks x workers -> records -> transforms -> prompts -> batches
(docs/DESIGN.md section 2).

Exactly once per epoch for any shard count / world / worker count, equal batch counts on every rank,
mid-epoch resume, fail-fast planning, JSON-only shard reading, pointwise/pairwise batches, length
policy counters and padding.
"""
from __future__ import annotations

import copy
import json
import os
import pickle
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

from crm.data.manifest import ShardInfo, load_manifest
from crm.data.reader import ShardError, iter_shard
from crm.data.packing import split_shared, unpack
from crm.data.config import StreamConfig
from crm.data.stream import PairStream, StreamLoader
from crm.core.prompts import PromptEncoder
from crm.core.records import parse_train
from crm.core.examples import LABEL_A, LABEL_B, LABEL_TIE, LABELS
from crm.data.transforms import TransformConfig, record_rng, train_example
from crm.data.shard import shard
from helpers import make_records, split_sizes, tiny_tokenizer, train_dict, write_shard_dir, write_tar

TOK = tiny_tokenizer()
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")

# 53 records, every 6th a tie (8 ties, 45 decided); shard sizes deliberately unequal. In the 8-shard
# layout shard 1 holds only record 5, a tie: under ties="drop" it has no eligible record at all.
RECORDS = make_records(53, tie_every=6)
BY_KEY = dict(RECORDS)
TIES = {k for k, r in RECORDS if r["human_winner"] == "tie"}
DECIDED = {k for k, _ in RECORDS} - TIES
LAYOUTS = {1: [53], 3: [30, 2, 21], 5: [1, 17, 3, 24, 8], 8: [5, 1, 12, 7, 2, 15, 1, 10]}
assert len(TIES) == 8 and BY_KEY["k0005"]["human_winner"] == "tie"


@pytest.fixture(scope="module", params=sorted(LAYOUTS), ids=lambda n: f"{n}shards")
def shards(request, tmp_path_factory) -> list[ShardInfo]:
    out = tmp_path_factory.mktemp(f"shards{request.param}")
    return write_shard_dir(out, split_sizes(RECORDS, LAYOUTS[request.param])).shards("train")


@pytest.fixture(scope="module")
def shards3(tmp_path_factory) -> list[ShardInfo]:
    out = tmp_path_factory.mktemp("shards3")
    return write_shard_dir(out, split_sizes(RECORDS, LAYOUTS[3])).shards("train")


def make_loader(shards, *, rank=0, world=1, workers=0, batch_size=4, ties="drop", mode="pairwise",
                transform: TransformConfig | None = None, tokenizer=TOK, packing=False,
                **cfg) -> StreamLoader:
    """A rank's loader; right-padded batches unless `packing` (the tests read rows by their mask;
    packed batches hold the same records: test_packed_batches_hold_...)."""
    transform = transform or TransformConfig(ties=ties)
    cfg = StreamConfig(batch_size=batch_size, mode=mode, packing=packing, **cfg)
    ds = PairStream(shards, tokenizer, cfg, transform, rank=rank, world=world)
    return StreamLoader(ds, num_workers=workers)


def keys_of(batches) -> list[str]:
    return [k for b in batches for k in b["keys"]]


def row_text(batch, i: int) -> str:
    n = int(batch["attention_mask"][i].sum())
    return TOK.decode(batch["input_ids"][i, :n].tolist())


# -- 1. exactly once ------------------------------------------------------------------------------


@pytest.mark.parametrize("ties", ["drop", "keep"])
def test_exactly_once_two_ranks_two_workers(shards, ties):
    loaders = [make_loader(shards, rank=r, world=2, workers=2, ties=ties) for r in range(2)]
    expected = DECIDED | TIES if ties == "keep" else DECIDED
    k = len(loaders[0])
    assert k == len(loaders[1]) == -(-len(expected) // (2 * 4))  # ceil(eligible / (world * batch))
    for epoch in range(2):
        per_rank = [list(loader) for loader in loaders]
        assert [len(b) for b in per_rank] == [k, k]  # equal step counts: no DDP hang at epoch end
        counts = Counter(keys_of(per_rank[0]) + keys_of(per_rank[1]))
        assert set(counts) == expected
        assert set(counts.values()) == {1}, [key for key, c in counts.items() if c > 1]
        assert not set(keys_of(per_rank[0])) & set(keys_of(per_rank[1]))
        for batches in per_rank:
            assert [b["position"].tolist() for b in batches] == [[epoch, j] for j in range(k)]
            assert all(1 <= len(b["keys"]) <= 4 for b in batches)
            assert sum(int(b["dropped"]) for b in batches) == 0
        for loader in loaders:
            assert loader.state_dict()["epoch"] == epoch + 1
            assert loader.state_dict()["batches_done"] == 0


@pytest.mark.parametrize("ties", ["drop", "keep"])
def test_exactly_once_three_ranks_no_workers(shards, ties):
    expected = DECIDED | TIES if ties == "keep" else DECIDED
    # A small shuffle buffer and length-grouping window: records stream through both in pieces.
    loaders = [make_loader(shards, rank=r, world=3, workers=0, ties=ties, batch_size=3,
                           shuffle_buffer=5, window_batches=2) for r in range(3)]
    k = len(loaders[0])
    assert all(len(loader) == k for loader in loaders)
    for _ in range(2):
        per_rank = [list(loader) for loader in loaders]
        assert [len(b) for b in per_rank] == [k] * 3
        keys = [key for batches in per_rank for key in keys_of(batches)]
        assert sorted(keys) == sorted(expected)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_more_workers_than_batches(tmp_path):
    shards = write_shard_dir(tmp_path, [make_records(6)]).shards("train")
    loader = make_loader(shards, workers=3, batch_size=4)
    assert len(loader) == 2
    batches = list(loader)
    assert len(batches) == 2
    assert sorted(keys_of(batches)) == [k for k, _ in make_records(6)]


# -- 2. batches independent of the worker count; epochs reshuffle -----------------------------------


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_batches_do_not_depend_on_worker_count(shards3):
    runs = {}
    for workers in (0, 2, 3):
        loader = make_loader(shards3, rank=1, world=2, workers=workers, shuffle_buffer=7,
                             window_batches=2)
        runs[workers] = [list(loader) for _ in range(2)]
    for workers in (2, 3):
        for e0, ew in zip(runs[0], runs[workers]):
            assert len(e0) == len(ew)
            for b0, bw in zip(e0, ew):
                assert b0["keys"] == bw["keys"]
                assert torch.equal(b0["input_ids"], bw["input_ids"])
                assert torch.equal(b0["labels"], bw["labels"])
                assert torch.equal(b0["position"], bw["position"])


def test_epochs_reshuffle_and_redraw(shards3):
    loader = make_loader(shards3, rank=0, world=2)
    e0, e1 = list(loader), list(loader)
    assert keys_of(e0) != keys_of(e1)  # the shuffle is re-seeded per epoch
    # The rank's share depends on the epoch's shard order; across ranks, every epoch is complete.
    other = make_loader(shards3, rank=1, world=2)
    o0, o1 = list(other), list(other)
    assert sorted(keys_of(e0) + keys_of(o0)) == sorted(keys_of(e1) + keys_of(o1)) == sorted(DECIDED)
    # Transforms re-draw each epoch (swap_prob 0.5): some key changes its label between epochs.
    labels = [{k: int(y) for b in ep for k, y in zip(b["keys"], b["labels"])} for ep in (e0 + o0, e1 + o1)]
    assert any(labels[0][k] != labels[1][k] for k in DECIDED)


def test_single_shard_epochs_reshuffle_within_the_same_share(tmp_path):
    # One shard: the shard order cannot change, so a new order must come from the re-seeded shuffle.
    shards = write_shard_dir(tmp_path, [RECORDS]).shards("train")
    loader = make_loader(shards, rank=1, world=2, window_batches=2)
    epochs = [keys_of(list(loader)) for _ in range(3)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(epochs[2])  # rank 1's share is fixed
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]


def test_no_redraw_keeps_labels_and_validation_order_is_fixed(shards3):
    loader = make_loader(shards3, transform=TransformConfig(redraw_each_epoch=False))
    e0, e1 = list(loader), list(loader)
    labels = [{k: int(y) for b in ep for k, y in zip(b["keys"], b["labels"])} for ep in (e0, e1)]
    assert labels[0] == labels[1]
    fixed = make_loader(shards3, shuffle=False)
    v0, v1 = list(fixed), list(fixed)
    assert [b["keys"] for b in v0] == [b["keys"] for b in v1]
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(v0, v1))


# -- 3. save / restore -----------------------------------------------------------------------------


def take(loader, k):
    it = iter(loader)
    batches = [next(it) for _ in range(k)]
    it.close()  # shuts the DataLoader (and its workers) down mid-epoch, as an interrupted run
    return batches


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("k", [1, 4])
def test_resume_mid_epoch(shards3, workers, k):
    full = list(make_loader(shards3, rank=1, world=2))
    first_loader = make_loader(shards3, rank=1, world=2, workers=workers)
    first = take(first_loader, k)
    state = first_loader.state_dict()
    assert (state["epoch"], state["batches_done"]) == (0, k)

    resumed = make_loader(shards3, rank=1, world=2, workers=workers)  # a new process's objects
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(first) + len(rest) == len(full)
    assert [b["keys"] for b in first + rest] == [b["keys"] for b in full]
    assert [b["position"].tolist() for b in rest] == [[0, j] for j in range(k, len(full))]
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(rest, full[k:]))
    counts = Counter(keys_of(first + rest))
    assert set(counts.values()) == {1} and set(counts) == set(keys_of(full))
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["batches_done"] == 0


def test_resume_in_a_later_epoch(shards3):
    ref = make_loader(shards3, rank=0, world=2)
    list(ref)
    epoch1 = list(ref)
    run = make_loader(shards3, rank=0, world=2)
    list(run)
    first = take(run, 2)
    resumed = make_loader(shards3, rank=0, world=2)
    resumed.load_state_dict(run.state_dict())
    rest = list(resumed)
    assert [b["keys"] for b in first + rest] == [b["keys"] for b in epoch1]
    assert all(torch.equal(a["labels"], b["labels"]) for a, b in zip(first + rest, epoch1))
    assert [int(b["position"][0]) for b in rest] == [1] * len(rest)


def test_mark_consumed(shards3):
    loader = make_loader(shards3, rank=0, world=2)
    k = len(loader)
    it = iter(loader)
    fetched = [next(it), next(it), next(it)]  # a trainer that prefetches is ahead of training
    assert loader.state_dict()["batches_done"] == 3
    loader.mark_consumed(fetched[0]["position"])
    state = loader.state_dict()
    assert (state["epoch"], state["batches_done"]) == (0, 1)
    it.close()
    resumed = make_loader(shards3, rank=0, world=2)
    resumed.load_state_dict(state)
    rest = list(resumed)
    full = list(make_loader(shards3, rank=0, world=2))
    assert [b["keys"] for b in rest] == [b["keys"] for b in full[1:]]

    # Consuming the epoch's last batch moves the state to the next epoch, before the loop ends.
    loader = make_loader(shards3, rank=0, world=2)
    for j, batch in enumerate(loader):
        loader.mark_consumed(batch["position"])
        state = loader.state_dict()
        if j < k - 1:
            assert (state["epoch"], state["batches_done"]) == (0, j + 1)
        else:
            assert (state["epoch"], state["batches_done"]) == (1, 0)
    assert (loader.epoch, loader.batches_done) == (1, 0)


def test_resume_mid_epoch_with_other_plan_refused(shards3):
    run = make_loader(shards3, rank=0, world=2)
    take(run, 2)
    state = run.state_dict()
    with pytest.raises(ValueError, match=r"cannot resume mid-epoch.*world size 2"):
        make_loader(shards3, rank=0, world=3).load_state_dict(state)
    with pytest.raises(ValueError, match="micro batch 4"):
        make_loader(shards3, rank=0, world=2, batch_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed 0"):
        make_loader(shards3, rank=0, world=2, seed=1).load_state_dict(state)
    # At an epoch boundary the plan may change: a new world size simply starts that epoch.
    boundary = {**state, "epoch": 1, "batches_done": 0}
    other = make_loader(shards3, rank=2, world=3)
    other.load_state_dict(boundary)
    batches = list(other)
    assert len(batches) == len(other)
    assert all(int(b["position"][0]) == 1 for b in batches)


# -- 4. fail fast ----------------------------------------------------------------------------------


def test_too_few_records_for_the_ranks(tmp_path):
    shards = write_shard_dir(tmp_path, [make_records(3)]).shards("train")
    for rank in range(4):
        with pytest.raises(ValueError, match="3 records cannot give each of 4 ranks a batch"):
            make_loader(shards, rank=rank, world=4)


def test_spread_thin_fails_on_every_rank(tmp_path):
    # 5 records, 4 ranks, batch 1: K = 2 batches but ranks 1..3 own one record each. Every rank must
    # refuse (a rank that starts alone would wait forever for the others in the first collective).
    shards = write_shard_dir(tmp_path, [make_records(5)]).shards("train")
    for rank in range(4):
        with pytest.raises(ValueError, match="lower the batch size or the number of ranks"):
            make_loader(shards, rank=rank, world=4, batch_size=1)
    assert len(make_loader(shards, rank=0, world=4, batch_size=2)) == 1  # K = 1: fine


def test_ties_only_leave_nothing_to_train(tmp_path):
    shards = write_shard_dir(tmp_path, [[("t0", train_dict("t0", "tie")),
                                         ("t1", train_dict("t1", "tie"))]]).shards("train")
    with pytest.raises(ValueError, match="0 records"):
        make_loader(shards)
    assert len(make_loader(shards, ties="keep")) == 1


def test_a_pointwise_batch_labels_its_ties_and_keeps_their_order(tmp_path):
    records = [("t0", train_dict("t0", "tie")), ("w1", train_dict("w1", "model_b"))]
    shards = write_shard_dir(tmp_path, [records]).shards("train")
    transform = TransformConfig(ties="keep", swap_prob=0.0)
    (batch,) = list(make_loader(shards, mode="pointwise", transform=transform, batch_size=2))
    labels = dict(zip(batch["keys"], batch["labels"].tolist()))
    assert sorted(labels.values()) == [LABEL_A, LABEL_TIE]  # the won pair: its chosen row first
    n = len(batch["keys"])
    for i, key in enumerate(batch["keys"]):
        first, second = row_text(batch, i), row_text(batch, n + i)
        # the won pair's chosen row (B's) first; a tie's rows in the order shown: A, then B
        assert ("beta reply" in first) == (labels[key] == LABEL_A), key
        assert ("alpha reply" in second) == (labels[key] == LABEL_A), key


def test_bad_settings_refused(shards3):
    with pytest.raises(ValueError, match="mode='listwise'"):
        StreamConfig(batch_size=4, mode="listwise")
    with pytest.raises(ValueError, match="criteria pool"):
        make_loader(shards3, transform=TransformConfig(noise="add"))
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        make_loader(shards3, rank=2, world=2)
    with pytest.raises(ValueError, match="batch size 0"):
        make_loader(shards3, batch_size=0)


# -- 5. shards are read as JSON and nothing else ---------------------------------------------------


class _Touch:
    """Unpickling this calls open(path, "w"): a marker file proves code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _payload(marker: Path) -> bytes:
    return pickle.dumps(_Touch(marker))


def test_pickle_payload_is_live(tmp_path):
    marker = tmp_path / "proof"
    pickle.loads(_payload(marker)).close()  # the payload used below really runs code when unpickled
    assert marker.exists()


@pytest.mark.parametrize("ext", ["pyd", "pickle"])
def test_pickle_member_refused_by_reader(tmp_path, ext):
    marker = tmp_path / "pwned"
    good = json.dumps(train_dict("k0")).encode()
    url = str(write_tar(tmp_path / "evil.tar", [("k0.json", good), (f"k1.{ext}", _payload(marker)),
                                                ("k2.json", good)]))
    it = iter_shard(url)
    assert next(it)[0] == "k0"
    with pytest.raises(ShardError, match=rf"evil\.tar.*'k1\.{ext}'.*never unpickled"):
        next(it)
    assert not marker.exists()


@pytest.mark.parametrize("workers", [0, 2])
def test_pickle_member_refused_by_stream(tmp_path, workers):
    marker = tmp_path / "pwned"
    records = make_records(12)
    write_shard_dir(tmp_path, split_sizes(records, [6, 6]))
    # Replace the second shard by one whose sample k0008 carries a pickle next to its JSON.
    members = [(f"{k}.json", json.dumps(r).encode()) for k, r in records[6:]]
    members.insert(3, ("k0008.pyd", _payload(marker)))
    write_tar(tmp_path / "train-000001.tar", members)
    loader = make_loader(load_manifest(tmp_path).shards("train"), workers=workers, shuffle=False)
    with pytest.raises(ShardError, match=r"train-000001\.tar.*'k0008\.pyd'") as excinfo:
        list(loader)  # a worker's ShardError reaches the main process as a ShardError
    # The re-raised exception's frames hold the DataLoader iterator in a reference cycle; left to
    # the garbage collector, its workers wait out two 5 s join timeouts. Clearing frees it now.
    traceback.clear_frames(excinfo.tb)
    assert not marker.exists()


def test_bad_json_member_names_shard_and_member(tmp_path):
    url = str(write_tar(tmp_path / "bad.tar", [("k0.json", json.dumps(train_dict("k0")).encode()),
                                               ("k1.json", b'{"human_winner": "model_a",')]))
    with pytest.raises(ShardError, match=r"bad\.tar: member '?k1\.json'?: bad JSON"):
        list(iter_shard(url))


def test_undecodable_json_member_names_shard(tmp_path):
    url = str(write_tar(tmp_path / "bytes.tar", [("k0.json", b'{"a": "\xff\xfe"}')]))
    with pytest.raises(ShardError, match=r"bytes\.tar: member '?k0\.json'?: bad JSON"):
        list(iter_shard(url))


def test_not_a_tar_names_shard(tmp_path):
    path = tmp_path / "junk.tar"
    path.write_bytes(b"this is not a tar archive" * 40)
    with pytest.raises(ShardError, match=r"junk\.tar.*not a readable tar shard"):
        list(iter_shard(str(path)))


def test_invalid_record_in_shard_names_shard_and_sample(tmp_path):
    bad = train_dict("k0001")
    del bad["a_criteria"]
    records = make_records(4)
    records[1] = ("k0001", bad)
    shards = write_shard_dir(tmp_path, [records]).shards("train")
    with pytest.raises(ShardError, match=r"train-000000\.tar: sample k0001: a_criteria: missing field"):
        list(make_loader(shards, shuffle=False))


def test_manifest_promising_more_than_the_shard_holds(tmp_path):
    shards = write_shard_dir(tmp_path, split_sizes(make_records(8), [4, 4]),
                             records_override={0: 6}).shards("train")
    with pytest.raises(ShardError, match=r"train-000000\.tar: 4 eligible records, the manifest promised"):
        list(make_loader(shards, shuffle=False))


def test_stream_reads_shards_written_by_crm_data_shard(tmp_path):
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for _, r in RECORDS) + "not json\n")
    manifest = shard([str(src)], tmp_path / "out", val_fraction=0.2, shard_size=7, seed=3)
    assert manifest["counts"] == {"read": 54, "written": 53, "rejected": 1}
    m = load_manifest(tmp_path / "out")
    seen = []
    for split in ("train", "val"):
        for keep in (False, True):
            shards = m.shards(split)
            loaders = [make_loader(shards, rank=r, world=2, workers=0, batch_size=2,
                                   ties="keep" if keep else "drop") for r in range(2)]
            assert len(loaders[0]) == len(loaders[1])
            keys = keys_of(list(loaders[0])) + keys_of(list(loaders[1]))
            assert len(keys) == len(set(keys)) == sum(s.eligible(keep) for s in shards)
            if keep:
                seen += keys
    # Keys are the JSONL line numbers; every line that parsed was trained on once across splits.
    assert sorted(seen) == [f"l{n:09d}" for n in range(1, 54)]


def test_stream_trains_readme_format_shards(tmp_path):
    """README-format records ({idx, prompt, model_a, model_b, criteria, preference}) sharded as they
    are: the criteria shown are the record's, the label its preference, ties follow the policy, and
    a direction that needs the loser's criteria is refused before the first batch."""
    src = tmp_path / "readme.jsonl"
    objs = {}
    for key, r in RECORDS:
        side = "a" if r["human_winner"] != "model_b" else "b"
        objs[key] = {"idx": key, "prompt": r["model_a"][0]["content"], "model_a": r["model_a"],
                     "model_b": r["model_b"], "criteria": r[f"{side}_criteria"],
                     "preference": r["human_winner"]}
    src.write_text("".join(json.dumps(o) + "\n" for o in objs.values()))
    shard([str(src)], tmp_path / "out", val_fraction=0.0, shard_size=10)
    m = load_manifest(tmp_path / "out")
    shards = m.shards("train")
    assert sum(s.one_sided for s in shards) == 53 and sum(s.ties for s in shards) == len(TIES)
    for direction in ("reverse", "random"):
        with pytest.raises(ValueError, match=f"direction='{direction}' shows the losing side's"):
            make_loader(shards, transform=TransformConfig(direction=direction))
    line_key = {f"l{n:09d}": key for n, key in enumerate(objs, start=1)}
    for ties in ("drop", "keep"):
        transform = TransformConfig(ties=ties, noise="replace", swap_prob=0.5)
        ds = PairStream(shards, TOK, StreamConfig(batch_size=4, packing=False), transform, m.criteria_pool)
        batches = list(StreamLoader(ds))
        keys = [line_key[k] for k in keys_of(batches)]
        assert sorted(keys) == sorted(DECIDED | (TIES if ties == "keep" else set()))
        for batch in batches:
            for i, k in enumerate(batch["keys"]):
                key, label, text = line_key[k], int(batch["labels"][i]), row_text(batch, i)
                preference = objs[key]["preference"]
                if preference == "tie":
                    assert label == LABEL_TIE
                else:  # the label names the slot that shows the preferred response
                    shown = "alpha" if preference == "model_a" else "beta"
                    slot = ("## Response A", "## Response B")[label]
                    assert text.index(slot) < text.index(f"{shown} reply {key}")
                    assert text.index(f"{shown} reply {key}") < (
                        text.index("## Response B") if label == 0 else len(text))
                assert f"{objs[key]['criteria'][0]}" in text  # 2 criteria: replace keeps both


# -- 6. pointwise and pairwise batches -------------------------------------------------------------


@pytest.mark.parametrize("direction", ["original", "reverse"])
def test_pointwise_rows_chosen_then_rejected(shards3, direction):
    loader = make_loader(shards3, mode="pointwise", transform=TransformConfig(direction=direction))
    batches = list(loader)
    assert sorted(keys_of(batches)) == sorted(DECIDED)
    for batch in batches:
        n = len(batch["keys"])
        assert batch["labels"].tolist() == [LABEL_A] * n  # each pair won by its first row
        assert batch["input_ids"].shape[0] == batch["attention_mask"].shape[0] == 2 * n
        for i, key in enumerate(batch["keys"]):
            a_wins = BY_KEY[key]["human_winner"] == "model_a"
            # The label follows the criteria: under "reverse" the loser's criteria prefer the loser.
            chosen_a = a_wins if direction == "original" else not a_wins
            chosen, rejected = ("alpha", "beta") if chosen_a else ("beta", "alpha")
            side = "a" if chosen_a else "b"
            c_text, r_text = row_text(batch, i), row_text(batch, n + i)
            assert f"{chosen} reply {key}" in c_text and f"{rejected} reply" not in c_text
            assert f"{rejected} reply {key}" in r_text and f"{chosen} reply" not in r_text
            for text in (c_text, r_text):  # both rows are judged under the chosen side's criteria
                assert f"- {key} {side}0" in text and f"{key} {'b' if chosen_a else 'a'}0" not in text


@pytest.mark.parametrize("swap_prob", [0.0, 1.0])
def test_pairwise_labels_follow_the_transform(shards3, swap_prob):
    loader = make_loader(shards3, transform=TransformConfig(swap_prob=swap_prob))
    for batch in loader:
        assert batch["labels"].dtype == torch.long
        assert batch["labels"].shape == (len(batch["keys"]),) == (batch["input_ids"].shape[0],)
        for i, key in enumerate(batch["keys"]):
            winner = LABELS[BY_KEY[key]["human_winner"]]
            label = int(batch["labels"][i])
            text = row_text(batch, i)
            first = "alpha" if swap_prob == 0 else "beta"
            assert text.index("## Response A") < text.index(f"{first} reply {key}") < text.index(
                "## Response B")
            assert label == (winner if swap_prob == 0 else 1 - winner)
            # the label names the slot that shows the winner's response
            shown = (("alpha", "beta") if swap_prob == 0 else ("beta", "alpha"))[label]
            assert BY_KEY[key]["human_winner"] == ("model_a" if shown == "alpha" else "model_b")


def test_workers_turn_the_tokenizers_thread_pool_off(shards3, monkeypatch):
    # A worker forked after the fast tokenizer used its pool with TOKENIZERS_PARALLELISM=true hangs.
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    TOK(["warm the pool", "in the parent"] * 64)
    loader = make_loader(shards3, workers=1)
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    assert len(list(loader)) == len(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_direction_warmup_counts_batches_across_epochs_and_resume(shards3, workers):
    def loader():
        transform = TransformConfig(direction="reverse", warmup_direction="original",
                                    warmup_batches=k + 2, swap_prob=0.0)
        return make_loader(shards3, rank=1, world=2, workers=workers, transform=transform)

    k = len(make_loader(shards3, rank=1, world=2))
    run = loader()
    batches = list(run) + take(run, 3)  # epoch 0, then epoch 1 up to a mid-epoch stop
    resumed = loader()
    resumed.load_state_dict(run.state_dict())
    batches += list(resumed)
    assert len(batches) == 2 * k
    # The warmup covers the records of the run's first k + 2 chunks (draw order): all of epoch 0
    # and epoch 1's first two chunks, wherever length grouping puts them.
    warm = {key for chunk in list(run.dataset.chunks_of_records(1))[:2] for _, key, _, _ in chunk}
    assert 0 < len(warm) < len(keys_of(batches[k:]))
    for index, batch in enumerate(batches):
        for key, label in zip(batch["keys"], batch["labels"].tolist()):
            winner = LABELS[BY_KEY[key]["human_winner"]]
            original = index < k or key in warm
            assert label == (winner if original else 1 - winner), (index, key)


def test_pairwise_ties_kept_get_the_tie_label(shards3):
    labels = {k: int(y) for b in make_loader(shards3, ties="keep")
              for k, y in zip(b["keys"], b["labels"])}
    assert set(labels) == DECIDED | TIES
    assert {k for k, y in labels.items() if y == LABEL_TIE} == TIES
    assert {labels[k] for k in DECIDED} <= {LABEL_A, LABEL_B}


# -- 7. length policy counters ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_lengths(tmp_path_factory):
    """12 short and 12 long records (long: 150 filler words in each response)."""
    records = [(f"s{i:03d}", train_dict(f"s{i:03d}", ("model_a", "model_b")[i % 2])) for i in range(12)]
    records += [(f"x{i:03d}", train_dict(f"x{i:03d}", ("model_a", "model_b")[i % 2], words=150))
                for i in range(12)]
    out = tmp_path_factory.mktemp("mixed")
    shards = write_shard_dir(out, split_sizes(records, [5, 11, 8])).shards("train")
    # Full lengths per key, from an unconstrained run.
    lengths = {k: int(m.sum()) for b in make_loader(shards, max_tokens=100_000)
               for k, m in zip(b["keys"], b["attention_mask"])}
    return shards, lengths


def test_length_policy_counts_in_batches(mixed_lengths):
    shards, lengths = mixed_lengths
    short = {k for k in lengths if k.startswith("s")}
    long = set(lengths) - short
    assert max(lengths[k] for k in short) < min(lengths[k] for k in long)
    limit = max(lengths[k] for k in short) + 80

    # Medium limit: every long row is shortened, nothing dropped, short rows untouched.
    batches = list(make_loader(shards, max_tokens=limit))
    assert sorted(keys_of(batches)) == sorted(lengths)
    for b in batches:
        assert int(b["dropped"]) == 0
        assert int(b["shortened"]) == sum(k in long for k in b["keys"])
        assert b["input_ids"].shape[1] <= limit
        for k, m in zip(b["keys"], b["attention_mask"]):
            assert int(m.sum()) == lengths[k] if k in short else int(m.sum()) <= limit
    assert sum(int(b["shortened"]) for b in batches) == len(long)

    # Tight limit: the short rows fit exactly as they are; the long ones cannot keep enough: dropped.
    tight = max(lengths[k] for k in short)
    batches = list(make_loader(shards, max_tokens=tight))
    assert len(batches) == len(make_loader(shards, max_tokens=tight))  # the step count never changes
    assert sorted(keys_of(batches)) == sorted(short)
    for b in batches:
        assert int(b["shortened"]) == 0
        assert b["labels"].shape[0] == b["input_ids"].shape[0] == len(b["keys"])
    assert sum(int(b["dropped"]) for b in batches) == len(long)


@pytest.mark.parametrize("mode", ["pairwise", "pointwise"])
def test_impossible_limit_drops_and_counts_everything(mixed_lengths, mode):
    shards, lengths = mixed_lengths
    loader = make_loader(shards, max_tokens=12, mode=mode)
    batches = list(loader)
    assert len(batches) == len(loader) == 6
    for b in batches:
        assert b["keys"] == [] and int(b["dropped"]) > 0  # dropped counts records
        assert b["input_ids"].shape[0] == b["attention_mask"].shape[0] == 0
        if mode == "pairwise":
            assert b["labels"].numel() == 0
    assert sum(int(b["dropped"]) for b in batches) == len(lengths)


# -- 8. padding ------------------------------------------------------------------------------------


def test_padding_and_rows_match_the_prompt_encoder(mixed_lengths):
    shards, lengths = mixed_lengths
    transform = TransformConfig()
    limit = 300
    tok = copy.deepcopy(TOK)
    tok.pad_token = "<|im_start|>"  # a pad id other than 0, so that zero-filling would show
    assert tok.pad_token_id not in (0, None)
    loader = make_loader(shards, max_tokens=limit, seed=5, tokenizer=tok)
    encoder = PromptEncoder(tok, max_tokens=limit, min_turn_tokens=16)
    records = {}
    for info in shards:
        records.update((k, parse_train(obj)) for k, obj in iter_shard(info.url))
    padded_somewhere = False
    for epoch in range(2):
        for b in loader:
            ids, mask = b["input_ids"], b["attention_mask"]
            assert ids.shape == mask.shape and ids.shape[0] == len(b["keys"])
            row_lengths = mask.sum(1).tolist()
            assert ids.shape[1] == max(row_lengths)
            for i, key in enumerate(b["keys"]):
                n = row_lengths[i]
                assert mask[i, :n].eq(1).all() and mask[i, n:].eq(0).all()  # right padded
                assert ids[i, n:].eq(tok.pad_token_id).all()
                padded_somewhere |= n < ids.shape[1]
                ex = train_example(records[key], key, transform, record_rng(5, epoch, key))
                (expected,) = encoder.pairwise_many([(ex.criteria, ex.query, ex.conv_a, ex.conv_b)])
                assert ids[i, :n].tolist() == expected
                assert int(b["labels"][i]) == ex.label
                assert ids[i, n - 2] == IM_END  # the chat template closes the prompt: never cut
    assert padded_somewhere


@pytest.mark.parametrize("mode", ["pairwise", "pointwise"])
def test_windows_group_records_by_encoded_length(mixed_lengths, mode):
    shards, lengths = mixed_lengths
    # One window of 6 batches holds all 24 records; in order (no shuffle) each batch's records are
    # the next-longest ones, by their longest row in tokens.
    batches = list(make_loader(shards, mode=mode, shuffle=False, window_batches=6))
    assert len(batches) == 6 and sorted(keys_of(batches)) == sorted(lengths)
    record_lengths = []
    for b in batches:
        rows = b["attention_mask"].sum(1).tolist()
        n = len(b["keys"])
        per_record = rows if mode == "pairwise" else [max(c, r) for c, r in zip(rows[:n], rows[n:])]
        assert b["input_ids"].shape[1] == max(per_record)
        record_lengths.append(per_record)
    for shorter, longer in zip(record_lengths, record_lengths[1:]):
        assert max(shorter) <= min(longer)


# -- packed rows (stream.packing) ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pairwise", "pointwise"])
def test_packed_batches_hold_the_padded_batches_records_and_step_counts(shards3, mode):
    """Packing changes how a batch is laid out, not what it holds: the same records in the same
    batches and steps, each read's sequence the padded row's real tokens; a pointwise pair computes
    its criteria + query once."""
    runs = []
    for packing in (False, True):
        loader = make_loader(shards3, mode=mode, batch_size=5, packing=packing)
        loader.step_batches = 2
        runs.append(list(loader))
    for padded, packed in zip(*runs, strict=True):
        for field in ("keys", "position", "step_examples", "step_index", "step_batches", "shortened"):
            assert packed[field] == padded[field] if field == "keys" else torch.equal(
                torch.as_tensor(packed[field]), torch.as_tensor(padded[field])), field
        rows = [row[:n].tolist() for row, n in zip(padded["input_ids"], padded["attention_mask"].sum(1))]
        assert unpack(packed) == rows
        assert packed["input_ids"].shape == (1, packed["real_tokens"])
        assert packed["padded_tokens"] == padded["input_ids"].numel()
        assert packed["attended_tokens"] == padded["attention_mask"].sum()
        if mode == "pairwise":
            assert torch.equal(packed["labels"], padded["labels"])
            assert packed["real_tokens"] == padded["attention_mask"].sum()
        else:  # the two rows' common prefix (the prompt up to the response) is in the row once
            n = len(rows) // 2
            shared = sum(len(split_shared(c, r)[0]) for c, r in zip(rows[:n], rows[n:]))
            assert shared > 0 and packed["real_tokens"] == padded["attention_mask"].sum() - shared
