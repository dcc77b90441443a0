"""Rendering a chat template that came with a request (only with
``--trust-request-chat-template``): a template is a program, so it runs in Jinja's immutable
sandbox with bounds on what it can cost:

* at most ``MAX_TEMPLATE_CHARS`` characters of template;
* ``range`` draws from one budget of ``MAX_LOOP_ITEMS`` items per render, so nested loops cannot
  multiply into billions of iterations (Jinja's own sandbox caps each range at 100,000 but not
  their product);
* at most ``MAX_OUTPUT_CHARS`` characters of output.

The server's own template (the model's, or ``--chat-template``) is trusted and rendered by
transformers as usual.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

MAX_TEMPLATE_CHARS = 64_000
MAX_LOOP_ITEMS = 100_000
MAX_OUTPUT_CHARS = 1_000_000


class TemplateLimitError(ValueError):
    pass


def render_untrusted(template: str, conversation: list[dict], tokenizer: Any, add_generation_prompt: bool,
                     continue_final_message: bool, **kwargs: Any) -> str:
    """The prompt text ``template`` makes of ``conversation``.

    Raises:
        TemplateLimitError: a bound was hit; ValueError: the template failed (its message).
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateLimitError(f"chat_template is {len(template)} characters, more than {MAX_TEMPLATE_CHARS}")
    budget = [MAX_LOOP_ITEMS]

    def bounded_range(*args: int) -> range:
        r = range(*args)
        budget[0] -= len(r)
        if budget[0] < 0:
            raise TemplateLimitError(f"chat_template loops over more than {MAX_LOOP_ITEMS} items")
        return r

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(range=bounded_range, raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: __import__("json").dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    try:
        compiled = env.from_string(template)
        pieces = []
        size = 0
        for piece in compiled.generate(messages=conversation, add_generation_prompt=add_generation_prompt,
                                       bos_token=tokenizer.bos_token or "", eos_token=tokenizer.eos_token or "", **kwargs):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise TemplateLimitError(f"chat_template output is over {MAX_OUTPUT_CHARS} characters")
            pieces.append(piece)
    except TemplateLimitError:
        raise
    except (jinja2.TemplateError, ValueError, TypeError, OverflowError) as e:
        raise ValueError(str(e)) from None
    text = "".join(pieces)
    if continue_final_message and conversation and conversation[-1].get("content"):
        final = conversation[-1]["content"]
        cut = text.rfind(final)
        if cut >= 0:
            text = text[: cut + len(final)]
    return text
