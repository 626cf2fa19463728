#!/usr/bin/env python3
"""The GPU speed targets against what a GPU campaign (benchmarks/gpu_campaign.sh) measured.

Reads every phase folder under DIR (the whole campaign, some phases, or runs of single steps
copied into subfolders), writes DIR/summary.md and prints it: the run's environment,
each step's exit code and time, and one row per target with the measured value, the goal and
whether it was met.

    python benchmarks/campaign_report.py /tmp/gpu_campaign
"""

import argparse
import glob
import json
import os
import statistics
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pycls.core.logging import load_json_stats  # noqa: E402

MET, MISSED, NONE, UNREACHED = "met", "NOT met", "not measured", "not reached"
# The speed targets (BENCHMARKS.md states them). A goal that depends on the card is a dict by
# card ("H100", "H200": the first of them in env.txt's GPU name; another card is judged by the
# H100's goal, and the row says so); STRETCH holds the goals beyond them.
GOALS = {
    "b16_mfu": {"H100": 0.40, "H200": 0.44},
    "b16_vs_torchvision": 1.2,
    "b16_vs_timm": 1.15,
    "h14_mfu": {"H100": 0.44, "H200": 0.47},
    "optim_floor": 1.3,
    "float8_h14": {"H100": 1.0, "H200": 1.1},
    "float8_l16": 1.0,
    "lever_win": 1.03,
    "loader_vs_b16": 2.0,
    "amp_points": 1.0,
    "amp_o3_points": 3.0,
    "b16_keep_half": 1.7,
    "b16_keep_quarter": 3.0,
    "packed_vs_padded": 1.3,
}
STRETCH = {
    "b16_mfu": {"H100": 0.45},
    "b16_vs_torchvision": 1.3,
    "b16_vs_timm": 1.25,
    "h14_mfu": 0.55,
    "optim_floor": 1.15,
    "float8_l16": 1.15,
}
CARDS = ("H200", "H100")
MAX_GRAPHS = 2  # a lever counts when every block compiled into at most this many graphs


def card_of(root):
    """ "H100" or "H200" from the GPU named in the first env.txt below root, else None."""
    for path in find(root, "env.txt"):
        with open(path) as f:
            gpu = next((line for line in f if line.startswith("gpu: ")), "")
        for card in CARDS:
            if card in gpu:
                return card
    return None


def goal_of(key, card=None, table=GOALS):
    """The goal of a target on this card (the H100's where the card is another or unknown);
    None where ``table`` has none."""
    value = table.get(key)
    if isinstance(value, dict):
        return value.get(card, value.get("H100"))
    return value


def find(root, pattern):
    """Paths matching ``pattern`` in any folder under root (phase folders, and the results of
    later runs copied below them), sorted."""
    return sorted(glob.glob(os.path.join(root, "**", pattern), recursive=True))


def stats_of(root, pattern, kind):
    """json_stats dicts of ``_type`` kind from the stdout.log files matching pattern."""
    out = []
    for path in find(root, pattern):
        out += [s for s in load_json_stats(path) if s.get("_type") == kind]
    return out


def bench_rows(root, name):
    """Rows of benchmarks/vs_libraries.py's benchmark.json in a step folder."""
    rows = []
    for path in find(root, f"{name}/benchmark.json"):
        with open(path) as f:
            rows += json.load(f)["rows"]
    return rows


def library_of(row_name):
    return row_name.split()[0]  # "torchvision ...", "timm ...", "pycls ..."


def best_by_library(rows):
    """{library: its fastest row} over the libraries tables (ablation rows are pycls too)."""
    best = {}
    for r in rows:
        if r["table"] == "ablation" or "images_per_sec" not in r:
            continue
        lib = library_of(r["name"])
        if lib not in best or r["images_per_sec"] > best[lib]["images_per_sec"]:
            best[lib] = r
    return best


