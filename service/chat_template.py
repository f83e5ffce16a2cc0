"""A checkpoint's own chat template, rendered the way transformers' ``apply_chat_template`` renders it.

Templates come from the model folder: ``chat_template.jinja``, ``additional_chat_templates/*.jinja``, or
``tokenizer_config.json`` "chat_template" (a string, or a list of {name, template}). They are untrusted code,
so they run in Jinja's immutable sandbox, with the names templates expect: ``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML, ``namespace``, ``dict``, loop controls, the
``{% generation %}`` tag, the tokenizer's special tokens (``bos_token``, ``eos_token``...) and
``add_generation_prompt``. Messages reach the template as plain JSON data with None-valued keys dropped.
Torch-free: the API layer renders here and tokenizes the text without adding special tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is what templates read


class ChatTemplateError(ValueError):
    """The template is missing, does not compile, or refused the conversation (raise_exception)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; it renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension API)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` in templates, without the type itself (no attribute games)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (no reaching into interpreter internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's own signature trick: `self` may be a keyword
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(),
                       namespace=_Namespace)
    return env


def _plain(value: Any) -> Any:
    """JSON data only (what a request body holds): anything else would give the template methods to call."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    raise ChatTemplateError(f"chat template data must be JSON values, got {type(value).__name__}")


def _message(message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"each message must be an object, got {message!r}")
    out = {k: v for k, v in _plain(message).items() if v is not None}
    reasoning = next((out[k] for k in REASONING_FIELDS if out.get(k) is not None), None)
    if reasoning is not None:  # older names for the reasoning, and `thinking` (gpt-oss templates read that)
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8") if path.is_file() else None
    except OSError as exc:
        logger.warning("could not read %s: %s", path, exc)
        return None


class ChatTemplates:
    """The chat templates of one model, by name ("default" is the one used unless a request names another),
    and the special tokens they see."""

    __slots__ = ("_compiled", "_env", "special_tokens", "templates")

    def __init__(self, templates: Mapping[str, str], special_tokens: Mapping[str, str] | None = None) -> None:
        if not templates:
            raise ValueError("give at least one chat template")
        self.templates = dict(templates)
        self.special_tokens = dict(special_tokens or {})
        self._env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplates | None:
        """The templates of a model folder; None when it has none."""
        folder = Path(path)
        config: dict[str, Any] = {}
        raw = _read_text(folder / "tokenizer_config.json")
        if raw is not None:
            try:
                loaded = json.loads(raw)
                config = loaded if isinstance(loaded, dict) else {}
            except json.JSONDecodeError as exc:
                logger.warning("could not read %s: %s", folder / "tokenizer_config.json", exc)
        templates: dict[str, str] = {}
        entry = config.get("chat_template")
        if isinstance(entry, str):
            templates["default"] = entry
        elif isinstance(entry, list):
            for item in entry:
                if isinstance(item, Mapping) and isinstance(item.get("name"), str) and isinstance(
                        item.get("template"), str):
                    templates[item["name"]] = item["template"]
        # Template files take priority over the config's entries, as transformers loads them
        files: dict[str, str] = {}
        default = _read_text(folder / "chat_template.jinja")
        if default is not None:
            files["default"] = default
        extra = folder / "additional_chat_templates"
        if extra.is_dir():
            for f in sorted(extra.glob("*.jinja")):
                text = _read_text(f)
                if text is not None:
                    files[f.name.removesuffix(".jinja")] = text
        if files:
            templates = files
        if not templates:
            return None
        specials = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
        return cls(templates, specials)

    def select(self, name: str | None = None, tools: Sequence[Any] | None = None) -> str:
        """The template's name: `name`, else "tool_use" when there are tools and such a template, else
        "default"."""
        if name is not None:
            if name not in self.templates:
                raise ChatTemplateError(f"this model has no chat template named {name!r}; it has "
                                        f"{sorted(self.templates)}")
            return name
        if len(self.templates) == 1:
            return next(iter(self.templates))
        if tools is not None and "tool_use" in self.templates:
            return "tool_use"
        if "default" in self.templates:
            return "default"
        raise ChatTemplateError(f"this model has several chat templates and no default: name one of "
                                f"{sorted(self.templates)} (chat_template_name)")

    def _template(self, name: str) -> jinja2.Template:
        compiled = self._compiled.get(name)
        if compiled is None:
            try:
                compiled = self._env.from_string(self.templates[name])
            except jinja2.exceptions.TemplateError as exc:
                raise ChatTemplateError(f"the model's chat template {name!r} does not compile: {exc}") from exc
            self._compiled[name] = compiled
        return compiled

    def render(self, messages: Sequence[Any], *, tools: Sequence[Any] | None = None,
               documents: Sequence[Any] | None = None, add_generation_prompt: bool = False,
               template: str | None = None, variables: Mapping[str, Any] | None = None) -> str:
        """The conversation as text. `variables` (a request's chat_template_kwargs) override the special
        tokens."""
        kwargs = dict(variables or {})
        if not messages:
            raise ChatTemplateError("the conversation is empty")
        reserved = sorted({"messages", "tools", "documents", "add_generation_prompt"} & set(kwargs))
        if reserved:
            raise ChatTemplateError(f"chat_template_kwargs cannot set {reserved}: they have their own fields")
        chat = [_message(m) for m in messages]
        compiled = self._template(self.select(template, tools))
        context = {**self.special_tokens, **_plain(kwargs)}
        try:
            return compiled.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as exc:  # raise_exception, a sandbox refusal, an undefined call
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed on this conversation: {exc!r}") from exc
