"""The OpenRLHF remote reward server and the verl batch compute_score, called with requests in the
exact shapes their projects send (crm/rl/openrlhf.py and crm/rl/verl.py cite the files checked)."""
from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from scorers import export_tiny, tiny_scorer

from crm.inference.reward import CRMReward, CRMRewardError
from crm.rl.openrlhf import make_server
from crm.rl.verl import compute_score

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CRITERIA = ["concise answer", "is friendly"]
# What OpenRLHF's prompt dataset renders with --data.apply_chat_template (ChatML, as Qwen's) and
# decodes back with skip_special_tokens=False: the prompt, the response, the end token.
PROMPT = "<|im_start|>user\nquestion one<|im_end|>\n<|im_start|>assistant\n"


def post(url: str, payload, timeout: float = 30) -> tuple[int, dict]:
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_openrlhf_request_gets_rewards_scores_and_extra_logs(openrlhf_server):
    reward, url = openrlhf_server
    labels = [{"criteria": CRITERIA, "reference": "beta reply"},
              json.dumps({"criteria": "is friendly", "reference": "beta reply",
                          "query": "question one"})]  # a label may be a JSON string
    body = {"query": [PROMPT + "alpha reply<|im_end|>", PROMPT + "alpha reply the a of<|im_end|>"],
            "prompts": [PROMPT, PROMPT], "labels": labels}
    status, answer = post(url, body)
    assert status == 200
    assert set(answer) == {"rewards", "scores", "extra_logs"}
    expected = reward(["question one"] * 2, ["alpha reply", "alpha reply the a of"],
                      criteria=[CRITERIA, ["is friendly"]], reference=["beta reply"] * 2)
    assert answer["rewards"] == pytest.approx(expected, abs=1e-6)
    assert answer["scores"] == answer["rewards"] == answer["extra_logs"]["crm_reward"]