def check(value, goal, at_most=False, stretch=None, missing=NONE):
    """met / NOT met (/ missing when there is no value); "met, stretch met" beyond the stretch
    goal."""
    if value is None:
        return missing
    beats = (lambda g: value <= g) if at_most else (lambda g: value >= g)
    if not beats(goal):
        return MISSED
    return f"{MET}, stretch met" if stretch is not None and beats(stretch) else MET


def pct(x):
    return "—" if x is None else f"{x:.1%}"


def pytest_results(root):
    """(passed, failed, skipped, {test name: outcome}) from the junit xml files."""
    outcomes = {}
    for path in find(root, "pytest_gpu.xml"):
        for case in ET.parse(path).getroot().iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            tags = {child.tag for child in case}
            outcome = "failed" if tags & {"failure", "error"} else "passed"
            outcomes[name] = "skipped" if "skipped" in tags else outcome
    count = lambda o: sum(v == o for v in outcomes.values())  # noqa: E731
    return count("passed"), count("failed"), count("skipped"), outcomes


def amp_accuracy(root):
    """{"O1/bfloat16": top-1 % of the last test_epoch} of the quickstart runs."""
    acc = {}
    for path in find(root, "amp/*/stdout.log"):
        tests = [s for s in load_json_stats(path) if s.get("_type") == "test_epoch"]
        if tests:
            key = os.path.basename(os.path.dirname(path)).replace("_", "/", 1)
            acc[key] = 100.0 - tests[-1]["top1_err"]
    return acc


def loader_rows(root):
    """(data, where, best images/s over the worker counts) of the loader table(s)."""
    rows = []
    for path in find(root, "loader.md"):
        with open(path) as f:
            for line in f:
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) < 5 or not cells[0] or cells[0] in ("data", "---"):
                    continue
                speeds = [float(c) for c in cells[4:] if c.replace(".", "", 1).isdigit()]
                if speeds:
                    rows.append((cells[0], cells[1], max(speeds)))
    return rows


