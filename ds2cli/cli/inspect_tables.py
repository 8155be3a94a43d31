"""`ds2 inspect`'s report (inspect_report.py) as rich tables: formatting only, every figure comes from
the report."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ds2cli.cli.inspect_report import PARAM_CATEGORIES
from ds2cli.wording import human_bytes, human_count, plural


# The tables' words for config.json's fields (--json keeps the field names verbatim).
YARN_WORDS = {"factor": "yarn factor", "original_max_position_embeddings": "yarn original context",
              "beta_fast": "yarn beta fast", "beta_slow": "yarn beta slow", "mscale": "yarn mscale",
              "mscale_all_dim": "yarn mscale, all dims"}
MLA_WORDS = {"q_lora_rank": "query latent rank", "kv_lora_rank": "key-value latent rank",
             "qk_nope_head_dim": "head dim without RoPE", "qk_rope_head_dim": "head dim with RoPE",
             "q_head_dim": "query head dim", "v_head_dim": "value head dim"}
MOE_WORDS = {"router": "router", "n_routed_experts": "routed experts", "n_shared_experts": "shared experts",
             "num_experts_per_tok": "experts per token", "topk_method": None,   # the router row says it
             "n_group": "expert groups", "topk_group": "groups per token",
             "norm_topk_prob": "weights renormalised", "routed_scaling_factor": "routed output scale",
             "moe_intermediate_size": "expert hidden size", "intermediate_size": "dense MLP hidden size",
             "first_k_dense_replace": "dense layers first", "moe_layer_freq": "MoE every nth layer",
             "moe_layers": "MoE layers", "dense_layers": "dense layers"}


def _words(section: dict, words: dict[str, str]) -> list[tuple[str, object]]:
    """A section's rows, each field in words (a field without words: its name, spaced; one whose
    words are None: left out, another row says it)."""
    return [(words.get(k, k.replace("_", " ")), v) for k, v in section.items() if words.get(k, k) is not None]


def _show(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return ", ".join(map(str, value)) if value else "none"
    return str(value)


def _kv_table(title: str, rows: list[tuple[str, object]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")           # a long value wraps; it is never cut
    for key, value in rows:
        table.add_row(key, value if isinstance(value, str) else _show(value))
    return table


def _model_table(r: dict) -> Table:
    m = r["model"]
    rows = [("type", m["type"]), ("family", m["family"]), ("layers", m["layers"]),
            ("hidden size", m["hidden_size"]), ("attention heads", m["heads"]),
            ("vocabulary", m["vocab_size"]), ("context length", m["context_length"]),
            ("rope theta", m["rope_theta"]), ("tied embeddings", m["tie_word_embeddings"])]
    rs = m["rope_scaling"]
    rows += [(YARN_WORDS.get(k, f"yarn {k}"), v) for k, v in rs.items() if k != "type"] if rs \
        else [("rope scaling", "none")]
    return _kv_table("Model", rows + [("softmax scale", m["softmax_scale"])])


def _moe_table(r: dict) -> Table:
    m = r["moe"]
    if not m["n_routed_experts"]:
        return _kv_table("MoE", [("experts", "none (dense model)"),
                                 (MOE_WORDS["intermediate_size"], m["intermediate_size"])])
    return _kv_table("MoE", _words(m, MOE_WORDS))


def _v3_table(r: dict) -> Table | None:
    """fp8 storage and MTP layers, for a checkpoint that has either."""
    f, m = r["fp8"], r["mtp"]
    rows = []
    if f:
        size = f["weight_block_size"]           # as config.json gives it: checked against the tensors
        block = ("x".join(map(str, size)) if isinstance(size, list) else _show(size)) or "-"
        rows += [("fp8 weights", f"{f['fmt']}, {block} blocks: {human_count(f['params'])} params "
                                 f"in {f['tensors']} tensors"),
                 ("fp8 scales", f"{f['scale_tensors']} weight_scale_inv ({human_bytes(f['scale_bytes'])})"),
                 ("fp8 at load", f["dequantized_to"])]
    if m["tensors"]:
        rows.append(("MTP layers (ignored)", f"{_show(m['layers'])}: {human_count(m['params'])} params "
                                             f"in {m['tensors']} tensors ({human_bytes(m['bytes'])}), not loaded"))
    return _kv_table("DeepSeek-V3 storage", rows) if rows else None


def _params_table(r: dict) -> Table:
    """The stored categories, which add up to the total; then, apart, what one token uses."""
    p = r["params_by_category"]
    table = Table(title="Parameters", title_justify="left")
    table.add_column("category", style="bold")
    table.add_column("params", justify="right")
    table.add_column("count", justify="right")
    for key in PARAM_CATEGORIES:
        if p[key] or key in ("embeddings", "lm_head"):
            label = key.replace("_", " ")
            if key == "lm_head" and p["tie_word_embeddings"]:
                label += " (tied: the embedding matrix)"
            table.add_row(label, human_count(p[key]), f"{p[key]:,}")
    table.add_section()
    table.add_row("total", human_count(p["total"]), f"{p['total']:,}", style="bold")
    table.add_section()
    table.add_row("active per token", human_count(p["active_per_token"]),
                  f"{p['active_per_token']:,}", style="bold")
    if p["routed_experts"]:
        table.add_row("  of which routed experts", human_count(p["routed_experts_active"]),
                      f"{p['routed_experts_active']:,}")
    return table


def _storage_table(r: dict, max_files: int = 8) -> Table:
    s = r["storage"]
    table = Table(title="Storage", title_justify="left")
    table.add_column("file / dtype", style="bold")
    table.add_column("params", justify="right")
    table.add_column("size", justify="right")
    for f in s["files"][:max_files]:
        table.add_row(f["name"], "", human_bytes(f["bytes"]))
    if len(s["files"]) > max_files:
        table.add_row(f"... and {len(s['files']) - max_files} more files", "", "")
    for dtype, d in s["dtypes"].items():        # scales hold no parameters: "-"
        table.add_row(dtype, human_count(d["params"]) if d["params"] else "-", human_bytes(d["bytes"]))
    table.add_row(f"total ({plural(len(s['files']), 'file')}, {plural(s['n_tensors'], 'tensor')})", "",
                  human_bytes(s["total_bytes"]), style="bold")
    return table


def _fits(form: dict) -> str:
    return "" if form["fits"] is None else " (fits now)" if form["fits"] else " (does NOT fit now)"


def _memory_table(r: dict) -> Table:
    forms = [(f"{f['format']}: weights, RAM at {f['context']} tokens",
              f"{human_bytes(f['weight_bytes'])}, {human_bytes(f['ram_bytes'])}{_fits(f)}")
             for f in r["memory"]["formats"]]
    return _kv_table("Memory", forms + _memory_rows(r["memory"]))


def _memory_rows(m: dict) -> list[tuple[str, str]]:
    """The rows under the forms, a checkpoint's and a GGUF file's alike: memory now, the caches."""
    n = m["context_length"]
    available = m["formats"][0]["available_bytes"] if m["formats"] else None
    return [
        ("available now", "unknown" if available is None else human_bytes(available)),
        ("latent cache per token", human_bytes(m["latent_cache_bytes_per_token"])),
        ("MHA cache per token", human_bytes(m["mha_cache_bytes_per_token"])),
        ("MHA / latent", f"{m['mha_to_latent_ratio']:.1f}x"),
        (f"latent cache at {n} tokens", human_bytes(m["latent_cache_bytes_at_context"])),
        (f"MHA cache at {n} tokens", human_bytes(m["mha_cache_bytes_at_context"]))] + _streaming_rows(m)


def _streaming_rows(m: dict) -> list[tuple[str, str]]:
    """--memory-budget: each streamable form's resident part beside the whole and the least
    budget that runs it; the experts a budget caches when one was given, or when the whole does
    not fit the memory available (the budget is then that memory)."""
    rows = []
    for f in m.get("streaming", []):
        name = f"streamed, {f['format']}" + (" copy" if f["command"] else "") + f" at {f['context']} tokens"
        text = (f"resident {human_bytes(f['resident_bytes'])} of {human_bytes(f['ram_bytes'])}: "
                f"--memory-budget {f['least_budget']} at least")
        budget, cached = f["budget_bytes"], f["cached_experts"]
        if budget is not None and (f["budget_given"] or budget < f["ram_bytes"]):
            text += f"; {human_bytes(budget)}" + ("" if f["budget_given"] else " (available)") + (
                " is below that" if cached is None else f" caches {cached:,} of {f['experts']:,} experts")
        rows.append((name, text))
    return rows


def _tokenizer_table(r: dict) -> Table:
    t = r["tokenizer"]
    if not (t["tokenizer_json"] or t["tokenizer_config"] or t["kind"] != "tokenizer.json"):
        return _kv_table("Tokenizer", [("files", "absent (no tokenizer.json, tokenizer_config.json)")])
    return _kv_table("Tokenizer", [
        ("read from", t["kind"]),
        ("tokenizer.json", "present" if t["tokenizer_json"] else "absent"),
        ("tokenizer_config.json", "present" if t["tokenizer_config"] else "absent"),
        ("vocabulary", t["vocab_size"]),
        ("bos", f"{t['bos_token']} ({_show(t['bos_token_id'])})" if t["bos_token"] else "-"),
        ("eos", f"{t['eos_token']} ({_show(t['eos_token_id'])})" if t["eos_token"] else "-"),
        ("add bos token", t["add_bos_token"]),
        ("chat template", t["chat_template"]),
        ("generation_config.json", "present" if t.get("generation_config") else "absent"),
        ("eos ids (generation_config)", t["generation_eos_token_ids"] if t.get("generation_config") else "-"),
        ("eos ids (config)", t["config_eos_token_ids"])])


def _format_words(spec: dict) -> str:
    """A storage format in words: what a weight is stored as, and its scales."""
    if spec.get("scale_value") == 1:        # stored as the values themselves: nothing to scale
        return f"{spec['qweight']} values, unscaled"
    what = f"{spec['bits']}-bit integers, a {spec['scales']} scale"
    if spec["scale_group"] == "row":
        return f"{what} per output row"
    if spec["scale_group"] == "block":
        return f"{what} per {spec['block_size']} inputs of a row"
    return f"{what} per {spec['group_size']} output rows of a column"


def _gguf_tables(r: dict) -> list:
    files = ", ".join(r["files"])
    tables = [_kv_table("GGUF", [("files", files), ("architecture", r["architecture"]), ("name", r["name"]),
                                 ("tensors", r["n_tensors"]), ("size", human_bytes(r["file_bytes"]))])]
    types = Table(title="Tensor types", title_justify="left")
    for column in ("type", "tensors", "params", "size"):
        types.add_column(column, justify="left" if column == "type" else "right")
    for name, d in r["tensor_types"].items():
        types.add_row(name, str(d["tensors"]), human_count(d["params"]), human_bytes(d["bytes"]))
    tables.append(types)
    if "model" in r:
        tables += [_model_table(r), _kv_table("MLA", _words(r["mla"], MLA_WORDS)),
                   _moe_table(r),
                   _gguf_memory_table(r)]
    t = r["tokenizer"]
    tables.append(_kv_table("Tokenizer (tokenizer.ggml.*)", [
        ("model / pre", f"{t['model']} / {t['pre']}"), ("tokens", t["tokens"]),
        ("bos id", _show(t["bos_token_id"])), ("eos id", _show(t["eos_token_id"])),
        ("add bos token", _show(t["add_bos_token"])), ("chat template", t["chat_template"])]))
    return tables


def _gguf_memory_table(r: dict) -> Table:
    """The forms a GGUF loads in, each with the option that picks it; then a checkpoint's rows."""
    forms = r["memory"]["formats"]
    context = f"; RAM at {forms[0]['context']} tokens" if forms else ""
    return _kv_table(f"Memory (ds2 converts the blocks at load{context})", [
        ("bulk type", r["bulk_type"]),
        *((f"{f['format']} ({f['option']}{', default' if f['default'] else ''})",
           f"weights {human_bytes(f['weight_bytes'])}, RAM {human_bytes(f['ram_bytes'])}{_fits(f)}")
          for f in forms),
        *_memory_rows(r["memory"])])


