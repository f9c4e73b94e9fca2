"""Chat templates: conversational prompts rendered as the model's tokenizer folder says.

A Hugging Face tokenizer folder may carry a *chat template*, a Jinja template that turns a list of
messages ``[{"role": "user", "content": "..."}]`` into the text the model was tuned on (its role markers,
its end-of-turn tokens). It is read from ``chat_template.jinja`` or, in older folders, the
``chat_template`` field of ``tokenizer_config.json``; the template sees the folder's special tokens
(``bos_token``, ``eos_token``, ...) as ``transformers`` passes them.

TRL's conversational rule (1.16's ``DPOTrainer`` tokenization, written out here):

* a prompt is rendered with ``add_generation_prompt=True`` (the opening of the assistant's turn);
* a response is the assistant's turn after it: ``prompt + [{"role": "assistant", "content": response}]``
  is rendered whole, and the response's tokens are those after the longest common prefix of the two
  renderings' tokens (a template that renders the prompt differently alone, or tokens that merge across
  the boundary, move the cut to where they diverge). Nothing is appended: the template ends the turn.

Rendered text is tokenized with no special tokens added (``apply_chat_template``'s own rule: the template
places them). Jinja runs sandboxed, as ``transformers`` runs it: a template cannot reach Python's internals.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from polyshard.data.errors import DataError
from polyshard.data.tokenizer import BYTES, FileTokenizer, Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
PROMPT_ROLES = ("system", "user", "tool")  # the roles a prompt may end with: the assistant answers next

Messages = list[dict[str, str]]


def is_conversation(value: Any) -> bool:
    """TRL's test: a non-empty list whose first item is a dict with a ``role``."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def check_messages(value: Any, where: str, name: str, last_roles: tuple[str, ...] | None = PROMPT_ROLES) -> Messages:
    """``value`` as messages, each ``{"role": str, "content": str}``, the last one's role in ``last_roles``
    (None: any); a one-line error naming ``where`` and ``name`` else."""
    if not isinstance(value, list) or not value:
        raise DataError(f'{where}: {name} must be text or a non-empty list of {{"role", "content"}} messages')
    for number, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DataError(
                f'{where}: {name}[{number}] must be {{"role": "...", "content": "..."}} with text values, '
                f"got {str(message)[:60]}"
            )
    if last_roles is not None and value[-1]["role"] not in last_roles:
        raise DataError(
            f"{where}: {name} ends with a {value[-1]['role']!r} message; a prompt ends with one of "
            f"{list(last_roles)} (the assistant answers it)"
        )
    return value


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer folder's chat template, ready to render."""

    source: Path
    """The file it was read from (for messages)."""
    text: str
    special: dict[str, str]
    """The folder's special tokens by their template names (``eos_token``: ``"</s>"``, ...)."""

    def render(self, messages: Messages, *, add_generation_prompt: bool) -> str:
        template = _compiled(self.text, str(self.source))
        try:
            return str(template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special))
        except Exception as err:  # the template's own raise_exception, or a template bug: name the file
            raise DataError(f"{self.source}: the chat template failed on {str(messages)[:80]} ({err})") from err