def targets(root):
    """[(target, measured, goal, status)] for every GPU speed target."""
    out = []
    passed, failed, skipped, outcomes = pytest_results(root)
    ran = passed + failed
    out.append((
        "pytest -m gpu", f"{passed} passed, {failed} failed, {skipped} skipped", "no failure",
        NONE if not ran else (MET if not failed else MISSED),
    ))  # fmt: skip
    sync = {k: v for k, v in outcomes.items() if "test_training_steps_do_not_synchronise" in k}
    sync_ran = [v for v in sync.values() if v != "skipped"]
    out.append((
        "no host-device sync in 20 steps (bf16 O1/O2/O3)",
        ", ".join(f"{k.split('[')[-1].rstrip(']')}: {v}" for k, v in sorted(sync.items())) or "—",
        "all pass", NONE if not sync_ran else (MET if all(v == "passed" for v in sync_ran)
                                               else MISSED),
    ))  # fmt: skip

    card = card_of(root)
    b16 = bench_rows(root, "bench_b16")
    best = best_by_library(b16)
    time_b16 = stats_of(root, "time_b16/stdout.log", "iter_times")
    mfus = [r["mfu"] for r in b16 if library_of(r["name"]) == "pycls" and r.get("mfu")]
    mfus += [s["mfu"] for s in time_b16 if s.get("mfu")]
    b16_mfu = max(mfus) if mfus else None
    g = goal_of("b16_mfu", card)
    out.append(("ViT-B/16 MFU (datasheet peak)", pct(b16_mfu), f">= {g:.0%}",
                check(b16_mfu, g)))  # fmt: skip
    vs_mm = [s["mfu_vs_matmul"] for s in time_b16 if s.get("mfu_vs_matmul")]
    out.append(("ViT-B/16 vs measured 8192^3 matmul", pct(max(vs_mm) if vs_mm else None),
                "(reported)", "—"))  # fmt: skip
    pycls_best = best.get("pycls")
    for lib, goal in (("torchvision", "b16_vs_torchvision"), ("timm", "b16_vs_timm")):
        other = best.get(lib)
        ratio = None
        if pycls_best and other:
            ratio = pycls_best["images_per_sec"] / other["images_per_sec"]
        detail = (
            "—"
            if ratio is None
            else (
                f"{ratio:.2f}x ({pycls_best['images_per_sec']:.0f} vs "
                f"{other['images_per_sec']:.0f} img/s: {other['name']})"
            )
        )
        out.append((f"ViT-B/16 images/s vs {lib} (each at its best)", detail,
                    f">= {GOALS[goal]:.2f}x", check(ratio, GOALS[goal])))  # fmt: skip

    h14 = bench_rows(root, "bench_h14")
    h_mfus = [r["mfu"] for r in h14 if library_of(r["name"]) == "pycls" and r.get("mfu")]
    h_mfus += [
        s["mfu"] for s in stats_of(root, "time_h14/stdout.log", "iter_times") if s.get("mfu")
    ]
    h14_mfu = max(h_mfus) if h_mfus else None
    g = goal_of("h14_mfu", card)
    out.append(("ViT-H/14 MFU", pct(h14_mfu), f">= {g:.0%}", check(h14_mfu, g)))

    optim = {s["optimizer"]: s for s in stats_of(root, "peak/stdout.log", "optim_step")}
    ours = optim.get("pycls AdamW (contiguous)", {}).get("ratio_to_floor")
    fused = optim.get("torch.optim.AdamW(fused=True)", {}).get("ratio_to_floor")
    detail = (
        "—"
        if ours is None
        else f"{ours:.2f}x floor (torch fused: " + ("—" if fused is None else f"{fused:.2f}x") + ")"
    )
    out.append(("AdamW step over ViT-H/14, contiguous mode", detail, "<= 1.30x floor",
                check(ours, GOALS["optim_floor"], at_most=True)))  # fmt: skip

    consumed = pycls_best["images_per_sec"] if pycls_best else None
    if time_b16 and (consumed is None or time_b16[-1]["train_images_per_sec"] > consumed):
        consumed = time_b16[-1]["train_images_per_sec"]
    for data, where, speed in loader_rows(root):
        if not where.startswith("GPU"):
            continue
        ratio = speed / consumed if consumed else None
        detail = f"{speed:.0f} img/s" + ("" if ratio is None else f" = {ratio:.2f}x the step")
        out.append((f"data path: {data}, {where}", detail, ">= 2x ViT-B/16 step",
                    check(ratio, GOALS["loader_vs_b16"])))  # fmt: skip

    acc = amp_accuracy(root)
    base = next((v for k, v in acc.items() if k.startswith("O0")), None)
    for key in sorted(k for k in acc if not k.startswith("O0")):
        gap = None if base is None else base - acc[key]
        goal = GOALS["amp_o3_points" if key.startswith("O3") else "amp_points"]
        detail = f"{acc[key]:.2f} % top-1" + ("" if gap is None else f" ({-gap:+.2f} vs O0)")
        out.append((f"quickstart {key}", detail, f"within {goal:g} point(s) of O0",
                    check(None if gap is None else -gap, -goal)))  # fmt: skip
    if base is not None:
        out.append(("quickstart O0", f"{base:.2f} % top-1", "(reference)", "—"))
    out += fewer_tokens_targets(root)
    return out


# ------------------------------------------------------------------------------------------------ #
# The levers of the ViT step (phase levers; benchmarks/gpu_short.sh)
# ------------------------------------------------------------------------------------------------ #