def render(report: dict, console: Console) -> None:
    """One table per section, then the problems in red. Warnings are left to the caller
    (`ds2 inspect` prints them to stderr), so they are not printed twice."""
    if report.get("format") == "gguf":
        tables = _gguf_tables(report)
    else:
        tables = _checkpoint_tables(report)
    # the path on a line of its own, never cut to fit a table's column
    console.print(f"checkpoint {report['path']}", soft_wrap=True, markup=False, highlight=False)
    for table in tables:
        if table is not None:
            console.print(table)
    if report.get("check"):
        console.print(check_line(report["check"]), markup=False, highlight=False)
    if report["problems"]:
        console.print(f"{plural(len(report['problems']), 'problem')}:", style="bold red", highlight=False)
    for problem in report["problems"]:
        console.print(f"  {problem}", style="red", markup=False, highlight=False)


def _checkpoint_tables(report: dict) -> list:
    tables = [_model_table(report), _kv_table("MLA", _words(report["mla"], MLA_WORDS)), _moe_table(report), _v3_table(report),
              _params_table(report), _storage_table(report), _memory_table(report), _tokenizer_table(report)]
    if report["quantization"]:
        q = report["quantization"]
        tables.insert(6, _kv_table("Quantization (ds2)", [
            ("bits", q["bits"]),
            *((f"{name} weights", _format_words(spec)) for name, spec in q["format_specs"].items()),
            *((role.replace("_", " "), fmt) for role, fmt in q["formats"].items()),
            ("bytes on disk", human_bytes(q["file_bytes"]))]))
    return tables


def check_line(check: dict) -> str:
    """--check's result in one line, so that a clean scan is seen to have run."""
    found = (f"{plural(check['nonfinite_tensors'], 'tensor')} with NaN or Inf (listed below)"
             if check["nonfinite_tensors"] else "all finite")
    stopped = "; then a tensor could not be read (below), the scan stopped there" if check["stopped"] else ""
    return f"check: {check['tensors_read']:,} floating-point tensors read, {found}{stopped}"
