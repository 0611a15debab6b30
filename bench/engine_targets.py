"""Engine v4's targets and their verdict over a `bench/throughput.py` result.

One table holds every threshold; `verdict` reads the figures from the benchmark's JSON object and
says, per figure, whether its target is met (None where the run did not measure it).

    >>> verdict({"throughput_speedup": {"4": 1.5}})   # no 16-in-flight run: nothing to judge
    {}
    >>> r = verdict({"throughput_speedup": {"16": 1.9}, "tokens_equal": True, "arrivals": {},
    ...              "padded_over_needed": 1.2, "ops_per_layer_step": {"1": 40, "16": 46}})
    >>> r["met"]
    {'throughput_speedup_16': True, 'kv_allocated_over_live': None, 'admission_p99_over_median': None, 'padded_over_needed': True, 'ops_per_layer_step': False}
    >>> r["throughput_speedup_16_min"]
    1.85
"""

from __future__ import annotations

TARGETS = {"throughput_speedup_16_min": 1.85, "ops_per_layer_step_16_max": 45, "ops_16_over_1_max": 1.1,
           "kv_allocated_over_live_max": 1.25, "admission_p99_over_median_max": 3.0,
           "prefill_steps_mean_over_bound_max": 1.5, "videos_decoding_mean_min": 12, "graph_coverage_min": 0.9,
           "padded_over_needed_max": 1.5}


def verdict(out: dict) -> dict:
    """The targets with `met` per figure, judged on the result `out`; {} without a 16-in-flight run.

    A figure from the arrival runs is None (not measured) when the run skipped them (--no-arrivals);
    the speedup counts only if every mode wrote the same tokens.
    """
    speed = out.get("throughput_speedup", {})
    if "16" not in speed:
        return {}
    t, measured = TARGETS, bool(out.get("arrivals"))
    met = {"throughput_speedup_16": speed["16"] >= t["throughput_speedup_16_min"] and out["tokens_equal"],
           "kv_allocated_over_live": out["kv_allocated_over_live"] <= t["kv_allocated_over_live_max"]
           if measured else None,
           "admission_p99_over_median": (out["admission_p99_over_median"] or 1e9) <= t["admission_p99_over_median_max"]
           if measured else None}
    if "prefill_steps_per_video" in out:
        pre = out["prefill_steps_per_video"]
        met["prefill_steps_per_video"] = pre is not None and pre["mean"] <= t["prefill_steps_mean_over_bound_max"] * pre["bound"]
        met["videos_decoding_mean"] = (out["videos_decoding_mean"] or 0) >= t["videos_decoding_mean_min"]
        met["graph_coverage"] = (out["graph_coverage"] or 0) >= t["graph_coverage_min"]
    met["padded_over_needed"] = out["padded_over_needed"] <= t["padded_over_needed_max"]
    ops = out.get("ops_per_layer_step", {})
    if {"1", "16"} <= set(ops):
        met["ops_per_layer_step"] = ops["16"] <= t["ops_per_layer_step_16_max"] and ops["16"] <= t["ops_16_over_1_max"] * ops["1"]
    return {**t, "met": met}
