"""Prompt templates and HF chat templates with a small local tokenizer."""
import pytest

from asyncrl.data.templates import ChatTemplate, PromptTemplate, TemplateError, build_prompt

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A word-level tokenizer with a chat template, saved and reloaded like a real one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    specials = ["<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    words = ["what", "is", "1+1?", "be", "brief."]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                   additional_special_tokens=specials[1:])
    fast.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def test_prompt_template_renders_and_names_missing_fields():
    template = PromptTemplate("{question}\nPut the answer in \\boxed{{}}.")
    assert template.render({"question": "1+1?"}) == "1+1?\nPut the answer in \\boxed{}."
    assert template.fields == ["question"]
    with pytest.raises(TemplateError, match="'question'.*fields: problem"):
        template.render({"problem": "x"})


def test_chat_template_with_system_prompt(tokenizer):
    chat = ChatTemplate(tokenizer, system_prompt="be brief.")
    text = chat.render("what is 1+1?")
    assert text == "<|system|>be brief.<|end|><|user|>what is 1+1?<|end|><|assistant|>"
    assert build_prompt("what is 1+1?", chat) == text
    ids = chat.token_ids("what is 1+1?")
    assert tokenizer.convert_ids_to_tokens(ids)[:2] == ["<|system|>", "be"]
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_chat_template_without_system_and_without_generation_prompt(tokenizer):
    chat = ChatTemplate(tokenizer, add_generation_prompt=False)
    assert chat.render("what is 1+1?") == "<|user|>what is 1+1?<|end|>"
    assert build_prompt("plain", None) == "plain"


def test_tokenizer_without_chat_template_is_a_clear_error(tokenizer):
    tokenizer_copy = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer_copy.chat_template = None
    with pytest.raises(TemplateError, match="no chat_template"):
        ChatTemplate(tokenizer_copy)
