"""An upper bound on how many tokens a worker's chat template adds to a conversation beyond its
messages' own text, which the worker announces in its heartbeat beside its tokenizer's bound
(tasks/registry.py, `ChatBound`): for a conversation of messages m_1 .. m_n,

    tokens(prompt) <= base + sum over i of (per_message + tokens(content_i) + tokens(name_i))

With the tokenizer's bound on each content and name (worker/tokenbound.py) the API tells from
their bytes alone that a chat request surely fits the context (webapp/context.py), and has a
worker count it only when it might not. `measure` finds `base` and `per_message` by rendering
probe conversations, then checks the bound on many more; a template that breaks it gets no
bound. How it is measured, and why it holds: docs/design.md, "Does a prompt fit? Token
bounds", "A chat template's bound".
"""

from __future__ import annotations

import itertools
import logging
import random
import typing
from collections.abc import Iterable, Sequence
from typing import Any

from tasks.registry import ChatBound
from tasks.schemas import ChatMessage, ChatOptions
from worker.engines.base import GenerationError

log = logging.getLogger(__name__)

# The roles of the conversations measured: the job contract's but `tool`, whose messages (like
# a call's `tool_calls` and the request's `tools`) templates render in ways of their own; a
# conversation with any of them gets no bound and is counted (webapp/context.py).
ROLES: tuple[str, ...] = tuple(r for r in typing.get_args(ChatMessage.model_fields["role"].annotation) if r != "tool")
# Contents of the measured messages (each one's own tokens are taken off) and their names.
CONTENTS = ("x", "Hello, world.", " two  spaces \n", "\n", "12")
NAMES = ("alice", "x y")
# For how real contents and names meet the template's text (a merge across one of their two
# ends that costs a token more than the measured ones did), and the same once for the whole.
MESSAGE_MARGIN = 4
BASE_MARGIN = 4

# Contents and names of the conversations the bound is checked on.
TEXTS = [
    "",
    "x",
    "Hi",
    "Hello, how are you today?",
    "  spaces around  ",
    "\n\nnew\nlines\n",
    "\"quoted\" 'single' \\back\\slashes\\ and\ttabs",
    '"' * 40 + "\\" * 40 + "\n" * 20,  # what a JSON or HTML escape lengthens
    "<b>&amp;</b> <script>",
    "word " * 120,  # long: a template that repeats a content shows
    "¿Dónde está la biblioteca? 图书馆在哪里 🤗👍🏽",
    "\u0958\u0959\u095a \ufdfa ﬃ ﬄ ㎒",
    "{{ messages }} {% if true %}x{% endif %}",
    "".join(chr(c) for c in range(32, 127)),
    "1234567890" * 20,
    "\u00a0\u2003\u200b\ufeff",
]
NAME_TEXTS = ["alice", "Bob Smith", "x", "名字", "a_b-c.d"]
SIZES = (1, 2, 3, 4, 5, 7, 10, 16)


