"""Tokenizers and chat templates for ``data.format=jsonl`` and ``hetjax generate``.

:class:`Tokens` is text -> ids: a checkpoint's ``tokenizer.json`` (the ``tokenizers``
package) or, without one, bytes (ids 0..255). Which one a run uses is
:func:`tokenizer_spec`: ``data.tokenizer`` when set, else the directory the weights come
from (``model.init_from=hf:<dir>``, ``--hf <dir>``) when it holds a ``tokenizer.json``,
else bytes; train, eval and generate all ask it, so they tokenise alike.

A chat record (``{"messages": [...]}``) is rendered by the tokenizer's chat template as
transformers renders it (``apply_chat_template``: a sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, ``raise_exception``, the special tokens by name) and
the rendered text encoded once WITHOUT the tokenizer's special tokens (a template writes
its own BOS), so the ids are ``apply_chat_template(messages, tokenize=True)``'s. The
template is ``chat_template.jinja`` beside the tokenizer (what current transformers
saves), else ``chat_template`` of ``tokenizer_config.json`` (a string, or the list of
named templates, whose ``default`` is taken).

The loss covers every assistant turn (as TRL's ``assistant_only_loss``): the text from
the end of the conversation before the turn, rendered with the generation prompt, to the
end of the conversation through the turn; the tokens overlapping those characters take
the loss, every other token (system, user, tool turns, the generation prompts) is
context. A template must render each such conversation as the beginning of the whole
one; one that rewrites earlier turns (e.g. drops their reasoning) is refused, naming
the record's line.
"""

from __future__ import annotations

import json
from pathlib import Path

from hetjax.config_values import ConfigError

BYTE_VOCAB = 256
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


def tokenizer_spec(config) -> str:
    """The tokenizer a run's text goes through: ``data.tokenizer``, else the weights'
    HF directory (``model.init_from``) when it holds a ``tokenizer.json``, else ``""``
    (bytes)."""
    if config.data.tokenizer:
        return config.data.tokenizer
    source = config.model.init_from.removeprefix("hf:")
    if source and (Path(source) / "tokenizer.json").is_file():
        return source
    return ""


def sources_line(config, tokenizer: str | None = None) -> str:
    """One line naming where the initial weights and the tokenizer come from."""
    init = config.model.init_from
    weights = (
        f"{init} (model.init_from)" if init else f"random init (train.seed {config.train.seed})"
    )
    spec = tokenizer_spec(config) if tokenizer is None else tokenizer
    if tokenizer is None and config.data.format != "jsonl":
        data = config.data.path or "the embedded corpus"
        return f"initial weights: {weights}; data: {data} (token ids, no tokenizer)"
    if not spec:
        tok = "bytes (ids 0..255; set data.tokenizer for a tokenizer.json)"
    elif spec == config.data.tokenizer and tokenizer is None:
        tok = f"{spec} (data.tokenizer)"
    elif spec == init.removeprefix("hf:"):
        tok = f"{spec} (the checkpoint's tokenizer.json)"
    else:
        tok = spec
    return f"initial weights: {weights}; tokenizer: {tok}"


def _template(folder: Path, cfg: dict) -> str | None:
    """The chat template of a tokenizer directory: ``chat_template.jinja``, else
    ``chat_template`` of its ``tokenizer_config.json`` (a list: the one named
    ``default``)."""
    file = folder / TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ConfigError(
                f"{folder / 'tokenizer_config.json'}: chat_template lists templates "
                f"{sorted(map(str, named))} but none named 'default'"
            )
        template = named["default"]
    return template or None