# What the analysis of the first run predicts for each row (docs/benchmarks.md names its source),
# by card where it differs; estimates, to be checked against the measured column
PREDICTIONS = {
    "matmul": {"H100": "~798 TFLOP/s", "H200": "~782 TFLOP/s"},
    "copy": {"H100": "~3.0 TB/s", "H200": "~4.2 TB/s"},
    "attention": "cuDNN, at least as fast as flash",
    "optim_fp32": "1.1-1.25x (torch fused ~1.4x)",
    "optim_o2": "1.1-1.25x, about the fp32 pass",
    "b16_mfu": {"H100": "39-42 % with every lever", "H200": "43-46 % with every lever"},
    "b16_o1": {"H100": "2,950-3,100 img/s", "H200": "3,350-3,450 img/s"},
    "o1_one_pass": "+1-2 %",
    "o1_bf16_residual": "+5-10 %",
    "o1_coordinate_descent": "+3-8 %",
    "o2_one_pass": "about O1's, with the O2 master update in one pass",
    "o1_parallel": "+5-15 % (ViT-22B and PaLM: about 15 % faster training)",
    "o1_bias_free": "+0-3 %",
    "b16_vs_timm": "1.1-1.2x (the levers' gain over the first run's tie)",
    "b16_vs_torchvision": "1.15-1.25x",
    "h14_mfu": "42-45 % every block compiled (50-53 % with the levers)",
    "h14_bf16": {"H200": "413-441 img/s"},
    "float8_all_h14": "1.05-1.15x",
    "float8_h14": "1.06-1.22x (~1.0x at 1,000 float8 TFLOP/s)",
    "float8_mlp_l16": "1.0-1.1x",
    "float8_l16": "1.02-1.21x",
}
# step_ab variants of each lever (benchmarks/gpu_campaign.sh, phase levers), against the baseline
LEVERS = (
    ("o1_one_pass", "one optimizer pass (OPTIM.ONE_PASS), O1"),
    ("o1_bf16_residual", "bf16 residual stream (AMP.RESIDUAL_DTYPE bfloat16), O1"),
    ("o1_coordinate_descent", "coordinate-descent tuning (TRAIN.COMPILE_COORDINATE_DESCENT), O1"),
    ("o2_one_pass", "O2 with the one pass, against O1"),
    ("o1_parallel", "parallel blocks (VIT.BLOCK parallel: another model, equal FLOPs), O1"),
    ("o1_bias_free", "bias-free layers (VIT.QKV_BIAS, VIT.PROJ_BIAS False: another model), O1"),
)


def ab_results(root, step):
    """benchmarks/step_ab.py's step_ab.json of a step (the last one found), or None."""
    paths = find(root, f"{step}/step_ab.json")
    if not paths:
        return None
    with open(paths[-1]) as f:
        return json.load(f)


def ab_row(data, name):
    rows = {r["name"]: r for r in (data or {}).get("rows", [])}
    row = rows.get(name)
    return row if row and "images_per_sec" in row else None


def valid(row):
    """A measured row whose every block compiled into at most MAX_GRAPHS graphs."""
    return (
        row is not None
        and not row.get("uncompiled")
        and (not row.get("compiled") or row.get("model_graphs", 0) <= MAX_GRAPHS)
    )


def lever_status(row):
    """wins / no win against the baseline of the same call, or why the row cannot count."""
    if row.get("uncompiled"):
        return "not comparable: a block ran eager"
    if row.get("compiled") and row.get("model_graphs", 0) > MAX_GRAPHS:
        return f"not comparable: {row['model_graphs']} graphs"
    return "wins" if row["speedup"] >= GOALS["lever_win"] else "no win"


def _predicted(key, card):
    value = PREDICTIONS.get(key, "—")
    return value.get(card, "—") if isinstance(value, dict) else value


def _goal_text(key, card, kind, at_most=False):
    g, stretch = goal_of(key, card), goal_of(key, card, STRETCH)
    sign = "<=" if at_most else ">="
    fmt = (lambda v: f"{v:.0%}") if kind == "%" else (lambda v: f"{v:.2f}x")
    text = f"{sign} {fmt(g)}" + (f" (stretch {fmt(stretch)})" if stretch is not None else "")
    return text + ("" if card or not isinstance(GOALS.get(key), dict) else " (H100's goal)")


def _judge(key, card, value, at_most=False):
    return check(value, goal_of(key, card), at_most, goal_of(key, card, STRETCH), UNREACHED)


