"""Chat templates from files (a checkpoint's tokenizer_config.json, a GGUF, --chat-template) are
code from outside: Jinja's ImmutableSandboxedEnvironment (as Hugging Face renders them) with a
budget on what one render may cost.

- Work: a render may run at most MAX_STEPS lines of template code (a trace hook on the rendering
  thread counts them; a normal chat template runs some tens of lines a message), so nested loops
  end in an error, never in a pinned thread.
- Size: no string or list the template builds may exceed MAX_CHARS: the operators that multiply,
  add, format or join (`*`, `**`, `+`, `%`, `~`), every call and filter whose numbers could ask for
  more, and the output as it is produced, are checked before the memory is asked for.
- Compiling never evaluates: constant folding is off (Jinja folds `"a" * 4000000000` at compile
  time otherwise), so loading a hostile file costs nothing.
Every failure is a TokenizerError naming the template's line."""

from __future__ import annotations

import functools
import json
import re
import sys
import traceback
from typing import Any

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ds2cli.errors import TokenizerError

# jinja2 names the frames of a template compiled from a string like this in tracebacks.
TEMPLATE_FRAME_FILENAME = "<template>"

MAX_STEPS = 1_000_000        # template lines one render may run
MAX_CHARS = 16 << 20         # characters (or items) any value a render builds, and its output, may hold
_WIDTH = re.compile(r"\d{8,}")   # a width or precision of 8+ digits in a format string asks for >= 10^7


class TemplateBudgetError(TokenizerError):
    """A template that would cost more than a chat prompt ever does."""


def _too_big(what: str) -> TemplateBudgetError:
    return TemplateBudgetError(f"{what} exceeds the template budget of {MAX_CHARS} characters")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _check_args(args, kwargs) -> None:
    for v in (*args, *kwargs.values()):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_CHARS:
            raise _too_big(f"the number {v}")
        if isinstance(v, str) and _WIDTH.search(v):
            raise _too_big(f"a format width in {v[:40]!r}")


class _CheckedCodeGenerator(CodeGenerator):
    """`a ~ b` joins through the environment, so its size is checked before the join."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "+", "%"])
    code_generator_class = _CheckedCodeGenerator

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            n, k = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(k, int) and _size(n) * max(k, 0) > MAX_CHARS:
                raise _too_big("a repetition")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right * max(abs(left), 2).bit_length() > 4096:
                raise _too_big("a power")
        elif operator == "+":
            if _size(left) + _size(right) > MAX_CHARS:
                raise _too_big("a concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_args((left,), {})
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any):
        """str.format's format string may ask for a width of a billion: checked when it is looked up."""
        if getattr(value, "__name__", "") in ("format", "format_map") and isinstance(getattr(value, "__self__", None), str):
            _check_args((value.__self__,), {})
        return super().wrap_str_format(value)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        _check_args(args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        if _size(out) > MAX_CHARS:
            raise _too_big("a call's result")
        return out

    @staticmethod
    def checked_concat(parts: tuple) -> str:
        texts = [str(p) for p in parts]
        if sum(map(len, texts)) > MAX_CHARS:
            raise _too_big("a ~ concatenation")
        return "".join(texts)


def _checked_filter(f):
    """A filter whose numbers are checked before it runs and whose result after (center, indent,
    wordwrap, batch, format, replace ... take sizes from the template)."""
    @functools.wraps(f)
    def run(*args, **kwargs):
        _check_args([a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.Environment))], kwargs)
        out = f(*args, **kwargs)
        if _size(out) > MAX_CHARS:
            raise _too_big("a filter's result")
        return out
    if hasattr(f, "jinja_pass_arg"):
        run.jinja_pass_arg = f.jinja_pass_arg
    return run


def compile_template(source: str, name: str = "chat template") -> jinja2.Template:
    """Compile once at load, in the same sandboxed environment Hugging Face uses, with the budget.
    `name` starts every error about it ("chat template bad.jinja" for a user's file)."""
    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                              optimized=False)
    env.filters = {name: _checked_filter(f) for name, f in env.filters.items()}
    env.filters["tojson"] = _checked_filter(_tojson)
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TokenizerError(f"{name} line {exc.lineno}: {one_line(exc.message or '')}") from exc


class _Steps:
    """A trace hook that counts the lines the template's own frames run, and stops the render
    once they pass MAX_STEPS. Only the rendering thread is traced, and only while it renders."""

    def __init__(self):
        self.left = MAX_STEPS

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename == TEMPLATE_FRAME_FILENAME:
            return self.line
        return None

    def line(self, frame, event, arg):
        if event == "line":
            self.left -= 1
            if self.left < 0:
                raise TemplateBudgetError(f"the chat template ran more than {MAX_STEPS} steps")
        return self.line


def render(template: jinja2.Template, variables: dict[str, Any], name: str = "chat template") -> str:
    before = sys.gettrace()
    sys.settrace(_Steps())
    try:
        out, n = [], 0
        for piece in template.generate(**variables):
            n += len(piece)
            if n > MAX_CHARS:
                raise _too_big("the rendered prompt")
            out.append(piece)
        return "".join(out)
    except Exception as exc:  # a template is user code: any failure in it is a template error
        line = _template_line(exc)
        where = f"{name} line {line}" if line is not None else name
        raise TokenizerError(f"{where}: {one_line(str(exc)) or type(exc).__name__}") from exc
    finally:
        sys.settrace(before)


def _template_line(exc: BaseException) -> int | None:
    """jinja2 rewrites tracebacks so that template frames carry the template's own line numbers."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if f.filename == TEMPLATE_FRAME_FILENAME]
    return frames[-1].lineno if frames else None


def _raise_exception(message: str) -> None:
    """The `raise_exception` templates call to reject a conversation (e.g. roles out of order)."""
    raise TokenizerError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's version: jinja2's own tojson HTML-escapes, which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def one_line(message: str) -> str:
    """Error messages are printed as a single line; collapse any whitespace runs in foreign text."""
    return " ".join(message.split())
