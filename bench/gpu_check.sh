#!/bin/bash
# The device check of a session lent a GPU: one call of the device tool, under 540 s in all.
#   run: bash bench/gpu_check.sh   carry: .gpuwheels (transformers + peft wheels for the device python)
#   make the wheels once: .venv/bin/pip download --no-deps -d .gpuwheels transformers==5.24.0 peft==0.21.2
# It needs nothing beyond the device's torch (CUDA, Triton) and those wheels, and prints:
# 1. the GPU-marked tests (flex kernel == reference kernel on CUDA, bf16 batched == alone, CUDA graphs
#    captured and replaying the eager step, the kernels' contracts, encoders, training);
# 2. bench/release_decode.py at the published model's shape (Qwen2.5-VL-3B LLM, random weights, bf16):
#    the kernel chosen; ms per decode step at 1, 16 and 64 videos in flight against the weight-bandwidth
#    floor (target: within 3x at 16); tokens/s at 64 over one at a time (target: >= 20x); batched == alone
#    in bf16 (or the first differing token and its logit margin); peak memory against infer.engine.memory_plan's figure;
#    the 16-in-flight step without CUDA graphs beside it (eager_over_graphs_ms_per_step, tokens_equal_graphs).
#    Results under $OUT.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpuwheels/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch,transformers,peft,triton;print(torch.__version__,transformers.__version__,peft.__version__,triton.__version__,torch.cuda.get_device_name())"
timeout 200 python3 -m pytest -q -m gpu tests/test_engine.py tests/test_engine_batch.py tests/test_kernels.py tests/test_graphs.py \
  tests/test_encoders.py tests/test_train_gpu.py -p no:cacheprovider 2>&1 | tail -12
timeout 300 python3 -m bench.release_decode --shape 3b --device cuda --dtype bfloat16 --videos 64 --in-flight 16 64 --eager-at 16 --kv-memory-gb 40 \
  --out $OUT/release_3b.json > $OUT/release.log 2>&1 || tail -c 3000 $OUT/release.log
python3 - $OUT/release_3b.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("kernel", d["kernel"], "floor ms/step", round(d["floor_ms_per_step"], 3))
for name, m in d["modes"].items():
    print(name, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in m.items()})
PY
