"""crm.core.prompts: templates, chat rendering and the length policy (docs/DESIGN.md section 5)."""
from __future__ import annotations

import pytest

from crm.models.tokenizer import train_bpe_tokenizer
from crm.core.prompts import ELLIPSIS, PAIRWISE_TEMPLATE, Fit, PromptEncoder, PromptTemplate, _water_level
from crm.core.records import Message
from helpers import CORPUS, tiny_tokenizer

TOK = tiny_tokenizer()
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
CLOSING = "Which response does this user prefer?"

CRITERIA = ("be concise", "cite sources")
QUERY = "How do tides work?"


def answer(text: str) -> tuple[Message, ...]:
    return (Message("assistant", text),)


def long_text(tag: str, words: int = 60) -> str:
    """START_tag ... MIDDLE_tag ... END_tag: the middle marker sits in the centre."""
    half = " ".join(f"{tag.lower()}{i}" for i in range(words))
    return f"START_{tag} {half} MIDDLE_{tag} {half} END_{tag}"


def pair_fit(enc: PromptEncoder, criteria, query, a, b) -> Fit:
    return enc.fit_pairwise([(criteria, query, a, b)])[0]


def pair_ids(enc: PromptEncoder, criteria, query, a, b):
    return pair_fit(enc, criteria, query, a, b).ids


def point_ids(enc: PromptEncoder, criteria, query, conversation):
    return enc.pointwise_many([(criteria, query, conversation)])[0]


def decode(ids) -> str:
    return TOK.decode(ids)


def tail_len(full: list[int], marker: str) -> int:
    """The number of trailing tokens of `full` from the one where `marker` starts."""
    for t in range(1, len(full) + 1):
        if marker in decode(full[-t:]):
            return t
    raise AssertionError(f"{marker} not in the prompt")


# -- rendering -------------------------------------------------------------------------------------


def test_pairwise_layout_criteria_query_a_b_in_order():
    t = PromptTemplate()
    text = t.pairwise_text(CRITERIA, QUERY, answer("Gravity of the moon."), answer("Wind."))
    assert "## Criteria\n- be concise\n- cite sources\n\n## Query\nHow do tides work?\n" in text
    assert "## Response A\nGravity of the moon.\n\n## Response B\nWind.\n" in text
    order = [text.index(s) for s in ("- be concise", "- cite sources", QUERY, "## Response A",
                                     "Gravity of the moon.", "## Response B", "Wind.", CLOSING)]
    assert order == sorted(order)
    assert text.endswith(CLOSING)
    assert text == PAIRWISE_TEMPLATE.format(criteria="- be concise\n- cite sources", query=QUERY,
                                            conversation_a="Gravity of the moon.", conversation_b="Wind.")


def test_pointwise_layout():
    text = PromptTemplate().pointwise_text(["be kind"], QUERY, answer("The moon pulls."))
    assert "## Criteria\n- be kind\n\n## Query\nHow do tides work?\n\n## Response\nThe moon pulls." in text
    assert "Response A" not in text


def test_multi_turn_conversation_in_full():
    conv = (Message("assistant", "first answer"), Message("user", "and why?"),
            Message("assistant", "second answer"), Message("user", "thanks"),
            Message("assistant", "welcome"))
    t = PromptTemplate()
    block = t.conversation_block(conv)
    assert block == ("Assistant: first answer\nUser: and why?\nAssistant: second answer\n"
                     "User: thanks\nAssistant: welcome")
    text = t.pairwise_text(CRITERIA, QUERY, conv, answer("short"))
    a = text[text.index("## Response A"):text.index("## Response B")]
    assert block in a
    assert text.index("## Response B\nshort") > text.index("Assistant: welcome")


def test_content_with_braces_is_not_formatted_again():
    text = PromptTemplate().pairwise_text(["use {json}"], "print {query}", answer("{conversation_b}"),
                                          answer("x = {'a': 1}"))
    assert "- use {json}" in text and "print {query}" in text
    assert "## Response A\n{conversation_b}\n" in text and "x = {'a': 1}" in text


def test_custom_template_replaces_the_wording():
    t = PromptTemplate(pairwise="C:{criteria}|Q:{query}|1:{conversation_a}|2:{conversation_b}|?",
                       pointwise="C:{criteria}|Q:{query}|R:{conversation}",
                       criterion="* {criterion}", turn="<{role}> {content}",
                       roles={"user": "U", "assistant": "M", "system": "S"}, system="You judge.")
    conv = (Message("assistant", "hi"), Message("user", "more"), Message("assistant", "ok"))
    assert t.pairwise_text(CRITERIA, QUERY, conv, answer("bye")) == (
        "C:* be concise\n* cite sources|Q:How do tides work?|1:<M> hi\n<U> more\n<M> ok|2:bye|?")
    assert t.pointwise_text(["x"], "q", answer("r")) == "C:* x|Q:q|R:r"
    assert t.messages("body") == [{"role": "system", "content": "You judge."},
                                  {"role": "user", "content": "body"}]
    ids = pair_ids(PromptEncoder(TOK, t), CRITERIA, QUERY, conv, answer("bye"))
    assert decode(ids) == ("<|im_start|>system\nYou judge.<|im_end|>\n<|im_start|>user\nC:* be concise\n"
                           "* cite sources|Q:How do tides work?|1:<M> hi\n<U> more\n<M> ok|2:bye|?"
                           "<|im_end|>\n")
    assert "Compare two responses" not in decode(ids)


