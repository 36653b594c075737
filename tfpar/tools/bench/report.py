"""The results, shown: the printed report, the JSON file and the PNG chart."""

from __future__ import annotations

import json
import os
from typing import Any



def failed_contenders(results: dict[str, Any]) -> dict[str, str]:
    """name -> why, for every contender the run recorded as failed (``"failed: ..."`` in
    ``distribution_tokens_per_sec``); a strategy that is not registered is not a failure."""
    return {name: value.removeprefix("failed: ")
            for name, value in results.get("distribution_tokens_per_sec", {}).items()
            if isinstance(value, str) and value.startswith("failed:")}


def format_report(results: dict[str, Any]) -> str:
    """The human-readable summary the script prints."""
    def num(v, fmt="{:,.0f}"):
        return fmt.format(v) if isinstance(v, (int, float)) else str(v)

    spec = results["spec"]
    lines = [
        f"corpus {results['corpus']} (vocab {results['vocab_size']}), {spec['layers']}-layer LSTM "
        f"{spec['embed_dim']}/{spec['hidden_dim']}, batch {spec['batch_size']}, bptt "
        f"{spec['bptt']}, stream mode, {spec['precision']}, {spec['optimizer']}; "
        f"{spec['rounds']} rounds x "
        f"{spec['steps']} steps",
    ]
    cpu = results["tokens_per_cpu_sec"]
    lines.append(f"{'contender':<22}{'tokens/s':>12}{'vs default':>12}{'tokens/cpu-s':>14}")
    keras_side = results["side_by_side_tokens_per_sec"].get("keras_baseline")
    lines.append(f"{'keras_baseline':<22}{num(keras_side):>12}"
                 f"{'':>12}{num(cpu.get('keras_baseline')):>14}")
    for name, value in results["distribution_tokens_per_sec"].items():
        rel = results["distribution_vs_default"][name]
        rel = num(rel, "{:.3f}") if isinstance(rel, float) else ""
        lines.append(f"{name:<22}{num(value):>12}{rel:>12}{num(cpu.get(name, '')):>14}")
    for name in ("mirrored", "default"):
        if f"tfpar_{name}_tokens_per_sec" not in results:
            continue
        lines.append(
            f"{'headline' if name == results['tfpar_strategy'] else 'also'}: tfpar {name} "
            f"{num(results[f'tfpar_{name}_tokens_per_sec'])} tokens/s = "
            f"{results[f'tfpar_{name}_vs_keras_baseline']:.3f} x Keras (per round: "
            + ", ".join(f"{x:.2f}" for x in results[f"tfpar_{name}_vs_keras_baseline_per_round"])
            + ")")
    lines.append(f"Keras baseline {num(results['keras_baseline_tokens_per_sec'])} tokens/s; "
                 f"headline ratio in tokens per CPU-second: "
                 f"{num(results['tfpar_vs_keras_baseline_cpu'], '{:.3f}')}")
    lines.append(f"input stall: {results['input_stall_fraction']:.4f} of a step waiting for "
                 f"tf.data (whole-step A/B against batches in memory: "
                 f"{results['input_stall_fraction_ab']:.4f})")
    lines.append(f"pad fraction: bucketed {results['pad_fraction_bucketed']:.4f}, plain padded_batch "
                 f"{results['pad_fraction_naive']:.4f} ({results['bucket_count']} buckets)")
    roof = results.get("roofline")
    if roof:
        limit = roof["limit_tokens_per_sec"]
        lines.append(
            f"roofline: {roof['flops_per_token'] / 1e6:.2f} MFLOP per token; this host's "
            f"matmul limit for the step's shapes {num(limit['fp32'])} tokens/s fp32, "
            f"{num(limit['bf16'])} bf16 ({roof['bf16_limit_vs_fp32_limit']:.2f}x)")
        lines.append(f"{'contender':<22}{'GFLOP/s':>10}{'of limit':>10}")
        for name, frac in roof["fraction_of_limit"].items():
            lines.append(f"{name:<22}{roof['gflops'][name]:>10.1f}{frac:>10.3f}")
        gf = roof["matmul_gflops"]
        lines.append("matmul GFLOP/s (fp32 / bf16): " + ", ".join(
            f"{k} {v:.0f}" + (f"/{gf['bfloat16'][k]:.0f}" if k in gf.get("bfloat16", {}) else "")
            for k, v in gf["float32"].items()))
    for mode, key in (("stream", "breakdown"), ("sentence", "breakdown_sentence")):
        for precision, row in (results.get(key) or {}).items():
            lines.append(f"step breakdown, {precision}, {mode} mode (ms measured / at the "
                         "matmul limit): " + ", ".join(
                             f"{part} {v['ms']:.1f}/{v['limit_ms']:.1f}"
                             + (f" ({v['fraction']:.2f})" if "fraction" in v else "")
                             for part, v in row.items()))
    fractions = {k.removesuffix("_fraction_of_limit"): v for k, v in results.items()
                 if k.startswith("output_layer") and k.endswith("_fraction_of_limit")}
    if fractions:
        lines.append("output layer, fraction of its matmul limit: " + ", ".join(
            f"{name.removeprefix('output_layer_')} {v:.3f}" for name, v in fractions.items()))
    if "fused_vs_unfused" in results:
        lines.append(f"default step (the fused output layer) vs with --no-fused-softmax "
                     f"(side by side): "
                     f"{results['fused_vs_unfused']:.3f}")
    if "bf16_vs_fp32" in results:
        lines.append(f"bf16 vs fp32 (default strategy, paired segments): "
                     f"{results['bf16_vs_fp32']:.3f} (per round: "
                     + ", ".join(f"{x:.2f}" for x in results["bf16_vs_fp32_per_round"]) + ")")
    if "host_overhead_ms_per_step" in results:
        ms, probe = results["spe_step_ms"], results["probe_step_ms"]
        lines.append(
            f"steps per call: {results['spe10_vs_1']:.3f} x tokens/s with 10 (step "
            f"{ms['1']:.2f} ms with 1, {ms['10']:.2f} ms with 10); host overhead "
            f"{results['host_overhead_ms_per_step']:.2f} ms per step (tiny-model probe: "
            f"{probe['1']:.2f} ms with 1, {probe['10']:.2f} ms with 10), so expected "
            f"{results['spe10_expected_gain']:.3f}x here and "
            f"{results['spe10_gain_at_5ms_step']:.2f}x for a 5 ms step")
    lines += scaling_lines(results.get("scaling"))
    la = (results["load_average_before"], results["load_average_after"])
    lines.append(f"load average {la[0]:.2f} -> {la[1]:.2f}"
                 + ("  (busy host: timings are noisy)" if max(la) > 1.5 else ""))
    for name, t in results["targets"].items():
        lines.append(f"{'PASS' if t['pass'] else 'FAIL'} {name} = "
                     f"{num(t['value'], '{:.4f}')} (target {t['target']})")
    return "\n".join(lines)


