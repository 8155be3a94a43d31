"""The tables `ds2 bench` prints, drawn with rich from a report: one run's figures against the
probes (and transformers'), or the formats side by side. Each fits an 80-column terminal: short
cells, a row per figure where one row would not fit, and the words that explain them in a few
short lines below the table."""

from __future__ import annotations

import math

from rich import box
from ds2cli.cli import console
from rich.table import Table

from ds2cli.wording import human_bytes, human_count, plural

PIPED_WIDTH = 1000          # columns for a table on a pipe or in a file: past any row's width


def stdout_console():
    """Rich's console for stdout. On a terminal rich fits the table to its width. Piped, it would
    wrap at 80 columns and split cells over lines that grep and diff then cut apart, so there the
    table takes the width its cells need (a table never widens past them), each row one line."""
    return console.stdout_console(piped_width=PIPED_WIDTH)


def fig(x: float) -> str:
    """A measured figure to three significant figures, whole numbers kept whole: 994.54 -> '995',
    16.84 -> '16.8', 1.234 -> '1.23', 0.0703 -> '0.0703', 1322.05 -> '1322'; never '0.0' for
    a figure that is not 0."""
    if x == 0 or not math.isfinite(x):
        return f"{x:.0f}"
    places = max(0, 2 - math.floor(math.log10(abs(x))))
    if places and math.floor(math.log10(abs(round(x, places)))) > math.floor(math.log10(abs(x))):
        places -= 1                                 # rounded up a digit: 99.96 -> '100', not '100.0'
    return f"{x:.{places}f}"


def pct(share: float) -> str:
    """A share as a percentage: '10%', and below 1% one significant figure ('0.1%'), not '0%'."""
    p = 100 * share
    return f"{p:.0f}%" if p == 0 or abs(p) >= 0.995 else f"{p:.1g}%"


WIDTH = 80                  # the terminal every table fits


def bench_table(title: str, caption: str | None = None) -> Table:
    """No edge columns and no padding at the table's edges: every column of an 80-column
    terminal goes to the cells. A table narrower than its title's or caption's lines widens to
    them (up to 80 columns), so they are not wrapped."""
    lines = [line for text in (title, caption or "") for line in text.splitlines()]
    return Table(title=title, caption=caption, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                 caption_justify="left", collapse_padding=True, min_width=min(WIDTH, max(map(len, lines))))


def model_line(m: dict, weight_bytes: int, form: str) -> str:
    return (f"{plural(m['num_hidden_layers'], 'layer')}, {human_count(m['params'])} params, "
            f"{human_bytes(weight_bytes)} as {form}")


def render(report: dict, out) -> None:
    m = report["model"]
    grid = bench_table(f"ds2 bench: {m['path']}\n{model_line(m, m['weight_bytes'], m['format'])}",
                   "\n".join([machine_line(report["machine"]), *footnotes(report)]))
    for name in ("test", "median", "min", "derived", "vs probe"):
        grid.add_column(name, no_wrap=True, justify="right" if name in ("median", "min") else "left")
    for row in table_rows(report):
        grid.add_row(*row)
    out.print(grid)
    if report.get("profile"):
        out.print()
        render_profile(report["profile"], out)


def footnotes(report: dict) -> list[str]:
    """What the short cells mean, a line each, only for the rows the table has."""
    notes = ["vs probe: the figure's share of the probe re-run beside it"]
    ceiling = report["probes"].get("ceiling")
    if ceiling:
        notes.append(f"ceiling: G weights/s numpy widens + multiplies, {ceiling['cores']} cores at once, "
                     "at most memory's; tg: the run's best so far")
    if report.get("passes"):
        notes.append("pass k @ c: k tokens after c, in decode steps of its repeat (median, range)")
    if any("cores" in r for r in report.get("prefill", []) + report.get("decode", [])):
        notes.append("cores: busy, CPU seconds a second of this process and its helpers; given,\n"
                     "the cores the passes had (at most --threads, fewer while others run)")
    if report.get("compare_hf"):
        notes.append("hf: transformers on the same checkpoint; vs probe: ds2's median over its")
    for d in report.get("decode", []):
        st = d.get("stream")
        if st:
            notes.append(f"tg{d['context']} streamed ({st['slots']} slots): {human_bytes(st['bytes_read_per_token'])} "
                         f"read a token in {st['read_seconds_per_token']:.2f} s of reading; the disk alone "
                         f"{st['disk_gb_per_s']:.2f} GB/s, {st['disk_seconds_per_token']:.2f} s a token, the step "
                         f"{st['step_vs_disk']:.2f}x that; {100 * st['hit_rate']:.0f}% hits, "
                         f"{100 * st['read_ahead_used']:.0f}% of reads ahead used")
    return notes


