"""Chat templates from files run at a bounded cost (text/chat_template.py): compiling never
evaluates (no constant folding), a render runs at most MAX_STEPS template lines, and nothing it
builds may exceed MAX_CHARS. Bounds are checked by what was allocated (tracemalloc) and the
steps counted, never by the clock."""

import subprocess
import sys
import tracemalloc

import pytest

from ds2cli.errors import TokenizerError
from ds2cli.text import chat_template
from ds2cli.text.chat_template import MAX_CHARS, MAX_STEPS, compile_template, render

HOSTILE = {
    "multiply": '{{ "a" * 4000000000 }}',
    "multiply_list": "{{ ([1, 2] * 3000000000)|length }}",
    "concat_doubling": '{% set ns = namespace(s="ab") %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}'
                       '{% endfor %}{{ ns.s|length }}',
    "plus_doubling": '{% set ns = namespace(s="ab") %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}'
                     '{% endfor %}{{ ns.s|length }}',
    "center": '{{ "x"|center(1000000000) }}',
    "percent_width": '{{ "%999999999s" % "x" }}',
    "format_width": '{{ "{:>999999999}".format("x") }}',
    "method_width": '{{ "x".ljust(1000000000) }}',
    "power": "{{ 10 ** 100000000 }}",
    "nested_loops": "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    "join_copies": '{% set s = "x" * 1000000 %}{{ [s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s]|join }}',
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_templates_end_in_an_error_at_a_bounded_cost(name):
    tracemalloc.start()
    try:
        template = compile_template(HOSTILE[name])           # compiling evaluates nothing
        compiled_peak = tracemalloc.get_traced_memory()[1]
        with pytest.raises(TokenizerError, match="budget|steps"):
            render(template, {"messages": []})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert compiled_peak < 8 << 20
    assert peak < 4 * MAX_CHARS + (64 << 20), f"{name} allocated {peak} bytes before it was stopped"


def test_the_step_budget_counts_template_lines():
    steps = chat_template._Steps()
    template = compile_template("{% for m in messages %}{{ m }}{% endfor %}")
    before = sys.gettrace()
    sys.settrace(steps)
    try:
        template.render(messages=list(range(1000)))
    finally:
        sys.settrace(before)
    used = MAX_STEPS - steps.left
    assert 1000 <= used <= 5000            # a few lines an iteration: the budget is in iterations


def test_within_the_budget_templates_render_as_jinja_does():
    src = ('{% for m in messages %}{{ m.role ~ ": " ~ m.content }}{{ "%5s|" % "x" }}'
           '{{ "ab" * 3 }}{{ 2 ** 10 }}{{ "x"|center(7) }}{{ "{:>4}".format(1) }}\n{% endfor %}')
    out = render(compile_template(src), {"messages": [{"role": "user", "content": "hi"}] * 3})
    assert out == "user: hi    x|ababab1024   x      1\n" * 3


@pytest.mark.slow
def test_a_hostile_template_file_is_one_error_line_in_the_cli(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(HOSTILE["nested_loops"])
    r = subprocess.run([sys.executable, "-m", "ds2cli", "generate", "--chat-template", path, "hi", "-n", "2"],
                       capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "steps" in lines[0] and lines[0].startswith("error: ")
    assert r.stdout == ""