def levers_targets(root):
    """[(target, measured, prediction, goal, status)] of the levers run below root."""
    card = card_of(root)
    rows = []
    for s in stats_of(root, "ceilings/stdout.log", "gpu_peak")[-1:]:
        rows.append(("matmul 8192^3 bf16 (ceiling)", f"{s['matmul_tflops']:.4g} TFLOP/s",
                     _predicted("matmul", card), "(reported)", "—"))  # fmt: skip
        rows.append(("device copy (ceiling)", f"{s['copy_gbps'] / 1e3:.2f} TB/s",
                     _predicted("copy", card), "(reported)", "—"))  # fmt: skip
    rows.append(attention_row(root))
    optim = {s.get("key"): s for s in stats_of(root, "optim_rows/stdout.log", "optim_step")}
    for key, what, pred in (
        ("pycls_one_pass", "AdamW one pass over ViT-H/14's fp32 parameters", "optim_fp32"),
        ("o2_one_pass", "AdamW + O2 master update, one pass, ViT-H/14", "optim_o2"),
    ):
        r = optim.get(key, {})
        ratio = r.get("ratio_to_floor")
        fused = optim.get("torch_fused", {}).get("ratio_to_floor")
        measured = (
            "—"
            if ratio is None
            else f"{ratio:.2f}x floor ({r['step_ms']:.2f} ms)"
            + ("" if fused is None else f"; torch fused {fused:.2f}x")
        )
        rows.append((what, measured, _predicted(pred, card),
                     _goal_text("optim_floor", card, "x", at_most=True),
                     _judge("optim_floor", card, ratio, at_most=True)))  # fmt: skip
    rows += b16_rows(root, card) + float8_rows(root, card)
    return rows


def attention_row(root):
    paths = find(root, "attention/attention.json")
    measured = "—"
    if paths:
        with open(paths[-1]) as f:
            att = json.load(f)["rows"]
        by = {(r["shape"], r["pass"], r["backend"]): r for r in att}
        default = by.get(("vit_b16", "forward+backward", "default"), {})
        if "picks" in default:
            times = ", ".join(
                f"{b} {by[k]['ms']:.2f} ms"
                for b in ("cudnn", "flash")
                if "ms" in by.get(k := ("vit_b16", "forward+backward", b), {})
            )
            measured = f"picks {default['picks']}" + (f" ({times})" if times else "")
    return ("SDPA default, ViT-B/16 forward+backward", measured, _predicted("attention", None),
            "(reported)", "—")  # fmt: skip


def b16_rows(root, card):
    data = ab_results(root, "ab_b16")
    base = ab_row(data, "o1")
    variants = (data or {}).get("rows", [])
    # the best of the variants of the baseline's model (the libraries do its work)
    ok = [r for r in variants if r.get("kind") == "pycls" and r.get("same_model", True)]
    ok = [r for r in ok if valid(ab_row(data, r["name"]))]
    best = max(ok, key=lambda r: r["images_per_sec"]) if ok else None
    rows = [(
        "ViT-B/16 trainer step O1, batch 256",
        "—" if base is None else f"{base['images_per_sec']:.0f} img/s, MFU {pct(base['mfu'])}"
        + ("" if valid(base) else " (a block ran eager)"),
        _predicted("b16_o1", card), "(reported)", "—",
    )]  # fmt: skip
    mfu = best.get("mfu") if best else None
    rows.append((
        "ViT-B/16 trainer step MFU (best variant, every block compiled)",
        "—" if best is None else f"{pct(mfu)} ({best['name']}, {best['images_per_sec']:.0f} img/s)",
        _predicted("b16_mfu", card), _goal_text("b16_mfu", card, "%"),
        _judge("b16_mfu", card, mfu),
    ))  # fmt: skip
    for name, what in LEVERS:
        r = ab_row(data, name)
        measured, status = "—", UNREACHED
        if r is not None and "speedup" in r:
            measured = f"{r['speedup']:.3f}x ({r['speedup_q1']:.3f}-{r['speedup_q3']:.3f})"
            status = lever_status(r)
        elif data and name in {x["name"] for x in data.get("rows", [])}:
            note = next(x for x in data["rows"] if x["name"] == name).get("note", "")
            measured = note[:90] or "—"
        rows.append((f"lever: {what}", measured, _predicted(name, card),
                     ">= 1.03x, blocks compiled, <= 2 graphs", status))  # fmt: skip
    for lib in ("timm", "torchvision"):
        other = ab_row(data, lib)
        ratio = None
        if best and other:
            ratio = best["images_per_sec"] / other["images_per_sec"]
        measured = (
            "—"
            if ratio is None
            else (
                f"{ratio:.2f}x ({best['images_per_sec']:.0f} vs "
                f"{other['images_per_sec']:.0f} img/s)"
            )
        )
        key = f"b16_vs_{lib}"
        rows.append((f"ViT-B/16 vs {lib} (the same work, each at its best)", measured,
                     _predicted(key, card), _goal_text(key, card, "x"),
                     _judge(key, card, ratio)))  # fmt: skip
    return rows


