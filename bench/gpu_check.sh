#!/bin/bash
# The device check of a session lent a GPU: one call of the device tool, under 540 s on a cold machine.
#   run: bash bench/gpu_check.sh        (nothing to carry: the device's torch + Triton only)
#   bash bench/gpu_check.sh --tiny      the same on the CPU at a tiny shape, fp32 (a smoke run: tests/test_bench_engine.py)
# 1. bench/step_check.py at the published model's LLM shape (Qwen2.5-VL-3B: 36 layers, hidden 2048, random
#    weights built on the device, bf16), synthetic videos arriving as others finish through the engine's
#    scheduler, step, flex kernel, CUDA graphs (whole steps and pieces) and staging: mixed and layered steps.
#    Prints per in-flight count (1, 16, 64): ms per step (all steps; decode-only steps) against the weight
#    floor (weight bytes / HBM bandwidth), prefill_steps_per_video against its bound, graph coverage and the
#    steps per route, batched == alone in bf16 (or the first differing token and its logit margin), peak
#    memory against infer.engine.memory_plan's figure; the compiled FlexAttention shapes against their bound
#    and the set-up time (captures, compiles). Results: $OUT/step_check_3b.json.
# 2. Only where transformers is importable (carry .gpuwheels: .venv/bin/pip download --no-deps -d .gpuwheels
#    transformers==5.24.0 peft==0.21.2): the GPU-marked tests, in what time is left.
set -u
START=$(date +%s)
OUT=${OUT:-/tmp}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ "${1:-}" = "--tiny" ]; then
  RUN="--shape tiny --device cpu --dtype float32 --in-flight 1 3 --videos 4 --caption 6"
else
  RUN="--shape 3b --device cuda --dtype bfloat16 --in-flight 1 16 64"
  $PY -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__,torch.cuda.get_device_name())"
fi
rm -f $OUT/step_check_3b.json
timeout 420 $PY -m bench.step_check $RUN --out $OUT/step_check_3b.json > $OUT/step_check.log 2>&1 \
  || { echo "step_check: rc $?"; tail -c 4000 $OUT/step_check.log; }
[ -f $OUT/step_check_3b.json ] && $PY - $OUT/step_check_3b.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("kernel", d["kernel"], "setup_s", d["setup_s"], "floor ms/step", round(d["floor_ms_per_step"], 3),
      "flex compiles", d["flex_compiles"], "bound", d["flex_compiles_bound"], "plan_gb", d["plan_gb"])
for name, m in d["modes"].items():
    print(name, m)
PY
if [ "${1:-}" != "--tiny" ] && [ -d .gpuwheels ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpuwheels/*.whl \
    && LEFT=$((520 - $(date +%s) + START)) && [ $LEFT -gt 30 ] && PYTHONPATH=/tmp/site:$PWD timeout $LEFT $PY -m pytest \
    -q -m gpu tests/test_graphs.py tests/test_engine_batch.py tests/test_kernels.py -p no:cacheprovider 2>&1 | tail -12
fi
echo "gpu_check: $(( $(date +%s) - START )) s"