def render_profile(p: dict, out) -> None:
    """--profile: a decode step's time by where it goes, summing to the step. A long name keeps
    its head in the table ('the rest') and is written out in full below it."""
    notes = [r["what"] for r in p["rows"] if len(r["what"]) > PROFILE_NAME]
    grid = bench_table(f"a decode step after {p['context']} tokens: {fig(1e3 * p['step_s'])} ms "
                   f"(mean of {p['steps']} steps)", "\n".join(notes) or None)
    for name in ("where", "ms", "share", "calls", "G w/s"):
        grid.add_column(name, no_wrap=True, justify="left" if name == "where" else "right")
    for r in p["rows"]:
        grid.add_row(short_name(r["what"]), fig(1e3 * r["per_step_s"]), pct(r["share"]),
                     "" if r["calls_per_step"] is None else f"{r['calls_per_step']:.0f}",
                     fig(r["g_weights_per_s"]) if "g_weights_per_s" in r else "")
    out.print(grid)
    if p.get("numpy_at_step_shapes"):
        out.print()
        render_step_shapes(p, out)


def render_step_shapes(p: dict, out) -> None:
    """Plain NumPy over the step's own matrices, per format, beside the ceiling probe's large
    matrix and ds2's kernels (the profile's product rows)."""
    s = p["numpy_at_step_shapes"]
    ours = {r["what"].removeprefix("products "): r.get("g_weights_per_s") for r in p["rows"]
            if r["what"].startswith("products ")}
    lines = [f"step shapes: the last {s['steps']} steps' own matrices, plain widen + multiply",
             f"on {s['cores']} cores at once, rows split evenly, nothing between products",
             "(bf16: the router's gate too, as in the ceiling)"]
    if "ceiling_tok_per_s" in s:
        lines.append(f"products at these shapes: {fig(1e3 * s['products_s'])} ms a step, "
                     f"{fig(s['ceiling_tok_per_s'])} tok/s; decode {pct(s['ceiling_share'])} of it")
    grid = bench_table("G weights/s: the ceiling probe, numpy at this step's shapes, ds2", "\n".join(lines))
    for name in ("format", "weights/step", "probe", "step shapes", "ds2 kernels"):
        grid.add_column(name, no_wrap=True, justify="left" if name == "format" else "right")
    probe = s.get("probe_g_weights_per_s", {})
    for fmt, f in s["by_format"].items():
        grid.add_row(fmt, human_count(f["values_per_step"]), fig(probe[fmt]) if fmt in probe else "",
                     fig(f["g_weights_per_s"]), fig(ours[fmt]) if ours.get(fmt) else "")
    out.print(grid)


PROFILE_NAME = 40           # a --profile row's name past this is cut to its head


def short_name(what: str) -> str:
    """'the rest: Python between them (...)' -> 'the rest'; a name that fits is left whole."""
    if len(what) <= PROFILE_NAME:
        return what
    for mark in (":", " ("):
        if mark in what:
            return what.split(mark, 1)[0]
    return what[:PROFILE_NAME - 3] + "..."


def stat_cells(s: dict) -> list[str]:
    return [fig(s["median"]), fig(s["min"])]


def cores_row(name: str, point: dict) -> list[list[str]]:
    """A measurement's cores (cli/cores_used.py): busy, and given where a machine counted them."""
    if "cores" not in point:
        return []
    c = point["cores"]
    given = "" if c["given"] is None else f" of {c['given']['min']}" + (
        f"-{c['given']['max']}" if c["given"]["max"] != c["given"]["min"] else "") + " given"
    return [[f"{name} cores", "", "", f"{fig(c['busy'])} busy{given}", ""]]


