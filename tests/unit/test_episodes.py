"""The episode store and its splicing rules (rollout_service/episodes.py), with a real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from fp8rl.errors import InvalidRequest, Overloaded, PreconditionFailed
from fp8rl.tiny import EOS_ID, build_tokenizer
from rollout_service.episodes import EpisodeLimits, Episodes, Turn, samples_of, spliced_chat, spliced_text

# A template that closes each turn with the end-of-turn token, as ChatML's <|im_end|> does.
CLOSING_TEMPLATE = (
    "{% for m in messages %}<bos>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CLOSING_TEMPLATE
    return tokenizer


def render(tokenizer: Any) -> Any:
    return lambda messages, generation: list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation, tokenize=True, return_dict=False
        )
    )


def tokenize(tokenizer: Any) -> Any:
    return lambda text: tokenizer(text, add_special_tokens=False).input_ids


def turn(prompt: list[int], sampled: list[int], context: Any, extends: bool = False) -> Turn:
    return Turn(prompt, sampled, [-0.5] * len(sampled), 3, "stop", extends, "", context)


@pytest.mark.parametrize("ended", [True, False])
def test_a_chat_turn_continues_the_sampled_ids_and_the_end_of_turn_is_the_policys(
    tokenizer: Any, ended: bool
) -> None:
    first = [{"role": "user", "content": "1+2="}]
    prompt = render(tokenizer)(first, True)
    # The sampled ids stand for the reply whatever its text re-tokenizes to (here: other ids, as when BPE
    # does not give back what was sampled); the policy ended its turn, or was cut off.
    sampled = [50, 51] + ([EOS_ID] if ended else [])
    history = [*first, {"role": "assistant", "content": "3 "}]
    messages = [*history, {"role": "user", "content": "and 4+5="}]
    ids, extends = spliced_chat(
        turn(prompt, sampled, history), messages, render(tokenizer), tokenize(tokenizer), EOS_ID
    )
    assert extends
    rest = render(tokenizer)(messages, True)[len(render(tokenizer)(history, False)) :]
    closing = tokenize(tokenizer)("\n") if ended else [EOS_ID, *tokenize(tokenizer)("\n")]
    assert ids == prompt + sampled + closing + rest


def test_a_chat_turn_that_changes_the_history_does_not_extend(tokenizer: Any) -> None:
    first = [{"role": "user", "content": "1+2="}]
    prompt = render(tokenizer)(first, True)
    previous = turn(prompt, [4 + ord("3"), EOS_ID], [*first, {"role": "assistant", "content": "3"}])
    for messages in (
        [*first, {"role": "assistant", "content": "4"}, {"role": "user", "content": "?"}],  # edited reply
        [{"role": "user", "content": "9+9="}],  # another conversation
        [{"role": "system", "content": "hi"}, *first, {"role": "assistant", "content": "3"}],
    ):
        ids, extends = spliced_chat(previous, messages, render(tokenizer), tokenize(tokenizer), EOS_ID)
        assert not extends and ids == render(tokenizer)(messages, True)


def test_text_turns_extend_by_text_and_append_the_new_text_alone(tokenizer: Any) -> None:
    previous = turn([10, 11], [12, 13], "ab" + "cd")
    ids, extends = spliced_text(previous, "abcd!", tokenize(tokenizer))
    assert extends and ids == [10, 11, 12, 13, *tokenize(tokenizer)("!")]
    assert spliced_text(previous, "abXd!", tokenize(tokenizer)) == (tokenize(tokenizer)("abXd!"), False)


def test_samples_mask_only_the_policys_tokens() -> None:
    turns = [
        turn([1, 2], [3, 4], None),
        turn([1, 2, 3, 4, 5], [6], None, extends=True),
        turn([9], [8, 7], None, extends=False),
    ]
    one, two = samples_of(turns)
    assert (one.prompt_token_ids, one.completion_token_ids) == ([1, 2], [3, 4, 5, 6])
    assert one.loss_mask == [True, True, False, True] and one.logprobs == [-0.5, -0.5, 0.0, -0.5]
    assert one.turns == [0, 1] and two.turns == [2] and two.loss_mask == [True, True]


def test_the_store_is_bounded_sequential_and_forgets_idle_episodes() -> None:
    now = [0.0]
    store = Episodes(EpisodeLimits(max_episodes=2, max_turns=2, max_tokens=10, idle_s=5), lambda: now[0])
    a = store.begin("a")
    with pytest.raises(PreconditionFailed, match="in flight"):
        store.begin("a")
    store.record(a, turn([1, 2], [3], None))
    store.finish(a)
    store.begin("b")
    with pytest.raises(Overloaded):
        store.begin("c")
    with pytest.raises(InvalidRequest, match="episode_id"):
        store.check_room(store.begin("a"), 5, 4)  # 3 held + 9 > 10
    store.record(a, turn([1, 2, 3], [4], None, extends=True))
    store.finish(a)
    with pytest.raises(InvalidRequest, match="2 turns"):
        store.begin("a")
    with pytest.raises(InvalidRequest, match="episode_id"):
        store.begin("no spaces")
    now[0] = 6.0  # both idle past 5 s: forgotten, a turn in flight (b's) included
    assert len(store) == 2
    c = store.begin("c")
    assert len(store) == 1
    with pytest.raises(InvalidRequest, match="no episode 'a'"):
        store.get("a")
    with pytest.raises(PreconditionFailed):
        store.end("c")  # (its turn is in flight)
    store.record(c, turn([1], [2], None))
    store.finish(c)
    assert store.end("c") is c and len(store) == 0
    failed = store.begin("d")
    store.finish(failed)  # (its first turn failed: nothing is kept)
    assert len(store) == 0