def scaling_lines(scaling: dict[str, Any] | None) -> list[str]:
    """The scaling model's tables and its loopback check, as printed lines."""
    if not scaling:
        return []
    lines = [f"scaling model: {scaling['gradient_bytes'] / 1e6:.1f} MB of gradients "
             f"all-reduced per step, host overhead {scaling['host_seconds'] * 1e3:.2f} ms "
             "per step (measured here), no compute/communication overlap"]
    for title, rows in scaling["tables"].items():
        lines.append(f"  {title}: " + "; ".join(
            f"{r['n']}: {r['step_ms']:.2f} ms {r['tokens_per_sec']:,.0f} tok/s "
            f"eff {r['efficiency']:.2f}" for r in rows))
    for c in scaling.get("loopback", []):
        lines.append(
            f"  loopback {c['workers']} workers (batch {c['batch_size']}): step "
            f"{c['step'] * 1e3:.1f} ms measured = compute {c['compute'] * 1e3:.1f} + all-reduce "
            f"{c['allreduce'] * 1e3:.1f} ms of {c['gradient_bytes'] / 1e6:.1f} MB (link "
            f"{c['link_bandwidth'] / 1e9:.2f} GB/s, {c['link_latency'] * 1e6:.0f} us); "
            f"predicted {c['predicted_from_one_process'] * 1e3:.1f} ms from the one-process step "
            f"({c['error_from_one_process']:+.1%}), {c['predicted_from_phases'] * 1e3:.1f} ms "
            f"from the phases ({c['error_from_phases']:+.1%})")
    return lines


