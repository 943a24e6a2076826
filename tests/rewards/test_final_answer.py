"""Which text of a response is its final answer (before any math parsing)."""
import pytest

from asyncrl.rewards.final_answer import extract_gsm8k, find_final_answer, normalize_text


@pytest.mark.parametrize("response,text,source", [
    # the last box wins over an earlier, corrected one
    ("First \\boxed{3}. Wait, that is wrong. Recomputing: \\boxed{5}", "5", "boxed"),
    # boxes offered together stay together (a set equals no single answer)
    ("\\boxed{3} or \\boxed{5}", "3, 5", "boxed"),
    ("$\\boxed{3}$, $\\boxed{5}$", "3, 5", "boxed"),
    ("\\boxed{5} and \\boxed{5}", "5", "boxed"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "boxed"),
    # final-answer lines, with alternatives kept and units dropped
    ("so\n#### 72", "72", "answer line"),
    ("#### 5 or 6", "5, 6", "answer line"),
    ("The answer is 5 or 6.", "5, 6", "answer line"),
    ("The answer is 5. I hope it is correct.", "5", "answer line"),
    ("The final answer is: 18 dollars", "18", "answer line"),
    ("**Answer:** $\\frac{1}{2}$", "\\frac{1}{2}", "answer line"),
    ("The final answer is:\n\n$$5$$", "5", "answer line"),
    ("The answer is 50%", "50\\%", "answer line"),
    # a response that is only an answer
    ("42", "42", "bare"),
    ("  $-\\frac{3}{4}$ ", "-\\frac{3}{4}", "bare"),
])
def test_final_answer(response, text, source):
    found = find_final_answer(response)
    assert (found.text, found.source) == (text, source)


@pytest.mark.parametrize("response", [
    "I computed 2+3 and got 5 apples but I am not sure",  # no final answer: no "last number"
    "There are 2 cats", "", "\\boxed{", "\\boxed{}", "#### ",
])
def test_no_final_answer(response):
    assert find_final_answer(response) is None


def test_last_number_only_when_asked():
    assert find_final_answer("we get 12 then 15 apples", last_number_fallback=True).text == "15"


def test_markdown_headings_are_not_answer_markers():
    assert find_final_answer("#### Final Answer\nSo \\boxed{5}").text == "5"
    assert find_final_answer("#### Step 1\nadd\n#### Step 2\nThe answer is 7").text == "7"
    assert normalize_text("## Step 1\n#### 72") == "Step 1\n#### 72"


def test_unicode_minus_and_spaces():
    assert normalize_text("\u22125 and 1\u202f000 and 2\u00a0500 and a\u200bb") == "-5 and 1000 and 2500 and ab"
    assert find_final_answer("The answer is \u22125").text == "-5"


def test_extract_gsm8k():
    assert extract_gsm8k("work\n#### 1,000") == "1000"
    assert extract_gsm8k("#### $18.00") == "18.00"
    assert extract_gsm8k("#### Final Answer\n\\boxed{3}") is None
    assert extract_gsm8k("no marker") is None
