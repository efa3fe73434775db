"""Chat templates: the server's --chat-template read and checked once, and the tokenizer's
template rendered without apply_chat_template's per-call conversions where that renders alike."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def read_chat_template(value: str) -> str:
    """--chat-template's template (a file's text, or the value itself), compiled once as the
    tokenizer's own is: raises ValueError saying why it does not compile."""
    text = Path(value).read_text() if os.path.isfile(value) else value
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: a broken template then fails each chat request (400)
        return text
    try:
        _compile_jinja_template(text)
    except Exception as e:  # jinja2's TemplateSyntaxError and the like
        raise ValueError(f"--chat-template does not compile: {e}") from None
    return text


class ChatTemplate:
    """The tokenizer's chat template, compiled once and rendered directly: a fraction of the
    cost of apply_chat_template, whose per-call conversions plain {"role", "content"}
    messages do not need; and with its variables built once (jinja's render() merges the
    template's globals, a ChainMap, into a new dict every call: most of a short render).
    Used only if it renders a sample conversation exactly as apply_chat_template does;
    otherwise (or on a transformers without the compiler) every render goes through
    apply_chat_template."""

    SAMPLE = (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    )

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._compiled = None
        self._variables: dict[str, Any] = {}  # everything a render sees but the messages
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            compiled = _compile_jinja_template(tokenizer.chat_template)
            self._variables = dict(
                compiled.globals,
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **getattr(tokenizer, "special_tokens_map", {}),
            )
            sample = [dict(m) for m in self.SAMPLE]
            want = tokenizer.apply_chat_template(sample, add_generation_prompt=True, tokenize=False)
            if self._render(compiled, sample) == want:
                self._compiled = compiled
        except Exception:  # no template, a template that fails the sample, another transformers
            pass

    def _render(self, compiled: Any, messages: list[dict[str, str]]) -> str:
        # the context made as new_context(shared=True) makes it, less the set of the template's
        # globals' names it builds from their ChainMap each time (only imports read it)
        env = compiled.environment
        context = env.context_class(env, {**self._variables, "messages": messages}, compiled.name, compiled.blocks)
        return env.concat(compiled.root_render_func(context))

    @property
    def fast(self) -> bool:
        """Whether renders skip apply_chat_template."""
        return self._compiled is not None

    def render(self, messages: list[dict[str, str]]) -> str:
        if self._compiled is not None:
            return self._render(self._compiled, messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
