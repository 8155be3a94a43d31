"""The command line, driven with click's CliRunner and real subprocesses, on ds2-tiny."""

import json
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

import ds2cli
from ds2cli.cli.main import main
from ds2cli.cli.console import LoadProgress
from ds2cli.generation.generate import stream_generate
from ds2cli.weights.source import bundled_model_dir
from ds2cli.weights.quantize import quantize_checkpoint
from ds2cli.wording import human_bytes, unpacked

STATS = re.compile(r"^\[(?:load \d+\.\d\ds \| )?prefill (\d+) tok, [\d.]+ tok/s \| decode (\d+) tok, [\d.]+ tok/s"
                   r"(?: \| cores ([\d.]+) prefill, ([\d.]+) decode \(of (\d+(?:-\d+)?)\))?"    # generate's
                   r" \| cache (\d+)/(\d+) tok, ([\d.]+ k?M?G?B)\]$")


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


@pytest.mark.slow
def test_chat_scripted_greedy_answers_and_prefills_only_new_tokens():
    script = "What is 17 + 25?\nCount from 4 to 8.\nWho are you?\n/exit\n"
    r = run("chat", "--temperature", "0", "--stats", input=script)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == [
        "17 + 25 = 42.",
        "4, 5, 6, 7, 8.",
        "I am ds2-tiny, a small DeepSeek-V2 model. I can add and subtract numbers, count, and babble like Shakespeare.",
    ]
    assert max(map(len, r.stderr.splitlines())) <= 80        # the stats lines wrapped within 80 columns
    lines = unpacked(r.stderr).splitlines()
    assert re.fullmatch(r"\[load \d+\.\d\ds\]", lines[0])            # the load time, once
    stats = [STATS.match(line) for line in lines[1:]]
    assert all(stats) and len(stats) == 3 and not any("load" in line for line in lines[1:])
    prefilled = [int(m.group(1)) for m in stats]
    cached = [int(m.group(6)) for m in stats]
    # each later turn prefills only its own tokens: the eos the last reply ended with (sampled,
    # never fed) plus "User: ...\n\nAssistant:"; everything before stays in the cache
    model = ds2cli.load()
    tok = model.tokenizer
    turn = lambda q: len(tok.encode("User: " + q + "\n\nAssistant:", add_special_tokens=False))  # noqa: E731
    assert prefilled[1] == 1 + turn("Count from 4 to 8.")
    assert prefilled[2] == 1 + turn("Who are you?")
    for i in (1, 2):
        assert cached[i] == cached[i - 1] + prefilled[i] + int(stats[i].group(2)) - 1


@pytest.mark.slow
def test_chat_commands_save_clear_and_load(tmp_path):
    saved = tmp_path / "conv.json"
    r = run("chat", "--temperature", "0", "--system", "Be brief.",
            input=f"What is 2 + 3?\n/save {saved}\n/clear\n/help\n/bogus\nWhat is 10 + 11?\n/quit\n")
    assert r.exit_code == 0
    assert r.stdout.splitlines() == ["2 + 3 = 5.", "10 + 11 = 21."]
    messages = json.loads(saved.read_text())
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "What is 2 + 3?"},
                        {"role": "assistant", "content": "2 + 3 = 5."}]
    assert "/save PATH" in r.stderr and "unknown or incomplete command '/bogus'" in r.stderr
    r = run("chat", "--temperature", "0", "--stats", input="What is 2 + 3?\n/save\n/help\n/system\n/clear\n")
    assert "usage: /save PATH" in r.stderr and max(map(len, r.stderr.splitlines())) <= 80, r.stderr
    r = run("chat", "--temperature", "0", "--load", str(saved), input="What is 30 + 12?\n")
    assert r.exit_code == 0 and r.stdout.splitlines() == ["30 + 12 = 42."]