def table_rows(report: dict) -> list[list[str]]:
    """The rows of the table, each five cells: test, median, min, derived, vs probe."""
    p = report["probes"]
    rows = [["matvec GB/s", *stat_cells(p["matvec"]["gb_per_s"]), "{}x{} float32".format(*p["matvec"]["shape"]), ""]]
    rows += [[f"gemm {name} GFLOP/s", *stat_cells(g["gflop_per_s"]), "{}x{}x{}".format(*g["shape"]), ""]
             for name, g in p["gemm"].items()]
    ceiling = p.get("ceiling")
    if ceiling:
        rows += [[f"ceiling {f} G w/s", "", "", fig(s), ""] for f, s in ceiling["g_weights_per_s"].items()]
    rows.append(["load s", *stat_cells(report["load_s"]), "", ""])
    for r in report["prefill"]:
        beside = r["probes"]
        rows.append([f"pp{r['tokens']} tok/s", *stat_cells(r["tok_per_s"]), f"{fig(r['gflop_per_s']['median'])} GFLOP/s",
                     f"{pct(r['gemm_ratio'])} of {fig(beside['gemm_gflop_per_s']['median'])}"])
        rows.append([f"pp{r['tokens']} weights", "", "", f"{fig(r['weight_gb_per_s'])} GB/s",
                     f"{pct(r['matvec_ratio'])} of {fig(beside['matvec_gb_per_s']['median'])}"])
        rows += cores_row(f"pp{r['tokens']}", r)
    for r in report["decode"]:
        rows.append([f"tg @ {r['context']} tok/s", *stat_cells(r["tok_per_s"]),
                     f"{human_bytes(r['bytes_per_token'])}/tok, {fig(r['gb_per_s'])} GB/s",
                     f"{pct(r['matvec_ratio'])} of {fig(r['probes']['matvec_gb_per_s']['median'])}"])
        if "ceiling_share" in r:
            rows.append([f"tg @ {r['context']} ceiling", "", "", f"{fig(r['ceiling_tok_per_s'])} tok/s",
                         f"{pct(r['ceiling_share'])} of it"])
        rows += cores_row(f"tg @ {r['context']}", r)
    for r in report.get("passes", []):
        ratio = r["step_ratio"]
        rows.append([f"pass {r['tokens']} @ {r['context']} ms", *stat_cells({k: 1e3 * r["pass_s"][k] for k in ("median", "min")}),
                     f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})", ""])
        rows.append([f"pass {r['tokens']} @ {r['context']} reads", "", "",
                     f"{human_bytes(r['weight_bytes'])}, {r['routed_experts_per_layer']:.1f} exp/layer", ""])
    rows += cores_row("passes", report["passes"][0]) if report.get("passes") else []
    mem = report["memory"]
    rows.append(["peak RSS", human_bytes(mem["peak_rss_bytes"]), "", f"{mem['rss_ratio']:.2f}x weights + cache", ""])
    rows.append(["weights + cache", "", "", f"{human_bytes(mem['weight_bytes'])} + {human_bytes(mem['cache_bytes'])}", ""])
    return rows + hf_rows(report)


def hf_rows(report: dict) -> list[list[str]]:
    """transformers' figures beside ds2's: the last column is ds2's median over transformers'."""
    hf = report.get("compare_hf")
    if not hf:
        return []
    ours = {("pp", r["tokens"]): r for r in report["prefill"]} | {("tg", r["context"]): r for r in report["decode"]}
    rows = []
    for kind, key, runs in (("pp", "tokens", hf["prefill"]), ("tg", "context", hf["decode"])):
        for r in runs:
            name = f"hf pp{r[key]}" if kind == "pp" else f"hf tg @ {r[key]}"
            mine = ours[(kind, r[key])]["tok_per_s"]["median"]
            rows.append([f"{name} tok/s", *stat_cells(r["tok_per_s"]), f"transformers {hf['transformers']}",
                         f"ds2 {mine / r['tok_per_s']['median']:.2f}x"])
    return rows


def render_formats(report: dict, out) -> None:
    comparison = report["comparison"]
    paired = (report.get("side_by_side") or {}).get("rows", {})
    first = next(iter(report["formats"].values()))[0]
    m = first["model"]
    notes = [machine_line(first["machine"]),
             f"medians of {next(iter(comparison.values()))['rounds']} rounds, each running every format in "
             "its own process, in turn",
             "ratio: this format / the first within each round, median (range)"]
    if paired:
        notes += [f"tok/s side by side: medians of {report['side_by_side']['samples']} samples of every format "
                  "in one process", "(interleaved), the ratios taken within each sample"]
    notes.append("peak RSS / f32: the highest peak RSS over the float32 weights' bytes")
    grid = bench_table(f"ds2 bench --formats: {m['path']}\n{model_line(m, m['float32_weight_bytes'], 'float32')}",
                   "\n".join(notes))
    grid.add_column("test", no_wrap=True)
    for name in comparison:
        grid.add_column(name, justify="right", no_wrap=True)
        if name != next(iter(comparison)):
            grid.add_column("ratio", justify="right", no_wrap=True)
    for row in next(iter(comparison.values()))["figures"]:
        cells = [row]
        for k, (name, c) in enumerate(comparison.items()):
            cells.append(fig(paired[row][name]["tok_per_s"]["median"] if row in paired else c["figures"][row]))
            if k:
                ratio, lo_hi = ((paired[row][name]["ratio"], paired[row][name]["ratio_range"]) if row in paired
                                else (c["ratios"][row], c["ratio_range"][row]))
                cells.append("-" if ratio is None else f"{ratio:.2f}x ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})")
        grid.add_row(*cells)
    cells = ["peak RSS / f32"]
    for k, c in enumerate(comparison.values()):
        cells += [f"{c['rss_vs_float32_weights']:.2f}x"] + ([""] if k else [])
    grid.add_row(*cells)
    out.print(grid)


def machine_line(machine: dict) -> str:
    blas = [f"{lib['internal_api']} {lib['version']} ({lib['num_threads']} threads)"
            for lib in machine["blas"] or [] if lib.get("user_api") == "blas"]
    return (f"{machine['cpus_usable']} of {machine['cpu_count']} CPUs, numpy {machine['numpy']}"
            + (", " + ", ".join(blas) if blas else ""))