def float8_rows(root, card):
    rows = []
    h14, l16 = ab_results(root, "ab_h14"), ab_results(root, "ab_l16")
    bf16 = ab_row(h14, "bf16")
    mfu = bf16.get("mfu") if valid(bf16) else None
    rows.append((
        "ViT-H/14 O2 batch 64 MFU (bf16)",
        "—" if bf16 is None else f"{pct(bf16.get('mfu'))} ({bf16['images_per_sec']:.0f} img/s)"
        + ("" if valid(bf16) else "; a block ran eager: not judged"),
        _predicted("h14_mfu", card) + (f"; {_predicted('h14_bf16', card)}"
                                       if _predicted("h14_bf16", card) != "—" else ""),
        _goal_text("h14_mfu", card, "%"), _judge("h14_mfu", card, mfu),
    ))  # fmt: skip
    for data, name, what, key, pred in (
        (h14, "float8_all", "float8 all layers vs bf16, ViT-H/14", None, "float8_all_h14"),
        (h14, "float8_auto", "float8 auto vs bf16, ViT-H/14", "float8_h14", "float8_h14"),
        (l16, "float8_mlp", "float8 MLP only vs bf16, ViT-L/16", None, "float8_mlp_l16"),
        (l16, "float8_auto", "float8 auto vs bf16, ViT-L/16", "float8_l16", "float8_l16"),
    ):
        r = ab_row(data, name)
        ratio = r.get("speedup") if valid(r) else None
        measured = (
            "—"
            if r is None or "speedup" not in r
            else (f"{r['speedup']:.3f}x" + ("" if valid(r) else " (a block ran eager: not judged)"))
        )
        if r is None and data:
            note = next((x.get("note", "") for x in data["rows"] if x["name"] == name), "")
            measured = note[:90] or "—"
        goal_text = "(reported)" if key is None else _goal_text(key, card, "x")
        status = "—" if key is None else _judge(key, card, ratio)
        rows.append((what, measured, _predicted(pred, card), goal_text, status))
    return rows


def levers_lines(root):
    """The levers' targets table (with predictions) and the tables their tools wrote."""
    card = card_of(root)
    head = "card: " + (card or "unknown (goals: the H100's)")
    lines = [
        "## Targets",
        "",
        head,
        "",
        "| target | measured | prediction | goal | status |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {t} | {m} | {p} | {g} | {st} |" for t, m, p, g, st in levers_targets(root)]
    lines.append("")
    for pattern, title in (
        ("optim_rows/gpu_peak.md", "Optimizer step against its floor"),
        ("attention/attention.md", "Attention backends"),
        ("ab_b16/step_ab.md", "ViT-B/16 A/B"),
        ("ab_h14/step_ab.md", "ViT-H/14 A/B"),
        ("ab_l16/step_ab.md", "ViT-L/16 A/B"),
    ):
        for path in find(root, pattern)[-1:]:
            with open(path) as f:
                lines += [f"## {title} ({os.path.relpath(path, root)})", "", f.read().strip(), ""]
    return lines