@pytest.mark.slow
def test_chat_drops_oldest_turns_when_the_context_is_full():
    questions = [f"What is {a} + {b}?" for a, b in [(11, 22), (33, 44), (15, 16), (21, 30)]]
    r = run("chat", "--temperature", "0", "--ctx", "64", "-n", "16", "--system", "Hi.",
            input="\n".join(questions) + "\n")
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines() == ["11 + 22 = 33.", "33 + 44 = 77.", "15 + 16 = 31.", "21 + 30 = 51."]
    # the warning says the room kept for the reply (-n 16, at most half of 64): why a turn goes early
    said = re.findall(r"warning: context full: dropped the oldest turn \((\d+) messages\): (\d+) tokens of history "
                      r"\+ (\d+) kept for the reply \(-n, at most half the context\) pass its (\d+)", r.stderr)
    assert said and all(m == "2" and rest == ["16", "64"] and int(t) + 16 > 64 >= int(t) for m, t, *rest in said)


def test_generate_json_fields():
    r = run("generate", "--chat", "What is 451 - 123?", "--temperature", "0", "--json")
    assert r.exit_code == 0
    out = json.loads(r.stdout)
    assert out["text"] == "451 - 123 = 328."
    assert out["finish_reason"] == "eos"
    assert out["prompt_tokens"] == 19 and out["completion_tokens"] == 16  # 15 text tokens + eos
    assert set(out["timings"]) == {"load_s", "prefill_tok_per_s", "decode_tok_per_s"}
    assert all(v > 0 for v in out["timings"].values())


@pytest.mark.slow
def test_generate_length_and_stop():
    r = run("generate", "ROMEO:\n", "--temperature", "0", "-n", "5", "--json")
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "length" and out["completion_tokens"] == 5
    r = run("generate", "--chat", "Count from 3 to 9.", "--temperature", "0", "--stop", "6", "--json")
    out = json.loads(r.stdout)
    assert out["text"] == "3, 4, 5, " and out["finish_reason"] == "stop"
    r = run("generate", "--chat", "Count from 3 to 9.", "--temperature", "0", "--stop", ", 6,")
    assert r.stdout == "3, 4, 5\n"


@pytest.mark.slow
def test_generate_seed_reproducible_and_stdin_prompt():
    args = ["generate", "-", "--temperature", "1.0", "--top-p", "0.9", "-n", "30"]
    a = run(*args, "--seed", "7", input="ROMEO:\n")
    b = run(*args, "--seed", "7", input="ROMEO:\n")
    c = run(*args, "--seed", "8", input="ROMEO:\n")
    assert a.exit_code == 0 and a.stdout == b.stdout and a.stdout != c.stdout
    d = run("generate", "--seed", "7", "--temperature", "1.0", "--top-p", "0.9", "-n", "30", input="ROMEO:\n")
    assert d.stdout == a.stdout


def test_generate_stats_line_on_stderr_only():
    r = run("generate", "--chat", "What is 2 + 2?", "--temperature", "0", "--stats")
    assert r.stdout == "2 + 2 = 4.\n"
    assert max(map(len, r.stderr.splitlines())) <= 80 < len(unpacked(r.stderr).strip())
    m = STATS.match(unpacked(r.stderr).strip())
    model = ds2cli.load()
    prompt = model.tokenizer.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    assert m and int(m.group(1)) == len(prompt) and int(m.group(6)) == len(prompt) + int(m.group(2)) - 1
    # the cache's size in the units every command prints (kB = 10^3 bytes), not a count of bytes
    assert m.group(8) == human_bytes(int(m.group(6)) * model.new_cache(1).bytes_per_token)
    assert m.group(8).endswith(" kB")
    # the cores prefill and decode kept busy, of those the machine gave the passes (at most them all)
    given = [int(n) for n in m.group(5).split("-")]
    assert 1 <= min(given) <= max(given) <= os.cpu_count() and all(0 < float(m.group(k)) for k in (3, 4))


def test_streaming_never_splits_a_character():
    """ds2-tiny's byte-level BPE spells non-ASCII byte by byte: force those tokens out of the
    generation loop and check every streamed chunk is whole text."""
    model = ds2cli.load()
    text = "café ☕ 你好 🚀!"
    target = model.tokenizer.encode(text, add_special_tokens=False)
    assert len(target) > len(text)  # characters really span several tokens
    script = iter(target + [1])
    chunks = list(stream_generate(model, [0], model.new_cache(64), lambda logits, history: next(script), 64))
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == text and chunks[-1].finish_reason == "eos"