class Tokens:
    """Text -> token ids: a ``tokenizers.Tokenizer`` with its chat template and EOS, or
    bytes. ``vocab_size``: the ids it can produce."""

    def __init__(self, spec: str):
        self.spec = spec
        self.chat_template: str | None = None
        self.eos: int | None = None
        self.special: dict[str, str] = {}
        if not spec:
            self._tok, self.vocab_size = None, BYTE_VOCAB
            return
        from tokenizers import Tokenizer  # start-up cost: only jsonl runs need it

        path = Path(spec)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(
                f"config key 'data.tokenizer': no tokenizer file {str(file)!r}; give a "
                "tokenizer.json or the checkpoint directory holding one"
            )
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # the tokenizers package raises its own Exception type
            raise ConfigError(f"tokenizer {str(file)!r} does not load: {e}") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        folder = path if path.is_dir() else path.parent
        settings = folder / "tokenizer_config.json"
        cfg = {}
        if settings.is_file():
            try:
                cfg = json.loads(settings.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise ConfigError(f"{settings} is not valid JSON ({e})") from None
        name = lambda t: t.get("content", "") if isinstance(t, dict) else (t or "")
        self.special = {k: name(cfg.get(k)) for k in SPECIAL_TOKENS}
        self.chat_template = _template(folder, cfg)
        if self.special["eos_token"]:
            self.eos = self._tok.token_to_id(self.special["eos_token"])

    @property
    def bos_token(self) -> str:
        return self.special.get("bos_token", "")

    @property
    def eos_token(self) -> str:
        return self.special.get("eos_token", "")

    def encode(self, text: str, special: bool) -> list[int]:
        """``text`` -> ids; ``special``: with the tokenizer's added special tokens (BOS)."""
        if self._tok is None:
            return list(text.encode("utf-8"))
        return self._tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids) -> str:
        if self._tok is None:
            return bytes(int(i) for i in ids if i < BYTE_VOCAB).decode("utf-8", "replace")
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def render(self, messages: list, generation_prompt: bool) -> str:
        """Messages rendered by the chat template, as transformers renders them."""
        return _compiled(self.chat_template).render(
            messages=messages, add_generation_prompt=generation_prompt, **self.special
        )

    def chat(self, messages, where: str) -> tuple[list[int], list[bool]]:
        """A conversation's ids (the rendered text encoded once, no special tokens
        added) and, per id, whether it takes the loss (it is part of an assistant turn).
        Raises ``ConfigError`` naming ``where`` for a malformed conversation, one the
        template refuses, or one with no assistant turn."""
        _check_messages(messages, where)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        whole, *pieces = self._rendered(messages, turns, where)
        spans = []
        for i, before, through in zip(turns, pieces[::2], pieces[1::2], strict=True):
            if not (whole.startswith(through) and through.startswith(before)):
                raise ConfigError(
                    f"{where}: the chat template renders the conversation through message "
                    f"{i} differently from the start of the whole one (it rewrites earlier "
                    "turns); give one record per assistant turn"
                )
            spans.append((len(before), len(through)))
        enc = self._tok.encode(whole, add_special_tokens=False)
        mask = [any(e > a and s < b for a, b in spans) for s, e in enc.offsets]
        return list(enc.ids), mask

    def _rendered(self, messages, turns, where: str) -> list[str]:
        """The whole conversation rendered, then for each assistant turn i the
        conversation before it with the generation prompt and the one through it."""
        import jinja2

        try:
            out = [self.render(messages, generation_prompt=False)]
            for i in turns:
                out.append(self.render(messages[:i], generation_prompt=True))
                out.append(self.render(messages[: i + 1], generation_prompt=False))
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: the chat template refused the record: {e}") from None
        return out


def _check_messages(messages, where: str) -> None:
    ok = isinstance(messages, list) and messages
    ok = ok and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    if not ok:
        raise ConfigError(
            f"{where}: 'messages' must be a non-empty list of objects with a 'role' and "
            'a \'content\', e.g. [{"role": "user", "content": "Hi"}, {"role": "assistant", '
            '"content": "Hello"}]'
        )
    if not any(m["role"] == "assistant" and m.get("content") for m in messages):
        raise ConfigError(
            f"{where}: 'messages' has no non-empty assistant message to learn from (the "
            "loss covers the assistant turns)"
        )


_COMPILED: dict[str, object] = {}


def _compiled(template: str):
    """The template compiled in a sandbox as transformers compiles chat templates (Hub
    templates are untrusted code): trim_blocks, lstrip_blocks, loop controls, a
    ``{% generation %}`` block rendered as its body, ``tojson`` without HTML escaping,
    ``raise_exception`` and ``strftime_now``."""
    if template in _COMPILED:
        return _COMPILED[template]
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' assistant-mask markers: their body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    compiled = _COMPILED[template] = env.from_string(template)
    return compiled