class _Meter:
    """Renders conversations with the worker's template (worker/chat.py `Chat`) and counts
    their tokens as the engines tokenize a chat job's prompt."""

    def __init__(self, chat: Any):
        self.chat, self.tok = chat, chat.tok
        self._own: dict[str, int] = {}

    def tokens(self, text: str) -> int:
        if text not in self._own:
            self._own[text] = len(self.tok(text, add_special_tokens=False).input_ids)
        return self._own[text]

    def own(self, messages: Sequence[ChatMessage]) -> int:
        """The messages' own tokens: their contents' and names'."""
        return sum(self.tokens(m.content) + (self.tokens(m.name) if m.name is not None else 0) for m in messages)

    def prompt(self, messages: Sequence[ChatMessage], gen: bool, cont: bool = False) -> int | None:
        """The rendered prompt's tokens; None when the template refuses the conversation (a job
        of it fails on the worker, whatever its length)."""
        try:
            text = self.chat.render(
                ChatOptions(messages=list(messages), add_generation_prompt=gen, continue_final_message=cont)
            )
        except GenerationError:
            return None
        return self.tokens(text)

    def prompts(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The prompt's tokens each way a request can render it: with the generation prompt,
        without, and continuing the final message."""
        counts = (self.prompt(messages, gen, cont) for gen, cont in ((True, False), (False, False), (False, True)))
        return [n for n in counts if n is not None]


def _message(role: str, content: str = "x", name: str | None = None) -> ChatMessage:
    return ChatMessage(role=role, content=content, name=name)


def fit(meter: _Meter) -> ChatBound | None:
    """The bound measured on probe conversations (module docstring), before it is checked;
    None when the template renders none of them."""
    variants = [(c, None) for c in CONTENTS] + [("x", n) for n in NAMES]
    prefixes = [[_message(r)] for r in ROLES] + [[_message(a), _message(b)] for a, b in itertools.product(ROLES, ROLES)]
    per: int | None = None
    probes: list[list[ChatMessage]] = [[_message(r, c, n)] for r in ROLES for c, n in variants]
    for prefix in prefixes:
        for gen in (True, False):
            before = meter.prompt(prefix, gen)
            if before is None:
                continue
            for role in ROLES:
                for content, name in variants:
                    conv = [*prefix, _message(role, content, name)]
                    after = meter.prompt(conv, gen)
                    if after is None:
                        continue
                    added = after - before - meter.own(conv[-1:])
                    per = added if per is None else max(per, added)
                    if gen:
                        probes.append(conv)
    base: int | None = None
    for conv in probes:
        for n in meter.prompts(conv):
            rest = n - meter.own(conv) - len(conv) * (per or 0)
            base = rest if base is None else max(base, rest)
    if base is None:
        return None
    return ChatBound(base=max(base, 0) + BASE_MARGIN, per_message=max(per or 0, 0) + MESSAGE_MARGIN)


def conversations(extra_texts: Iterable[str] = (), seed: int = 0) -> list[list[ChatMessage]]:
    """What the bound is checked on: every size in SIZES, its roles alternating user and
    assistant (after a system message, or not) or at random, contents and names at random."""
    rng = random.Random(seed)
    texts = [*TEXTS, *extra_texts]
    convs = []
    for size in SIZES:
        alternating = [("user", "assistant")[i % 2] for i in range(size)]
        orders = [alternating, ["system", *alternating[: size - 1]], [rng.choice(ROLES) for _ in range(size)]]
        for roles in orders:
            convs.append(
                [
                    _message(role, rng.choice(texts), rng.choice(NAME_TEXTS) if rng.random() < 0.3 else None)
                    for role in roles
                ]
            )
    # Every text once as the only message's content, then as the last one after a turn.
    convs += [[_message("user", t)] for t in texts]
    convs += [[_message("system", "s"), _message("user", "u"), _message("assistant", t)] for t in texts]
    return convs


def holds(meter: _Meter, bound: ChatBound, convs: Iterable[Sequence[ChatMessage]]) -> tuple[bool, str]:
    """Whether every rendering of every conversation the template takes stays within the
    bound (and at least one does), and if not, which broke it."""
    rendered = 0
    for conv in convs:
        allowed = bound.base + sum(bound.per_message + meter.own([m]) for m in conv)
        for n in meter.prompts(conv):
            rendered += 1
            if n > allowed:
                roles = ", ".join(m.role for m in conv)
                return False, f"a conversation ({roles}) became {n} tokens, above its bound {allowed}"
    return rendered > 0, "the template renders none of the conversations"


def measure(chat: Any) -> ChatBound | None:
    """The bound a worker announces for its chat template (`chat`: its worker/chat.py `Chat`,
    with a tokenizer and a template), or None, and the API has a worker count every
    conversation, when it could not bound the template."""
    if chat.tok is None or chat.template is None:
        return None
    if "strftime_now" in chat.template:
        log.info("conversations are counted by a worker: the chat template reads the clock (strftime_now)")
        return None
    meter = _Meter(chat)
    try:
        bound = fit(meter)
        if bound is None:
            log.info("conversations are counted by a worker: the chat template renders none of the probes")
            return None
        added = list(getattr(chat.tok, "get_added_vocab", dict)())[:32]
        ok, why = holds(meter, bound, conversations(["".join(added), " ".join(added)]))
    except Exception as exc:  # noqa: BLE001 - the worker serves without it: the API counts conversations
        log.warning("conversations are counted by a worker: measuring the chat template failed (%s)", exc)
        return None
    if not ok:
        log.warning("conversations are counted by a worker: the chat template's tokens are not bounded (%s)", why)
        return None
    log.info("chat template bound: %d tokens + %d per message beside their text", bound.base, bound.per_message)
    return bound
