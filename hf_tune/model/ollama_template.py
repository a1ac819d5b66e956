"""An Ollama Modelfile whose Go template renders what the run's Jinja chat template renders.

Ollama does not run Jinja. The run's template is rendered on marker conversations to read off the text around each
role's content (the header with and without a system message, user and assistant turns, the generation prompt); the
parts are then checked against the Jinja template on other conversations, and a template that is not a fixed text
around each turn (one that rewrites history, say) is refused rather than approximated.
"""

from __future__ import annotations

import dataclasses

from hf_tune.errors import HfTuneError

MARK = "\u2063hf_tune_{}\u2063"  # a marker no template prints on its own
CHECKS = (  # conversations the read-off parts must render exactly as the Jinja template does
    [("user", "Hi")],
    [("system", "Be brief."), ("user", "Hi")],
    [("user", "What is 2 + 2?"), ("assistant", "4."), ("user", "And 3 + 3?")],
    [("system", "You answer in French."), ("user", "Hello"), ("assistant", "Bonjour."), ("user", "Thanks"),
     ("assistant", "De rien."), ("user", "Bye")],
)


@dataclasses.dataclass(frozen=True)
class TurnParts:
    header: str  # before the first user turn, without a system message (a default system prompt lives here)
    system_open: str  # before the system message's content
    system_close: str  # after it, up to the first user turn
    user_open: str
    user_close: str
    assistant_open: str
    assistant_close: str
    generation: str  # the generation prompt after the last user turn

    def render(self, messages: list[tuple[str, str]]) -> str:
        """The conversation as the Go template renders it, for the check against Jinja."""
        text, rest = self.header, messages
        if messages and messages[0][0] == "system":
            text, rest = self.system_open + messages[0][1] + self.system_close, messages[1:]
        for role, content in rest:
            text += (self.user_open + content + self.user_close if role == "user"
                     else self.assistant_open + content + self.assistant_close)
        return text + self.generation


def turn_parts(tokenizer) -> TurnParts:
    """Read the parts off the tokenizer's chat template; an error says why a template has none."""
    def render(messages, generation=False):
        try:
            return tokenizer.apply_chat_template([{"role": role, "content": content} for role, content in messages],
                                                 tokenize=False, add_generation_prompt=generation)
        except Exception as err:  # jinja2's TemplateError, or what raise_exception raises
            raise _not_fixed(f"it refuses {[role for role, _ in messages]}: {err}") from None

    if not tokenizer.chat_template:
        raise HfTuneError("the tokenizer has no chat template, so there is no conversation format to give Ollama\n"
                          "  fix: export --format gguf and pass Ollama a TEMPLATE of your own")
    sys_, u1, a1, u2 = (MARK.format(name) for name in ("system", "user1", "assistant1", "user2"))
    one, one_prompted = render([("user", u1)]), render([("user", u1)], True)
    two, three = render([("user", u1), ("assistant", a1)]), render([("user", u1), ("assistant", a1), ("user", u2)])
    with_system = render([("system", sys_), ("user", u1)])
    if not (one_prompted.startswith(one) and two.startswith(one) and three.startswith(two)
            and with_system.endswith(u1 + _after(one, u1))):
        raise _not_fixed("a later turn changes the text of earlier ones")
    user_close = _after(one, u1)
    assistant_open, assistant_close = _around(two[len(one):], a1)
    user_open, user_close_again = _around(three[len(two):], u2)
    before_user = _before(one, u1)
    if user_close_again != user_close or not before_user.endswith(user_open):
        raise _not_fixed("the first user turn is written otherwise than later ones")
    system_open, system_rest = _around(_before(with_system, u1), sys_)
    if not system_rest.endswith(user_open):
        raise _not_fixed("the system message is not followed by a user turn's opening")
    parts = TurnParts(before_user[:len(before_user) - len(user_open)], system_open,
                      system_rest[:len(system_rest) - len(user_open)], user_open, user_close, assistant_open,
                      assistant_close, one_prompted[len(one):])
    for conversation in CHECKS:
        if parts.render(conversation) != render(conversation, True):
            raise _not_fixed(f"the parts read off it render {conversation!r} otherwise")
    return parts


def modelfile(parts: TurnParts, gguf_name: str, stops: list[str]) -> str:
    """The Modelfile: the GGUF beside it, the Go template of the parts, and the stop strings."""
    def literal(text: str) -> str:
        if "{{" in text or '"""' in text:
            raise _not_fixed("its text holds '{{' or '\"\"\"', which a Modelfile TEMPLATE cannot carry as text")
        return text

    template = (f'{{{{ if .System }}}}{literal(parts.system_open)}{{{{ .System }}}}{literal(parts.system_close)}'
                f'{{{{ else }}}}{literal(parts.header)}{{{{ end }}}}'
                f'{{{{ range .Messages }}}}{{{{ if eq .Role "user" }}}}{literal(parts.user_open)}{{{{ .Content }}}}'
                f'{literal(parts.user_close)}{{{{ else if eq .Role "assistant" }}}}{literal(parts.assistant_open)}'
                f'{{{{ .Content }}}}{literal(parts.assistant_close)}{{{{ end }}}}{{{{ end }}}}'
                f'{literal(parts.generation)}')
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{template}"""']
    lines += [f"PARAMETER stop {_quoted(stop)}" for stop in stops]
    return "\n".join(lines) + "\n"


def stop_strings(tokenizer, parts: TurnParts) -> list[str]:
    """The end-of-sequence token and every special token that closes an assistant turn or opens a user turn."""
    special = [token for token in tokenizer.all_special_tokens if token]
    found = [token for token in special if token in parts.assistant_close or token in parts.user_open]
    eos = [tokenizer.eos_token] if tokenizer.eos_token else []
    return list(dict.fromkeys(found + eos))


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _before(text: str, mark: str) -> str:
    return text[:text.index(mark)]


def _after(text: str, mark: str) -> str:
    return text[text.index(mark) + len(mark):]


def _around(text: str, mark: str) -> tuple[str, str]:
    if text.count(mark) != 1:
        raise _not_fixed("a message's content is not written once where its turn is")
    return _before(text, mark), _after(text, mark)


def _not_fixed(why: str) -> HfTuneError:
    return HfTuneError(f"the chat template is not a fixed text around each turn ({why}), so no Ollama template "
                       "reproduces it exactly\n  fix: export --format gguf (the file carries the Jinja template) and "
                       "run it with llama.cpp's --jinja, or write a Modelfile TEMPLATE by hand")