def test_openrlhf_concurrent_single_sample_requests_each_get_their_own(openrlhf_server):
    """OpenRLHF posts one sample per request, many at once: they share a batch, not answers."""
    reward, url = openrlhf_server
    texts = [f"alpha reply {'the a of ' * i}" for i in range(6)]
    results = [None] * len(texts)

    def one(i):
        results[i] = post(url, {"query": [PROMPT + texts[i] + "<|im_end|>"], "prompts": [PROMPT],
                                "labels": [{"criteria": CRITERIA, "reference": "beta reply"}]})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    expected = reward(["question one"] * len(texts), [t.strip() for t in texts],
                      criteria=[CRITERIA] * len(texts), reference=["beta reply"] * len(texts))
    assert [r[0] for r in results] == [200] * len(texts)
    assert [r[1]["rewards"][0] for r in results] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("payload,message", [
    (b"{not json", "not JSON"),
    ({"query": ["x"]}, 'expected {"query": [...], "prompts": [...], "labels": [...]}'),
    ({"query": ["x"], "prompts": ["y"], "labels": [["c"]]}, "row 0: the query holds neither its prompt"),
    ({"query": [PROMPT + "a"], "prompts": [PROMPT], "labels": [["c"]]},
     'needs a reference answer: the label\'s "reference" key'),
    ({"query": [PROMPT + "a"], "prompts": [PROMPT], "labels": [""]}, "row 0: no criteria in the label"),
    ({"query": [PROMPT + "a"], "prompts": [PROMPT], "labels": [{"criteria": []}]}, "row 0: no criteria"),
    ({"query": [PROMPT + "a"], "prompts": [PROMPT], "labels": [{"criteria": ["c"], "answer": 1}]},
     "unknown label keys"),
])
def test_openrlhf_bad_requests_are_400_with_the_reason_and_logged(openrlhf_server, payload, message,
                                                                  caplog):
    _, url = openrlhf_server
    with caplog.at_level(logging.WARNING, logger="crm.rl.openrlhf"):
        status, answer = post(url, payload)
    assert status == 400 and message in answer["error"]
    # logged before the answer is sent: the server's log names the reason too
    assert any(message in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("earlier", ["<|im_start|>system\nbe brief<|im_end|>\n",
                                     # an earlier assistant turn: the header occurs twice
                                     PROMPT + "alpha reply<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"])
def test_openrlhf_left_truncated_prompt_is_scored_as_the_whole(openrlhf_server, earlier):
    """OpenRLHF cuts an over-long prompt's tokens from the left: `query` starts inside `prompts`."""
    reward, url = openrlhf_server
    prompt = earlier + PROMPT
    label = {"criteria": CRITERIA, "reference": "beta reply"}
    whole = post(url, {"query": [prompt + "alpha reply<|im_end|>"], "prompts": [prompt], "labels": [label]})
    assert whole[0] == 200
    for cut in (5, len(earlier) + 3):  # inside the earlier turns, inside the last user turn
        query = "\ufffd" + prompt[cut:] + "alpha reply<|im_end|>"  # a broken first byte, as decoded
        assert post(url, {"query": [query], "prompts": [prompt], "labels": [label]}) == whole


def test_openrlhf_refuses_round_robin():
    with pytest.raises(CRMRewardError, match="OpenRLHF scores each sample alone"):
        make_server(CRMReward(tiny_scorer(), "round_robin"), "127.0.0.1", 0)


def verl_batch(queries, responses, truths):
    """What verl's BatchRewardManager.verify passes: numpy arrays of non-tensor fields."""
    n = len(responses)
    return dict(data_sources=np.array(["crm"] * n, dtype=object), solution_strs=responses,
                ground_truths=truths,
                extra_infos=np.array([{"split": "train", "index": i, "question": q,
                                       "rollout_reward_scores": {}} for i, q in enumerate(queries)],
                                     dtype=object))


def test_verl_compute_score_groups_rollouts_by_criteria_and_query(tmp_path):
    export = export_tiny(tmp_path / "crm")
    queries = ["question one", "question one", "question two", "question two"]
    responses = ["alpha reply", "beta reply", "alpha reply the", "beta"]
    truths = [CRITERIA, CRITERIA, {"criteria": CRITERIA}, json.dumps({"criteria": CRITERIA})]
    # reward_kwargs from custom_reward_function.reward_kwargs are merged into the call
    scores = compute_score(**verl_batch(queries, responses, truths), checkpoint=str(export))
    expected = CRMReward(export)(queries, responses, criteria=[CRITERIA] * 4)
    assert scores == pytest.approx(expected, abs=1e-6)
    assert scores[0] + scores[1] == pytest.approx(1.0, abs=1e-6)  # round robin of two
    reference = compute_score(**verl_batch(queries[:1], responses[:1],
                                           [{"criteria": CRITERIA, "reference": "beta reply"}]),
                              checkpoint=str(export), strategy="reference")
    assert reference == pytest.approx([scores[0]], abs=1e-6)  # P(alpha beats beta), both orders


def test_verl_needs_a_query(tmp_path):
    export = export_tiny(tmp_path / "crm")
    batch = verl_batch(["q"], ["a"], [CRITERIA])
    batch["extra_infos"] = np.array([{"index": 0}], dtype=object)
    with pytest.raises(CRMRewardError, match=r"row 0: no query"):
        compute_score(**batch, checkpoint=str(export))


def test_verl_per_sample_compute_score_points_to_the_reward_manager():
    """verl 0.7+'s reward loop calls compute_score(data_source=, solution_str=, ...) per response."""
    with pytest.raises(CRMRewardError, match="pkg://crm.rl.verl_manager"):
        compute_score(data_source="crm", solution_str="a", ground_truth=CRITERIA,
                      extra_info={"question": "q"}, checkpoint="unused")


def test_openrlhf_request_the_crm_refuses_fails_alone_in_a_shared_batch(openrlhf_server):
    """An empty criterion passes the label check and is refused by the reward call itself: the
    batch it shares is scored again request by request, so only its own request fails."""
    reward, url = openrlhf_server
    bodies = [{"query": [PROMPT + "alpha reply"], "prompts": [PROMPT],
               "labels": [{"criteria": criteria, "reference": "beta reply"}]}
              for criteria in (CRITERIA, ["c", ""], CRITERIA)]
    results = [None] * 3

    def one(i):
        results[i] = post(url, bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    expected = reward(["question one"], ["alpha reply"], criteria=[CRITERIA], reference=["beta reply"])
    assert [r[0] for r in results] == [200, 400, 200]
    assert "empty or non-string criterion" in results[1][1]["error"]
    assert results[0][1]["rewards"] == results[2][1]["rewards"] == pytest.approx(expected, abs=1e-6)
