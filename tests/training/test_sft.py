"""SFT batches: the loss covers what the model writes, never a tool's output (regression: the
calculator warm start trained the model to predict the calculator's product in its head)."""
import itertools

import pytest

from asyncrl.data.demonstrations import SEGMENTS
from asyncrl.data.tasks import CalculatorTask
from asyncrl.training.sft import demonstration_batch
from asyncrl.types import Example


@pytest.fixture(scope="module")
def calculator_tokenizer(tmp_path_factory):
    return CalculatorTask(seed=0, num_eval=2).build_tokenizer(tmp_path_factory.mktemp("tok"))


def _decode(tokenizer, ids):
    return "".join(tokenizer.convert_ids_to_tokens(ids))


def test_segments_mask_what_the_model_only_reads(calculator_tokenizer):
    tok = calculator_tokenizer
    segments = [("12", True), ("<tool_response>34</tool_response>", False), ("5", True)]
    plain = Example(prompt="1*2=", answer="77")
    tool = Example(prompt="3*4=", answer="12<tool_response>34</tool_response>5", fields={SEGMENTS: segments})
    input_ids, attention, mask, prompt_len = demonstration_batch([plain, tool], tok)
    # row 1: "1" "2" <tool_response> "3" "4" </tool_response> "5" <eos> -> loss on 1, 2, 5, <eos>
    assert mask[1].tolist() == [1, 1, 0, 0, 0, 0, 1, 1]
    assert _decode(tok, input_ids[1, prompt_len:].tolist()) == "12<tool_response>34</tool_response>5<eos>"
    # row 0 (no segments): the whole answer + EOS, then padding without loss
    assert mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert attention[0].sum() == len(tok("1*2=")["input_ids"]) + 3


def test_segments_must_join_to_the_answer(calculator_tokenizer):
    bad = Example(prompt="3*4=", answer="12", fields={SEGMENTS: [("1", True)]}, uid="row 7")
    with pytest.raises(ValueError, match="row 7.*do not join to its answer"):
        demonstration_batch([bad], calculator_tokenizer)


def test_calculator_demonstrations_train_the_call_and_the_copy_not_the_product(calculator_tokenizer):
    tok = calculator_tokenizer
    task = CalculatorTask(seed=0, num_eval=2, tool_share=1.0)
    demos = list(itertools.islice(task.demonstrations(seed=0), 4))
    input_ids, _, mask, prompt_len = demonstration_batch(demos, tok)
    for row, ex in enumerate(demos):
        ids = input_ids[row, prompt_len:].tolist()
        trained = _decode(tok, [t for t, m in zip(ids, mask[row].tolist()) if m])
        read = _decode(tok, [t for t, m in zip(ids, mask[row].tolist()) if not m]).replace("<pad>", "")
        product = ex.fields["answer"]
        assert read == f"<tool_response>{product}</tool_response>"
        assert trained.startswith("<tool_call>") and trained.endswith(f"</tool_call><eos>{product}<eos>")
