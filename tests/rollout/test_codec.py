"""Prompts as plain text or in the tokenizer's chat template (instruct models)."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_rl.files.hf_checkpoint import asset_files
from megatron_rl.rollout.codec import PromptCodec
from tests.rollout.test_collect import TINY_MODEL

# A minimal template of our own, in the tiny character vocabulary (digits, + - = # space and
# newline): "# " opens the user's turn, "## " the assistant's.
TEMPLATE = (
    "{% for message in messages %}# {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}## {% endif %}"
)


def test_a_chat_template_wraps_the_prompt_as_a_user_turn(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    plain = PromptCodec(model, max_prompt_tokens=200)
    chat = PromptCodec(model, max_prompt_tokens=200, chat_template=True)
    ids = chat.encode_prompt("1+2=")
    assert chat.decode(ids) == "# 1+2=\n## "
    assert ids == plain.encode_prompt("# 1+2=\n## ")
    assert plain.encode_prompt("1+2=") != ids


def test_a_chat_template_the_tokenizer_lacks_is_refused():
    with pytest.raises(ValueError, match=r"data.chat_template: the tokenizer in .* has no chat"):
        PromptCodec(TINY_MODEL, max_prompt_tokens=200, chat_template=True)


def _without_tokenizer_json(model):
    (model / "tokenizer.json").unlink()


@pytest.mark.parametrize(
    ("damage", "named", "message"),
    [
        (
            lambda model: (model / "tokenizer.json").write_bytes(b"\xff\x00 not json"),
            "tokenizer.json",
            "the tokenizer cannot be loaded (not JSON:",
        ),
        (
            lambda model: (model / "tokenizer_config.json").write_text("{tokenizer"),
            "tokenizer_config.json",
            "the tokenizer cannot be loaded (not JSON:",
        ),
        (
            lambda model: (model / "tokenizer.json").write_text('{"model": 3}'),
            "",
            "the tokenizer cannot be loaded (",
        ),
        # transformers would build a tokenizer of one token from the rest
        (_without_tokenizer_json, "", "no tokenizer (none of tokenizer.json, tokenizer.model"),
        (shutil.rmtree, "", "not a directory"),
    ],
)
def test_a_missing_or_damaged_tokenizer_is_one_line_naming_its_path(
    tmp_path, damage, named, message
):
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    damage(model)
    with pytest.raises(ValueError) as raised:
        PromptCodec(model, max_prompt_tokens=200)
    text = str(raised.value)
    assert text.startswith(f"{model / named if named else model}: {message}"), text
    assert "\n" not in text


# A tokenizer that is code of its own, as Moonlight's (tiktoken.model + tokenization_moonshot.py,
# named by tokenizer_config.json's auto_map): here one token per character.
CHAR_TOKENIZER_CODE = """
import json

from transformers import PreTrainedTokenizer


class CharTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, **kwargs):
        with open(vocab_file, encoding="utf-8") as file:
            self.chars = json.load(file)
        self.ids = {char: index for index, char in enumerate(self.chars)}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.chars)

    def get_vocab(self):
        return dict(self.ids) | self.added_tokens_encoder

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.ids[token]

    def _convert_id_to_token(self, index):
        return self.chars[index]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)
"""


def _code_tokenizer(directory):
    directory.mkdir()
    (directory / "tiktoken.model").write_text(json.dumps(list("0123456789+-=*?\n ")))
    (directory / "tokenization_chars.py").write_text(CHAR_TOKENIZER_CODE)
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_chars.CharTokenizer", None]},
        "tokenizer_class": "CharTokenizer",
        "eos_token": "<eos>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_a_tokenizer_of_its_own_code_runs_only_when_trusted(tmp_path):
    directory = _code_tokenizer(tmp_path / "moonlight-like")
    message = (
        r"the tokenizer is code of its own \(tokenization_chars.py, named by "
        r"tokenizer_config.json's auto_map\); set model.trust_remote_code=true"
    )
    with pytest.raises(ValueError, match=message):
        PromptCodec(directory, max_prompt_tokens=40)
    codec = PromptCodec(directory, max_prompt_tokens=40, trust_remote_code=True)
    ids = codec.encode_prompt("12+3=?")
    assert ids == [1, 2, 10, 3, 12, 14]
    assert codec.decode(ids) == "12+3=?"
    assert codec.stop_token_ids == (17,)  # <eos>, added after the 17 characters
    assert codec.newline_token_ids == [15]
    # its code and vocabulary travel with the weights (conversion, export)
    names = {path.name for path in asset_files(directory)}
    assert {"tiktoken.model", "tokenization_chars.py", "tokenizer_config.json"} <= names
