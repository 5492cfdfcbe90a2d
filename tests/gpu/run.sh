#!/bin/bash
# GPU validation of sglang_patch on real SGLang 0.5.17 (one H200), from the repository root:
#   bash tests/gpu/run.sh [tiny_a] [tiny_b] [bench] [bench_plain]      (default: all four)
# Needs .gpu/ (a copy of the SGLang bundle folder) and .whl/ (zarr, numcodecs, inotify_simple, donfig, zlib-ng,
# google-crc32c, pydantic-settings, python-dotenv wheels for Python 3.12, and pytest, pluggy, iniconfig,
# packaging and pytest-timeout for the checks). Writes logs and JSON results to $OUT.
#   tiny_a       tiny random Llama, CUDA graphs off, radix cache off, chunked prefill 256,
#                HSDUMP_LAYER_IDS=1,4,7, started through `python -m sglang_patch.launch_server`;
#                the checks: `pytest -m gpu tests/gpu` (the dumps and the stored states against
#                transformers, another client's requests never dumped)
#   tiny_b       the same model, CUDA graphs on (decode + breakable prefill graphs), radix cache on,
#                chunked prefill 256, the model's default EAGLE-3 layers, started through
#                `python -m sglang.launch_server` (plugin found by its entry point); the same checks
#   bench        ~1B random Llama with the plugin: hsdump extract vs a plain client, concurrency 1, 8
#   bench_dump   the same server with the plugin: dump-only client (waits for done, deletes) vs plain
#   graphs_1b    the ~1B model with CUDA graphs and the radix cache on: tests/gpu/test_dump.py, then
#                benchmarks/gpu_bench.py --mode dump
#   bench_plain  the same server without the plugin (server alone), plain client only
#   kimi         a random Llama with Kimi-K2.5's hidden size (H=7168, 57,344 B a token), SGLang's
#                defaults (radix cache, CUDA graphs, 8192-token chunks): benchmarks/gpu_kimi.py
#                measures server alone, dump-only, store alone and hsdump extract at 1/8/32 in flight
#                (KIMI_ARGS passes it options; KIMI_HUGE=1 puts the dumps and the memory store on a
#                tmpfs mounted with huge=within_size at /mnt/hsdump-huge instead of /dev/shm; needs root)
#   pre_llama    tiny_b's server with HSDUMP_FINAL_NORM=pre_norm (the final norm's input); its store
#                comes back as $OUT/store_pre_llama.tar.part-*
#   pre_deepseek Kimi-K2.5's language model shape (DeepSeek-V3: MLA, 384 experts), pre_norm, CUDA
#                graphs and radix cache on, chunks of 256: tests/gpu/test_tiny.py
#   kimi25       the same weights as SGLang's KimiK25ForConditionalGeneration (MoonViT wrapper),
#                multimodal off (tests/gpu/launch_text_only.py), pre_norm (KIMI25_NORM): test_tiny.py;
#                KIMI25_STARTUP=1 then runs benchmarks/bench_startup.py against it
#   startup      the kimi server: benchmarks/bench_startup.py (launch to first commit, last commit
#                to exit; STARTUP_ARGS passes it options)
#   e2e          the kimi server: benchmarks/gpu_e2e.py times hsdump extract from launch until a sync
#                after it returns, against the server alone and the disk's rate; E2E_BASELINE names
#                a directory holding another build's source (its hsdump is run alternately)
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
REPO=$(pwd)
STAGES=${*:-tiny_a tiny_b bench bench_plain}
PORT=30000; URL=http://127.0.0.1:$PORT
status=0

setup() {
  [ -d /tmp/site/sglang ] || python3 -c "import sys,tarfile;tarfile.open(sys.argv[1]).extractall('/tmp/site')" .gpu/sglang-0.5.17-site.tar.xz
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  # The documented server-side install: the checkout without its dependencies (registers the entry point).
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/hs "$REPO" || exit 1
  export PYTHONPATH=/tmp/hs:/tmp/site PATH=/tmp/hs/bin:$PATH SGLANG_IS_FLASHINFER_AVAILABLE=false PYTHONUNBUFFERED=1
  python3 -c "import sglang, torch, importlib.metadata as m; print('sglang', sglang.__version__, 'torch', torch.__version__, [e.value for e in m.entry_points(group='sglang.srt.plugins')])"
  python3 -c "import pytest, pytest_timeout" || { echo "the checks need pytest and pytest-timeout in .whl/"; exit 1; }
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
}

