"""Text <-> token ids for rollouts, with the Hugging Face tokenizer saved beside the model."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from megatron_rl.files.hf_checkpoint import tokenizer_code_files

# Where a tokenizer's vocabulary comes from: a fast tokenizer's tokenizer.json, a SentencePiece
# model, a BPE vocabulary, a tiktoken ranks file (read by the tokenizer's own code).
# Without any of them transformers builds a tokenizer of one token.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
# The tokenizer's JSON files, checked to name the damaged one when loading fails.
JSON_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)


class PromptCodec:
    """Encodes prompts, decodes responses, and names the token ids the trainer cares about.

    Args:
        tokenizer_dir: a directory with the tokenizer files (the Hugging Face model's).
        max_prompt_tokens: longest prompt accepted; a longer one is an error naming it.
        chat_template: each prompt becomes one user message in the tokenizer's chat template,
            followed by the assistant's turn (instruct models).
        trust_remote_code: run the tokenizer's own code (`model.trust_remote_code`).
    """

    def __init__(
        self,
        tokenizer_dir: str | Path,
        *,
        max_prompt_tokens: int,
        chat_template: bool = False,
        trust_remote_code: bool = False,
    ) -> None:
        self.tokenizer = load_tokenizer(Path(tokenizer_dir), trust_remote_code=trust_remote_code)
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"{tokenizer_dir}: the tokenizer defines no eos token")
        if chat_template and not self.tokenizer.chat_template:
            raise ValueError(
                f"data.chat_template: the tokenizer in {tokenizer_dir} has no chat template "
                "(tokenizer_config.json's chat_template); set data.chat_template=false"
            )
        self.chat_template = chat_template
        self.max_prompt_tokens = max_prompt_tokens
        vocab = self.tokenizer.get_vocab()
        # SSPO segments end at newlines; with BPE vocabularies merged tokens such as ".\n" too.
        self.newline_token_ids = sorted(
            index for index in vocab.values() if self.tokenizer.decode([index]).endswith("\n")
        )

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.tokenizer.eos_token_id,)

    def encode_prompt(self, text: str, *, origin: str = "") -> list[int]:
        """The token ids of prompt `text`; errors name it and `origin` (`FILE:LINE`)."""
        named = f"{origin + ': ' if origin else ''}prompt {text[:40]!r}"
        try:
            if self.chat_template:
                ids = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            else:
                ids = self.tokenizer.encode(text, add_special_tokens=False)
        except Exception as error:  # the tokenizers library raises bare Exceptions
            raise ValueError(f"{named}: the tokenizer cannot encode it ({error})") from None
        if not ids:
            raise ValueError(f"{named}: encodes to no tokens")
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(
                f"{named}: {len(ids)} tokens, longer than the {self.max_prompt_tokens} "
                "allowed (context length minus rollout.max_new_tokens)"
            )
        return ids

    def decode(self, ids: tuple[int, ...] | list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(directory: Path, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer in `directory`, its own code run only with `trust_remote_code`;
    a missing or damaged one is a ValueError of one line naming the directory, or the file when
    a JSON file of it is not JSON, and a tokenizer of its own code without `trust_remote_code`
    one that says so."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (the tokenizer's)")
    if not any((directory / name).is_file() for name in VOCABULARY_FILES):
        raise ValueError(f"{directory}: no tokenizer (none of {', '.join(VOCABULARY_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except Exception as error:  # transformers and the tokenizers library raise many kinds
        code = tokenizer_code_files(directory)
        if code and not trust_remote_code:
            raise ValueError(
                f"{directory}: the tokenizer is code of its own ({', '.join(code)}, named by "
                "tokenizer_config.json's auto_map); set model.trust_remote_code=true to run it"
            ) from None
        for name in JSON_FILES:
            path = directory / name
            try:
                if path.is_file():
                    json.loads(path.read_bytes())
            except ValueError as damage:  # JSONDecodeError, UnicodeDecodeError
                reason = f"not JSON: {_first_line(damage)}"
                raise ValueError(f"{path}: the tokenizer cannot be loaded ({reason})") from None
        reason = f"{type(error).__name__}: {_first_line(error)}"
        raise ValueError(f"{directory}: the tokenizer cannot be loaded ({reason})") from None


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
