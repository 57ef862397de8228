"""NCCL GPU-to-GPU KV transfer (issue 9, needs 2 GPUs): prefill on cuda:0, decode on cuda:1.

    python loadtest/bench_nccl.py --out loadtest/results     # writes transfer_nccl_h200x2.json/.png
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadtest.bench_transfer import main  # noqa: E402

if __name__ == "__main__":
    import torch

    if torch.cuda.device_count() < 2:
        sys.exit("bench_nccl needs 2 GPUs")
    main(["--paths", "nccl,gloo", "--decode-device", "cuda:1", "--name", "transfer_nccl_h200x2"] + sys.argv[1:])