start_server() {  # name, launcher module, extra args...
  local name=$1 module=$2; shift 2
  rm -rf "${HSDUMP_DUMP_DIR:-/nonexistent}"
  python3 -m "$module" --skip-tokenizer-init --attention-backend triton --sampling-backend pytorch \
    --host 127.0.0.1 --port $PORT "$@" > "$OUT/server_$name.log" 2>&1 &
  SP=$!
  local t0=$SECONDS
  until curl -s -m 2 $URL/health > /dev/null 2>&1; do
    kill -0 $SP 2> /dev/null || { echo "server $name died"; tail -40 "$OUT/server_$name.log"; return 1; }
    [ $((SECONDS - t0)) -gt 240 ] && { echo "server $name not up in 240 s"; return 1; }
    sleep 1
  done
  echo "server $name up after $((SECONDS - t0)) s"
  grep -h "hsdump" "$OUT/server_$name.log" | head -5
  return 0
}

memory_root() {  # sets MEM: /dev/shm, or with KIMI_HUGE=1 a tmpfs with huge pages (mounted here, as root)
  MEM=/dev/shm
  [ "${KIMI_HUGE:-0}" = 1 ] || return 0
  MEM=/mnt/hsdump-huge
  mkdir -p $MEM && { mountpoint -q $MEM || mount -t tmpfs -o huge=within_size,size=100g tmpfs $MEM; } \
    || { echo "could not mount a tmpfs with huge pages at $MEM (needs root)"; return 1; }
}

startup_bench() {  # benchmarks/bench_startup.py against the server running now
  mkdir -p /tmp/startup && python3 benchmarks/bench_startup.py --server-url $URL --dump-dir $HSDUMP_DUMP_DIR \
    --work-dir /tmp/startup ${STARTUP_ARGS:-} 2>&1 | tee "$OUT/startup.log"
}

keep_store() {  # stage: its checks' store, as tar parts small enough to come back from $OUT
  tar -C "/tmp/work_$1" -cf - store | split -b 15M - "$OUT/store_$1.tar.part-"
}

stop_server() {
  kill $SP 2> /dev/null; wait $SP 2> /dev/null
  sleep 2
}

checks() {  # the GPU checks (tests/gpu/test_*.py, or the files given) against the server in GPU_CHECK_*
  # -W default: this machine's torch and transformers may warn on import; the checks judge the states.
  python3 -m pytest -m gpu -p no:cacheprovider -v -W default "${@:-tests/gpu}"
}

tiny() {  # name, expected layers, launcher module, server args...
  local name=$1 layers=$2 module=$3; shift 3
  make_model llama /tmp/tiny
  served "$name" "$layers" /tmp/tiny /tmp/tiny "$module" --mem-fraction-static 0.2 "$@"
}

make_model() {  # kind, directory[, source]: tests/gpu/make_model.py, once
  [ -d "$2" ] || python3 tests/gpu/make_model.py "$@" > /dev/null || exit 1
}

served() {  # name, expected layers (or ""), served model, transformers model, launcher, server args...
  local name=$1 layers=$2 model=$3 reference=$4 module=$5; shift 5
  start_server "$name" "$module" --model-path "$model" \
    --enable-return-hidden-states --chunked-prefill-size 256 "$@" || { status=1; return; }
  curl -s $URL/server_info > "$OUT/server_info_$name.json"
  local radix=0; [[ " $* " == *" --disable-radix-cache "* ]] || radix=1
  GPU_CHECK_URL=$URL GPU_CHECK_STAGE=$name GPU_CHECK_MODEL=$reference GPU_CHECK_LAYERS=$layers \
    GPU_CHECK_RADIX=$radix checks ${CHECKS:-} > "$OUT/check_$name.log" 2>&1 || status=1
  tail -40 "$OUT/check_$name.log"
  [ -z "${AFTER_CHECKS:-}" ] || eval "$AFTER_CHECKS" || status=1  # more work on the same server
  ls -la "$HSDUMP_DUMP_DIR" "$HSDUMP_DUMP_DIR/_producers" >> "$OUT/check_$name.log" 2>&1
  stop_server
  grep -hE "Traceback|hsdump.*(fail|error)" "$OUT/server_$name.log" | head -10
}

