"""The tables `ds2 bench` prints, drawn with rich from a report: one run's figures against the
probes (and transformers'), or the formats side by side."""

from __future__ import annotations

from rich import box
from ds2cli.cli import console
from rich.table import Table

PIPED_WIDTH = 1000          # columns for a table on a pipe or in a file: past any row's width


def stdout_console():
    """Rich's console for stdout. On a terminal rich fits the table to its width. Piped, it would
    wrap at 80 columns and split cells over lines that grep and diff then cut apart, so there the
    table takes the width its cells need (a table never widens past them), each row one line."""
    return console.stdout_console(piped_width=PIPED_WIDTH)


def render(report: dict, out) -> None:
    m = report["model"]
    table = Table(title=f"ds2 bench: {m['path']}\n{m['num_hidden_layers']} layers, "
                        f"{m['params'] / 1e9:.2f} B params, {m['weight_bytes'] / 1e9:.2f} GB as {m['format']}",
                  caption=machine_line(report["machine"]), box=box.SIMPLE_HEAD)
    for name in ("test", "median", "min", "derived", "vs probe beside it"):
        table.add_column(name, no_wrap=name == "test", justify="right" if name in ("median", "min") else "left")
    for row in table_rows(report):
        table.add_row(*row)
    out.print(table)
    if report.get("profile"):
        render_profile(report["profile"], out)


def render_profile(p: dict, out) -> None:
    """--profile: a decode step's time by where it goes, summing to the step."""
    table = Table(title=f"a decode step after {p['context']} tokens: {1e3 * p['step_s']:.1f} ms "
                        f"(mean of {p['steps']} steps)", box=box.SIMPLE_HEAD)
    for name in ("where", "ms", "share", "calls"):
        table.add_column(name, justify="left" if name == "where" else "right")
    for r in p["rows"]:
        table.add_row(r["what"], f"{1e3 * r['per_step_s']:.2f}", f"{r['share']:.0%}",
                      "" if r["calls_per_step"] is None else f"{r['calls_per_step']:.0f}")
    out.print(table)


def stat_cells(s: dict, fmt: str) -> list[str]:
    return [format(s["median"], fmt), format(s["min"], fmt)]


def table_rows(report: dict) -> list[list[str]]:
    p = report["probes"]
    rows = [["matvec GB/s", *stat_cells(p["matvec"]["gb_per_s"], ".1f"),
             "{}x{} float32".format(*p["matvec"]["shape"]), ""]]
    rows += [[f"gemm {name} GFLOP/s", *stat_cells(g["gflop_per_s"], ".1f"), "{}x{}x{}".format(*g["shape"]), ""]
             for name, g in p["gemm"].items()]
    rows.append(["load s", *stat_cells(report["load_s"], ".2f"), "", ""])
    rows += [[f"pp{r['tokens']} tok/s", *stat_cells(r["tok_per_s"], ".2f"),
              f"{r['gflop_per_s']['median']:.1f} GFLOP/s, {r['weight_gb_per_s']:.1f} GB/s",
              f"{r['gemm_ratio']:.0%} of {r['probes']['gemm_gflop_per_s']['median']:.0f} GFLOP/s, "
              f"{r['matvec_ratio']:.0%} of {r['probes']['matvec_gb_per_s']['median']:.1f} GB/s"]
             for r in report["prefill"]]
    ceiling = p.get("ceiling")
    if ceiling:
        rows.append(["numpy ceiling G w/s", "", "", ", ".join(f"{f} {s:.1f}"
                                                              for f, s in ceiling["g_weights_per_s"].items()),
                     f"widen + multiply: one core x {ceiling['cores']}, at most memory's"])
    rows += [[f"tg @ {r['context']} tok/s", *stat_cells(r["tok_per_s"], ".2f"),
              f"{r['bytes_per_token'] / 1e6:.0f} MB/tok, {r['gb_per_s']:.1f} GB/s",
              f"{r['matvec_ratio']:.0%} of {r['probes']['matvec_gb_per_s']['median']:.1f} GB/s"
              + (f"; {r['ceiling_share']:.0%} of ceiling {r['ceiling_tok_per_s']:.2f} tok/s"
                 if "ceiling_share" in r else "")]
             for r in report["decode"]]
    rows += [[f"pass of {r['tokens']} @ {r['context']} ms", *stat_cells({k: 1e3 * r["pass_s"][k] for k in ("median", "min")}, ".1f"),
              f"{r['step_ratio']['median']:.2f}x a decode step ({r['step_ratio']['min']:.2f}-{r['step_ratio']['max']:.2f})",
              f"{r['routed_experts_per_layer']:.1f} experts/layer, {r['weight_bytes'] / 1e6:.0f} MB"]
             for r in report.get("passes", [])]
    mem = report["memory"]
    rows.append(["peak RSS GB", f"{mem['peak_rss_bytes'] / 1e9:.2f}", "",
                 f"weights {mem['weight_bytes'] / 1e9:.2f} + cache {mem['cache_bytes'] / 1e9:.2f}",
                 f"{mem['rss_ratio']:.2f}x those"])
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
            rows.append([f"{name} tok/s", *stat_cells(r["tok_per_s"], ".2f"), f"transformers {hf['transformers']}",
                         f"ds2 {mine / r['tok_per_s']['median']:.2f}x"])
    return rows


