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