def template_of(spec: str) -> ChatTemplate | None:
    """The chat template of the tokenizer ``spec`` names (a folder, or a ``tokenizer.json`` inside one), or
    None: the byte tokenizer, or a folder with none."""
    if spec == BYTES:
        return None
    path = Path(spec).expanduser()
    folder = path if path.is_dir() else path.parent
    config = _config(folder / CONFIG_FILE)
    texts = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS}
    special = {k: v for k, v in texts.items() if v is not None}
    jinja = folder / TEMPLATE_FILE
    if jinja.is_file():
        return ChatTemplate(jinja, jinja.read_text(encoding="utf-8"), special)
    text = config.get("chat_template")
    if isinstance(text, list):  # several named templates: the one called "default", as transformers picks
        text = next((t.get("template") for t in text if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(text, str) and text:
        return ChatTemplate(folder / CONFIG_FILE, text, special)
    return None


def no_template(where: str, name: str, spec: str) -> DataError:
    """The one-line error for a conversational row when the tokenizer has no template."""
    return DataError(
        f"{where}: {name} is a list of messages, but data.tokenizer={spec!r} has no chat template "
        f"({TEMPLATE_FILE}, or chat_template in {CONFIG_FILE}); give a tokenizer folder with one, or the prompt as text"
    )


def plain_ids(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    """How rendered text becomes ids: no special token added (the template placed them)."""
    if isinstance(tokenizer, FileTokenizer):
        inner = tokenizer.inner
        return lambda text: list(inner.encode(text, add_special_tokens=False).ids)
    return tokenizer.encode


def prompt_ids(template: ChatTemplate, messages: Messages, encode: Callable[[str], list[int]]) -> tuple[list[int], str]:
    """A conversational prompt's ids and its rendered text (with the assistant turn's opening)."""
    text = template.render(messages, add_generation_prompt=True)
    return encode(text), text


def assistant_turn(response: str | Messages) -> Messages:
    """A response as messages: text is the assistant's turn; messages (TRL's conversational form) as given."""
    return [{"role": "assistant", "content": response}] if isinstance(response, str) else response


def pair_ids(
    template: ChatTemplate, messages: Messages, responses: list[Messages], encode: Callable[[str], list[int]]
) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, each response's ids) by the module's rule: the prompt is the common prefix of its own
    rendering and every prompt + response rendering, in tokens."""
    prompt, _ = prompt_ids(template, messages, encode)
    whole = [encode(template.render([*messages, *r], add_generation_prompt=False)) for r in responses]
    kept = min(_common_prefix(prompt, ids) for ids in whole)
    return prompt[:kept], [ids[kept:] for ids in whole]


def _common_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def _config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not a JSON object ({err}); restore the tokenizer folder's {CONFIG_FILE}") from err
    if not isinstance(config, dict):
        raise DataError(f"{path}: not a JSON object; restore the tokenizer folder's {CONFIG_FILE}")
    return config


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or ``{"content": text, ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


_COMPILED: dict[str, Any] = {}


def _compiled(text: str, where: str) -> Any:
    """The template compiled once per process, in a sandbox with transformers' helpers."""
    if text in _COMPILED:
        return _COMPILED[text]
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as err:
        raise DataError(f"{where}: chat templates need jinja2: pip install jinja2") from err

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON, as transformers gives
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    loops = ["jinja2.ext.loopcontrols"]  # {% break %} and {% continue %}, which templates use
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=loops)
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        _COMPILED[text] = environment.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as err:
        raise DataError(f"{where}: the chat template is not valid Jinja ({err}, line {err.lineno})") from err
    return _COMPILED[text]


class Chat:
    """What a reader of conversational rows needs: the template of ``tokenizer``'s folder (or None), the
    checks and the encoding, so DPO pairs, GRPO prompts and ``prepare`` apply one rule."""

    def __init__(self, tokenizer: Tokenizer):
        self.spec = str(tokenizer.path) if isinstance(tokenizer, FileTokenizer) else BYTES
        self.template = template_of(self.spec)
        self.encode = plain_ids(tokenizer)

    def _template(self, where: str, name: str) -> ChatTemplate:
        if self.template is None:
            raise no_template(where, name, self.spec)
        return self.template

    def prompt(self, value: Any, where: str, name: str = "prompt") -> tuple[list[int], str]:
        """A conversational prompt's ids and rendered text."""
        template = self._template(where, name)
        return prompt_ids(template, check_messages(value, where, name), self.encode)

    def pair(self, prompt: Any, responses: dict[str, Any], where: str) -> tuple[list[int], list[list[int]]]:
        """(prompt ids, each response's ids) of a conversational pair; ``responses`` by field name, each
        text (the assistant's turn) or messages."""
        template = self._template(where, "prompt")
        messages = check_messages(prompt, where, "prompt")
        turns = []
        for name, value in responses.items():
            if isinstance(value, str):
                if not value:
                    raise DataError(f"{where}: {name} is empty; every pair needs two non-empty responses")
                turns.append(assistant_turn(value))
            else:
                turns.append(check_messages(value, where, name, last_roles=None))
        return pair_ids(template, messages, turns, self.encode)
