# Sourced by the one-GPU device scripts (ttft_h200.sh, run_itl_h200.sh, run_prefix_cache.sh): MPS=1 runs the prefill and
# decode workers' processes through an MPS control daemon that the script starts for its run and stops
# at its end, with its pipe and log directories under /tmp (nothing of the machine's is touched; no
# compute mode or other card setting is changed). Without it they share the GPU as any two processes
# do, time-sliced between their contexts (deploy/gpu_sharing.py). CUDA only: a dry run refuses MPS=1.
# Sets SHARING (mps | time-sliced); mps_stop is safe to call more than once.
SHARING=time-sliced
MPS_STARTED=""
mps_start() {
  [ -z "${MPS:-}" ] && return 0
  [ -n "${DRY_RUN:-}" ] && [ "${DRY_RUN}" != 0 ] && { echo "MPS=1 needs CUDA: a dry run cannot start an MPS daemon" >&2; exit 2; }
  command -v nvidia-cuda-mps-control >/dev/null || { echo "MPS=1: nvidia-cuda-mps-control is not on this machine" >&2; exit 2; }
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/pdserve-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/pdserve-mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "MPS=1: the MPS control daemon did not start" >&2; exit 2; }
  MPS_STARTED=1
  SHARING=mps
  # A client must get through the daemon before a server waits minutes on it.
  if ! timeout 90 "${PYTHON:-python3}" -c 'import torch; torch.ones(1, device="cuda").sum().item()'; then
    echo "MPS=1: a CUDA client cannot start under the MPS daemon" >&2
    mps_stop; exit 2
  fi
}
mps_stop() {  # after the servers: the daemon ends once no client holds it
  [ -z "$MPS_STARTED" ] && return 0
  echo quit | nvidia-cuda-mps-control
  MPS_STARTED=""
}