make_llama() {  # directory, LlamaConfig keyword arguments: a random bf16 Llama built on the GPU
  [ -d "$1" ] && return
  python3 - "$1" "$2" << 'PY'
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = eval(f"LlamaConfig({sys.argv[2]}, head_dim=128, vocab_size=32000)")
with torch.device("cuda"):
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(sys.argv[1])
PY
}

make_1b() {
  make_llama /tmp/m1b "hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, \
    num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=8192"
}

make_kimi() {  # Kimi-K2.5's hidden size: 4 x 7168 bf16 values, 57,344 bytes a token
  make_llama /tmp/kimi "hidden_size=7168, intermediate_size=8192, num_hidden_layers=8, \
    num_attention_heads=56, num_key_value_heads=8, max_position_embeddings=32768"
}

BENCH_ARGS=(--model-path /tmp/m1b --disable-radix-cache --disable-cuda-graph --mem-fraction-static 0.5)

setup
for stage in $STAGES; do
  echo "=== $stage"
  case $stage in
    tiny_a) export HSDUMP_DUMP_DIR=/dev/shm/hsdump-a HSDUMP_LAYER_IDS=1,4,7
            tiny tiny_a 1,4,7 sglang_patch.launch_server --disable-cuda-graph --disable-radix-cache
            unset HSDUMP_DUMP_DIR HSDUMP_LAYER_IDS ;;
    tiny_b) export HSDUMP_DUMP_DIR=/dev/shm/hsdump-b
            tiny tiny_b 2,4,5 sglang.launch_server --cuda-graph-max-bs 16
            unset HSDUMP_DUMP_DIR ;;
    pre_llama) export HSDUMP_DUMP_DIR=/dev/shm/hsdump-pre HSDUMP_FINAL_NORM=pre_norm
            CHECKS=tests/gpu/test_tiny.py tiny pre_llama 2,4,5 sglang.launch_server --cuda-graph-max-bs 16
            keep_store pre_llama
            unset HSDUMP_DUMP_DIR HSDUMP_FINAL_NORM ;;
    pre_deepseek) make_model deepseek /tmp/ds
            export HSDUMP_DUMP_DIR=/dev/shm/hsdump-ds HSDUMP_FINAL_NORM=pre_norm
            GPU_CHECK_MOE=1 CHECKS=tests/gpu/test_tiny.py \
              served pre_deepseek "" /tmp/ds /tmp/ds sglang.launch_server \
              --mem-fraction-static 0.5 --cuda-graph-max-bs 16
            unset HSDUMP_DUMP_DIR HSDUMP_FINAL_NORM ;;
    kimi25) make_model deepseek /tmp/ds; make_model kimi25 /tmp/k25 /tmp/ds
            export HSDUMP_DUMP_DIR=/dev/shm/hsdump-k25 HSDUMP_FINAL_NORM=${KIMI25_NORM:-pre_norm}
            PYTHONPATH=$PYTHONPATH:$REPO/tests/gpu GPU_CHECK_MOE=1 CHECKS=tests/gpu/test_tiny.py \
              AFTER_CHECKS=${KIMI25_STARTUP:+startup_bench} \
              served kimi25 "" /tmp/k25 /tmp/ds launch_text_only --mem-fraction-static 0.5 \
              --cuda-graph-max-bs 16
            unset HSDUMP_DUMP_DIR HSDUMP_FINAL_NORM ;;
    startup) make_kimi
            export HSDUMP_DUMP_DIR=/dev/shm/hsdump-startup
            start_server startup sglang.launch_server --model-path /tmp/kimi --enable-return-hidden-states || { status=1; continue; }
            startup_bench || status=1
            stop_server; unset HSDUMP_DUMP_DIR ;;
    bench) make_1b
           export HSDUMP_DUMP_DIR=/dev/shm/hsdump-bench
           start_server bench sglang.launch_server "${BENCH_ARGS[@]}" --enable-return-hidden-states || { status=1; continue; }
           python3 benchmarks/gpu_bench.py --server plugin --url $URL --dump-dir $HSDUMP_DUMP_DIR --out "$OUT" || status=1
           stop_server; unset HSDUMP_DUMP_DIR ;;
    bench_dump) make_1b
           export HSDUMP_DUMP_DIR=/dev/shm/hsdump-bench
           start_server bench_dump sglang.launch_server "${BENCH_ARGS[@]}" --enable-return-hidden-states || { status=1; continue; }
           python3 benchmarks/gpu_bench.py --server plugin --mode dump --url $URL --dump-dir $HSDUMP_DUMP_DIR --out "$OUT" || status=1
           stop_server; unset HSDUMP_DUMP_DIR ;;
    graphs_1b) make_1b  # one server: ~1B model, CUDA graphs on, radix cache on; correctness + speed
           export HSDUMP_DUMP_DIR=/dev/shm/hsdump-1b
           start_server graphs_1b sglang.launch_server --model-path /tmp/m1b --mem-fraction-static 0.5 \
             --enable-return-hidden-states --cuda-graph-max-bs 16 || { status=1; continue; }
           GPU_CHECK_URL=$URL GPU_CHECK_STAGE=graphs_1b GPU_CHECK_MODEL=/tmp/m1b GPU_CHECK_RADIX=1 \
             checks tests/gpu/test_dump.py > "$OUT/check_graphs_1b.log" 2>&1 || status=1
           tail -30 "$OUT/check_graphs_1b.log"
           echo "prefill batches replayed as CUDA graphs: $(grep -c 'Prefill batch.*cuda graph: True' "$OUT/server_graphs_1b.log")" \
             "eager: $(grep -c 'Prefill batch.*cuda graph: False' "$OUT/server_graphs_1b.log")"
           python3 benchmarks/gpu_bench.py --server plugin-graphs --mode dump --url $URL --dump-dir $HSDUMP_DUMP_DIR --out "$OUT" || status=1
           stop_server; unset HSDUMP_DUMP_DIR ;;
    kimi) make_kimi
           memory_root || { status=1; continue; }
           export HSDUMP_DUMP_DIR=$MEM/hsdump-kimi
           start_server kimi sglang.launch_server --model-path /tmp/kimi --enable-return-hidden-states || { status=1; continue; }
           python3 benchmarks/gpu_kimi.py --dump-dir $HSDUMP_DUMP_DIR --shm $MEM/kimi-store --out "$OUT" ${KIMI_ARGS:-} || status=1
           grep -hE "Traceback|hsdump.*(fail|error)" "$OUT/server_kimi.log" | head -10
           grep -h "hsdump" "$OUT/server_kimi.log" | tail -12
           stop_server; unset HSDUMP_DUMP_DIR ;;
    e2e) make_kimi
           export HSDUMP_DUMP_DIR=/dev/shm/hsdump-e2e
           start_server e2e sglang.launch_server --model-path /tmp/kimi --enable-return-hidden-states || { status=1; continue; }
           builds=(--build "this=/tmp/hs:/tmp/site")
           if [ -n "${E2E_BASELINE:-}" ]; then
             python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/hs-base "$E2E_BASELINE" || exit 1
             builds+=(--build "baseline=/tmp/hs-base:/tmp/site")
           fi
           python3 benchmarks/gpu_e2e.py --dump-dir $HSDUMP_DUMP_DIR --out "$OUT" "${builds[@]}" ${E2E_ARGS:-} || status=1
           grep -hE "Traceback|hsdump.*(fail|error)" "$OUT/server_e2e.log" | head -10
           stop_server; unset HSDUMP_DUMP_DIR ;;
    bench_plain) make_1b
           start_server bench_plain sglang.launch_server "${BENCH_ARGS[@]}" || { status=1; continue; }
           python3 benchmarks/gpu_bench.py --server alone --mode plain --url $URL --out "$OUT" || status=1
           stop_server ;;
  esac
done
echo "=== done, status $status"
exit $status
