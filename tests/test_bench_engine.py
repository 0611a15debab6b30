"""The engine benchmarks run end to end on small inputs (bench/throughput.py, bench/padding.py, bench/packing.py):
their JSON has the keys the docs report, and every mode writes the same tokens."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys


def load_bench(name: str):
    """bench/<name>.py (the benchmarks are the `bench` package)."""
    return importlib.import_module(f"bench.{name}")


def test_throughput_benchmark_smoke(capsys):
    """bench/throughput.py end to end on short prefixes: every engine mode writes the same tokens,
    the JSON has the keys and ratios the issue asks for, and the single chain on the engine's
    step writes exactly what the reference single chain writes."""
    bench = load_bench("throughput")
    out = bench.main(["--videos", "18", "--in-flight", "4,16", "--chain-videos", "1", "--prefix", "100,200",
                      "--events", "2,4", "--lengths", "2,7", "--step-tokens", "64"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
    assert out["tokens_equal"] is True and set(out["throughput_speedup"]) == {"4", "16"}
    assert set(out["end_to_end_speedup"]) == {"16"} and out["kernel"] == "sdpa"
    assert set(out["ops_per_layer_step"]) == {"1", "16"} and all(v > 0 for v in out["ops_per_layer_step"].values())
    assert out["kv_allocated_over_live"] >= 1.0 and out["admission_p99_over_median"] > 0
    modes = out["modes"]
    assert len({m["tokens"] for m in modes.values()}) == 1  # same tokens in every mode
    assert modes["in_flight_4"]["steps"] < modes["one_at_a_time"]["steps"]  # videos shared steps
    assert modes["in_flight_4"]["rows_per_decode_step"] > modes["one_at_a_time"]["rows_per_decode_step"]
    for m in modes.values():
        assert m["tokens_per_s"] > 0 and m["videos_per_min"] > 0 and m["floor_ms_per_step"] > 0
    chain = out["single_chain"]
    assert chain["single_chain_fast"]["tokens_equal_single_chain"] is True
    # --no-arrivals: the decode-phase modes only; what comes from the arrival runs is absent, never judged
    quick = bench.main(["--videos", "6", "--in-flight", "4,16", "--chain-videos", "0", "--prefix", "100,200",
                        "--events", "2,4", "--lengths", "2,7", "--no-arrivals", "--attention-calls", "0"])
    assert quick["arrivals"] == {} and quick["end_to_end_speedup"] == {} and quick["attention_calls"] == 0
    assert quick["tokens_equal"] is True and quick["kv_allocated_over_live"] is None
    assert quick["targets"]["met"]["kv_allocated_over_live"] is None
    assert quick["targets"]["met"]["admission_p99_over_median"] is None
    assert chain["single_chain"]["tokens"] == chain["single_chain_fast"]["tokens"] == chain["single_chain"]["steps"]
    # the prefill keys, from the arrival run at 16 in flight: every video that prefilled is counted once
    counted = [out[k] for k in ("prefill_steps_per_video", "prefill_steps_cold_start") if out[k]]
    assert sum(p["videos"] for p in counted) == 18
    assert all(0 < p["bound"] <= p["mean"] <= p["max"] for p in counted)
    # graph coverage: on the CPU counted by an arrival run at 16 in infer.cuda_graphs=static mode (same tokens)
    static = out["arrivals"]["in_flight_16_static"]
    r = static["graph_routes"]
    assert r["full"] + r["pieces"] + r["eager"] == static["steps"] and out["arrivals"]["in_flight_16"]["graph_routes"] is None
    assert out["graph_coverage"] == round((r["full"] + r["pieces"]) / static["steps"], 4)
    assert out["targets"]["met"]["graph_coverage"] == (out["graph_coverage"] >= 0.9)
    # padding by arithmetic at the CUDA sizes and the CPU's: flex computes at least what is needed, and
    # smaller pages and query blocks never compute more
    pad, (cuda, smaller) = out["padding"], load_bench("padding").padding_sizes()
    assert list(pad) == [cuda, smaller] and out["padded_over_needed"] == pad["cuda_defaults"]["overall"]
    assert all(p["overall"] >= 1.0 and p["decode_and_planning_steps"] >= 1.0 and p["steps"] > 0 for p in pad.values())
    assert pad[smaller]["overall"] <= pad["cuda_defaults"]["overall"]
    # the two designs weighed by the same arithmetic (bench/padding.py split_work): small blocks for the
    # decode and planning rows never compute more, folding a KV group's heads into them never more again
    for p in pad.values():
        small, folded = p["projected"]["small_blocks"], p["projected"]["small_blocks_gqa_folded"]
        for key in ("overall", "decode_and_planning_steps"):
            assert 1.0 <= folded[key] <= small[key] <= p[key]
    assert out["targets"]["met"]["padded_over_needed"] == (out["padded_over_needed"] <= 1.5)


def test_packing_benchmark_smoke(capsys):
    """bench/packing.py end to end on short prefixes: the engine's decode steps recorded with their blocks
    (at least one block per decoding video), each plan timed; exact shapes do no padded work, every other
    plan at least the work needed; with infer.attention_calls=0 the engine's plan is the exact one."""
    out = load_bench("packing").main(["--videos", "6", "--in-flight", "4", "--prefix", "100,300", "--events", "2,6",
                      "--lengths", "2,9", "--repeats", "1"])
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(out))
    assert out["steps"] > 0 and out["padded_over_needed_work"]["exact"] == 1.0
    assert all(w >= 1.0 for w in out["padded_over_needed_work"].values())
    assert out["calls_per_layer"]["max_calls_1"] == 1.0 and out["calls_per_layer"]["exact"] >= 4 - 1e-9
    assert out["attention_calls"] == 3 and out["step_ms_packed_over_exact"] > 0
    exact = load_bench("packing").main(["--videos", "5", "--in-flight", "4", "--prefix", "100,300",
                                                      "--events", "2,6", "--lengths", "2,9", "--repeats", "1",
                                                      "--attention-calls", "0"])
    assert exact["attention_calls"] == 0 and exact["steps"] > 0
    assert exact["padded_over_needed_work"]["packed"] == 1.0 and exact["calls_per_layer"]["packed"] >= 4 - 1e-9


