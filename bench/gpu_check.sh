#!/bin/bash
# The device check of a session lent a GPU (one call of the device tool, ~8 min on an H200):
#   run: bash bench/gpu_check.sh   carry: .gpuwheels (transformers + peft wheels for the device python)
#   make the wheels once: .venv/bin/pip download --no-deps -d .gpuwheels transformers==5.24.0 peft==0.21.2
# 1. GPU-marked tests (engine on CUDA, CUDA graphs == eager, bf16 default, attention kernels, training);
# 2. bench/decode.py, Qwen2.5-3B shape, bf16, prefix 8k, K = 8 x 32: engine step vs the bandwidth floor and
#    vs parallel_copy (targets: within 3x the floor, faster per step than parallel_copy);
# 3. bench/throughput.py, same shape: 1 vs 4 / 16 / 64 videos in flight (target: 64 in flight >= 20x the
#    tokens/s of one at a time, tokens equal);
# 4. bench/release_decode.py: the published model's shape (Qwen2.5-VL-3B LLM, random weights) in bf16 through
#    the engine, ms per token / per video vs the paper's 13.4 ms/token (A6000) and the bandwidth floor.
#    Results under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpuwheels/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch,transformers,peft;print(torch.__version__,transformers.__version__,peft.__version__,torch.cuda.get_device_name())"
python3 -c "import flash_attn" 2>&1 | tail -1
timeout 150 python3 -m pytest -q -m gpu tests/test_engine.py tests/test_engine_batch.py tests/test_attention.py tests/test_encoders.py tests/test_train_gpu.py -p no:cacheprovider 2>&1 | tail -12
timeout 150 python3 bench/decode.py --preset qwen2.5-3b --device cuda --dtype bfloat16 --repeats 3 --prefix 8192 \
  --modes parallel_copy,engine --out $OUT/decode_3b_8k.json --png $OUT/decode_3b_8k.png > $OUT/decode.log 2>&1
python3 - $OUT/decode_3b_8k.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
print({m:(r.get('ms_per_token'),r.get('ms_per_step')) for m,r in d['modes'].items()}, d['floor'].get('floor_ms_per_step'), d['floor'].get('engine_ms_per_step_over_floor'), d['targets'])
PY
timeout 240 python3 bench/throughput.py --preset qwen2.5-3b --device cuda --dtype bfloat16 --chain-videos 2 \
  --out $OUT/throughput_3b.json > $OUT/throughput.log 2>&1
python3 - $OUT/throughput_3b.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
print(d['kernel'], d['throughput_speedup'], d['end_to_end_speedup'], d['tokens_equal'], {m:r['ms_per_step'] for m,r in d['modes'].items()})
PY
timeout 150 python3 bench/release_decode.py --shape 3b --device cuda --dtype bfloat16 --videos 16 --in-flight 16 \
  --out $OUT/release_3b.json > $OUT/release.log 2>&1; tail -c 1500 $OUT/release.log
