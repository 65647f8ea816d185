#!/usr/bin/env bash
# `make gpu-check`: the llmapi era end to end on a machine with an NVIDIA GPU and TensorRT-LLM 1.2.1
# (pip install tensorrt-llm==1.2.1, or the Triton container built from tensorrtllm_backend@0b9d7d5; see
# docs/tensorrt_llm.md). Builds the pair of build/qwen_coder_trtllm.yaml (the torch build writes the Hugging
# Face checkpoints), checks the llmapi plan, serves it with trtllm-serve, runs validate through the OpenAI API
# (exactness against the torch backend's greedy text, acceptance, speedup) and, inside the Triton container,
# also loads the generated Triton repository and asks it once. Everything goes to reports/<name>/gpu_check/.
# Budget: about 10 minutes on an H100/H200 (the GGUF wheels and the torch build are most of it).
set -euo pipefail
SPEC=${SPEC:-build/qwen_coder_trtllm.yaml}
PAIR=${PAIR:-build/qwen_coder.yaml}
PY=${PY:-.venv/bin/python}
NAME=$($PY -c "import sys; from pipeline import spec; print(spec.load(sys.argv[1]).name)" "$SPEC")
OUT=reports/$NAME/gpu_check
mkdir -p "$OUT"
say() { echo "[gpu-check] $*" | tee -a "$OUT/steps.log"; }
fail() { say "FAILED: $*"; exit "${2:-1}"; }

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  fail "no NVIDIA GPU here (nvidia-smi finds none): run this on a GPU machine with tensorrt-llm==1.2.1" 3
fi
nvidia-smi -L | tee "$OUT/gpus.txt"
VER=$($PY -c "import tensorrt_llm; print(tensorrt_llm.__version__)" 2>/dev/null) \
  || fail "tensorrt_llm does not import in $PY: pip install tensorrt-llm==1.2.1 (or run inside the container)" 3
WANT=$($PY -c "from pipeline.trtllm.era import LLMAPI_ERA; print(LLMAPI_ERA.tensorrt_llm)")
[ "$VER" = "$WANT" ] || say "warning: tensorrt_llm $VER here, the era is pinned to $WANT"
command -v trtllm-serve >/dev/null || fail "trtllm-serve is not on PATH" 3

say "1/5 the pair's Hugging Face checkpoints (torch build of $PAIR)"
$PY -m pipeline fetch "$PAIR" >>"$OUT/steps.log" 2>&1
$PY -m pipeline engine "$PAIR" >>"$OUT/steps.log" 2>&1 || fail "torch build of $PAIR"

say "2/5 the llmapi plan and its preflight"
$PY -m pipeline engine "$SPEC" >"$OUT/plan.txt" 2>&1 || { cat "$OUT/plan.txt"; fail "plan/preflight"; }

say "3/5 trtllm-serve"
eval "SERVE=($($PY -c "import shlex,sys; from pipeline import spec; from pipeline.trtllm import llmapi; \
print(shlex.join(llmapi.serve_argv(spec.load(sys.argv[1]))))" "$SPEC"))"
BASE=$($PY -c "import sys; from pipeline import spec; from pipeline.trtllm import llmapi; \
print(llmapi.openai_base_url(spec.load(sys.argv[1])))" "$SPEC")
"${SERVE[@]}" >"$OUT/trtllm_serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do
  curl -sf "${BASE%/v1}/health" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || fail "trtllm-serve exited; see $OUT/trtllm_serve.log"
  sleep 2
done
curl -sf "${BASE%/v1}/health" >/dev/null || fail "trtllm-serve not healthy after 600 s"

say "4/5 validate through the OpenAI API at $BASE"
if $PY -m pipeline validate --help 2>/dev/null | grep -q -- "--api"; then
  $PY -m pipeline validate "$SPEC" --api openai --url "$BASE" >"$OUT/validate.txt" 2>&1 \
    || { tail -30 "$OUT/validate.txt"; fail "validate"; }
else
  fail "this checkout's validate has no --api openai (pipeline/openai_client.py); point it at $BASE" 4
fi
kill $SERVER; wait $SERVER 2>/dev/null || true

say "5/5 Triton's llmapi model (inside the container only)"
$PY -m pipeline repo "$SPEC" >"$OUT/repo.txt" 2>&1 || fail "repo"
if [ -f /app/scripts/launch_triton_server.py ]; then
  $PY -m pipeline serve "$SPEC" >"$OUT/triton.log" 2>&1 &
  sleep 5
  $PY -m pipeline client "$SPEC" --prompt "Write a Python function that reverses a string." >"$OUT/client.txt" 2>&1 \
    || fail "Triton client request; see $OUT/client.txt"
else
  say "not in the Triton container: repository written ($OUT/repo.txt), not served"
fi
say "done: $OUT (plan.txt, validate.txt, client.txt)"