def fewer_tokens_speedups(root):
    """{(table, arch, amp, contender): speed-up over the table's first contender} from every
    benchmarks/fewer_tokens.py run below root (its fewer_tokens.json; the median time per image of
    all rounds pooled, as its tables give it)."""
    out = {}
    for path in find(root, "fewer_tokens.json"):
        with open(path) as f:
            results = json.load(f)["results"]
        for key, contenders in results.items():
            if key == "accuracy":
                continue
            table, arch, amp = key.split("/")
            medians = {
                name: statistics.median(t for r in rounds for t in r["times"])
                for name, rounds in contenders.items()
            }
            ref = medians[next(iter(contenders))]
            for name, median in medians.items():
                out[(table, arch, amp, name, os.path.basename(os.path.dirname(path)))] = (
                    ref / median
                )
    return out


def fewer_tokens_targets(root):
    """ViT-B/16 keeping half / a quarter of the tokens against all of them, and packed against
    padded token batches (sizes varying 2x), bf16 steps."""
    speedups = fewer_tokens_speedups(root)
    rows = []
    for what, table, contender, goal, arch in (
        ("ViT-B/16 step, keep 0.5 of the tokens vs all", "patch_drop", "keep 0.5",
         "b16_keep_half", "vit_b16"),
        ("ViT-B/16 step, keep 0.25 of the tokens vs all", "patch_drop", "keep 0.25",
         "b16_keep_quarter", "vit_b16"),
        ("ViT-B/16 step, packed vs padded (sides varying 2x)", "packing", "packed",
         "packed_vs_padded", "vit_b16"),
    ):  # fmt: skip
        found = {step: v for (t, a, amp, name, step), v in speedups.items()
                 if (t, a, amp, name) == (table, arch, "O1", contender)}  # fmt: skip
        best = max(found.values()) if found else None
        detail = "—" if best is None else ", ".join(f"{v:.2f}x ({k})" for k, v in found.items())
        rows.append((what, detail, f">= {GOALS[goal]:.1f}x", check(best, GOALS[goal])))
    return rows


def fewer_tokens_lines(root):
    """The tables of every benchmarks/fewer_tokens.py run below root."""
    lines = []
    for path in find(root, "fewer_tokens.md"):
        with open(path) as f:
            lines += [f"## {os.path.relpath(path, root)}", "", f.read().strip(), ""]
    return lines


def steps_table(root):
    lines = ["| phase | step | exit | seconds | limit, s |", "|---|---|---:|---:|---:|"]
    for path in find(root, "steps.tsv"):
        phase = os.path.basename(os.path.dirname(path))
        with open(path) as f:
            for line in f:
                cells = line.rstrip("\n").split("\t")
                if len(cells) == 4:
                    rc = {"0": "ok", "124": "124 (time limit)"}.get(cells[1], cells[1])
                    lines.append(f"| {phase} | {cells[0]} | {rc} | {cells[2]} | {cells[3]} |")
    return lines


def profile_lines(root):
    lines = []
    for s in stats_of(root, "profile_*/stdout.log", "profile"):
        busy = s.get("gpu_busy_frac")
        idle = "—" if busy is None else f"{1 - busy:.1%}"
        lines.append(
            f"- profile {s['arch']} batch {s['batch_size']} {s['amp']}, compile {s['compile']}: "
            f"{s['step_ms']:.1f} ms/step under the profiler, GPU idle {idle}; top: "
            + ", ".join(f"`{t[:60]}`" for t in s.get("top", [])[:3])
        )
    return lines


def cnn_zoo_lines(root):
    """The CNN zoo against upstream pycls and timm (phase cnn_zoo), one table row per model."""
    rows = []
    for s in stats_of(root, "cnn_zoo.log", "upstream_benchmark"):
        for model, r in s.items():
            if not isinstance(r, dict):
                continue
            cells = [model, f"{r['ours_median_s'] * 1e3:.1f} ms"]
            for other in ("upstream", "timm"):
                if f"ratio_{other}_median" in r:
                    cells.append(
                        f"{r[f'{other}_median_s'] * 1e3:.1f} ms, ours/{other} "
                        f"{r[f'ratio_{other}_median']:.3f} ({r[f'ratio_{other}_q1']:.3f}-"
                        f"{r[f'ratio_{other}_q3']:.3f})"
                    )
                else:
                    cells.append("—")
            rows.append("| " + " | ".join(cells) + " |")
    if not rows:
        return []
    head = [
        "CNN zoo, forward+backward per iteration (median; ratio median and quartiles):",
        "",
        "| model | ours | upstream pycls | timm |",
        "|---|---:|---:|---:|",
    ]
    return head + rows + [""]