def test_help_and_version():
    r = run("--help")
    assert r.exit_code == 0
    for command in ("generate", "chat", "inspect"):
        assert command in r.stdout
    r = run("--version")
    assert r.exit_code == 0 and ds2cli.__version__ in r.stdout


def test_model_from_environment_variable(tmp_path):
    r = CliRunner(env={"DS2_MODEL": str(tmp_path / "nowhere")}).invoke(main, ["generate", "hi"])
    assert r.exit_code == 1
    assert r.stderr.startswith("error: no such file or directory") and "DS2_MODEL" in r.stderr and r.stderr.count("\n") == 1
    assert r.stderr.rstrip().endswith("(the model path was set by DS2_MODEL)")
    r = CliRunner().invoke(main, ["generate", "hi", "-m", str(tmp_path / "nowhere")])
    assert r.exit_code == 1 and "DS2_MODEL" not in r.stderr
    r = CliRunner(env={"DS2_MODEL": str(tmp_path)}).invoke(main, ["inspect"])
    assert r.exit_code == 1 and r.stderr.rstrip().endswith("(the model path was set by DS2_MODEL)")
    r = CliRunner(env={"DS2_MODEL": str(tmp_path)}).invoke(main, ["inspect", str(tmp_path)])
    assert r.exit_code == 1 and "DS2_MODEL" not in r.stderr