def test_encoding_goes_through_the_chat_template():
    enc = PromptEncoder(TOK)
    ids = pair_ids(enc, CRITERIA, QUERY, answer("A says"), answer("B says"))
    text = PromptTemplate().pairwise_text(CRITERIA, QUERY, answer("A says"), answer("B says"))
    chat = TOK.apply_chat_template([{"role": "user", "content": text}], tokenize=False)
    assert ids == TOK(chat, add_special_tokens=False)["input_ids"]
    assert decode(ids) == f"<|im_start|>user\n{text}<|im_end|>\n"
    assert ids[-2] == IM_END and TOK.convert_tokens_to_ids("<|im_start|>") == ids[0]


def test_chat_template_that_transforms_content_is_rendered_per_example():
    tok = train_bpe_tokenizer(CORPUS, vocab_size=300)
    tok.chat_template = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
                         "message['content'] | upper + '<|im_end|>\\n' }}{%- endfor %}")
    enc = PromptEncoder(tok)
    ids = point_ids(enc, ["kind"], "q", answer("shout this"))
    assert "SHOUT THIS" in tok.decode(ids) and "shout this" not in tok.decode(ids)


def test_many_equals_one_by_one():
    items = [(CRITERIA, QUERY, answer(f"A{i} " * i), answer(long_text("B", 10 * i))) for i in range(5)]
    batch = PromptEncoder(TOK, max_tokens=260)
    single = PromptEncoder(TOK, max_tokens=260)
    fits = batch.fit_pairwise(items)
    assert fits == [single.fit_pairwise([it])[0] for it in items]
    assert batch.pairwise_many(items) == [f.ids for f in fits]
    assert any(f.shortened for f in fits)


# -- length policy ---------------------------------------------------------------------------------


def test_fitting_prompt_is_untouched():
    enc = PromptEncoder(TOK, max_tokens=10_000)
    full = pair_ids(enc, CRITERIA, QUERY, answer(long_text("A")), answer(long_text("B")))
    exact = PromptEncoder(TOK, max_tokens=len(full))
    assert pair_fit(exact, CRITERIA, QUERY, answer(long_text("A")), answer(long_text("B"))) == \
        Fit(full, False)


def test_shortening_keeps_the_tail_and_cuts_middles():
    a, b = answer(long_text("A")), answer(long_text("B"))
    full = pair_ids(PromptEncoder(TOK, max_tokens=10_000), CRITERIA, QUERY, a, b)
    tail = tail_len(full, "END_B")  # end of B + closing text + <|im_end|> + newline
    limit = len(full) // 2
    enc = PromptEncoder(TOK, max_tokens=limit)
    ids, shortened = pair_fit(enc, CRITERIA, QUERY, a, b)
    assert shortened and ids is not None and len(ids) <= limit
    assert ids[-tail:] == full[-tail:]
    text = decode(ids)
    for kept in ("- be concise", "- cite sources", QUERY, "START_A", "END_A", "START_B", "END_B",
                 CLOSING + "<|im_end|>\n"):
        assert kept in text, kept
    assert "MIDDLE_A" not in text and "MIDDLE_B" not in text  # the middles went
    assert text.count(ELLIPSIS.strip()) == 2
    assert text.index("START_A") < text.index("END_A") < text.index("START_B") < text.index("END_B")


def test_tail_is_never_cut_at_any_limit():
    a, b = answer(long_text("A", 40)), answer(long_text("B", 40))
    full = pair_ids(PromptEncoder(TOK, max_tokens=10_000), CRITERIA, QUERY, a, b)
    tail = tail_len(full, "END_B")
    enc = PromptEncoder(TOK, min_turn_tokens=16)
    outcomes = []
    for limit in range(len(full) + 5, 0, -7):
        enc.max_tokens = limit
        ids, shortened = pair_fit(enc, CRITERIA, QUERY, a, b)
        outcomes.append(ids is not None)
        assert shortened == (ids is not None and limit < len(full)), limit
        if ids is None:
            continue
        assert len(ids) <= limit
        assert len(ids) >= min(limit, len(full)) - 10, limit  # cuts no more than it must
        assert ids[-tail:] == full[-tail:], limit
        text = decode(ids)
        assert all(m in text for m in ("START_A", "END_A", "START_B", "END_B")), limit
    assert True in outcomes and False in outcomes
    # Once an example cannot fit, no smaller limit fits it either.
    assert outcomes == sorted(outcomes, reverse=True)