def float8_lines(root):
    """Training images/s of each ViT without float8 and with each recipe (phase recipes, step
    float8: one --mode time run per folder ARCH_MODE), and the ratio to bfloat16."""
    rates = {}
    for path in find(root, "float8/*/stdout.log"):
        arch, _, mode = os.path.basename(os.path.dirname(path)).rpartition("_")
        for s in load_json_stats(path):
            if s.get("_type") == "iter_times":
                rates.setdefault(arch, {})[mode] = s["train_images_per_sec"]
    if not rates:
        return []
    lines = [
        "float8 linear layers (every block layer), compiled, O2 bfloat16, training images/s:",
        "",
        "| model | bfloat16 | tensorwise | rowwise |",
        "|---|---:|---:|---:|",
    ]
    for arch, by_mode in sorted(rates.items()):
        base = by_mode.get("none")
        cells = [f"{base:.1f}" if base else "—"]
        for mode in ("tensorwise", "rowwise"):
            rate = by_mode.get(mode)
            ratio = f" ({rate / base:.2f}x)" if rate and base else ""
            cells.append(f"{rate:.1f}{ratio}" if rate else "—")
        lines.append(f"| {arch} | " + " | ".join(cells) + " |")
    return lines + [""]


def distill_lines(root):
    """benchmarks/distill_step.py's table (phase recipes, step distill), as it wrote it."""
    lines = []
    for path in find(root, "distill/distill.md"):
        with open(path) as f:
            lines += ["Distillation's step overhead:", "", f.read().strip(), ""]
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help="the campaign's output folder (holding peak/, vit_b16/, ...)")
    p.add_argument("--out", help="where to write the summary (default: DIR/summary.md)")
    p.add_argument(
        "--levers",
        action="store_true",
        help="only the levers run's targets and tables (benchmarks/gpu_short.sh)",
    )
    args = p.parse_args(argv)
    lines = ["# GPU campaign summary" if not args.levers else "# GPU levers run summary", ""]
    envs = find(args.dir, "env.txt")
    if envs:
        with open(envs[0]) as f:
            env = f.read().strip()
        if "rehearsal: 1" in env:
            lines += ["**A rehearsal on the CPU at tiny sizes: no number below says anything "
                      "about a GPU, and neither does any status.**", ""]  # fmt: skip
        lines += ["```", env, "```", ""]
    if args.levers:
        lines += levers_lines(args.dir) + ["## Steps", ""] + steps_table(args.dir)
        return _write(args, "\n".join(lines) + "\n")
    lines += levers_lines(args.dir)
    for s in stats_of(args.dir, "peak/stdout.log", "gpu_peak"):
        lines.append(
            f"- matmul {s['matmul_n']}^3 {s['matmul_dtype']}: {s['matmul_tflops']:.4g} TFLOP/s "
            f"({pct(s.get('matmul_vs_datasheet'))} of the datasheet); copy {s['copy_gbps']:.4g} "
            "GB/s"
        )
    lines += profile_lines(args.dir) + [""]
    lines += cnn_zoo_lines(args.dir) + float8_lines(args.dir) + distill_lines(args.dir)
    lines += fewer_tokens_lines(args.dir)
    lines += ["## Targets of the earlier campaign (first GPU run's list, today's goals)", ""]
    lines += ["| target | measured | goal | status |", "|---|---|---|---|"]
    lines += [f"| {t} | {m} | {g} | {st} |" for t, m, g, st in targets(args.dir)]
    lines += [""] + steps_table(args.dir)
    return _write(args, "\n".join(lines) + "\n")


def _write(args, text):
    with open(args.out or os.path.join(args.dir, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