@pytest.mark.slow
def test_real_subprocess_python_m_and_pipe():
    p = subprocess.run([sys.executable, "-m", "ds2cli", "generate", "--chat", "What is 40 + 2?",
                        "--temperature", "0"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "40 + 2 = 42.\n" and p.stderr == ""


# ---- help, aliases and conveniences ----

def test_top_level_help_shows_whole_command_summaries():
    r = CliRunner().invoke(main, ["--help"], terminal_width=80)
    commands = r.stdout[r.stdout.index("Commands:"):]
    assert "..." not in commands
    summary = " ".join(commands.split())
    assert "inspect Summarise a checkpoint from its headers: architecture, parameters, memory, cache economics." in summary
    assert 'generate Generate a completion of PROMPT (or of stdin when PROMPT is omitted or "-").' in summary


def test_help_texts_show_defaults_and_ds2_model():
    generate_help = " ".join(run("generate", "--help").stdout.split())
    for text in ("DS2_MODEL", "else 256", "generation_config.json's, else 0.7", "--from-bos",
                 "prompt + max-new-tokens, at most the model's max_position_embeddings", "\\n \\t",
                 "--temperature, --temp", "-p, --prompt"):
        assert text in generate_help, text
    chat_help = " ".join(run("chat", "--help").stdout.split())
    for text in ("DS2_MODEL", "min(max_position_embeddings, 4096)", 'a line holding only """',
                 "/system [TEXT]", "chat_history"):
        assert text in chat_help, text


def test_prompt_option_and_temp_alias():
    r = run("generate", "--chat", "-p", "What is 2 + 2?", "--temp", "0")
    assert r.exit_code == 0 and r.stdout == "2 + 2 = 4.\n"
    r = run("generate", "--chat", "--prompt", "What is 2 + 2?", "--temp", "0")
    assert r.stdout == "2 + 2 = 4.\n"
    r = run("generate", "hi", "-p", "hello")
    assert r.exit_code == 2 and "not both" in r.stderr


@pytest.mark.slow
def test_ignore_eos_generates_to_the_limit():
    r = run("generate", "--chat", "What is 2 + 2?", "--temp", "0", "--json")
    assert json.loads(r.stdout)["finish_reason"] == "eos"
    r = run("generate", "--chat", "What is 2 + 2?", "--temp", "0", "--json", "--ignore-eos", "-n", "30")
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "length" and out["completion_tokens"] == 30
    # eos is just a token now, and a special one: its text is left out unless --special asks
    assert out["text"].startswith("2 + 2 = 4.") and "<｜" not in out["text"]
    shown = json.loads(run(*["generate", "--chat", "What is 2 + 2?", "--temp", "0", "--json", "--ignore-eos",
                             "-n", "30", "--special"]).stdout)
    assert shown["text"].startswith("2 + 2 = 4.<｜end▁of▁sentence｜>")
    specials = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")
    hidden = shown["text"]
    for text in specials:
        hidden = hidden.replace(text, "")
    assert hidden == out["text"] and shown["completion_tokens"] == 30
    r = run("chat", "--temp", "0", "-n", "30", "--special", input="What is 2 + 2?\n")
    assert r.exit_code == 0 and r.stdout == "2 + 2 = 4.\n"      # chat takes the flag; its reply ends at eos


def verbose_prompt(stderr: str) -> tuple[str, list[int]]:
    """(prompt text, ids) from --verbose-prompt's lines on stderr."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if re.fullmatch(r"prompt \(\d+ tokens?\):", line))
    end = next(i for i, line in enumerate(lines) if line.startswith("token ids: "))
    return "\n".join(lines[start + 1:end]), [int(t) for t in lines[end].split(": ")[1].split()]


def test_verbose_prompt_prints_the_rendered_prompt_and_ids():
    r = run("generate", "--chat", "What is 2 + 2?", "--temp", "0", "--verbose-prompt")
    assert r.exit_code == 0 and r.stdout == "2 + 2 = 4.\n"
    text, ids = verbose_prompt(r.stderr)
    tok = ds2cli.load().tokenizer
    assert ids == tok.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    assert text == tok.decode(ids) == "<｜begin▁of▁sentence｜>User: What is 2 + 2?\n\nAssistant:"
    assert f"prompt ({len(ids)} tokens):" in r.stderr


def test_chat_template_file_replaces_the_checkpoints(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}User: {{ m['content'] }} please\n\n"
                        "{% endfor %}Assistant:", encoding="utf-8")
    r = run("generate", "What is 2 + 2?", "--temp", "0", "-n", "3", "--verbose-prompt",
            "--chat-template", str(template))          # implies --chat
    assert r.exit_code == 0, r.stderr
    assert verbose_prompt(r.stderr)[0] == "<｜begin▁of▁sentence｜>User: What is 2 + 2? please\n\nAssistant:"
    r = run("chat", "--temp", "0", "--chat-template", str(template), input="What is 2 + 2?\n")
    assert r.exit_code == 0 and r.stdout.strip()
    template.write_text("{% for %}")
    r = run("generate", "hi", "--chat-template", str(template))
    assert r.exit_code == 1 and r.stderr.startswith(f"error: chat template {template} line 1: ")
    template.write_text("{{ raise_exception('no system here') }}")       # fails when it renders, not before
    r = run("generate", "hi", "--chat-template", str(template))
    assert r.exit_code == 1 and r.stderr == f"error: chat template {template} line 1: no system here\n"
    r = run("chat", "--chat-template", str(template), input="hi\n")
    assert f"chat template {template} line 1: no system here" in r.stderr
    r = run("generate", "hi", "--chat-template", str(tmp_path / "none.jinja"))
    assert r.exit_code == 1 and "cannot read chat template" in r.stderr


def test_threads_limits_blas_while_generating(command_samples):
    """--threads 1: BLAS at one thread while each token is sampled, and the model's machine on one
    core; BLAS as it was afterwards."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    seen, cores = [], []

    def recording(model, opts, real):
        cores.append(model.executor.compute.machine.workers.n)
        sample = real(model, opts)

        def sampling(logits, history):
            seen.append([p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"])
            return sample(logits, history)
        return sampling
    command_samples(recording)
    before = [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
    r = run("generate", "--chat", "What is 2 + 2?", "--temp", "0", "--threads", "1")
    assert r.exit_code == 0 and r.stdout == "2 + 2 = 4.\n"
    assert seen and all(s == [1] * len(before) for s in seen) and before and cores == [1]
    assert [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"] == before


@pytest.mark.slow
def test_stop_understands_escapes():
    from ds2cli.cli.options import unescape
    assert unescape(r"\n\n") == "\n\n" and unescape(r"a\tb\\n") == "a\tb\\n"
    assert unescape(r"\x41\q\"") == 'A\\q"' and unescape("\\") == "\\"
    free = json.loads(run("generate", "ROMEO:\n", "--temp", "0", "-n", "40", "--json").stdout)["text"]
    cut = free.index("\n\n", 1)
    r = run("generate", "ROMEO:\n", "--temp", "0", "-n", "40", "--json", "--stop", r"\n\n")
    out = json.loads(r.stdout)
    assert out["text"] == free[:cut] and out["finish_reason"] == "stop"


def test_empty_prompt_needs_from_bos():
    r = run("generate", "")
    assert r.exit_code == 1 and "--from-bos" in r.stderr and r.stderr.count("\n") == 1
    r = run("generate", input="")
    assert r.exit_code == 1 and "the prompt is empty" in r.stderr
    r = run("generate", "", "--from-bos", "-n", "4", "--temp", "0", "--json")
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and out["prompt_tokens"] == 1 and out["completion_tokens"] == 4
    r = run("generate", "", "--from-bos", "--chat")
    assert r.exit_code == 2 and "--from-bos is for raw completion" in r.stderr


def test_byte_order_mark_is_dropped_and_prompt_file_dash_reads_stdin(tmp_path):
    plain = verbose_prompt(run("generate", "ROMEO:", "-n", "1", "--verbose-prompt").stderr)[1]
    bom = "\ufeffROMEO:".encode("utf-8")
    (tmp_path / "p.txt").write_bytes(bom)
    for args, stdin in ([["--prompt-file", str(tmp_path / "p.txt")], None], [["--prompt-file", "-"], bom], [[], bom]):
        r = run("generate", *args, "-n", "1", "--verbose-prompt", input=stdin)
        assert r.exit_code == 0, r.stderr
        assert verbose_prompt(r.stderr)[1] == plain


def test_context_clipping_max_new_tokens_is_said_once():
    ids = ds2cli.load().tokenizer.encode("ROMEO:")
    r = run("generate", "ROMEO:", "--temp", "0", "--ctx", "12", "-n", "50", "--json", "--ignore-eos")
    out = json.loads(r.stdout)
    room = 12 - len(ids) + 1
    assert out["finish_reason"] == "length" and out["completion_tokens"] == room
    assert r.stderr == (f"warning: the context of 12 tokens leaves room for {room} of the 50 new tokens "
                        f"asked for (-n): generation stops there\n")
    r = run("generate", "ROMEO:", "--temp", "0", "--ctx", "12", "-n", str(room), "--json", "--ignore-eos")
    assert r.stderr == "" and json.loads(r.stdout)["completion_tokens"] == room


@pytest.mark.parametrize("as_json", [True, False])
def test_ctrl_c_during_generation_reports_the_timings_of_what_ran(command_samples, as_json):
    """An interrupted generation still says how fast its prefill and decode steps ran: --json's
    object and the --stats line carry real figures, not zeros."""
    def sampler_for(model, opts, real):
        sample, calls = real(model, opts), []

        def interrupting(logits, history):
            calls.append(1)
            if len(calls) == 7:
                raise KeyboardInterrupt      # as a Ctrl-C would, between two decode steps
            return sample(logits, history)
        return interrupting
    command_samples(sampler_for)
    args = ["generate", "--chat", "Count from 3 to 9.", "--temp", "0", "--stats", "--ignore-eos", "-n", "50"]
    r = run(*args, *(["--json"] if as_json else []))
    assert r.exit_code == 130
    stats = [line for line in unpacked(r.stderr).splitlines() if line.startswith("[load")]
    assert len(stats) == 1
    prefill, decode = re.search(r"prefill \d+ tok, ([\d.]+) tok/s \| decode 6 tok, ([\d.]+) tok/s", stats[0]).groups()
    assert float(prefill) > 0 and float(decode) > 0
    if as_json:
        out = json.loads(r.stdout)
        assert out["finish_reason"] == "interrupted" and out["completion_tokens"] == 6
        assert out["text"].startswith("3, 4")
        assert out["timings"]["prefill_tok_per_s"] > 0 and out["timings"]["decode_tok_per_s"] > 0
    else:
        assert r.stdout.startswith("3, 4")


def test_chat_says_when_the_context_cuts_a_reply():
    """A reply stopped by a full context (not by -n, eos or a stop) is reported on stderr, after
    the reply's own line, as generate warns of it up front."""
    r = run("chat", "--ctx", "30", "--temp", "0", input="Count from 3 to 9.\n")
    assert r.exit_code == 0 and r.stdout == "3, 4, 5, 6, 7, \n"
    warning, = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert "context of 30 tokens is full" in warning and "cut after 16 of the 256 tokens" in warning
    r = run("chat", "--ctx", "100", "--temp", "0", input="Count from 3 to 9.\n")
    assert r.exit_code == 0 and r.stdout == "3, 4, 5, 6, 7, 8, 9.\n" and "warning" not in r.stderr


def test_inspect_refuses_a_directory_and_a_different_model_option(tmp_path):
    """`ds2 inspect DIR -m OTHER` names two checkpoints: a usage error, as generate's two prompts
    are, rather than silently reporting on one of them. DS2_MODEL is only a default: DIR wins."""
    from ds2cli.weights.source import bundled_model_dir
    r = run("inspect", str(bundled_model_dir()), "-m", str(tmp_path))
    assert r.exit_code == 2 and "not both" in r.stderr and r.stdout == ""
    r = CliRunner(env={"DS2_MODEL": str(tmp_path)}).invoke(main, ["inspect", "--json", str(bundled_model_dir())])
    assert r.exit_code == 0 and json.loads(r.stdout)["num_hidden_layers"] == 6


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
@pytest.mark.parametrize("args", [["--temperature", "nan"], ["--temp", "inf"], ["--top-p", "nan"],
                                  ["--min-p", "-inf"], ["--repetition-penalty", "nan"], ["--seed", "-5"],
                                  ["--seed", "x"]])
def test_non_finite_values_and_negative_seeds_are_usage_errors(no_loading, command, args):
    r = run(*command, *args)
    assert r.exit_code == 2 and args[0] in r.stderr and "Traceback" not in r.output, r.output


@pytest.mark.slow
def test_seed_minus_one_means_a_random_seed():
    """-1 is "random", as in llama.cpp: two runs differ, where a fixed seed repeats itself."""
    outs = {run("generate", "ROMEO:", "-n", "24", "--temp", "1.5", "--seed", "-1").stdout for _ in range(4)}
    assert len(outs) > 1
    fixed = {run("generate", "ROMEO:", "-n", "24", "--temp", "1.5", "--seed", "7").stdout for _ in range(2)}
    assert len(fixed) == 1


def test_quantize_progress_counts_the_models_layers(tmp_path):
    """ds2-tiny has 6 layers: quantize's progress says 6, not 7 (its last shard, the embeddings
    and lm_head, is said in words once the layers are done)."""
    calls = []
    quantize_checkpoint(bundled_model_dir(), tmp_path / "q8", 8,
                        progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 6) for i in range(1, 7)]
    bar = LoadProgress(label="quantizing", then="the embeddings and lm_head")
    assert bar.text(3, 6) == "3/6 layers"
    assert bar.text(6, 6) == "6/6 layers, now the embeddings and lm_head"


def test_packed_lines_keep_within_the_width_and_unpack_to_one_line():
    from ds2cli.wording import packed, unpacked
    parts = ["[load 0.05s", "prefill 19 tok, 2419.2 tok/s", "decode 16 tok, 381.8 tok/s", "cache 34/275 tok, 65.3 kB]"]
    text = packed(parts)
    assert text.splitlines() == ["[load 0.05s | prefill 19 tok, 2419.2 tok/s | decode 16 tok, 381.8 tok/s",
                                 "  | cache 34/275 tok, 65.3 kB]"]
    assert unpacked(text) == " | ".join(parts) and packed(["a", "b"]) == "a | b"
    assert all(len(line) <= 20 for line in packed(["x" * 10, "y" * 10, "z" * 15], width=20).splitlines())

