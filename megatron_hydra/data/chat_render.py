"""The process that renders a chat template (``chat_template.JinjaTemplate`` starts one per template).

A ``chat_template`` comes with an imported model, from anyone. Jinja's sandbox keeps it from
reaching Python's internals, but not from looping for hours or allocating without bound
(``'x' * 4000000000``, a macro that doubles its output), and no Python code can interrupt a
C-level allocation or a loop that calls nothing. So templates are compiled and rendered here, in a
process of their own with an address-space limit; the parent kills it when a reply is late.

This module imports the standard library and Jinja only, so that the process starts quickly. It
speaks JSON lines on stdin/stdout:

- it writes ``{"ready": true}`` once started;
- ``{"template": source, "specials": {...}, "max_chars": n, "memory_bytes": n}`` compiles the
  template (constant folding runs template code already) and answers ``{"ok": true}``;
- ``{"messages": [...], "renders": [[k, add_generation_prompt], ...]}`` renders ``messages[:k]``
  for each pair and answers ``{"texts": [...]}``;
- any failure is ``{"error": kind, "message": text}``, kind one of ``syntax``, ``refused`` (the
  template raised or met an undefined value), ``too_long``, ``memory``, ``recursion``, ``failed``.
"""

from __future__ import annotations

import json
import signal
import sys


class _TooLong(Exception):
    pass


def _environment():
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """Hugging Face's ``{% generation %}...{% endgeneration %}`` marks assistant text in some
        templates; the parent finds that text from prefix renders, so the tag renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                         extensions=["jinja2.ext.loopcontrols", Generation])


def _limit_memory(nbytes: int) -> None:
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = nbytes if hard == resource.RLIM_INFINITY else min(nbytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (ImportError, ValueError, OSError):  # no such limit here: the parent's timeout remains
        pass


def _render(template, specials: dict, messages: list, add_generation_prompt: bool, max_chars: int) -> str:
    from jinja2 import TemplateError

    def raise_exception(message):
        raise TemplateError(message)

    pieces, size = [], 0
    for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                   raise_exception=raise_exception, **specials):
        size += len(piece)
        if size > max_chars:
            raise _TooLong()
        pieces.append(piece)
    return "".join(pieces)


def _failure(e: BaseException) -> dict:
    from jinja2 import TemplateError, TemplateSyntaxError

    first = (str(e).splitlines() or [""])[0][:300]
    kind = ("syntax" if isinstance(e, TemplateSyntaxError) else "refused" if isinstance(e, TemplateError)
            else "too_long" if isinstance(e, _TooLong) else "memory" if isinstance(e, MemoryError)
            else "recursion" if isinstance(e, RecursionError) else "failed")
    named = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return {"error": kind, "message": first if kind == "refused" else "" if kind == "too_long" else named}


def _serve(requests, reply) -> None:
    env, template, setup = _environment(), None, {}
    reply({"ready": True})
    for line in requests:
        try:
            request = json.loads(line)
            if "template" in request:
                setup = request
                _limit_memory(int(setup["memory_bytes"]))
                template = env.from_string(setup["template"])
                answer = {"ok": True}
            else:
                messages = request["messages"]
                answer = {"texts": [_render(template, setup["specials"], messages[:k], bool(prompt),
                                            int(setup["max_chars"])) for k, prompt in request["renders"]]}
        except Exception as e:  # everything a template can do wrong is an answer, never a crash
            answer = _failure(e)
        reply(answer)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle

    def reply(answer: dict) -> None:
        try:
            text = json.dumps(answer)
        except MemoryError:
            text = json.dumps({"error": "memory", "message": "MemoryError"})
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    _serve(sys.stdin, reply)


if __name__ == "__main__":
    main()
