"""The roofline of one plan, with its decode and prefill points (matplotlib, imported lazily:
it is a dev dependency, and only `--plot` needs it)."""

from __future__ import annotations


def plot_roofline(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SystemExit(f"--plot needs matplotlib (pip install -e '.[dev]'): {e}")
    import numpy as np

    roof = result["roofline"]
    peak, bw, ridge = roof["peak_flops"], roof["hbm_bandwidth"], roof["ridge_point"]
    dec, pre = result["decode"], result["prefill"]
    lo = min(0.1, dec["intensity"] / 4)
    hi = max(ridge * 30, pre["intensity"] * 4)
    x = np.logspace(np.log10(lo), np.log10(hi), 400)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.loglog(x, np.minimum(peak, x * bw), color="black", lw=2, label="attainable (min of roofs)")
    ax.axhline(peak * pre["mfu"], color="gray", ls=":", lw=1, label=f"{pre['mfu']:.0%} of peak (prefill MFU)")
    ax.axvline(ridge, color="gray", ls="--", lw=1)
    ax.text(ridge * 1.08, peak * 0.02, f"ridge {ridge:,.0f} FLOP/B", rotation=90, va="bottom", color="gray")
    points = [
        ("decode", dec["intensity"], min(peak, dec["intensity"] * bw), "tab:blue",
         f"decode, batch {dec['batch']}"),
        ("prefill", pre["intensity"], min(peak * pre["mfu"], pre["intensity"] * bw), "tab:red",
         f"prefill, {pre['prompt_len']} tokens"),
    ]
    for _, xi, yi, color, label in points:
        ax.scatter([xi], [yi], s=60, color=color, zorder=3, label=f"{label}: {xi:,.1f} FLOP/B")
    i = result["inputs"]
    ax.set_title(f"{i['model']} on {i['device']}, tp={i['tp']} pp={i['pp']}")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of HBM traffic)")
    ax.set_ylabel("attainable FLOP/s per device")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
