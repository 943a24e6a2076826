import pytest

from asyncrl.rewards.format import extract_tag, regex_reward, tags_reward, think_answer_format


@pytest.mark.parametrize("text,expected", [
    ("<think>reason</think><answer>42</answer>", 1.0),
    ("  <think>\nreason\n</think>\n<answer> 42 </answer>\n", 1.0),
    ("<think></think><answer>42</answer>", 0.0),  # empty reasoning
    ("<answer>42</answer><think>r</think>", 0.0),  # wrong order
    ("<think>r</think><answer>42</answer> trailing", 0.0),
    ("<think>r<think>x</think><answer>42</answer>", 0.0),  # nested tag
    ("42", 0.0),
    ("", 0.0),
])
def test_think_answer_format(text, expected):
    assert think_answer_format("p", text) == expected


def test_tags_reward_partial_credit_and_order():
    assert tags_reward("", "<think>a</think><answer>b</answer>") == 1.0
    # think counts; answer comes before think, so it does not count in order
    assert tags_reward("", "<answer>b</answer><think>a</think>") == 0.5
    assert tags_reward("", "<answer>b</answer><think>a</think>", ordered=False) == 1.0
    assert tags_reward("", "<think>a</think><think>b</think>") == 0.0  # duplicated


def test_regex_reward_and_extract_tag():
    assert regex_reward("", "The answer is 12.", pattern=r"answer is \d+") == 1.0
    assert regex_reward("", "The answer is 12.", pattern=r"\d+", fullmatch=True) == 0.0
    assert extract_tag("<answer>1</answer> <answer> 2 </answer>", "answer") == "2"
    with pytest.raises(ValueError, match="pattern"):
        regex_reward("", "x")