def render_formats(report: dict, out) -> None:
    comparison = report["comparison"]
    paired = (report.get("side_by_side") or {}).get("rows", {})
    first = next(iter(report["formats"].values()))[0]
    m = first["model"]
    table = Table(title=f"ds2 bench --formats: {m['path']}\n{m['num_hidden_layers']} layers, "
                        f"{m['params'] / 1e9:.2f} B params, {m['float32_weight_bytes'] / 1e9:.2f} GB as float32",
                  caption=machine_line(first["machine"]) + f"; medians of {next(iter(comparison.values()))['rounds']} "
                          "rounds, each running every format in its own process, in turn; ratio = this format "
                          "/ the first (median, and range), within each round" + (
                              f"; speed rows side by side: medians of {report['side_by_side']['samples']} "
                              "samples of every format interleaved in one process, each ratio within a sample"
                              if paired else ""),
                  box=box.SIMPLE_HEAD)
    table.add_column("test", no_wrap=True)
    for name in comparison:
        table.add_column(name, justify="right")
        if name != next(iter(comparison)):
            table.add_column("ratio", justify="right")
    for row in next(iter(comparison.values()))["figures"]:
        cells = [row]
        for k, (name, c) in enumerate(comparison.items()):
            cells.append(f"{paired[row][name]['tok_per_s']['median'] if row in paired else c['figures'][row]:.2f}")
            if k:
                ratio, lo_hi = ((paired[row][name]["ratio"], paired[row][name]["ratio_range"]) if row in paired
                                else (c["ratios"][row], c["ratio_range"][row]))
                cells.append("-" if ratio is None else f"{ratio:.2f}x ({lo_hi[0]:.2f}-{lo_hi[1]:.2f})")
        table.add_row(*cells)
    cells = ["peak RSS / f32 weights"]
    for k, c in enumerate(comparison.values()):
        cells += [f"{c['rss_vs_float32_weights']:.2f}x"] + ([""] if k else [])
    table.add_row(*cells)
    out.print(table)


def machine_line(machine: dict) -> str:
    blas = [f"{lib['internal_api']} {lib['version']} ({lib['num_threads']} threads)"
            for lib in machine["blas"] or [] if lib.get("user_api") == "blas"]
    return (f"{machine['cpus_usable']} of {machine['cpu_count']} CPUs, numpy {machine['numpy']}"
            + (", " + ", ".join(blas) if blas else ""))
