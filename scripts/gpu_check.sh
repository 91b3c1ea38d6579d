#!/usr/bin/env bash
# The GPU acceptance check: everything this project can only prove on a CUDA GPU, in under 10
# minutes on one GPU, ending in one summary table. Run from the repository root of an installed
# checkout (the Docker image has everything): bash scripts/gpu_check.sh
# The full pytest log, its JUnit report and the throughput table stay in $GPU_CHECK_OUT (default: a new
# temporary folder).
#   1. pytest -m gpu: bf16 and fp16 steps on CUDA against the CPU's (GPT and Llama forms);
#      generation; Transformer Engine against the local layers (logits and grads); fp8 training;
#      fused AdamW and apex FusedAdam against torch's AdamW; mode=plan against
#      torch.cuda.max_memory_allocated; resume and recompute with dropout (CUDA random states);
#      MoE grouped GEMM against the per-expert loop.
#   2. gpt_1.3b bf16 training throughput (tokens/s, MFU) with local layers eager and compiled
#      (trainer.compile=true, with its cold-compile time: the measurement its GPU default waits for)
#      and with Transformer Engine.
set -u
cd "$(dirname "$0")/.."
out=${GPU_CHECK_OUT:-$(mktemp -d)}
mkdir -p "$out"
python3 -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
timeout 200 python3 -m pytest -m gpu tests/ -p no:cacheprovider -q -rA --timeout 120 --continue-on-collection-errors -o junit_family=xunit1 \
    --junitxml="$out/gpu.xml" > "$out/pytest.txt" 2>&1
status=$?
tail -n 30 "$out/pytest.txt"
timeout 330 python3 benchmarks/gpu_throughput.py --steps 30 > "$out/throughput.txt" 2>&1
echo
echo "== summary =="
python3 - "$out/gpu.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except (OSError, ET.ParseError) as e:
    print(f"pytest -m gpu produced no report: {e}"); sys.exit(0)
for case in cases:
    outcome = "passed"
    for tag, name in (("failure", "FAILED"), ("error", "ERROR"), ("skipped", "skipped")):
        node = case.find(tag)
        if node is not None:
            outcome = f"{name}: {(node.get('message') or '').splitlines()[0][:90] if node.get('message') else ''}"
    print(f"{case.get('name'):<58} {outcome}")
PY
cat "$out/throughput.txt"
exit $status
