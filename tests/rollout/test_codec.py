"""Prompts as plain text or in the tokenizer's chat template (instruct models)."""

from __future__ import annotations

import json
import shutil

import pytest

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
