"""A model's tokenizer folder, as Hugging Face lays it out and as transformers reads it: the one
place that knows its file names, finds a run's or a corpus's folder, and answers its tokenizer,
special tokens, end-of-sequence ids and chat template.

End-of-sequence ids follow transformers' ``generate``, which stops on its generation config's
``eos_token_id`` (an id or a list: Llama 3 and Qwen2.5 list several): ``generation_config.json``'s
when the folder has one, else the id of the tokenizer's end-of-sequence token
(``tokenizer_config.json``'s ``eos_token``, else ``special_tokens_map.json``'s; a tokenizer that
``theseus tokenize`` trained has neither file, and its token is the first of
:data:`EOS_CANDIDATES` among its special tokens). Chat generation stops on these ids, the
evaluation harness's generations end on them, and the codec of ``theseus generate`` reports them.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from theseus.config import is_int
from theseus.data.shards import TOKENIZER_FILE

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves a chat template
#: The files of a tokenizer folder that a run keeps: ``import-hf`` copies them, a run started from
#: another run's parameters (``--init-from``) copies that run's, and an export writes them.
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    CHAT_TEMPLATE_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    GENERATION_CONFIG_FILE,
)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers' clean_up_tokenization: spaces before punctuation and contractions removed.
_CLEAN_UP = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)
_CLEAN_UP_BPE = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
EOS_TOKEN = "<|endoftext|>"  # the end-of-text token of tokenizers theseus trains
# End-of-text tokens of common tokenizers, looked for (in this order) in one without configuration.
EOS_CANDIDATES = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")


def load_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json``, or a model's tokenizer folder holding
    one (a clear error when unreadable)."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise ValueError(f"tokenizer {str(path)!r} does not exist; pass a tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # noqa: BLE001 - the Rust library raises a plain Exception
        raise ValueError(
            f"cannot read tokenizer {str(path)!r}: {error}; pass a Hugging Face tokenizer.json"
        ) from None


def candidate_eos(tokenizer) -> str | None:
    """The first of :data:`EOS_CANDIDATES` among the special tokens of ``tokenizer``."""
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    return next((c for c in EOS_CANDIDATES if c in special), None)


@dataclass(frozen=True)
class TokenizerFolder:
    """A tokenizer folder ``path`` and its ``tokenizer.json`` (``tokenizer_file``; another name
    when the user named a file). Files are read on first use."""

    path: Path
    tokenizer_file: Path

    @classmethod
    def at(cls, given: str | os.PathLike) -> TokenizerFolder:
        """The folder ``given``, or the folder of the tokenizer file ``given``."""
        given = Path(given)
        if given.is_dir():
            return cls(given, given / TOKENIZER_FILE)
        return cls(given.parent, given)

    @classmethod
    def find(
        cls, given: str | os.PathLike | None, folders: Sequence[str | os.PathLike | None]
    ) -> TokenizerFolder | None:
        """``given`` when the user named a folder or file; else, of ``folders`` (a run, the run
        it fine-tunes, the tokenized folder it trained on; None entries skipped), the first
        holding ``tokenizer.json`` with its ``tokenizer_config.json``, else the first holding
        ``tokenizer.json`` (a run keeps only the tokenizer.json of the tokenized folder it trained
        on, whose folder keeps the configuration too); else None."""
        if given is not None:
            return cls.at(given)
        held = [Path(f) for f in folders if f is not None and (Path(f) / TOKENIZER_FILE).is_file()]
        configured = [f for f in held if (f / TOKENIZER_CONFIG_FILE).is_file()]
        return cls.at(next(iter(configured + held))) if held else None

    @functools.cached_property
    def tokenizer(self):
        """The ``tokenizers.Tokenizer`` of ``tokenizer.json``."""
        return load_tokenizer(self.tokenizer_file)

    @functools.cached_property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens (``eos_token``, ``bos_token``...) as transformers reads them:
        ``tokenizer_config.json``'s, then ``special_tokens_map.json``'s (text, or a dict with its
        content)."""
        found: dict[str, str] = {}
        for file in (SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE):  # the config wins
            record = self._json(file) or {}
            for name in SPECIAL_TOKEN_NAMES:
                value = record.get(name)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    found[name] = value
        return found

    def eos_token(self, override: str | None = None) -> tuple[str, int]:
        """The end-of-sequence token and its id: ``override`` (``--eos-token``) when given, else
        the configuration's ``eos_token``, else the first of :data:`EOS_CANDIDATES`."""
        name = override or self.special_tokens.get("eos_token") or candidate_eos(self.tokenizer)
        if name is None:
            raise ValueError(
                f"tokenizer folder {self.path} has no end-of-sequence token (no eos_token in "
                f"{TOKENIZER_CONFIG_FILE} or {SPECIAL_TOKENS_MAP_FILE}, and none of "
                f"{', '.join(EOS_CANDIDATES)} among its special tokens); name it with "
                "--eos-token or add eos_token to its tokenizer_config.json"
            )
        token_id = self.tokenizer.token_to_id(name)
        if token_id is None:
            raise ValueError(
                f"end-of-sequence token {name!r} is not a token of tokenizer folder {self.path}; "
                "name one of its tokens (--eos-token) or fix its tokenizer_config.json"
            )
        return name, token_id

    @functools.cached_property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end a generation, as transformers' ``generate`` stops: the generation
        config's ``eos_token_id`` (an id or a list), else the end-of-sequence token's id."""
        given = (self._json(GENERATION_CONFIG_FILE) or {}).get("eos_token_id")
        if given is None:
            return (self.eos_token()[1],)
        ids = given if isinstance(given, list) else [given]
        if not ids or not all(is_int(i) for i in ids):
            raise ValueError(
                f"{self.path / GENERATION_CONFIG_FILE} has eos_token_id={given!r}; it must be a "
                "token id or a list of them"
            )
        return tuple(dict.fromkeys(ids))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        """The text of ``ids`` as transformers' ``decode`` (and ``batch_decode``) gives it: the
        tokenizer's decoding, then ``clean_up_tokenization_spaces`` when
        ``tokenizer_config.json`` sets it, which transformers 5 skips for a BPE model (it would
        remove spaces the text has) unless the configuration insists."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        config = self._settings
        insists = config.get(_CLEAN_UP_BPE, False)
        if config.get("clean_up_tokenization_spaces", False) and (
            type(self.tokenizer.model).__name__ != "BPE" or insists
        ):
            for spaced, joined in _CLEAN_UP:
                text = text.replace(spaced, joined)
        return text

    @functools.cached_property
    def _settings(self) -> dict[str, Any]:
        """``tokenizer_config.json`` (empty when the folder lacks it), read once: decoding
        reads its flags for every text."""
        return self._json(TOKENIZER_CONFIG_FILE) or {}

    def chat_template(self, template_file: str | os.PathLike | None = None):
        """The folder's :class:`~theseus.tokenization.chat.template.ChatTemplate`
        (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``, a named
        list taking ``default``) or ``template_file``'s, with the special tokens; None when there
        is none. A folder without ``tokenizer_config.json`` is refused."""
        from theseus.tokenization.chat.template import ChatTemplate

        config = self._json(TOKENIZER_CONFIG_FILE)
        if config is None:
            raise ValueError(
                f"tokenizer folder {self.path} has no {TOKENIZER_CONFIG_FILE}; pass the model's "
                "tokenizer folder (tokenizer.json and tokenizer_config.json, as save_pretrained "
                "writes them)"
            )
        if template_file is not None:
            if not Path(template_file).is_file():
                raise ValueError(
                    f"--chat-template {template_file} does not exist; pass a Jinja file"
                )
            return ChatTemplate(Path(template_file).read_text(), self.special_tokens)
        if (self.path / CHAT_TEMPLATE_FILE).is_file():
            return ChatTemplate((self.path / CHAT_TEMPLATE_FILE).read_text(), self.special_tokens)
        template = config.get("chat_template")
        if isinstance(template, list):
            template = {item.get("name"): item.get("template") for item in template}.get("default")
        return ChatTemplate(template, self.special_tokens) if isinstance(template, str) else None

    def copy_config(self, out_dir: Path) -> None:
        """``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir`` (a chat corpus keeps
        them beside its shards)."""
        shutil.copyfile(self.tokenizer_file, out_dir / TOKENIZER_FILE)
        shutil.copyfile(self.path / TOKENIZER_CONFIG_FILE, out_dir / TOKENIZER_CONFIG_FILE)

    def _json(self, name: str) -> dict[str, Any] | None:
        """The JSON object of file ``name``, None when the folder lacks it."""
        path = self.path / name
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
        except ValueError as error:
            raise ValueError(f"cannot read {path}: {error}; fix or replace it") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path} holds no JSON object; fix or replace it")
        return record
