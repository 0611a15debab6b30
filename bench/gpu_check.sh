#!/bin/bash
# The device check of a session lent a GPU (one call of the device tool, ~6 min on an H200):
#   run: bash bench/gpu_check.sh   carry: .gpuwheels (transformers + peft wheels for the device python)
#   make the wheels once: .venv/bin/pip download --no-deps -d .gpuwheels transformers==5.24.0 peft==0.21.2
# GPU-marked tests, then bench/decode.py on the Qwen2.5-3B shape with the auto prefix splits (0)
# and with the prefix split in 4 (the rule before 8349016), results under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpuwheels/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -c "import torch,transformers,peft;print(torch.__version__,transformers.__version__,peft.__version__,torch.cuda.get_device_name())"
python3 -c "import flash_attn" 2>&1 | tail -1
timeout 150 python3 -m pytest -q -m gpu tests/test_engine.py tests/test_attention.py tests/test_encoders.py tests/test_train_gpu.py -p no:cacheprovider 2>&1 | tail -12
for s in 0 4; do
  timeout 150 python3 bench/decode.py --preset qwen2.5-3b --device cuda --dtype bfloat16 --repeats 3 --modes monolithic,parallel_copy,engine --prefix-splits $s --out $OUT/decode_3b_splits$s.json --png $OUT/decode_3b_splits$s.png > $OUT/bench_$s.log 2>&1
  python3 - $OUT/decode_3b_splits$s.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
print(sys.argv[1].split('/')[-1], {m:(r.get('ms_per_token'),r.get('ms_per_step'),r.get('speedup_vs_monolithic')) for m,r in d['modes'].items()}, d['floor'].get('floor_ms_per_step'), d.get('roofline'))
PY
done