def test_step_check_smoke(tmp_path):
    """bench/gpu_check.sh --tiny (bench/step_check.py, what it runs at the 3B shape on CUDA) at the tiny shape on
    the CPU, and the same with the flex kernel: mixed and layered steps, every step routed (whole steps with
    flex, pieces otherwise), the counts consistent, and batched == alone exactly in fp32."""
    run = subprocess.run(["bash", "bench/gpu_check.sh", "--tiny"], env={**os.environ, "OUT": str(tmp_path),
                         "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "in_flight_3" in run.stdout, run.stdout + run.stderr
    script = json.loads((tmp_path / "step_check_3b.json").read_text())
    flex = load_bench("step_check").main(["--shape", "tiny", "--in-flight", "1", "3", "--videos", "4", "--caption", "4",
                                          "--kernel", "flex"])
    for out, kernel in ((script, "sdpa"), (flex, "flex")):
        assert out["kernel"] == kernel and out["floor_ms_per_step"] > 0 and out["plan_gb"] > 0
        for m in out["modes"].values():
            r = m["graph_routes"]
            assert m["mixed_steps"] > 0 and m["layered_steps"] > 0 and sum(r.values()) == m["steps"]
            assert m["graph_coverage"] == round((r["full"] + r["pieces"]) / m["steps"], 4)
            assert (r["full"] > 0) == (kernel == "flex") and r["pieces"] > 0
            p = m["prefill_steps_per_video"]
            assert p["videos"] > 0 and p["max"] >= p["mean"] > 0
        assert out["modes"]["in_flight_3"]["batched_equals_alone"] is True
    assert 0 < flex["flex_compiles"] <= flex["flex_compiles_bound"]
