"""The GGUF's chat template (`tokenizer.chat_template`), rendered without a Jinja engine.

SmolLM2 ships the ChatML template: each message is "<|im_start|>{role}\\n{content}<|im_end|>\\n",
a default system message comes first when the conversation has none, and the generation prompt
is "<|im_start|>assistant\\n". Rather than interpret arbitrary Jinja, we recognise that template
exactly (with or without a default system message, whose text is read from the template) and
refuse any other: a renderer that guessed at an unknown template would feed the model a prompt
format it was never trained on, and the answers would quietly degrade.
"""
from __future__ import annotations

import re

# The ChatML template as Hugging Face writes it, split where the default system message sits.
_SYSTEM_OPEN = ("{% if loop.first and messages[0]['role'] != 'system' %}"
                "{{ '<|im_start|>system\n")
_SYSTEM_CLOSE = "<|im_end|>\n' }}{% endif %}"
_HEAD = "{% for message in messages %}"
_BODY = ("{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_CHATML = re.compile(re.escape(_HEAD)
                     + "(?:" + re.escape(_SYSTEM_OPEN) + "(?P<system>[^'{}]*)"
                     + re.escape(_SYSTEM_CLOSE) + ")?" + re.escape(_BODY))


class ChatTemplate:
    def __init__(self, source: str):
        if not isinstance(source, str):
            raise TypeError(f"source must be a str, not {type(source).__name__}")
        match = _CHATML.fullmatch(source.strip())
        if match is None:
            raise ValueError("source: tokenizer.chat_template is not the ChatML template this "
                             f"renderer implements; it begins {source[:120]!r}")
        self.source = source
        self.default_system: str | None = match.group("system")

    def render(self, messages, *, add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`, a list of {"role": str, "content": str} dicts, exactly
        as Jinja would render the template (the tests pin it character for character)."""
        if isinstance(messages, (str, bytes)) or not hasattr(messages, "__iter__"):
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
        messages = list(messages)
        if not messages:
            raise ValueError("messages must hold at least one message")
        out = []
        for k, message in enumerate(messages):
            if not isinstance(message, dict):
                raise TypeError(f"messages[{k}] must be a dict, not {type(message).__name__}")
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise ValueError(f"messages[{k}] needs str 'role' and 'content', got {message!r}")
            if k == 0 and role != "system" and self.default_system is not None:
                out.append(f"<|im_start|>system\n{self.default_system}<|im_end|>\n")
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)
