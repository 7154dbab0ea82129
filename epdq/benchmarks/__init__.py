"""Benchmarks behind `epdq bench`: each prints a comparison table and writes JSON (and a PNG plot
where a picture says more). Ratios are measured side by side in one run; absolute times are
context only (these machines are noisy)."""
