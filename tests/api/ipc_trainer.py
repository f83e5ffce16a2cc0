"""A trainer process on this host pushing a safetensors checkpoint from its own GPU memory (CUDA IPC handles).

    python ipc_trainer.py ok|wrong-shape HTTP_URL WEIGHTS.safetensors VERSION

The tensors are loaded onto cuda:0 and pushed with our client (client/weights.py `push_cuda_ipc`); `wrong-shape`
drops the last row of one tensor first. Prints the server's reply as one JSON line, or {"error": message}. The admin
token comes from SPECROLL_ADMIN_TOKEN.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import load_file

from client import weights as wt


def main() -> None:
    kind, url, path, version = sys.argv[1:5]
    state = {name: t.to("cuda:0") for name, t in load_file(path).items()}
    if kind == "wrong-shape":
        name = next(n for n, t in state.items() if t.dim() == 2)
        state[name] = state[name][:-1]
    try:
        reply = wt.push_cuda_ipc(url, state, version, admin_token=os.environ["SPECROLL_ADMIN_TOKEN"])
    except wt.GroupPushError as exc:
        reply = {"error": str(exc)}
    torch.cuda.synchronize()
    print(json.dumps(reply))


if __name__ == "__main__":
    main()