def test_short_answer_stays_whole_while_the_long_one_is_cut():
    short = "The moon pulls the water toward it."
    a, b = answer(short), answer(long_text("B", 80))
    full = pair_ids(PromptEncoder(TOK, max_tokens=10_000), CRITERIA, QUERY, a, b)
    enc = PromptEncoder(TOK, max_tokens=len(full) - 150)
    text = decode(pair_ids(enc, CRITERIA, QUERY, a, b))
    assert f"## Response A\n{short}\n" in text
    assert "START_B" in text and "END_B" in text and "MIDDLE_B" not in text
    # B is shown last: swapping the roles keeps the short answer whole in slot B too.
    text = decode(pair_ids(enc, CRITERIA, QUERY, b, a))
    assert text.endswith(f"## Response B\n{short}\n\n{CLOSING}<|im_end|>\n")


def test_multi_turn_turns_survive_shortening():
    conv = (Message("assistant", long_text("X", 50)), Message("user", "and the spring tides?"),
            Message("assistant", long_text("Y", 50)))
    full = pair_ids(PromptEncoder(TOK, max_tokens=10_000), CRITERIA, QUERY, conv, answer("short"))
    enc = PromptEncoder(TOK, max_tokens=len(full) - 200)
    text = decode(pair_ids(enc, CRITERIA, QUERY, conv, answer("short")))
    order = [text.index(s) for s in ("Assistant: START_X", "END_X", "User: and the spring tides?",
                                     "Assistant: START_Y", "END_Y", "## Response B\nshort")]
    assert order == sorted(order)
    assert "MIDDLE_X" not in text and "MIDDLE_Y" not in text


def test_pointwise_shortening_keeps_the_tail():
    conv = answer(long_text("R", 80))
    full = point_ids(PromptEncoder(TOK, max_tokens=10_000), CRITERIA, QUERY, conv)
    tail = tail_len(full, "END_R")
    enc = PromptEncoder(TOK, max_tokens=len(full) // 2)
    ids = point_ids(enc, CRITERIA, QUERY, conv)
    assert len(ids) <= len(full) // 2 and ids[-tail:] == full[-tail:]
    assert "START_R" in decode(ids) and "MIDDLE_R" not in decode(ids)


@pytest.mark.parametrize("limit", [1, 30])
def test_too_small_limit_drops(limit):
    enc = PromptEncoder(TOK, max_tokens=limit)
    assert pair_fit(enc, CRITERIA, QUERY, answer(long_text("A")), answer("b")) == Fit(None, False)
    assert enc.fit_pointwise([(CRITERIA, QUERY, answer("tiny"))]) == [Fit(None, False)]


def test_min_turn_tokens_decides_between_shortening_and_dropping():
    a, b = answer(long_text("A")), answer(long_text("B"))
    full = pair_ids(PromptEncoder(TOK, max_tokens=10_000), CRITERIA, QUERY, a, b)
    fixed = len(full) - sum(len(TOK(m.content, add_special_tokens=False)["input_ids"]) for m in a + b)
    limit = fixed + 2 * 40 + 20  # room for about 40 tokens of each answer
    assert pair_ids(PromptEncoder(TOK, max_tokens=limit, min_turn_tokens=16), CRITERIA, QUERY, a, b)
    strict = PromptEncoder(TOK, max_tokens=limit, min_turn_tokens=60)
    assert pair_fit(strict, CRITERIA, QUERY, a, b) == Fit(None, False)


def test_fits_say_which_prompts_were_shortened():
    enc = PromptEncoder(TOK, max_tokens=200)
    items = [(CRITERIA, QUERY, answer("a"), answer("b")),  # fits
             (CRITERIA, QUERY, answer(long_text("A", 30)), answer(long_text("B", 30))),  # shortened
             (CRITERIA, QUERY, answer("a"), answer("b" * 10))]  # fits
    fits = enc.fit_pairwise(items)
    assert [f.shortened for f in fits] == [False, True, False]
    assert all(f.ids is not None for f in fits)
    enc.max_tokens = 5
    assert enc.fit_pointwise([(CRITERIA, QUERY, answer("a"))] * 2) == [Fit(None, False)] * 2


def test_water_level():
    assert _water_level([10, 100], 50) == 50  # 10 + 50 = 60 = 110 - 50: only the long one is capped
    assert _water_level([100, 100], 50) == 75
    assert _water_level([10, 20], 0) == 20
    assert _water_level([10, 20], 30) is None  # nothing left
    assert _water_level([5, 40, 40], 31) == 24  # 5 + 24 + 24 = 53 <= 85 - 31; 25 would give 55