def write_json(path: str, results: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, sort_keys=True)


def write_plot(path: str, results: dict[str, Any]) -> None:
    """Bar charts of tokens/s and of the stall and pad shares, as a PNG.

    Raises:
      ConfigError: matplotlib is not installed (it is the optional ``bench`` extra).
    """
    from tfpar.tools.plot import pyplot

    plt = pyplot("--plot needs matplotlib, which is not installed; install the extra with "
                 "pip install -e '.[bench]' or leave out --plot")
    keras_rate = results["side_by_side_tokens_per_sec"]["keras_baseline"]
    names = ["keras_baseline"] + list(results["distribution_tokens_per_sec"])
    values = [keras_rate] + [
        v if isinstance(v, float) else 0.0 for v in results["distribution_tokens_per_sec"].values()]
    roof = results.get("roofline")
    fig, axes = plt.subplots(1, 3 if roof else 2, figsize=(16 if roof else 11, 4),
                             gridspec_kw={"width_ratios": [2, 1, 2] if roof else [2, 1]})
    a, b = axes[0], axes[1]
    bars = a.bar(names, values, color=["grey"] + ["tab:blue"] * (len(names) - 1))
    for bar, v, name in zip(bars, values, names):
        label = f"{v:,.0f}" if v else "n/a"
        a.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), label, ha="center",
               va="bottom", fontsize=8)
    a.axhline(1.5 * keras_rate, color="tab:red", ls="--", lw=1,
              label="1.5 x Keras baseline (target)")
    a.set_ylabel("training tokens/s")
    a.set_title(f"{results['corpus']}: {results['spec']['layers']}x{results['spec']['hidden_dim']} "
                f"LSTM, batch {results['spec']['batch_size']}, bptt {results['spec']['bptt']}; "
                f"side by side (headline pairs: {results['tfpar_vs_keras_baseline']:.2f} x Keras)",
                fontsize=9)
    a.tick_params(axis="x", labelrotation=20, labelsize=8)
    a.legend(fontsize=8)
    shares = {"input stall": results["input_stall_fraction"] or 0.0,
              "pad (bucketed)": results["pad_fraction_bucketed"],
              "pad (padded_batch)": results["pad_fraction_naive"]}
    b.bar(list(shares), list(shares.values()), color=["tab:green", "tab:blue", "grey"])
    for i, v in enumerate(shares.values()):
        b.text(i, v, f"{v:.3f}", ha="center", va="bottom", fontsize=8)
    b.set_ylim(0, max(0.1, max(shares.values()) * 1.15))
    b.set_ylabel("share of step time / of tokens")
    b.tick_params(axis="x", labelrotation=20, labelsize=8)
    if roof:
        _roofline_panel(axes[2], roof)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _roofline_panel(ax, roof: dict[str, Any]) -> None:
    """Every contender's step FLOP/s against this host's matmul limit for the step's
    shapes (dashed: fp32, dotted: bf16)."""
    names = list(roof["gflops"])
    values = [roof["gflops"][n] for n in names]
    bars = ax.bar(names, values, color=["grey" if n == "keras_baseline" else "tab:blue"
                                        for n in names])
    for bar, name in zip(bars, names):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                f"{roof['fraction_of_limit'][name]:.0%}", ha="center", va="bottom", fontsize=8)
    per_token = roof["flops_per_token"] / 1e9
    for precision, style in (("fp32", "--"), ("bf16", ":")):
        ax.axhline(roof["limit_tokens_per_sec"][precision] * per_token, color="tab:red",
                   ls=style, lw=1, label=f"matmul limit, {precision}")
    ax.set_ylabel("step GFLOP/s (labels: fraction of its limit)")
    ax.set_title("roofline: the step's matmuls at this host's rate for each shape", fontsize=9)
    ax.tick_params(axis="x", labelrotation=25, labelsize=8)
    ax.legend(fontsize=8)
